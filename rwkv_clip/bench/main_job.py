"""The main job's figure as a distribution: ``train.py`` (the README's command 1) once per
seed, CPU path and thread count, each run's final zero-shot top-1 on the held-out and the
shifted split read back from its ``training.log``, and their range over the grid. Used by
``scripts/bench_main_job.py``.

A CPU path is the arithmetic another CPU would take, forced on this one: ``avx2`` and
``avx512`` cap torch's kernels, oneDNN's GEMMs and the WKV build at that level
(:mod:`rwkv_clip.cpu_isa`); ``mkl`` / ``onednn`` pick the fp32 ``Linear`` GEMM;
``native`` is the machine as it is. Paths combine with ``+`` (``avx2+mkl``).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..compiling import INDUCTOR_CACHE_ENV, inductor_cache_dir
from ..errors import ConfigError
from .provenance import code_commit, measured

# environment of each CPU path (the variables torch and oneDNN read; the dispatch override
# pinning the fp32 Linear's implementation, rwkv_clip.ops.products)
CPU_PATHS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "mkl": {"RWKV_CLIP_DISPATCH": "linear=mkl"},
    "onednn": {"RWKV_CLIP_DISPATCH": "linear=onednn"},
}
WKV_LINE = re.compile(r"WKV: (?P<wkv>.*?) \(choice")


def path_environment(path: str) -> dict[str, str]:
    """The variables of ``path`` (names from :data:`CPU_PATHS` joined by ``+``)."""
    env: dict[str, str] = {}
    for part in path.split("+"):
        if part not in CPU_PATHS:
            raise ConfigError(f"CPU path {part!r} (in {path!r}): expected names from "
                              f"{', '.join(CPU_PATHS)} joined by '+'")
        env.update(CPU_PATHS[part])
    return env


FINAL = re.compile(r"final zero-shot accuracy(?P<shifted> on the shifted split)?: "
                   r"top-1 (?P<top1>[\d.]+)%(?:, top-5 (?P<top5>[\d.]+)%)?")
DONE = re.compile(r"done: (?P<steps>\d+) steps in (?P<minutes>[\d.]+) min")


def read_run(log_text: str) -> dict[str, Any]:
    """A run's steps, training minutes and final top-1 / top-5 (percent) on both splits,
    from the closing lines of its ``training.log``."""
    out: dict[str, Any] = {}
    for match in DONE.finditer(log_text):
        out.update(steps=int(match["steps"]), train_minutes=float(match["minutes"]))
    wkv = WKV_LINE.search(log_text)
    if wkv is not None:
        out["wkv"] = wkv["wkv"]
    for match in FINAL.finditer(log_text):
        split = "shifted" if match["shifted"] else "held_out"
        out[f"{split}_top1"] = float(match["top1"])
        out[f"{split}_top5"] = None if match["top5"] is None else float(match["top5"])
    if "held_out_top1" not in out or "shifted_top1" not in out:
        raise ConfigError("training.log: expected the final zero-shot lines of a finished "
                          "train.py run on the built-in dataset (held-out and shifted split)")
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """min / median / max over the runs of each split's top-1."""
    return {key: spread([r[key] for r in runs]) for key in ("held_out_top1", "shifted_top1")}


def run_seed(python: str, repo: Path, output: Path, seed: int, extra: list[str],
             env: dict[str, str] | None = None) -> float:
    """Run command 1's ``train.py`` with ``--seed`` (``env`` added to the environment); its
    wall-clock seconds."""
    start = time.perf_counter()
    cmd = [python, str(repo / "train.py"), "--output", str(output), "--seed", str(seed), *extra]
    full = {**os.environ, **(env or {})}
    if env and "ATEN_CPU_CAPABILITY" in env:  # compiled kernels of that level apart
        full[INDUCTOR_CACHE_ENV] = inductor_cache_dir(env["ATEN_CPU_CAPABILITY"])
    result = subprocess.run(cmd, cwd=repo, env=full, stdout=sys.stderr)  # stdout: the JSON
    if result.returncode:
        raise ConfigError(f"train.py --seed {seed} exited with status {result.returncode}; "
                          f"its log is {output / 'training.log'}")
    return time.perf_counter() - start


def grid(seeds: list[int], paths: list[str], threads: list[int | None]
         ) -> list[tuple[str, int | None, int, str]]:
    """(path, threads, seed, run folder name) of every run; a one-path, default-threads
    grid keeps the plain ``seedN`` folders."""
    plain = paths == ["native"] and threads == [None]
    return [(path, n, seed, f"seed{seed}" if plain else
             f"{path}-t{n if n is not None else 'default'}-seed{seed}")
            for path in paths for n in threads for seed in seeds]


def fresh_cache_env(checkout: Path, folder: Path) -> dict[str, str]:
    """The environment that gives ``checkout`` an empty cache in ``folder`` for everything
    (data and compiled kernels), as on a fresh clone: ``RWKV_CLIP_CACHE``, and for a
    checkout that still reads its own kernel-cache variable, that one too (a checkout that
    rejects it lists it among its replaced variables)."""
    from ..ops.dispatch import LEGACY_KERNEL_CACHE_ENV
    env = {"RWKV_CLIP_CACHE": str(folder)}
    dispatch_py = checkout / "rwkv_clip" / "ops" / "dispatch.py"
    rejects = dispatch_py.is_file() and LEGACY_KERNEL_CACHE_ENV in dispatch_py.read_text()
    if not rejects:
        env[LEGACY_KERNEL_CACHE_ENV] = str(folder / "kernels")
    return env


def time_against(ns: Any, repo: Path) -> dict[str, Any]:
    """Command 1's wall time here against another checkout's (``ns.against``), paired:
    ``ns.repeats`` pairs in ABBA order, each run in a fresh cache of its own (the built-in
    set is generated and the WKV kernel compiled as on a fresh clone), one seed. Their time / ours > 1:
    this checkout is faster."""
    from .versus import paired_ratios
    other = Path(ns.against).resolve()
    if not (other / "train.py").is_file():
        raise ConfigError(f"--against {ns.against}: expected a checkout of rwkv-clip (a "
                          "folder with train.py), e.g. one made by git worktree add")
    if ns.repeats < 1:
        raise ConfigError(f"--repeats {ns.repeats}: expected 1 or more")
    seed = ns.seeds[0]
    sides = {"ours": repo, "theirs": other}
    walls: dict[str, list[float]] = {"ours": [], "theirs": []}
    runs: list[dict[str, Any]] = []
    for r in range(ns.repeats):
        for side in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
            output = Path(ns.runs) / f"{side}-{r}"
            env = fresh_cache_env(sides[side], Path(ns.runs).resolve() / f"cache-{side}-{r}")
            wall = run_seed(sys.executable, sides[side], output, seed, ns.train_args, env)
            walls[side].append(wall)
            runs.append({"side": side, "repeat": r, "seed": seed, "wall_s": wall,
                         **read_run((output / "training.log").read_text())})
            print(f"{side} {r}: {runs[-1]}", file=sys.stderr, flush=True)
    return {"ours": {"checkout": str(repo), "commit": code_commit(repo),
                     "median_wall_s": statistics.median(walls["ours"])},
            "theirs": {"checkout": str(other), "commit": code_commit(other),
                       "median_wall_s": statistics.median(walls["theirs"])},
            **paired_ratios(walls["ours"], walls["theirs"]), "runs": runs}


def main(ns: Any) -> int:
    import torch

    from .versus import machine
    repo = Path(__file__).resolve().parents[2]
    if getattr(ns, "against", None):
        result = {"benchmark": "main_job_time",
                  "command": "train.py --output RUNS/NAME --seed N " + " ".join(ns.train_args),
                  "machine": machine(torch.device("cpu")), "threads": torch.get_num_threads(),
                  "torch": torch.__version__, **time_against(ns, repo),
                  **measured()}
        return write_result(result, ns.out)
    paths = getattr(ns, "paths", None) or ["native"]
    threads = getattr(ns, "threads", None) or [None]
    for path in paths:
        path_environment(path)  # every name checked before the first run
    runs: list[dict[str, Any]] = []
    for path, n, seed, name in grid(ns.seeds, paths, threads):
        output = Path(ns.runs) / name
        log = output / "training.log"
        env = path_environment(path)
        if n is not None:
            env["OMP_NUM_THREADS"] = str(n)
        wall = None
        if not (ns.reuse and log.is_file()):
            wall = run_seed(sys.executable, repo, output, seed, ns.train_args, env)
        if not log.is_file():
            raise ConfigError(f"{log}: no such file (run without --reuse to train seed {seed})")
        runs.append({"seed": seed, "path": path, "threads": n or torch.get_num_threads(),
                     "env": env, **read_run(log.read_text()), "wall_s": wall})
        print(f"{name}: {runs[-1]}", file=sys.stderr, flush=True)
    result = {"benchmark": "main_job",
              "command": "train.py --output RUNS/NAME --seed N " + " ".join(ns.train_args),
              "machine": machine(torch.device("cpu")), "threads": torch.get_num_threads(),
              "paths": paths, "torch": torch.__version__, "runs": runs,
              "top1_over_seeds": summarise(runs),
              **measured()}
    return write_result(result, ns.out)


def write_result(result: dict[str, Any], out: str | None) -> int:
    text = json.dumps(result)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0
