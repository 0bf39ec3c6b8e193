#!/usr/bin/env python
"""Benchmark the WKV backends; prints ONE JSON object.

For each shape (B, T, H, N) and each backend: forward time and forward+backward time
(median over --repeats, after --warmup), measured on inputs that require grad as in
training. Before a backend is timed it is checked against the float64 reference on the
first --check-batch rows (max error relative to the largest reference value, for y and
all five gradients); a backend that fails the check (--tolerance) is reported and not
timed. Ratios are against the pure-PyTorch reference on CPU and against the
port-faithful CUDA kernel on GPU, measured in the same run.

Defaults: on GPU the real shapes (256, 49, 8, 80), (256, 77, 10, 64), (256, 196, 8, 80)
with backends cuda-faithful and cuda-fast; on CPU scaled-down shapes (16, 77, 10, 64),
(16, 49, 8, 80), (4, 196, 8, 80) with backends reference and cpu. ``--shapes issue47``
is the four shapes of the chunked kernel's targets (the three above and (4, 3136, 12, 64))
plus (1, 5000, 12, 64) for the float64 check of a long sequence.

Backend ``sdpa`` is a yardstick, not a WKV: PyTorch's scaled_dot_product_attention with
the flash backend, forward + backward, at the same (B, T, H) with head size 64 (bf16/fp16
only; no float64 check, it computes something else).

    python scripts/bench_wkv.py                       # defaults for this machine
    python scripts/bench_wkv.py --device cpu --shapes 16,77,10,64
    python scripts/bench_wkv.py --device cuda --dtype bf16
    python scripts/bench_wkv.py --threads 1 --clock cpu   # on a busy shared machine
    python scripts/bench_wkv.py --device cuda --dtype bf16 --shapes issue47 \
        --backends cuda-chunked,cuda-fast,cuda-faithful,fla-chunk,sdpa

``--clock cpu`` times with the calling thread's CPU clock (``time.thread_time``), which
other processes on a shared machine do not inflate; it needs ``--threads 1`` (the kernel
then runs on the calling thread) and a CPU device.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # fla_anchor.py beside this file

import torch

from rwkv_clip.bench.provenance import measured
from rwkv_clip.ops import wkv6_bidirectional, wkv6_bidirectional_reference

GPU_SHAPES = [(256, 49, 8, 80), (256, 77, 10, 64), (256, 196, 8, 80)]
CPU_SHAPES = [(16, 77, 10, 64), (16, 49, 8, 80), (4, 196, 8, 80)]
ISSUE47_SHAPES = GPU_SHAPES + [(4, 3136, 12, 64), (1, 5000, 12, 64)]
SDPA_HEAD_SIZE = 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_backend(name: str):
    if name == "reference":
        return lambda *a: wkv6_bidirectional(*a, backend="reference")
    if name == "cpu":
        return lambda *a: wkv6_bidirectional(*a, backend="cpu")
    if name.startswith("cuda-"):
        from rwkv_clip.ops.kernels import run_native
        variant = name.split("-", 1)[1]
        return lambda *a: run_native("cuda", *a, variant=variant)
    if name.startswith("fla-"):  # the anchor: flash-linear-attention's RWKV-6 (fla-core)
        from fla_anchor import make_fla_backend
        return make_fla_backend(name)
    raise SystemExit(f"unknown backend {name!r}")


def time_sdpa(B, T, H, device, dtype, warmup, repeats, clock=time.perf_counter):
    """Flash attention forward and forward + backward at (B, T, H, 64): the yardstick."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator().manual_seed(0)
    q, k, v, gy = (torch.randn(B, H, T, SDPA_HEAD_SIZE, generator=g).to(device, dtype)
                   for _ in range(4))

    def attn(*xs):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*xs)
    rec = time_backend(attn, [q, k, v], gy, device, warmup, repeats, clock)
    return {"head_size": SDPA_HEAD_SIZE, "backend": "flash", **rec}


def make_inputs(B, T, H, N, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = H * N
    r = torch.randn(B, T, C, generator=g)
    k = torch.randn(B, T, C, generator=g) * 0.5
    v = torch.randn(B, T, C, generator=g)
    w = torch.randn(B, T, C, generator=g) * 0.7 - 1.5  # decays spread over (0.6, 1)
    u = torch.randn(H, N, generator=g) * 0.5
    gy = torch.randn(B, T, C, generator=g)
    # activations in the chosen dtype; w and u as the model keeps them (w float32)
    xs = [r.to(dtype), k.to(dtype), v.to(dtype), w, u.to(dtype)]
    return [x.to(device) for x in xs], gy.to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(fn, inputs, gy, rows):
    """Max relative errors of y and the five gradients vs the float64 reference."""
    sub = [x[:rows] for x in inputs[:4]] + [inputs[4]]
    gsub = gy[:rows]
    ref_in = [x.detach().double().cpu().requires_grad_() for x in sub]
    y_ref = wkv6_bidirectional_reference(*ref_in)
    g_ref = torch.autograd.grad(y_ref, ref_in, gsub.double().cpu(), allow_unused=True)
    test_in = [x.detach().clone().requires_grad_() for x in sub]
    y = fn(*test_in)
    g = torch.autograd.grad(y, test_in, gsub.to(y.dtype), allow_unused=True)
    errs = {}
    ours, refs = [y.detach(), *g], [y_ref.detach(), *g_ref]
    for name, a, b in zip(["y", "r", "k", "v", "w", "u"], ours, refs, strict=True):
        b = torch.zeros_like(ref_in[0] if name != "u" else ref_in[4]) if b is None else b
        a = torch.zeros_like(b) if a is None else a.detach().double().cpu()
        errs[name] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
    return errs


def time_backend(fn, inputs, gy, device, warmup, repeats, clock=time.perf_counter):
    xs = [x.detach().clone().requires_grad_() for x in inputs]

    def fwd():
        return fn(*xs)

    def fwd_bwd():
        y = fn(*xs)
        torch.autograd.grad(y, xs, gy, allow_unused=True)

    out = {}
    for key, f in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        for _ in range(warmup):
            f()
        sync(device)
        times = []
        for _ in range(repeats):
            t0 = clock()
            f()
            sync(device)
            times.append((clock() - t0) * 1e3)
        out[key] = round(statistics.median(times), 3)
    return out


def parse_shapes(text):
    if text == "issue47":
        return list(ISSUE47_SHAPES)
    shapes = []
    for part in text.split(";"):
        vals = tuple(int(x) for x in part.replace(" ", "").split(","))
        if len(vals) != 4:
            raise SystemExit(f"--shapes wants B,T,H,N[;B,T,H,N...], got {part!r}")
        shapes.append(vals)
    return shapes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--shapes", help="B,T,H,N[;B,T,H,N...] or issue47 (default depends on the "
                                    "device)")
    p.add_argument("--backends", help="comma list among reference, cpu, cuda-faithful, cuda-fast, "
                                      "cuda-chunked, fla-chunk, fla-fused-recurrent, fla-naive "
                                      "(fla_anchor.py), sdpa (yardstick)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of r, k, v, u")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="wall: perf_counter; cpu: this thread's CPU time (needs --threads 1)")
    p.add_argument("--check-batch", type=int, default=2, help="rows checked against float64")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative error to pass the check (default 1e-4 fp32, 2e-2 bf16/fp16)")
    args = p.parse_args(argv)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit("--clock cpu needs --device cpu and --threads 1 (the calling thread's "
                         "CPU time only covers work done on that thread)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    on_gpu = device.type == "cuda"
    shapes = parse_shapes(args.shapes) if args.shapes else (GPU_SHAPES if on_gpu else CPU_SHAPES)
    if args.backends:
        backends = args.backends.split(",")
    else:
        backends = ["cuda-faithful", "cuda-fast"] if on_gpu else ["reference", "cpu"]
    baseline = "cuda-faithful" if on_gpu else "reference"
    dtype = DTYPES[args.dtype]
    tol = args.tolerance if args.tolerance is not None else (1e-4 if args.dtype == "fp32" else 2e-2)

    result = {
        "benchmark": "wkv6_bidirectional",
        **measured(),
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "dtype": args.dtype,
        "baseline": baseline,
        "tolerance": tol,
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "shapes": [],
    }
    ok = True
    for (B, T, H, N) in shapes:
        inputs, gy = make_inputs(B, T, H, N, device, dtype)
        entry = {"B": B, "T": T, "H": H, "N": N, "backends": {}}
        for name in backends:
            rec = {}
            if name == "sdpa":
                try:
                    rec = time_sdpa(B, T, H, device, dtype, args.warmup, args.repeats, clock)
                except Exception as e:  # e.g. no flash kernel for fp32 or on this device
                    rec["error"] = f"{type(e).__name__}: {e}"
                entry["backends"][name] = rec
                continue
            fn = make_backend(name)
            try:
                errs = check(fn, inputs, gy, min(args.check_batch, B))
                rec["max_rel_err"] = {k: float(f"{v:.3g}") for k, v in errs.items()}
                rec["check_passed"] = max(errs.values()) <= tol
                if rec["check_passed"]:
                    rec.update(time_backend(fn, inputs, gy, device, args.warmup, args.repeats,
                                            clock))
                else:
                    ok = False
            except Exception as e:  # reported in the JSON, not fatal for the others
                rec["error"] = f"{type(e).__name__}: {e}"
                ok = False
            entry["backends"][name] = rec
        base = entry["backends"].get(baseline, {})
        for rec in entry["backends"].values():
            for key in ("fwd_ms", "fwd_bwd_ms"):
                if key in rec and key in base and rec[key] > 0:
                    rec[f"speedup_{key[:-3]}_vs_{baseline}"] = round(base[key] / rec[key], 2)
        result["shapes"].append(entry)
    result["all_checks_passed"] = ok
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
