#!/usr/bin/env python
"""Profile the training step (both towers, ClipLoss, backward, AdamW, as train.py runs it)
with torch.profiler: kernel launches per step and the time shares by kind; one JSON.

On CUDA the device's kernels (and memcpy / memset) are counted and timed; on the CPU,
where there are no kernels, the operators that call no other operator, by self time.
Kinds (:data:`KINDS`, first match of :data:`RULES` on the kernel's name): matrix products,
the WKV kernels, copies and dtype casts, norms, elementwise, reductions, optimizer, other.

    python scripts/profile_step.py --device cuda --config B32 --batch-size 256 --precision bf16
    python scripts/profile_step.py --device cuda --compile --trace step.json.gz
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = ("matmul", "wkv", "copy_cast", "norm", "elementwise", "reduction", "optimizer", "other")
# (kind, pattern searched in the lower-cased kernel or operator name), first match wins:
# WKV before everything (the CUDA kernels wkv_* and fast_*, fla's *rwkv6*), then the optimizer's
# multi-tensor kernels, the GEMMs (cuBLAS / CUTLASS / Triton templates / aten products),
# norms (inductor names a fused kernel after its ops: a norm wins over its elementwise
# epilogue), copies and casts, reductions, elementwise
RULES: tuple[tuple[str, str], ...] = (
    ("other", r"nccl"),  # collectives (their names say reduce) stay out of the maths
    ("wkv", r"(?<!r)wkv|rwkv6|\bfast_(?:forward|backward)"),
    ("optimizer", r"multi_tensor_apply|foreach|fused_adam|adamw?_|_adam"),
    ("matmul", r"gemm|cutlass|cublas|xmma|wgmma|sm\d+_.*(?:tn|nt|nn|tt)|triton_tem_|"
               r"^aten::(?:mm|bmm|addmm|baddbmm|matmul|linear|_?convolution|conv2d|"
               r"mkldnn_convolution|_linear_pointwise)$|^mkldnn::_linear_pointwise$|"
               r"rwkv_clip::onednn_linear|splitk|convolution|conv2d|implicit_gemm|"
               r"flash|fmha|attention"),
    ("norm", r"layer_?norm|group_?norm|batch_?norm|rms_?norm|welford|native_norm|"
             r"rowwisemoments|fusedparams|gammabeta|internalgradients"),
    ("copy_cast", r"copy|_shift$|memcpy|memset|_to_copy|^aten::to$|convert|cast|contiguous|clone|"
                  r"cat_|catarraybatched|^aten::cat$|index_put|fill|zero_|^aten::zero"),
    ("reduction", r"reduce|triton_red_|triton_per_|^aten::(?:sum|mean|amax|max|min|norm)$|"
                  r"sum_|softmax|logsumexp|cross_entropy|nll_loss"),
    ("elementwise", r"elementwise|vectorized|unrolled|triton_poi_|pointwise|"
                    r"^aten::(?:add|sub|mul|div|lerp|tanh|sigmoid|silu|relu|exp|square|"
                    r"pow|neg|rsub|addcmul|addcdiv|where|threshold_backward|"
                    r"sigmoid_backward|tanh_backward|silu_backward|gelu|clamp|sqrt|"
                    r"rsqrt|abs|sign|lt|gt|le|ge|eq|ne)_?$"),
)
_COMPILED = [(kind, re.compile(pattern)) for kind, pattern in RULES]


def classify(name: str) -> str:
    """The kind of a kernel (or CPU operator) by its name: one of :data:`KINDS`."""
    low = name.lower()
    for kind, pattern in _COMPILED:
        if pattern.search(low):
            return kind
    return "other"


def summarise(events: Iterable[tuple[str, float]], steps: int, top: int = 15) -> dict:
    """From (name, microseconds) per kernel launch over ``steps`` steps: launches per
    step, time per step, each kind's share of the time (summing to 1) and launches per
    step, and the ``top`` kernels by time."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    time_by_kind = dict.fromkeys(KINDS, 0.0)
    launches_by_kind = dict.fromkeys(KINDS, 0)
    by_name: dict[str, float] = {}
    calls: Counter[str] = Counter()
    for name, us in events:
        kind = classify(name)
        time_by_kind[kind] += us
        launches_by_kind[kind] += 1
        by_name[name] = by_name.get(name, 0.0) + us
        calls[name] += 1
    total = sum(time_by_kind.values())
    launches = sum(launches_by_kind.values())
    return {
        "steps": steps,
        "launches_per_step": launches / steps,
        "time_ms_per_step": total / steps / 1e3,
        "shares": {k: (v / total if total else 0.0) for k, v in time_by_kind.items()},
        "launches_per_step_by_kind": {k: v / steps for k, v in launches_by_kind.items()},
        "top": [{"name": name[:160], "kind": classify(name), "share": us / total,
                 "launches_per_step": calls[name] / steps}
                for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]
        if total else [],
    }


# CPU operators that only make views or empty tensors: not counted as work
_NO_WORK = re.compile(r"^aten::(?:empty\w*|view\w*|_?reshape\w*|as_strided\w*|alias|detach\w*|"
                      r"t|transpose|permute|expand\w*|unsqueeze|squeeze\w*|select|slice|"
                      r"unbind|split\w*|chunk|narrow|_unsafe_view|resolve_\w+|lift\w*|"
                      r"result_type|is_\w+|size|stride|numel|item|_local_scalar_dense)$")
# CPU operators whose whole subtree counts as their kind (the WKV operator and the
# products call copies and allocations of their own)
_SUBTREE_KINDS = ("wkv", "matmul", "norm")


def kernel_events(prof, device_type: str) -> list[tuple[str, float]]:
    """(name, microseconds) of each kernel the profile recorded: on CUDA the device's
    kernels and memory operations; on the CPU each operator that does work, by its self
    time, named after its outermost WKV, product or norm caller where it has one."""
    from torch.autograd import DeviceType
    out = []
    for event in prof.events():
        if device_type == "cuda":
            if event.device_type in (DeviceType.CUDA, DeviceType.PrivateUse1):
                out.append((event.name, event.time_range.elapsed_us()))
            continue
        if (event.device_type != DeviceType.CPU or _NO_WORK.match(event.name)
                or not event.name.startswith(("aten::", "mkldnn::", "rwkv_clip::"))):
            continue
        name, parent = event.name, event.cpu_parent
        while parent is not None:
            if (parent.name.startswith(("aten::", "mkldnn::", "rwkv_clip::"))
                    and classify(parent.name) in _SUBTREE_KINDS):
                name = parent.name
            parent = parent.cpu_parent
        out.append((name, event.self_cpu_time_total))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="B32", help="model config (path or shipped name)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--compile", action="store_true", help="compile_model the model first")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (aot_eager: trace only, no code generation)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before profiling")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by time")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--trace", default=None, help="also write the Chrome trace here")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    if ns.steps < 1 or ns.warmup < 0 or ns.batch_size < 1:
        ap.error("--steps and --batch-size must be at least 1, --warmup at least 0")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rwkv_clip.compiling import compile_model
    from rwkv_clip.config import resolve_config_path
    from rwkv_clip.distributed import pick_device
    from rwkv_clip.memory import build_measured_model, make_step, synthetic_batch
    if ns.threads:
        torch.set_num_threads(ns.threads)
    device = pick_device(ns.device)
    cuda = device.type == "cuda"
    args, model = build_measured_model(resolve_config_path(ns.config), device, False, None)
    model.train()
    forward = compile_model(model, backend=ns.compile_backend) if ns.compile else model
    step = make_step(forward, ns.precision, device.type)
    images, tokens = synthetic_batch(args, ns.batch_size, device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(ns.warmup):
        step(images, tokens)
    sync()
    warmup_s = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(ns.steps):
            step(images, tokens)
        sync()
        wall = time.perf_counter() - t0
    result = {
        "config": ns.config, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "precision": ns.precision, "batch": ns.batch_size,
        "compiled": ns.compile, "warmup_steps": ns.warmup, "warmup_s": round(warmup_s, 2),
        "wall_ms_per_step_profiled": wall / ns.steps * 1e3,
        "what": "device kernels" if cuda else "CPU leaf operators (self time)",
        **summarise(kernel_events(prof, device.type), ns.steps, ns.top),
    }
    if ns.trace:
        prof.export_chrome_trace(ns.trace)
    text = json.dumps(result, indent=1)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    from rwkv_clip.errors import run_cli
    sys.exit(run_cli(main))
