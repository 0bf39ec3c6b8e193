"""``square(relu(x))`` in Triton, one pass each way: ``rwkv_clip::glue_relu_square``.

The forward keeps the input's dtype (the square computed in float32, rounded once, as
torch computes a bf16 square); the backward is ``2 relu(x) grad`` from x itself, so only
x is kept. Both equal the plain ops bit for bit: a product of two bf16 values is exact in
float32, and doubling commutes with rounding.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def _forward_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.maximum(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + offs, (r * r).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n"])
def _backward_kernel(x_ptr, g_ptr, gx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.maximum(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32), 0.0)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    gx = (g * r).to(gx_ptr.dtype.element_ty).to(tl.float32) * 2.0  # torch's rounding: (g r) 2
    tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=m)


def _on_device(x: Tensor):
    """Launch on the inputs' GPU (CPU tensors: the Triton interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def forward(x: Tensor) -> Tensor:
    out = torch.empty_like(x)
    if x.numel():
        with _on_device(x):
            _forward_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), BLOCK=BLOCK)
    return out


def backward(grad: Tensor, x: Tensor) -> Tensor:
    gx = torch.empty_like(x)
    if x.numel():
        with _on_device(x):
            _backward_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, grad, gx, x.numel(),
                                                               BLOCK=BLOCK)
    return gx


@torch.library.custom_op("rwkv_clip::glue_relu_square", mutates_args=())
def relu_square_op(x: Tensor) -> Tensor:
    return forward(x.contiguous())


@torch.library.custom_op("rwkv_clip::glue_relu_square_backward", mutates_args=())
def relu_square_backward_op(grad: Tensor, x: Tensor) -> Tensor:
    return backward(grad.contiguous(), x.contiguous())


@relu_square_op.register_fake
def _(x):
    return torch.empty_like(x)


@relu_square_backward_op.register_fake
def _(grad, x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    return relu_square_backward_op(grad, *ctx.saved_tensors)


relu_square_op.register_autograd(_backward, setup_context=_setup)
