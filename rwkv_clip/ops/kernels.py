"""Autograd wrappers around the native WKV kernels (CPU and CUDA).

``run_native(backend, r, k, v, w, u)`` checks sizes and the toolchain (raising
:class:`rwkv_clip.ops.WKVError` before anything runs), builds the kernel on first use
(see :mod:`rwkv_clip.ops.build`), and returns float32 y. Gradients come back in the
dtypes of the inputs (u's gradient in u's dtype).
"""
from __future__ import annotations

import torch

from . import build

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _prep(x: torch.Tensor, allow_double: bool) -> torch.Tensor:
    if x.dtype not in _KERNEL_DTYPES and not (allow_double and x.dtype == torch.float64):
        x = x.float()
    return x.contiguous()


class _WKV6CPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, k, v, w, u):
        mod = build.get_cpu_kernel()
        r_, k_, v_, w_, u_ = (_prep(x, True) for x in (r, k, v, w, u))
        y = mod.forward(r_, k_, v_, w_, u_)
        ctx.save_for_backward(r_, k_, v_, w_, u_)
        ctx.dtypes = tuple(x.dtype for x in (r, k, v, w, u))
        return y

    @staticmethod
    def backward(ctx, gy):
        r, k, v, w, u = ctx.saved_tensors
        mod = build.get_cpu_kernel()
        grads = mod.backward(r, k, v, w, u, gy.float().contiguous())
        return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes))


def _cuda_dtypes(r, k, v, w):
    """Kernel instantiations: r/k/v share one dtype F; w is float32 or F."""
    same = r.dtype == k.dtype == v.dtype
    F = r.dtype if same and r.dtype in _KERNEL_DTYPES else torch.float32
    FW = w.dtype if w.dtype in (torch.float32, F) else torch.float32
    return F, FW


class _WKV6CUDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, k, v, w, u, variant):
        T = r.shape[1]
        N = u.shape[1]
        mod = build.get_cuda_kernel(N, T, variant)
        F, FW = _cuda_dtypes(r, k, v, w)
        r_, k_, v_ = (x.to(F).contiguous() for x in (r, k, v))
        w_ = w.to(FW).contiguous()
        u_ = u.float().contiguous()
        with torch.cuda.device(r.device):
            y = mod.forward(r_, k_, v_, w_, u_)
        ctx.save_for_backward(r_, k_, v_, w_, u_)
        ctx.dtypes = tuple(x.dtype for x in (r, k, v, w, u))
        ctx.variant = variant
        return y

    @staticmethod
    def backward(ctx, gy):
        r, k, v, w, u = ctx.saved_tensors
        mod = build.get_cuda_kernel(u.shape[1], r.shape[1], ctx.variant)
        with torch.cuda.device(r.device):
            grads = mod.backward(r, k, v, w, u, gy.float().contiguous())
        return tuple(g.to(dt) for g, dt in zip(grads, ctx.dtypes)) + (None,)


def run_native(backend: str, r, k, v, w, u, variant: str | None = None) -> torch.Tensor:
    """Run the native kernel of ``backend`` ("cpu" or "cuda"); returns float32 (B, T, C)."""
    if backend == "cpu":
        build._check_cxx()
        return _WKV6CPU.apply(r, k, v, w, u)
    if backend == "cuda":
        T = r.shape[1]
        N = u.shape[1]
        variant = build.resolve_cuda_variant(variant)
        build.check_cuda_head_size(N)
        build.cuda_t_bucket(T)
        return _WKV6CUDA.apply(r, k, v, w, u, variant)
    from . import WKVError
    raise WKVError(f"run_native: no native kernel for backend {backend!r}")
