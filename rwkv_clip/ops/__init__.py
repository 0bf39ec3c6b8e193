"""The bidirectional WKV6 operator behind both RWKV-CLIP towers.

One entry point, :func:`wkv6_bidirectional`, three backends: ``"cuda"`` and ``"cpu"``
(native kernels built on first use, :mod:`.kernels`) and ``"reference"`` (pure PyTorch,
the test oracle). Backend choice and overrides: docs/wkv.md. Nothing is compiled at import.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ..cpu_isa import cpu_info
from ..errors import WKVError
from . import build, cache, kernels
from .reference import wkv6_bidirectional_reference

BACKEND_ENV_VAR = "RWKV_CLIP_WKV_BACKEND"
BACKENDS = ("auto", "cuda", "cpu", "reference")


def reset_backend_override() -> None:
    """Read ``RWKV_CLIP_WKV_BACKEND`` (and the CUDA variant variable) again on the next call."""
    build.reset_env_overrides()


def check_wkv_environment() -> None:
    """``RWKV_CLIP_WKV_BACKEND`` and ``RWKV_CLIP_WKV_CUDA_VARIANT`` name known choices: a
    :class:`WKVError` naming the allowed ones otherwise, on every device (a CUDA variant
    mistyped on a CPU machine is an error there too, not a surprise on the GPU)."""
    choice = build.env_override(BACKEND_ENV_VAR)
    if choice is not None and choice not in BACKENDS:
        raise WKVError(f"unknown WKV backend {choice!r} (from {BACKEND_ENV_VAR}); expected "
                       f"one of {', '.join(BACKENDS)}")
    build.resolve_cuda_variant()


def describe_wkv(device: torch.device | str, backend: str | None = None) -> str:
    """The one line that says which WKV kernel runs on ``device``: the backend, and on
    CUDA the variant (``WKV: cuda kernel, variant fast``)."""
    check_wkv_environment()
    chosen = resolve_backend(torch.device(device), backend)
    if chosen == "cuda":
        return (f"WKV: cuda kernel, variant {build.resolve_cuda_variant()} (choices: "
                f"{BACKEND_ENV_VAR}, {build.CUDA_VARIANT_ENV_VAR})")
    if chosen == "reference":
        return f"WKV: pure-PyTorch reference (choice: {BACKEND_ENV_VAR})"
    return (f"WKV: cpu kernel {build.cpu_kernel_name()} on {cpu_info().describe()} "
            f"(choice: {BACKEND_ENV_VAR})")


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """Pick the backend for tensors on ``device``: argument, then env var, then device.
    The environment's backend and CUDA variant are checked here whatever the device."""
    if not backend:
        check_wkv_environment()
    choice = backend or build.env_override(BACKEND_ENV_VAR) or "auto"
    if choice not in BACKENDS:
        raise WKVError(f"unknown WKV backend {choice!r} (from argument); expected one of "
                       f"{', '.join(BACKENDS)}")
    if choice == "auto":
        return "cuda" if device.type == "cuda" else "cpu"
    if choice == "cuda" and device.type != "cuda":
        raise WKVError(f"WKV backend 'cuda' needs CUDA tensors, got tensors on {device}")
    if choice == "cpu" and device.type != "cpu":
        raise WKVError(f"WKV backend 'cpu' needs CPU tensors, got tensors on {device}")
    return choice


def _nothing_to_wait_for(raise_error: bool = True) -> None:
    return None


def prepare_wkv_kernel(device: torch.device, notify: Callable[[str], None],
                       background: bool = False) -> Callable[..., None]:
    """Build (or load) the CPU WKV kernel before the first step, saying so through
    ``notify`` when it is not in the kernel cache yet (the first use compiles it). Other
    devices and the pure-PyTorch backend need nothing here.

    Returns ``wait(raise_error=True)``: it waits for the kernel and raises the build's
    error, if any (``raise_error=False`` on the way out of another error, which is the
    one to report). ``background=True`` compiles in a thread (the compiler is a
    subprocess, so the GIL is free) while the caller builds the model and the data."""
    if torch.device(device).type != "cpu":
        return _nothing_to_wait_for
    if (build.env_override(BACKEND_ENV_VAR) or "").strip().lower() == "reference":
        return _nothing_to_wait_for
    if build.cpu_kernel_cached():
        return _nothing_to_wait_for
    notify(f"preparing the WKV CPU kernel (first use compiles it; cached in "
           f"{cache.cache_root()})")
    t0 = time.time()
    failure: list[BaseException] = []

    def compile_kernel() -> None:
        try:
            build.get_cpu_kernel()
            notify(f"WKV CPU kernel ready ({time.time() - t0:.0f} s)")
        except BaseException as exc:  # handed to the waiter, raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=compile_kernel, name="wkv-kernel-build", daemon=True)
    thread.start()

    def wait(raise_error: bool = True) -> None:
        thread.join()  # never leave a half-written build behind on exit
        if failure and raise_error:
            raise failure[0]
    if not background:
        wait()
    return wait


def check_inputs(r, k, v, w, u) -> tuple[int, int, int, int, int]:
    """Validate shapes, dtypes and devices before any kernel runs; returns (B, T, C, H, N)."""
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
    for name, t in (("r", r), ("k", k), ("v", v), ("w", w), ("u", u)):
        if t.device != r.device:
            raise WKVError(f"wkv6: {name} is on {t.device} but r is on {r.device}")
        if not t.is_floating_point():
            raise WKVError(f"wkv6: {name} has dtype {t.dtype}, expected a floating dtype")
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
    return kernels.run_native(chosen, r, k, v, w, u)


__all__ = ["BACKENDS", "BACKEND_ENV_VAR", "WKVError", "check_inputs", "check_wkv_environment",
           "describe_wkv", "reset_backend_override",
           "prepare_wkv_kernel", "resolve_backend", "wkv6_bidirectional", "wkv6_bidirectional_reference"]
