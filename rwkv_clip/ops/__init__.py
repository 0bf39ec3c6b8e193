"""The bidirectional WKV6 operator behind both RWKV-CLIP towers.

One entry point, :func:`wkv6_bidirectional`, three backends:

* ``"cuda"``      - native CUDA kernel (built on first use, cached on disk)
* ``"cpu"``       - native C++/OpenMP kernel (built on first use, cached on disk)
* ``"reference"`` - pure PyTorch, any dtype including float64 (slow; the test oracle)

The backend follows the tensors' device unless overridden by the ``backend`` argument
or the ``RWKV_CLIP_WKV_BACKEND`` environment variable (read at call time, never at
import). Nothing is compiled at import.
"""
from __future__ import annotations

import os

import torch

from ..errors import WKVError
from .reference import wkv6_bidirectional_reference

BACKEND_ENV_VAR = "RWKV_CLIP_WKV_BACKEND"
BACKENDS = ("auto", "cuda", "cpu", "reference")


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """Pick the backend for tensors on ``device``: argument, then env var, then device."""
    choice = backend or os.environ.get(BACKEND_ENV_VAR) or "auto"
    if choice not in BACKENDS:
        raise WKVError(
            f"unknown WKV backend {choice!r} (from "
            f"{'argument' if backend else BACKEND_ENV_VAR}); expected one of {BACKENDS}")
    if choice == "auto":
        return "cuda" if device.type == "cuda" else "cpu"
    if choice == "cuda" and device.type != "cuda":
        raise WKVError(f"WKV backend 'cuda' needs CUDA tensors, got tensors on {device}")
    if choice == "cpu" and device.type != "cpu":
        raise WKVError(f"WKV backend 'cpu' needs CPU tensors, got tensors on {device}")
    return choice


def check_inputs(r, k, v, w, u) -> tuple[int, int, int, int, int]:
    """Validate shapes before any kernel runs; returns (B, T, C, H, N)."""
    if r.dim() != 3:
        raise WKVError(f"wkv6: r must be (B, T, C), got shape {tuple(r.shape)}")
    B, T, C = r.shape
    for name, t in (("k", k), ("v", v), ("w", w)):
        if t.shape != r.shape:
            raise WKVError(f"wkv6: {name} has shape {tuple(t.shape)}, expected {tuple(r.shape)}")
    if u.dim() != 2:
        raise WKVError(f"wkv6: u must be (H, N), got shape {tuple(u.shape)}")
    H, N = u.shape
    if H * N != C:
        raise WKVError(f"wkv6: u is ({H}, {N}) but C = {C} is not H x N")
    if T < 1:
        raise WKVError("wkv6: sequence length T must be at least 1")
    devices = {t.device for t in (r, k, v, w, u)}
    if len(devices) != 1:
        raise WKVError(f"wkv6: inputs are on different devices {sorted(map(str, devices))}")
    return B, T, C, H, N


def wkv6_bidirectional(r, k, v, w, u, backend: str | None = None) -> torch.Tensor:
    """Bidirectional WKV6: a causal WKV6 with bonus ``u`` plus a time-reversed one without.

    r, k, v, w: (B, T, C), C = H * N, any float dtype (fp32, bf16, fp16; float64 for
    the reference); u: (H, N). Per-step decay is exp(-exp(w)). Returns float32
    (B, T, C) (float64 from the reference backend on float64 inputs).
    """
    check_inputs(r, k, v, w, u)
    chosen = resolve_backend(r.device, backend)
    if chosen == "reference":
        return wkv6_bidirectional_reference(r, k, v, w, u)
    from .kernels import run_native  # local import: the native path builds on first use
    return run_native(chosen, r, k, v, w, u)


__all__ = ["wkv6_bidirectional", "wkv6_bidirectional_reference", "resolve_backend",
           "check_inputs", "WKVError", "BACKENDS", "BACKEND_ENV_VAR"]
