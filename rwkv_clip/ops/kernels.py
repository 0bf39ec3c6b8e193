"""The native WKV kernels as PyTorch operators: ``torch.ops.rwkv_clip.wkv6_forward`` and
``torch.ops.rwkv_clip.wkv6_backward`` (dtypes at :func:`wkv6_forward`).

Custom operators with fake implementations and autograd, opaque to ``torch.compile``;
registered at import, built or loaded the first time one runs (docs/wkv.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import WKVError
from . import build

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_VARIANT = build.DEFAULT_CUDA_VARIANT


# ------------------------------------------------------------------------- forward op
@torch.library.custom_op("rwkv_clip::wkv6_forward", mutates_args=(), device_types="cpu")
def wkv6_forward(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor,
                 cuda_variant: str = DEFAULT_VARIANT) -> Tensor:
    """Bidirectional WKV6 forward; ``cuda_variant`` picks the CUDA kernel (ignored on CPU).

    y is float32 (B, T, C). The CPU kernel reads every input in its own dtype (fp32, bf16,
    fp16, fp64); the CUDA kernels take r, k, v in one dtype, w in fp32 or that dtype, u in
    fp32, so the CUDA implementation converts on the device where the inputs do not fit.
    The backward returns each gradient in its input's dtype."""
    mod = build.get_cpu_kernel()
    return mod.forward(r.contiguous(), k.contiguous(), v.contiguous(), w.contiguous(),
                       u.contiguous())


@wkv6_forward.register_fake
def _wkv6_forward_fake(r, k, v, w, u, cuda_variant=DEFAULT_VARIANT):
    return r.new_empty(r.shape, dtype=torch.float32)


def _cuda_dtypes(r: Tensor, k: Tensor, v: Tensor, w: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """Kernel instantiations: r/k/v share one dtype F; w is float32 or F."""
    same = r.dtype == k.dtype == v.dtype
    F = r.dtype if same and r.dtype in _KERNEL_DTYPES else torch.float32
    FW = w.dtype if w.dtype in (torch.float32, F) else torch.float32
    return F, FW


def _cuda_inputs(r, k, v, w, u):
    F, FW = _cuda_dtypes(r, k, v, w)
    return ([x.to(F).contiguous() for x in (r, k, v)] + [w.to(FW).contiguous()]
            + [u.float().contiguous()])


def _triton_kernel(variant: str):
    """The module of a Triton variant (``chunked``), imported on first use: Triton's
    import is not free and the CPU path never needs it."""
    from . import wkv_chunked
    return wkv_chunked


@wkv6_forward.register_kernel("cuda")
def _wkv6_forward_cuda(r, k, v, w, u, cuda_variant=DEFAULT_VARIANT):
    if r.numel() == 0:  # an empty batch: a launch of zero blocks is a CUDA error
        return r.new_zeros(r.shape, dtype=torch.float32)
    if cuda_variant in build.TRITON_CUDA_VARIANTS:
        return _triton_kernel(cuda_variant).forward(*_cuda_inputs(r, k, v, w, u))
    mod = build.get_cuda_kernel(u.shape[1], cuda_variant)
    with torch.cuda.device(r.device):
        return mod.forward(*_cuda_inputs(r, k, v, w, u))


# ------------------------------------------------------------------------ backward op
@torch.library.custom_op("rwkv_clip::wkv6_backward", mutates_args=(), device_types="cpu")
def wkv6_backward(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor, gy: Tensor,
                  cuda_variant: str = DEFAULT_VARIANT
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (gr, gk, gv, gw, gu) of :func:`wkv6_forward`, each in its input's dtype."""
    mod = build.get_cpu_kernel()
    gr, gk, gv, gw, gu = mod.backward(r.contiguous(), k.contiguous(), v.contiguous(),
                                      w.contiguous(), u.contiguous(), gy.contiguous())
    return gr, gk, gv, gw, gu


@wkv6_backward.register_fake
def _wkv6_backward_fake(r, k, v, w, u, gy, cuda_variant=DEFAULT_VARIANT):
    return tuple(x.new_empty(x.shape) for x in (r, k, v, w, u))


@wkv6_backward.register_kernel("cuda")
def _wkv6_backward_cuda(r, k, v, w, u, gy, cuda_variant=DEFAULT_VARIANT):
    if r.numel() == 0:
        return tuple(x.new_zeros(x.shape) for x in (r, k, v, w, u))
    if cuda_variant in build.TRITON_CUDA_VARIANTS:
        grads = _triton_kernel(cuda_variant).backward(*_cuda_inputs(r, k, v, w, u),
                                                      gy.float().contiguous())
    else:
        mod = build.get_cuda_kernel(u.shape[1], cuda_variant)
        with torch.cuda.device(r.device):
            grads = mod.backward(*_cuda_inputs(r, k, v, w, u), gy.float().contiguous())
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, (r, k, v, w, u), strict=True))


# ------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    r, k, v, w, u, cuda_variant = inputs
    ctx.save_for_backward(r, k, v, w, u)
    ctx.cuda_variant = cuda_variant


def _backward(ctx, gy):
    r, k, v, w, u = ctx.saved_tensors
    grads = wkv6_backward(r, k, v, w, u, gy, ctx.cuda_variant)
    return (*grads, None)


wkv6_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------ entry point
def run_native(backend: str, r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor,
               variant: str | None = None) -> Tensor:
    """Run the native kernel of ``backend`` ("cpu" or "cuda"); returns float32 (B, T, C).

    ``variant`` picks the CUDA kernel (default ``fast``). The model calls the kernels
    through the dispatch table (:mod:`.dispatch`); this is the direct way in."""
    if backend == "cpu":
        return wkv6_forward(r, k, v, w, u)
    if backend == "cuda":
        variant = build.resolve_cuda_variant(variant)
        if variant in build.TRITON_CUDA_VARIANTS:
            _triton_kernel(variant).channel_block(u.shape[1])  # a WKVError before any launch
        else:
            build.check_cuda_head_size(u.shape[1])  # a WKVError before any build
        return wkv6_forward(r, k, v, w, u, variant)
    raise WKVError(f"run_native: no native kernel for backend {backend!r}; expected 'cpu' or "
                   "'cuda'")
