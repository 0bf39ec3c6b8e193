#!/usr/bin/env python3
"""The one-shot GPU check's step runner (called by scripts/gpu_check.sh); ONE JSON out.

A lent GPU machine is bare and offline (Python 3.12, torch 2.11, a small preinstalled
set, nvcc) and lent for 15 minutes in all, so this must work the first time: it uses
only the standard library itself, installs the travelling wheels (``.whl/``, see
scripts/device_wheels.sh) into a target folder with pip --no-index, and runs every
measurement as a subprocess of the same interpreter with ``PYTHONPATH=SITE:REPO``. Each
step has its own timeout, all of them share one budget (under 8 minutes), and a step
that fails, times out or cannot run is recorded with its reason; none stops the others.

``--rehearse`` (what ``gpu_check.sh --rehearse`` runs here, in a device-like venv)
runs every step the same way; a step that needs CUDA is recorded as skipped ("no CUDA
device") after running its dry form, the same code on the CPU at small sizes (the
anchor's adapter through fla's own PyTorch recurrence, the training steps on the tiny
config, torchrun over gloo), so argument errors and missing imports show up here.

Internal subcommands (run by the steps): ``imports``, ``build``, ``torchrun-step``,
``torchrun-ddp`` (runs ``ddp-step`` under torchrun), ``dali-gpu``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
B32 = str(REPO / "model_config" / "RWKV_CLIP_B32.json")
TINY = str(REPO / "model_config" / "RWKV_CLIP_tiny.json")
GiB = 1024 ** 3
# the resolution sweep's image sides: B/16's image tower has (side / 16)^2 tokens. At batch
# 4 an H200 runs ViT-B-16 faster than ours up to 896 px at least, so inference goes on to
# 3584 px (50176 tokens), where attention should dominate; training stops at 1792 px
# (ours needs about 9 GB at 896 px, and that grows with the tokens). A case predicted to
# end past the step's time is skipped by the benchmark itself.
RESOLUTION_SIDES = "224,448,896,1792,3584"
RESOLUTION_TRAIN_SIDES = "224,448,896,1792"
# the speed comparisons of the whole model (GPU_CHECK_ONLY=speed runs these alone, after
# the environment, imports and kernel build): B/32 batch 256 beside ViT-B-32, the B/16
# sweep (training batch 16, inference batch 32) and the B/32 step's kernel profile
SPEED_SIDES = "224,448,896,1792"
SPEED_STEPS = ("speed_b32_versus", "speed_b16_sweep", "profile_b32_eager",
               "profile_b32_compiled")
# the fused glue ops: their GPU tests, then timed against their reference, eager and
# compiled (GPU_CHECK_ONLY=glue runs these alone)
GLUE_STEPS = ("glue_gpu_tests", "glue_ops")
GLUE_TESTS = "tests/test_ops_glue.py"
# steps that run no native WKV kernel: a selection of only these skips the kernel build
WITHOUT_KERNELS = GLUE_STEPS
STEP_GROUPS = {"speed": SPEED_STEPS, "glue": GLUE_STEPS}
ALWAYS = ("environment", "imports", "build_kernels")  # every selection needs them
# the seed's memory claims (README of the original), checked against the measurements
CLAIMS = {
    "inference_bf16_b1": "< 4 GB",
    "inference_fp32_b1": "5-6 GB",
    "train_b256_bf16": "~18 GB per GPU",
    "train_b256_bf16_ckpt": "~18 GB per GPU",
}
# distribution -> import name of every wheel that travels (scripts/device_wheels.txt plus
# torchvision, which device_wheels.sh adds for the target torch)
WHEEL_DISTS = {"open_clip_torch": "open_clip", "timm": "timm", "ftfy": "ftfy",
               "wcwidth": "wcwidth", "webdataset": "webdataset", "braceexpand": "braceexpand",
               "fla-core": "fla", "einops": "einops", "ninja": "ninja", "pyyaml": "yaml",
               "torchvision": "torchvision"}
WHEEL_MODULES = tuple(WHEEL_DISTS.values())
# what the lent device has preinstalled (distribution -> import name); huggingface_hub
# brings its own requirements (packaging, filelock, fsspec, typing_extensions, ...)
DEVICE_PREINSTALLED = {"torch": "torch", "triton": "triton", "numpy": "numpy",
                       "pillow": "PIL", "tqdm": "tqdm", "regex": "regex", "scipy": "scipy",
                       "tensorboard": "tensorboard", "huggingface_hub": "huggingface_hub",
                       "safetensors": "safetensors", "pytest": "pytest", "pyarrow": "pyarrow",
                       "packaging": "packaging", "filelock": "filelock", "fsspec": "fsspec",
                       "typing_extensions": "typing_extensions"}


# ----------------------------------------------------------------------------- steps
@dataclass
class Step:
    """One measurement: ``cmd`` runs under the check's interpreter; a CUDA step without a
    CUDA device runs ``dry`` instead (if given) and is recorded as skipped."""
    name: str
    cmd: list[str]
    timeout: int
    cuda: bool = False
    dry: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    why: str = ""


def last_json(text: str):
    """The last JSON object printed: the whole output, else the last line-start '{'."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]))
            except ValueError:
                try:
                    return json.loads(lines[i])
                except ValueError:
                    continue
    return None


class Runner:
    def __init__(self, budget_s: float, env: dict[str, str], rehearse: bool, cuda: bool,
                 timeout_scale: float = 1.0, only: set[str] | None = None):
        self.start = time.monotonic()
        self.budget = budget_s
        self.scale = timeout_scale
        self.env = env
        self.rehearse = rehearse
        self.cuda = cuda
        self.steps: dict[str, dict] = {}
        self.only = only  # step names to run (None: all)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def _exec(self, cmd: list[str], limit: float, extra_env: dict[str, str]) -> dict:
        env = dict(self.env, **extra_env)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)  # the step's own process group
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
        return {"command": " ".join(cmd), "rc": proc.returncode, "timed_out": timed_out,
                "seconds": round(time.monotonic() - t0, 2), "limit_s": round(limit),
                "result": last_json(out), "stdout_tail": out[-3000:],
                "stderr_tail": err[-3000:]}

    def run(self, step: Step) -> dict:
        rec: dict = {"why": step.why} if step.why else {}
        limit = min(step.timeout * self.scale, self.left() - 10)
        if self.only is not None and step.name not in self.only:
            rec.update(status="skipped", reason="not selected (GPU_CHECK_ONLY / --only)")
        elif limit < 5:
            rec.update(status="skipped", reason=f"no time left in the {self.budget:.0f}s budget")
        elif step.cuda and not self.cuda:
            rec.update(status="skipped", reason="no CUDA device", command=" ".join(step.cmd))
            if step.dry:
                dry = self._exec(step.dry, limit, step.env)
                rec["dry_run"] = dry
                if dry["rc"] != 0:
                    rec["status"] = "failed"
                    rec["reason"] = (f"no CUDA device, and its CPU dry run failed "
                                     f"(rc {dry['rc']}{', timed out' if dry['timed_out'] else ''})")
        else:
            res = self._exec(step.cmd, limit, step.env)
            rec.update(res)
            rec["status"] = ("ok" if res["rc"] == 0 else
                             "timed_out" if res["timed_out"] else "failed")
        self.steps[step.name] = rec
        print(f"== {step.name}: {rec['status']}"
              + (f" ({rec['reason']})" if "reason" in rec else "")
              + (f" in {rec['seconds']}s" if "seconds" in rec else ""), file=sys.stderr)
        return rec

    def note(self, name: str, status: str, reason: str) -> None:
        self.steps[name] = {"status": status, "reason": reason}
        print(f"== {name}: {status} ({reason})", file=sys.stderr)


# ----------------------------------------------------------------------------- wheels
def wheel_tags(python: str) -> set[str]:
    """Tags (interpreter-abi-platform) the interpreter accepts, from its own pip."""
    code = ("from pip._vendor.packaging import tags\n"
            "print('\\n'.join(str(t) for t in tags.sys_tags()))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def wheel_name_tags(path: Path) -> tuple[str, set[str]]:
    """(distribution, tags) from a wheel file name (PEP 427, compressed tag sets)."""
    parts = path.name[:-len(".whl")].split("-")
    dist, (py, abi, plat) = parts[0], parts[-3:]
    tags = {f"{a}-{b}-{c}" for a in py.split(".") for b in abi.split(".") for c in plat.split(".")}
    return dist.lower().replace("_", "-"), tags


def has_module(python: str, module: str, env: dict[str, str]) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], env=env,
                          capture_output=True).returncode == 0


def install_wheels(python: str, site: Path, wheel_dirs: list[Path], base_env: dict[str, str]
                   ) -> dict:
    """pip install --no-index --no-deps --target SITE the wheels this interpreter accepts.

    A binary wheel built for another interpreter is left out (named in the report); a
    distribution the interpreter already has without SITE is not shadowed when it is
    binary (torchvision must match the local torch build)."""
    accepted = wheel_tags(python)
    chosen, left_out = [], {}
    seen = set()
    for folder in wheel_dirs:
        for whl in sorted(folder.glob("*.whl")):
            dist, tags = wheel_name_tags(whl)
            if not tags & accepted:
                left_out[whl.name] = "built for another interpreter or platform"
                continue
            binary = not all(t.endswith("-none-any") for t in tags)
            if binary and dist == "torchvision" and has_module(python, "torchvision", base_env):
                left_out[whl.name] = "the interpreter already has torchvision"
                continue
            if dist in seen:
                left_out[whl.name] = f"another {dist} wheel was chosen first"
                continue
            seen.add(dist)
            chosen.append(whl)
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    if not chosen and not left_out:  # an ordinary environment: its own packages serve
        return {"status": "skipped", "site": str(site), "installed": [], "left_out": {},
                "reason": f"no wheels in {[str(d) for d in wheel_dirs]}: the interpreter's "
                          "own packages are used"}
    cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
           "--quiet", "--target", str(site)] + [str(w) for w in chosen]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=base_env)
    return {"status": "ok" if proc.returncode == 0 and chosen else "failed",
            "site": str(site), "installed": [w.name for w in chosen], "left_out": left_out,
            "rc": proc.returncode, "stderr_tail": proc.stderr[-3000:],
            **({} if chosen else {"reason": f"no wheels found in {[str(d) for d in wheel_dirs]}"})}


# ----------------------------------------------------------------------------- subcommands
def cmd_imports(site: str) -> int:
    """Import what the project needs; print where each module comes from (JSON)."""
    import importlib
    out: dict = {"modules": {}, "missing": []}
    for name in WHEEL_MODULES + ("torch", "triton", "numpy", "PIL", "scipy", "regex",
                                 "huggingface_hub", "safetensors", "tensorboard", "pytest"):
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # reported, the check goes on
            out["missing"].append(f"{name}: {type(e).__name__}: {e}")
            continue
        path = getattr(mod, "__file__", "") or ""
        out["modules"][name] = {"version": getattr(mod, "__version__", None),
                                "from_wheels": bool(site) and path.startswith(site)}
    try:  # the project itself, through the paths the steps use
        from fla.ops.rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6  # noqa: F401

        import rwkv_clip
        from rwkv_clip.data import wds  # noqa: F401
        from rwkv_clip.tokenizer import tokenize
        tokens = tokenize(["a photo of a cat"])
        out["rwkv_clip"] = {"file": rwkv_clip.__file__, "tokens_shape": list(tokens.shape)}
    except Exception as e:
        out["missing"].append(f"rwkv_clip stack: {type(e).__name__}: {e}")
    print(json.dumps(out))
    return 1 if out["missing"] else 0


def cmd_build(jobs: list[str]) -> int:
    """Build kernels in parallel processes (one nvcc each); JSON with each one's time."""
    from rwkv_clip.ops import cache, toolchain
    procs, out = {}, {}
    for job in jobs:
        if job != "cpu" and toolchain.find_cuda_home() is None:
            out[job] = {"skipped": "no CUDA toolkit (nvcc) found"}
            continue
        if job == "cpu":
            code = "from rwkv_clip.ops import build; build.get_cpu_kernel()"
        else:
            variant, N = job.split(":")
            code = f"from rwkv_clip.ops import build; build.get_cuda_kernel({N}, {variant!r})"
        procs[job] = (time.monotonic(), subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    failed = 0
    for job, (t0, p) in procs.items():
        text, _ = p.communicate()
        out[job] = {"rc": p.returncode, "seconds": round(time.monotonic() - t0, 1),
                    **({"output_tail": text[-1500:]} if p.returncode else {})}
        failed += p.returncode != 0
    print(json.dumps({"kernels": out, "cache": str(cache.cache_root()),
                      "cuda_home": str(toolchain.find_cuda_home())}))
    return 1 if failed else 0


def cmd_torchrun_step(device: str, precision: str) -> int:
    """One-process torchrun of train.py for 2 steps on a tiny RecordIO file (NCCL on CUDA,
    gloo on CPU); prints the run's result as JSON."""
    sys.path.insert(0, str(REPO / "tests"))
    from train_util import TINY_CONFIG, make_tiny_rec
    with tempfile.TemporaryDirectory() as tmp:
        rec = make_tiny_rec(tmp, n=32)
        out_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "1", str(REPO / "train.py"), "--config", TINY_CONFIG,
               "--train-data", rec, "--output", str(out_dir), "--device", device,
               "--loader", "torch", "--workers", "0", "--batch-size", "8", "--epochs", "1",
               "--max-steps", "2", "--precision", precision, "--progress", "False",
               "--final-zero-shot", "False", "--tensorboard", "False", "--log-every", "1"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        log = out_dir / "training.log"
        text = log.read_text() if log.exists() else ""
        ckpts = sorted(p.name for p in (out_dir / "checkpoints").glob("*.pt")) \
            if (out_dir / "checkpoints").exists() else []
        backend = "nccl" if device == "cuda" else "gloo"
        print(json.dumps({"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
                          "backend_expected": backend,
                          "backend_in_log": backend in text.lower() or None,
                          "checkpoints": ckpts, "log_tail": text[-1500:],
                          "stdout_tail": proc.stdout[-1500:],
                          "stderr_head": proc.stderr[:3000]}))
    return proc.returncode


def cmd_ddp_step(device: str) -> int:
    """Under torchrun: a process group of its own (NCCL on CUDA, gloo on CPU; train.py
    starts none for one process), an all-reduce, and one DDP training step of the tiny
    model through the training loop's step; prints JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from rwkv_clip.memory import build_measured_model, make_step, synthetic_batch
    cuda = device == "cuda"
    dev = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda
           else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        ones = torch.ones(4, device=dev)
        dist.all_reduce(ones)
        args, model = build_measured_model(TINY, dev, False, None)
        ddp = DistributedDataParallel(model, device_ids=[dev] if cuda else None)
        step = make_step(ddp, "bf16" if cuda else "fp32", dev.type)
        images, tokens = synthetic_batch(args, 8, dev)
        losses = [float(step(images, tokens)) for _ in range(2)]
        print(json.dumps({"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                          "all_reduce_sum": ones.sum().item(), "losses": losses}))
    finally:
        dist.destroy_process_group()
    return 0


def cmd_torchrun_ddp(device: str) -> int:
    """One-process torchrun of the ddp-step subcommand; prints its JSON."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "1", str(Path(__file__).resolve()), "--subcommand", "ddp-step", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    res = last_json(proc.stdout) or {}
    print(json.dumps({"rc": proc.returncode, **res,
                      **({"stderr_head": proc.stderr[:3000]} if proc.returncode else {})}))
    return proc.returncode


def cmd_dali_gpu() -> int:
    """The DALI GPU pipeline over a tiny RecordIO file: one epoch, batch shapes."""
    import importlib.util
    from types import SimpleNamespace
    sys.path.insert(0, str(REPO / "tests"))
    from train_util import make_tiny_rec
    spec = importlib.util.spec_from_file_location("dali_top", REPO / "dali.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with tempfile.TemporaryDirectory() as tmp:
        rec = make_tiny_rec(tmp, n=32)
        t0 = time.monotonic()
        loader = mod.dali_dataloader(SimpleNamespace(train_data=rec, batch_size=8, workers=2,
                                                     input_size=24, dali_cpu=False))
        shapes = []
        for images, tokens in loader:
            shapes.append([list(images.shape), list(tokens.shape), str(images.device)])
        print(json.dumps({"batches": len(shapes), "first": shapes[:1],
                          "seconds": round(time.monotonic() - t0, 2)}))
    return 0 if shapes else 1


# ----------------------------------------------------------------------------- plan
def wkv_step(name: str, dtype: str, backends: str, timeout: int, dry_backends: str,
             why: str) -> Step:
    bench = [sys.executable, str(SCRIPTS / "bench_wkv.py")]
    return Step(name, bench + ["--device", "cuda", "--dtype", dtype, "--backends", backends,
                               "--check-batch", "8", "--warmup", "2", "--repeats", "10"],
                timeout, cuda=True, why=why,
                dry=bench + ["--device", "cpu", "--dtype", dtype, "--backends", dry_backends,
                             "--shapes", "2,49,8,80;1,77,10,64", "--check-batch", "1",
                             "--warmup", "0", "--repeats", "1", "--threads", "1"])


def wkv_implementation(variant: str) -> str:
    """The dispatch table's name of a CUDA WKV variant ("fast" -> "cuda-fast")."""
    return variant if variant == "chunked" else f"cuda-{variant}"


def train_step(name: str, variant: str, checkpointing: bool, compiled: bool, timeout: int
               ) -> Step:
    bench = [sys.executable, str(SCRIPTS / "bench_train.py")]
    flags = (["--checkpointing"] if checkpointing else []) + (["--compile"] if compiled else [])
    wkv_steps = "0" if compiled else "1"
    return Step(name, bench + ["--device", "cuda", "--config", B32, "--batch-size", "256",
                               "--precision", "bf16", "--warmup", "3", "--steps", "5",
                               "--wkv-steps", wkv_steps] + flags,
                timeout, cuda=True, env={"RWKV_CLIP_DISPATCH": f"wkv={wkv_implementation(variant)}"},
                why=f"B/32 batch 256 bf16 training step, {variant} kernel, "
                    f"{'compiled' if compiled else 'eager'}, checkpointing "
                    f"{'on' if checkpointing else 'off'}",
                dry=bench + ["--device", "cpu", "--config", TINY, "--batch-size", "4",
                             "--precision", "bf16", "--warmup", "1", "--steps", "1",
                             "--wkv-steps", wkv_steps, "--threads", "1"] + flags
                + (["--compile-backend", "aot_eager"] if compiled else []))  # trace, no codegen


def memory_step(name: str, precision: str, timeout: int) -> Step:
    mem = [sys.executable, "-m", "rwkv_clip.memory", "--config", B32, "--batch-size", "1",
           "--precision", precision, "--mode", "inference", "--measure", "--json"]
    return Step(name, mem + ["--device", "cuda"], timeout, cuda=True,
                why=f"inference memory, B/32 batch 1 {precision} (claim {CLAIMS[name[7:]]})",
                dry=mem + ["--device", "cpu"])


def resolution_step(name: str, timeout: int) -> Step:
    bench = [sys.executable, str(SCRIPTS / "bench_resolution.py")]
    return Step(name, bench + ["--device", "cuda", "--model", "B16", "--precisions", "bf16",
                               "--sides", RESOLUTION_SIDES,
                               "--train-sides", RESOLUTION_TRAIN_SIDES, "--batch-size", "4",
                               "--train-batch-size", "4", "--warmup", "2", "--repeats", "4",
                               "--max-seconds", str(timeout - 30)],
                timeout, cuda=True,
                why=f"B/16 beside open_clip ViT-B-16 at {RESOLUTION_SIDES} px (training "
                    f"{RESOLUTION_TRAIN_SIDES}), bf16, batch 4: "
                    "inference and training step, time and peak memory, log-log slopes",
                dry=bench + ["--device", "cpu", "--model", "B32", "--precisions", "bf16",
                             "--sides", "32,64", "--warmup", "1", "--repeats", "1",
                             "--threads", "1"])


def speed_steps(timeouts: dict[str, int]) -> list[Step]:
    """The whole model's speed beside open_clip (bf16, one process, ABBA-interleaved) and
    the B/32 training step's kernel profile, eager and compiled (scripts/profile_step.py);
    dry forms on the tiny sizes."""
    res = [sys.executable, str(SCRIPTS / "bench_resolution.py")]
    prof = [sys.executable, str(SCRIPTS / "profile_step.py")]
    dry_res = res + ["--device", "cpu", "--model", "B32", "--precisions", "bf16",
                     "--sides", "32", "--warmup", "1", "--repeats", "1", "--threads", "1"]
    dry_prof = prof + ["--device", "cpu", "--config", TINY, "--batch-size", "2",
                       "--warmup", "1", "--steps", "1", "--threads", "1"]
    steps = [
        Step("speed_b32_versus", res + [
            "--device", "cuda", "--model", "B32", "--precisions", "bf16", "--sides", "224",
            "--train-sides", "224", "--batch-size", "256", "--train-batch-size", "256",
            "--warmup", "3", "--repeats", "10",
            "--max-seconds", str(timeouts["speed_b32_versus"] - 20)],
            timeouts["speed_b32_versus"], cuda=True, dry=dry_res,
            why="B/32 beside open_clip ViT-B-32 at batch 256, bf16: the training step (both "
                "towers, ClipLoss, backward, AdamW) and image-tower inference"),
        Step("speed_b16_sweep", res + [
            "--device", "cuda", "--model", "B16", "--precisions", "bf16",
            "--sides", SPEED_SIDES, "--train-sides", SPEED_SIDES, "--batch-size", "32",
            "--train-batch-size", "16", "--warmup", "2", "--repeats", "4",
            "--max-seconds", str(timeouts["speed_b16_sweep"] - 30)],
            timeouts["speed_b16_sweep"], cuda=True, dry=dry_res,
            why=f"B/16 beside open_clip ViT-B-16 at {SPEED_SIDES} px, bf16: training at "
                "batch 16, inference at batch 32, time and peak memory"),
    ]
    for name, flags in (("profile_b32_eager", []), ("profile_b32_compiled", ["--compile"])):
        steps.append(Step(name, prof + ["--device", "cuda", "--config", B32, "--batch-size",
                                        "256", "--precision", "bf16", "--warmup", "3",
                                        "--steps", "3", *flags],
                          timeouts[name], cuda=True,
                          dry=dry_prof + flags + (["--compile-backend", "aot_eager"]
                                                  if flags else []),
                          why="torch.profiler of the B/32 batch-256 bf16 training step "
                              f"({'compiled' if flags else 'eager'}): kernel launches per "
                              "step, GPU-time shares by kind"))
    return steps


def selected_steps(text: str | None) -> set[str] | None:
    """The steps ``--only`` / GPU_CHECK_ONLY names (steps or groups, comma-separated) plus
    those every selection needs; None (every step) for none. The kernel build is left out
    where no selected step runs a native kernel."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        return None
    only = set(ALWAYS).union(*(STEP_GROUPS.get(n, (n,)) for n in names))
    if only - set(ALWAYS) <= set(WITHOUT_KERNELS):
        only.discard("build_kernels")
    return only


def glue_step(timeout: int) -> Step:
    """Each fused glue op (rwkv_clip.ops.glue) at the B/32 batch-256 bf16 shapes: forward +
    backward of the eager reference, the compiled reference and the Triton op, checked
    against float64, then interleaved (scripts/bench_glue.py); a case that would start
    past the step's time is skipped by the benchmark itself."""
    bench = [sys.executable, str(SCRIPTS / "bench_glue.py")]
    return Step("glue_ops", bench + ["--device", "cuda", "--config", B32, "--batch", "256",
                                     "--dtype", "bf16", "--warmup", "3", "--repeats", "10",
                                     "--max-seconds", str(timeout - 40)],
                timeout, cuda=True,
                dry=bench + ["--device", "cpu", "--config", B32, "--batch", "1", "--dtype",
                             "bf16", "--warmup", "0", "--repeats", "1", "--threads", "1",
                             "--compile-backend", "aot_eager"],  # trace, no codegen
                why="the fused glue ops (token shift + lerps, head norm + gate, squared "
                    "ReLU) beside their reference, eager and torch.compile'd, B/32 batch "
                    "256 bf16, forward + backward")


def fastest_cuda_variant(runner: Runner) -> tuple[str, str]:
    """The faster CUDA variant by summed bf16 fwd+bwd time over the shapes, among those
    that passed the float64 check; faithful when nothing was measured."""
    res = runner.steps.get("wkv_bf16", {}).get("result") or {}
    totals: dict[str, float] = {}
    for shape in res.get("shapes", []):
        for name, rec in shape["backends"].items():
            if name.startswith("cuda-") and "fwd_bwd_ms" in rec:
                totals[name[5:]] = totals.get(name[5:], 0.0) + rec["fwd_bwd_ms"]
    if len(totals) < 2:
        return "faithful", "no bf16 timings of both CUDA variants: the faithful one"
    best = min(totals, key=totals.get)
    return best, f"fastest bf16 fwd+bwd over the three shapes: {totals}"


def summarize(runner: Runner) -> dict:
    """The figures that matter, pulled out of the steps' results."""
    s = runner.steps
    out: dict = {"parity": {}, "wkv_fwd_bwd_ms": {}, "training": {}, "memory": []}
    for step in ("wkv_fp32", "wkv_bf16", "wkv_chunked_bf16", "wkv_fla_bf16"):
        res = s.get(step, {}).get("result") or {}
        for shape in res.get("shapes", []):
            key = f"({shape['B']},{shape['T']},{shape['H']},{shape['N']})"
            for name, rec in shape["backends"].items():
                out["parity"].setdefault(res["dtype"], {}).setdefault(name, {})[key] = {
                    "passed": rec.get("check_passed"), "max_rel_err": rec.get("max_rel_err"),
                    **({"error": rec["error"]} if "error" in rec else {})}
                if "fwd_bwd_ms" in rec:
                    out["wkv_fwd_bwd_ms"].setdefault(f"{res['dtype']} {key}", {})[name] = \
                        rec["fwd_bwd_ms"]
    for name, rec in s.items():
        res = rec.get("result") or {}
        if name.startswith("train_") and "samples_per_s" in res:
            out["training"][name] = {
                "pairs_per_s": round(res["samples_per_s"], 1),
                "peak_memory_gib": round(res["peak_memory_bytes"] / GiB, 2),
                "estimated_peak_gib": round(res["estimated_peak_bytes"] / GiB, 2),
                "wkv_share": res.get("wkv_share")}
    res = s.get("resolution_bf16", {}).get("result") or {}
    out["resolution"] = {
        "cases": [{"task": c["task"], "side": c["side"], "tokens": c["tokens"],
                   **{k: c[k] for k in ("ratio", "memory_ratio") if k in c},
                   **{name: c[name].get("median_s", c[name].get("error"))
                      for name in ("rwkv_clip", "open_clip") if name in c}}
                  for c in res.get("cases", [])],
        "slopes": res.get("slopes", [])}
    out["speed"] = {}
    for name in SPEED_STEPS:
        res = s.get(name, {}).get("result") or {}
        if name.startswith("profile_"):
            keys = ("launches_per_step", "time_ms_per_step", "shares")
            out["speed"][name] = {k: res[k] for k in keys if k in res}
        elif res:
            out["speed"][name] = [
                {"task": c["task"], "side": c["side"], "batch": c.get("batch"),
                 **{k: c[k] for k in ("ratio", "memory_ratio") if k in c}}
                for c in res.get("cases", [])]
    res = s.get("glue_ops", {}).get("result") or {}
    out["glue"] = [{"name": c["name"], "fastest": c.get("fastest"),
                    **{k: c[k]["ratio"] for k in ("triton_vs_eager", "triton_vs_compiled",
                                                  "compiled_vs_eager") if k in c},
                    **({"skipped": c["skipped"]} if "skipped" in c else {})}
                   for c in res.get("cases", [])]
    for key, claim in CLAIMS.items():
        if key.startswith("inference"):
            res = (s.get(f"memory_{key}", {}).get("result") or {}).get("measured") or {}
            measured, est = res.get("measured_peak_bytes"), res.get("estimated_peak_bytes")
        else:
            res = s.get(f"train_faithful_eager{'_ckpt' if key.endswith('ckpt') else ''}",
                        {}).get("result") or {}
            measured, est = res.get("peak_memory_bytes"), res.get("estimated_peak_bytes")
        out["memory"].append({"what": key, "claim": claim,
                              "measured_gib": round(measured / GiB, 2) if measured else None,
                              "planner_estimate_gib": round(est / GiB, 2) if est else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--rehearse", action="store_true",
                    help="rehearsal on a machine without CUDA: CUDA steps run their CPU dry form")
    ap.add_argument("--wheels", action="append", default=None,
                    help="wheel folder(s) to install from (default .whl)")
    ap.add_argument("--site", default=str(REPO / ".cache" / "gpu_check" / "site"),
                    help="target folder for the wheels (emptied first)")
    ap.add_argument("--budget", type=float, default=465.0, help="seconds for all steps")
    ap.add_argument("--timeout-scale", type=float, default=1.0,
                    help="multiply every step's timeout (the rehearsal's dry runs share 2 CPU "
                         "cores and build the kernels cold)")
    ap.add_argument("--only", default=os.environ.get("GPU_CHECK_ONLY") or None,
                    help="comma-separated steps or groups (speed, glue) to run; the "
                         "environment, imports and kernel build always run, the build only "
                         "where a selected step needs it (default: every step)")
    ap.add_argument("--compile-cache", default=os.environ.get("GPU_CHECK_COMPILE_CACHE")
                    or str(REPO / ".cache" / "gpu_check" / "compile"),
                    help="inductor and Triton cache folder, kept between runs")
    ap.add_argument("--subcommand", nargs="+", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.subcommand:
        sub, *rest = ns.subcommand
        return {"imports": lambda: cmd_imports(*rest),
                "build": lambda: cmd_build(rest),
                "torchrun-step": lambda: cmd_torchrun_step(*rest),
                "ddp-step": lambda: cmd_ddp_step(*rest),
                "torchrun-ddp": lambda: cmd_torchrun_ddp(*rest),
                "dali-gpu": cmd_dali_gpu}[sub]()

    python = sys.executable
    site = Path(ns.site).resolve()
    wheel_dirs = [Path(w).resolve() for w in (ns.wheels or [str(REPO / ".whl")])]
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base_env["PYTHONUNBUFFERED"] = "1"
    env = dict(base_env, PYTHONPATH=f"{site}{os.pathsep}{REPO}",
               PATH=f"{site / 'bin'}{os.pathsep}{base_env.get('PATH', '')}")
    # caches of the check's own, beside its site (kernels in its kernels/): the build step
    # times a cold build, a timed-out build's leftover locks can be cleared, and no other
    # checkout's cache is touched
    own_cache = "RWKV_CLIP_CACHE" not in env
    kernels = Path(env.setdefault("RWKV_CLIP_CACHE", str(site.parent))) / "kernels"
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    # compiled graphs and Triton kernels (the anchor's, inductor's) from earlier runs
    compile_cache = Path(ns.compile_cache).resolve()
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(compile_cache / "triton"))
    only = selected_steps(ns.only)

    # wheels first: nothing else imports without them
    wheels = install_wheels(python, site, wheel_dirs, base_env)
    probe = subprocess.run([python, "-c", "import torch, json; print(json.dumps(dict("
                            "torch=torch.__version__, cuda=torch.version.cuda, "
                            "available=torch.cuda.is_available(), device=torch.cuda."
                            "get_device_name(0) if torch.cuda.is_available() else None)))"],
                           capture_output=True, text=True, env=env)
    torch_info = last_json(probe.stdout) or {"error": probe.stderr[-1500:]}
    cuda = bool(torch_info.get("available"))
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # fla's autotuning results too
    runner = Runner(ns.budget, env, ns.rehearse, cuda, ns.timeout_scale, only)
    runner.steps["wheels"] = wheels
    print(f"== wheels: {wheels['status']} ({len(wheels['installed'])} installed)", file=sys.stderr)
    if ns.rehearse and cuda:
        print("note: --rehearse on a machine with CUDA runs the real steps", file=sys.stderr)

    me = [python, str(Path(__file__).resolve()), "--subcommand"]
    runner.run(Step("environment", ["bash", "-c",
                    "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,"
                    "noheader 2>&1 || echo 'no nvidia-smi'; nvcc --version 2>&1 | tail -2 "
                    "|| echo 'no nvcc'"], 20))
    runner.run(Step("imports", me + ["imports", str(site)], 90,
                    why="every module the steps import, and where it comes from"))
    # the published configs' kernels (head sizes 64 and 80; any sequence length)
    jobs = ["cpu"] + [f"{v}:{n}" for v in ("faithful", "fast") for n in (64, 80)]
    build = runner.run(Step("build_kernels", me + ["build", *jobs], 180,
                            why="kernel build time: CPU kernel and both CUDA variants for "
                                "N=64/80 (the published configs and the GPU tests), "
                                "one process each, in parallel"))
    if build["status"] == "timed_out" and own_cache:  # dead builders leave locks behind
        build["locks_removed"] = [str(p) for p in kernels.rglob("lock")]
        for lock in kernels.rglob("lock"):
            lock.unlink()
    runner.run(Step("gpu_tests", [python, "-m", "pytest", "-m", "gpu", "--slow", "-q",
                                  "-p", "no:cacheprovider", "--ignore", GLUE_TESTS, "tests"],
                    150, cuda=True,
                    dry=[python, "-m", "pytest", "-m", "gpu", "--slow", "-q",
                         "-p", "no:cacheprovider", "--collect-only", "tests"],
                    why="the GPU-marked tests (the glue ops' in the glue group)"))
    runner.run(wkv_step("wkv_fp32", "fp32", "cuda-faithful,cuda-fast", 75, "reference,cpu",
                        "parity vs float64 (y + 5 grads) and fwd+bwd time, fp32 inputs"))
    runner.run(wkv_step("wkv_bf16", "bf16", "cuda-faithful,cuda-fast", 75, "reference,cpu",
                        "parity vs float64 (y + 5 grads) and fwd+bwd time, bf16 inputs"))
    bench = [sys.executable, str(SCRIPTS / "bench_wkv.py"), "--dtype", "bf16", "--check-batch", "1"]
    runner.run(Step("wkv_chunked_bf16",
                    bench + ["--device", "cuda", "--shapes", "issue47", "--warmup", "2",
                             "--repeats", "10", "--backends",
                             "cuda-chunked,cuda-fast,cuda-faithful,fla-chunk,sdpa"],
                    150, cuda=True,
                    dry=bench + ["--device", "cpu", "--shapes", "1,17,2,64;1,9,2,80",
                                 "--warmup", "0", "--repeats", "1", "--threads", "1",
                                 "--backends", "reference,cpu,sdpa"],
                    why="the chunked Triton kernel against fast, faithful, fla's chunk_rwkv6 "
                        "(bidirectional) and flash attention (SDPA, N=64) at the four target "
                        "shapes, float64 check incl. T=5000 (bf16)"))
    # before the anchor, whose Triton kernels compile on first use and can take its timeout
    runner.run(resolution_step("resolution_bf16", 120))
    runner.run(wkv_step("wkv_fla_bf16", "bf16", "cuda-faithful,fla-chunk,fla-fused-recurrent",
                        120, "fla-naive",
                        "the anchor: fla's chunk_rwkv6 / fused_recurrent_rwkv6 as a "
                        "bidirectional op, checked vs float64 before timing (bf16)"))
    best, best_why = fastest_cuda_variant(runner)
    runner.steps["best_cuda_variant"] = {"status": "ok", "variant": best, "why": best_why}
    for ckpt in (False, True):
        tag = "_ckpt" if ckpt else ""
        runner.run(train_step(f"train_faithful_eager{tag}", "faithful", ckpt, False, 75))
    for ckpt in (False, True):
        tag = "_ckpt" if ckpt else ""
        if best == "faithful" and cuda:
            runner.note(f"train_best_eager{tag}", "skipped",
                        "the best kernel is the faithful one: same as train_faithful_eager")
        else:
            runner.run(train_step(f"train_best_eager{tag}", best if cuda else "fast", ckpt,
                                  False, 75))
    runner.run(memory_step("memory_inference_bf16_b1", "bf16", 60))
    runner.run(memory_step("memory_inference_fp32_b1", "fp32", 60))
    runner.run(Step("torchrun_nccl", me + ["torchrun-step", "cuda", "bf16"], 90, cuda=True,
                    dry=me + ["torchrun-step", "cpu", "fp32"],
                    why="one-process torchrun of train.py, 2 steps (it starts no process "
                        "group for one process)"))
    runner.run(Step("torchrun_nccl_ddp", me + ["torchrun-ddp", "cuda"], 90, cuda=True,
                    dry=me + ["torchrun-ddp", "cpu"],
                    why="one-process torchrun: NCCL process group, all-reduce, 2 DDP steps"))
    for ckpt in (False, True):
        tag = "_ckpt" if ckpt else ""
        runner.run(train_step(f"train_best_compiled{tag}", best if cuda else "fast", ckpt,
                              True, 150))
    runner.run(Step("glue_gpu_tests", [python, "-m", "pytest", "-m", "gpu", "-q", "-p",
                                       "no:cacheprovider", GLUE_TESTS], 120, cuda=True,
                    why="the fused glue ops' GPU tests: kernels against float64, one "
                        "compiled graph"))
    # its own guard stops it starting a case past the step's time: a step killed by the
    # runner would leave no JSON at all
    runner.run(glue_step(int(min(300, runner.left() - 10))))
    for step in speed_steps({"speed_b32_versus": 90, "speed_b16_sweep": 240,
                             "profile_b32_eager": 60, "profile_b32_compiled": 180}):
        runner.run(step)
    dali = has_module(python, "nvidia.dali", env)
    if not dali:
        runner.note("dali_gpu", "skipped", "DALI is not importable (it cannot travel: ~480 MB)")
    else:
        runner.run(Step("dali_gpu", me + ["dali-gpu"], 60, cuda=True,
                        why="the DALI GPU pipeline over a tiny RecordIO file"))

    failed = [n for n, r in runner.steps.items() if r["status"] in ("failed", "timed_out")]
    # the default as the builder has it (read, not imported: this process has no SITE)
    found = re.search(r'^DEFAULT_CUDA_VARIANT = "(\w+)"',
                      (REPO / "rwkv_clip" / "ops" / "build.py").read_text(), re.M)
    from_build = found.group(1) if found else None
    report = {
        "rehearsal": ns.rehearse,
        "date": started,
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch_info,
        "budget_s": ns.budget,
        "only": sorted(only) if only is not None else None,
        "compile_cache": str(compile_cache),
        "total_s": round(time.monotonic() - runner.start, 1),
        "all_ok": not failed,
        "failed": failed,
        "default_cuda_variant": {"now": from_build, "fastest_measured": best,
                                 "why": best_why},
        "summary": summarize(runner),
        "steps": runner.steps,
    }
    text = json.dumps(report, indent=1)
    Path(ns.out).write_text(text + "\n")
    print(json.dumps({k: report[k] for k in ("rehearsal", "total_s", "all_ok", "failed")}))
    print(f"wrote {ns.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
