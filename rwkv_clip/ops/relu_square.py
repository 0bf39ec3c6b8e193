"""``torch.square(torch.relu(x))``, the channel mixes' activation, with a shorter backward.

Two passes over the (B, T, 4C) tensor instead of autograd's four, with bit-identical
values (:func:`relu_square`); :func:`relu_square_reference` is the torch expression it
stands for.
"""
from __future__ import annotations

from typing import Any

import torch


def _square_in_own_dtype(r: torch.Tensor) -> torch.Tensor:
    # outside autocast: CUDA autocast would run pow in fp32 (see relu_square)
    with torch.autocast(r.device.type, enabled=False):
        return torch.square(r)


class _ReluSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu(x)
        ctx.save_for_backward(r)
        return _square_in_own_dtype(r)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (r,) = ctx.saved_tensors
        return (grad.to(r.dtype) * r).mul_(2)


def relu_square(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``torch.square(torch.relu(x))`` in x's dtype (same values and saved tensor).
    ``inplace``: x is the caller's scratch, overwritten with the result where nothing
    needs its gradient.

    autograd runs the pair's backward as pow's (``grad * (2 * r.pow(1))``, three passes
    over the (B, T, 4C) tensor) then relu's mask (a fourth); here it is ``(grad * r) * 2``,
    two passes, from the one tensor both save (r = relu(x)). The values are bit-identical:
    the forward is the same two ops, and scaling by 2 commutes with rounding (where r is 0
    the product is a zero too, the mask's job).

    Under CUDA autocast the square stays in x's dtype, where autocast would run pow in
    fp32: the square of a bf16/fp16 value is exact in fp32, so the one rounding to x's
    dtype (here, or where the value product casts its input) gives the same bits, and so
    does the gradient ``2 * grad * r`` (docs/differences.md)."""
    if torch.jit.is_tracing():
        return relu_square_reference(x)
    if not (torch.is_grad_enabled() and x.requires_grad):
        if inplace and not torch.compiler.is_compiling():
            return x.relu_().square_()
        return _square_in_own_dtype(torch.relu(x))
    return _ReluSquare.apply(x)


def relu_square_reference(x: torch.Tensor) -> torch.Tensor:
    """What :func:`relu_square` computes, in torch's own ops (under CUDA autocast, pow in
    fp32 and an fp32 result: the same values once rounded to x's dtype)."""
    return torch.square(torch.relu(x))


__all__ = ["relu_square", "relu_square_reference"]
