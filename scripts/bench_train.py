#!/usr/bin/env python
"""Steady-state training throughput, peak memory and WKV share of a training step.

Synthetic images and tokens (no data loading); the step is the planner's plain
training step (rwkv_clip.memory.make_step: forward both towers, L2-normalise,
ClipLoss, backward, clip grad norm 1.0, AdamW). Prints ONE JSON object.

    python scripts/bench_train.py                       # CPU: small config, batch 32, fp32
    python scripts/bench_train.py --checkpointing       # on GPU: B/32, batch 256, bf16
    python scripts/bench_train.py --versus              # CPU: B/32 beside open_clip ViT-B-32
    python scripts/bench_train.py --versus --repeats 6 --modes eager

``--versus [MODEL]`` runs a different benchmark: RWKV-CLIP (``--versus-config``, default
B/32) and open_clip's MODEL (default ViT-B-32, randomly initialised), interleaved in this
process, training steps at ``--batch-sizes`` (default 4,16), fp32 and bf16 autocast,
eager and torch.compile'd, pairs/s and ratios as one JSON object; see
rwkv_clip.bench.versus. The flags above do not apply to it.

Two phases: ``--steps`` timed steps as they run in training (samples/s), then
``--wkv-steps`` steps in which every WKV call is timed, forward and backward, with
device synchronisation around it (so the share is the WKV op's fraction of a step that
was itself synchronised; those steps are a little slower and are not used for samples/s).
With checkpointing, the recomputation in backward calls WKV again: those calls count
(calls_per_step doubles) since they are WKV time spent in the step.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import rwkv_clip.layers.time_mix as time_mix
from rwkv_clip.bench.provenance import measured
from rwkv_clip.bench.versus import add_versus_flags, run_versus
from rwkv_clip.compiling import compile_model
from rwkv_clip.errors import run_cli
from rwkv_clip.host_memory import add_host_malloc_flag, configure_host_malloc
from rwkv_clip.memory import (
    PeakRSS,
    build_measured_model,
    make_step,
    rss_kib,
    synthetic_batch,
    training_peak,
)
from rwkv_clip.ops import dispatch


class WKVTimer:
    """Times every WKV call, forward and backward, by patching the op used by the
    time-mix layers and bracketing it with autograd marks that synchronise."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fwd = 0.0
        self.bwd = 0.0
        self.calls = 0
        self._orig = time_mix.wkv6_bidirectional
        self._bwd_start: list[float] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        timer = self

        class Before(torch.autograd.Function):  # backward runs right after WKV's backward
            @staticmethod
            def forward(ctx, *xs):
                return tuple(x.view_as(x) for x in xs)

            @staticmethod
            def backward(ctx, *grads):
                timer.sync()
                timer.bwd += time.perf_counter() - timer._bwd_start.pop()
                return grads

        class After(torch.autograd.Function):  # backward runs right before WKV's backward
            @staticmethod
            def forward(ctx, y):
                return y.view_as(y)

            @staticmethod
            def backward(ctx, g):
                timer.sync()
                timer._bwd_start.append(time.perf_counter())
                return g

        def timed(r, k, v, w, u, backend=None):
            if torch.is_grad_enabled():
                r, k, v, w, u = Before.apply(r, k, v, w, u)
            timer.sync()
            t0 = time.perf_counter()
            y = timer._orig(r, k, v, w, u, backend=backend)
            timer.sync()
            timer.fwd += time.perf_counter() - t0
            timer.calls += 1
            return After.apply(y) if torch.is_grad_enabled() else y

        time_mix.wkv6_bidirectional = timed
        return self

    def __exit__(self, *exc):
        time_mix.wkv6_bidirectional = self._orig
        return False


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None,
                    help="model config (default: B/32 on GPU, small on CPU)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 256 GPU, 32 CPU")
    ap.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                    help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--wkv-backend", default=None, help="force a WKV backend (cuda/cpu/reference)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5 GPU, 1 CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10 GPU, 3 CPU)")
    ap.add_argument("--wkv-steps", type=int, default=None,
                    help="steps with the WKV op timed (default 3 GPU, 1 CPU; 0 to skip)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_host_malloc_flag(ap)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (warm-up steps include the compilation)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend (aot_eager: trace only, no code generation)")
    add_versus_flags(ap, default_batches="4,16", versus_default=None,
                     default_config=str(REPO / "model_config" / "RWKV_CLIP_B32.json"))
    ns = ap.parse_args(argv)
    if ns.versus is not None:
        return run_versus(ns, tasks=("train",))
    gpu = ns.device == "cuda"
    config = ns.config or str(REPO / "model_config" /
                              ("RWKV_CLIP_B32.json" if gpu else "RWKV_CLIP_small.json"))
    batch = ns.batch_size or (256 if gpu else 32)
    precision = ns.precision or ("bf16" if gpu else "fp32")
    warmup = ns.warmup if ns.warmup is not None else (5 if gpu else 1)
    steps = ns.steps if ns.steps is not None else (10 if gpu else 3)
    wkv_steps = ns.wkv_steps if ns.wkv_steps is not None else (3 if gpu else 1)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if steps < 1:
        ap.error("--steps must be at least 1")
    device = torch.device(ns.device)
    host_malloc = configure_host_malloc(device, ns.host_malloc)  # as train.py

    rss_before_kib = rss_kib()
    args, model = build_measured_model(config, device, ns.checkpointing, ns.wkv_backend)
    model.train()
    if ns.compile:
        model = compile_model(model, backend=ns.compile_backend)
    images, tokens = synthetic_batch(args, batch, device)
    step = make_step(model, precision, device.type)

    def sync():
        if gpu:
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step(images, tokens)
    sync()
    warm_s = time.perf_counter() - t0

    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    with PeakRSS() as rss:
        for _ in range(steps):
            sync()
            t = time.perf_counter()
            loss = step(images, tokens)
            sync()
            times.append(time.perf_counter() - t)
            losses.append(float(loss))
    if gpu:
        peak = torch.cuda.max_memory_allocated(device)
        peak_method = "torch.cuda.max_memory_allocated"
        reserved = torch.cuda.max_memory_reserved(device)
    else:
        peak = (rss.peak - rss_before_kib) * 1024
        peak_method = ("peak RSS during the timed steps minus RSS before the model was built "
                       "(includes first-use code pages and allocator slack)")
        reserved = None

    wkv = None
    if wkv_steps > 0:
        with WKVTimer(device) as timer:
            t = time.perf_counter()
            for _ in range(wkv_steps):
                step(images, tokens)
            sync()
            total = time.perf_counter() - t
        wkv = dict(steps=wkv_steps, calls_per_step=timer.calls / wkv_steps,
                   forward_s_per_step=timer.fwd / wkv_steps,
                   backward_s_per_step=timer.bwd / wkv_steps,
                   synced_step_s=total / wkv_steps,
                   share_of_step=(timer.fwd + timer.bwd) / total)

    mean = sum(times) / len(times)
    backend = ns.wkv_backend or dispatch.override().get("wkv") or "auto"
    estimate = training_peak(args, batch, precision, ns.checkpointing, device=device.type)
    result = {
        "config": Path(config).name,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "batch_size": batch,
        "precision": precision,
        "checkpointing": ns.checkpointing,
        "wkv_backend": backend,
        "wkv_choices": {c["shape"]: c["implementation"] for c in dispatch.choices().values()
                        if c["op"] == "wkv"},
        "compiled": ns.compile_backend if ns.compile else False,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host_malloc": host_malloc,
        "warmup_steps": warmup,
        "warmup_s": warm_s,
        "steps": steps,
        "step_s_mean": mean,
        "step_s_min": min(times),
        "step_s_all": times,
        "samples_per_s": batch / mean,
        "peak_memory_bytes": int(peak),
        "peak_memory_method": peak_method,
        "max_reserved_bytes": reserved,
        "estimated_peak_bytes": estimate["training_peak_bytes"],
        "wkv": wkv,
        "wkv_share": wkv["share_of_step"] if wkv else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_finite": all(math.isfinite(x) for x in losses),
        **measured(),
    }
    text = json.dumps(result)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    return 0 if result["loss_finite"] else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
