"""The main job's figure as a distribution: ``train.py`` (the README's command 1) once per
seed, each run's final zero-shot top-1 on the held-out and the shifted split read back
from its ``training.log``, and their range over the seeds. Used by
``scripts/bench_main_job.py``.
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError

FINAL = re.compile(r"final zero-shot accuracy(?P<shifted> on the shifted split)?: "
                   r"top-1 (?P<top1>[\d.]+)%(?:, top-5 (?P<top5>[\d.]+)%)?")
DONE = re.compile(r"done: (?P<steps>\d+) steps in (?P<minutes>[\d.]+) min")


def read_run(log_text: str) -> dict[str, Any]:
    """A run's steps, training minutes and final top-1 / top-5 (percent) on both splits,
    from the closing lines of its ``training.log``."""
    out: dict[str, Any] = {}
    for match in DONE.finditer(log_text):
        out.update(steps=int(match["steps"]), train_minutes=float(match["minutes"]))
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
    """min / median / max over the seeds of each split's top-1."""
    return {key: spread([r[key] for r in runs]) for key in ("held_out_top1", "shifted_top1")}


def run_seed(python: str, repo: Path, output: Path, seed: int, extra: list[str]) -> float:
    """Run command 1's ``train.py`` with ``--seed``; its wall-clock seconds."""
    start = time.perf_counter()
    cmd = [python, str(repo / "train.py"), "--output", str(output), "--seed", str(seed), *extra]
    result = subprocess.run(cmd, cwd=repo)
    if result.returncode:
        raise ConfigError(f"train.py --seed {seed} exited with status {result.returncode}; "
                          f"its log is {output / 'training.log'}")
    return time.perf_counter() - start


def main(ns: Any) -> int:
    import torch

    from .versus import machine
    repo = Path(__file__).resolve().parents[2]
    runs: list[dict[str, Any]] = []
    for seed in ns.seeds:
        output = Path(ns.runs) / f"seed{seed}"
        log = output / "training.log"
        wall = None
        if not (ns.reuse and log.is_file()):
            wall = run_seed(sys.executable, repo, output, seed, ns.train_args)
        if not log.is_file():
            raise ConfigError(f"{log}: no such file (run without --reuse to train seed {seed})")
        runs.append({"seed": seed, **read_run(log.read_text()), "wall_s": wall})
        print(f"seed {seed}: {runs[-1]}", file=sys.stderr, flush=True)
    result = {"benchmark": "main_job",
              "command": "train.py --output RUNS/seedN --seed N " + " ".join(ns.train_args),
              "machine": machine(torch.device("cpu")), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "runs": runs, "top1_over_seeds": summarise(runs),
              "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    text = json.dumps(result)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    return 0
