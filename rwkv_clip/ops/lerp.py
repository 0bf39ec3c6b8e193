"""``torch.lerp`` with a backward that reduces broadcast operands in fewer passes.

The towers mix each token with its shifted neighbours by ``lerp(x, shifted, weight)``, five
(or two) mixes at once with a stacked weight; :func:`lerp` and :func:`lerp_split` (the
stacked lerp as its slices) keep the forward and do less work in the backward.
:func:`lerp_reference` and :func:`lerp_split_reference` are the torch expressions they
stand for.
"""
from __future__ import annotations

from typing import Any

import torch

_WIDE = (torch.float32, torch.float64)


class _Lerp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, start: torch.Tensor, end: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(start, end, weight)
        return torch.lerp(start, end, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        start, end, weight = ctx.saved_tensors
        need_start, need_end, need_weight = ctx.needs_input_grad
        # fp32 / fp64: the start gradient as sum(grad) - sum(grad * weight); in bf16 / fp16
        # that difference would cancel, so torch's grad * (1 - weight) there
        reduce_first = grad.dtype in _WIDE and start.shape == end.shape
        grad_start = grad_end = grad_weight = None
        if need_end or (need_start and reduce_first):
            towards_end = (grad * weight).sum_to_size(end.shape)
            grad_end = towards_end if need_end else None
            if need_start and reduce_first:
                grad_start = grad.sum_to_size(start.shape) - towards_end
        if need_start and not reduce_first:
            grad_start = (grad * (1 - weight)).sum_to_size(start.shape)
        if need_weight:
            grad_weight = (grad * (end - start)).sum_to_size(weight.shape)
        return grad_start, grad_end, grad_weight


def lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.lerp(start, end, weight)`` (same values, same saved tensors).

    autograd's lerp backward forms ``grad * (1 - weight)``, ``grad * weight`` and
    ``grad * (end - start)`` at the broadcast size and reduces each; here, in fp32/fp64,
    the start gradient is ``sum(grad) - sum(grad * weight)``: no ``1 - weight`` tensor and
    one full-size product fewer (bf16/fp16 keep torch's form, where the difference would
    cancel)."""
    return _Lerp.apply(start, end, weight)


class _LerpSplit(torch.autograd.Function):
    """``torch.lerp(start, end, weight).unbind(0)``; start and end (*shape), weight
    (S, *shape) or broadcasting to it."""

    @staticmethod
    def forward(ctx: Any, start: torch.Tensor, end: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(start, end, weight)
        return torch.lerp(start, end, weight).unbind(0)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        start, end, weight = ctx.saved_tensors
        need_start, need_end, need_weight = ctx.needs_input_grad
        S = len(grads)
        ws = weight.expand(S, *weight.shape[1:]).unbind(0)  # a size-1 stack broadcasts
        grad_start = grad_end = grad_weight = None
        if grads[0].dtype in _WIDE:
            # sum_s g_s w_s and sum_s g_s, accumulated in place slice by slice (the order
            # of torch's sum over the stack)
            if need_end or need_start:
                towards_end = grads[0] * ws[0]
                for g, w in zip(grads[1:], ws[1:], strict=True):
                    towards_end.addcmul_(g, w)
                towards_end = towards_end.sum_to_size(end.shape)
                grad_end = towards_end if need_end else None
                if need_start:
                    total = grads[0].clone()
                    for g in grads[1:]:
                        total.add_(g)
                    grad_start = total.sum_to_size(start.shape).sub_(towards_end)
        else:  # bf16 / fp16: torch's products, each rounded, summed over the stack
            if need_end:
                grad_end = _stacked_products(grads, ws).sum(0).sum_to_size(end.shape)
            if need_start:
                grad_start = _stacked_products(grads, [1 - w for w in ws]).sum(0)
                grad_start = grad_start.sum_to_size(start.shape)
        if need_weight:
            diff = end - start
            if weight.shape[1:] == grads[0].shape:  # a full-size weight: written in place
                grad_weight = _stacked_products(grads, [diff] * S).sum_to_size(weight.shape)
            else:
                grad_weight = torch.stack([(g * diff).sum_to_size(weight.shape[1:])
                                           for g in grads]).sum_to_size(weight.shape)
        return grad_start, grad_end, grad_weight


def _stacked_products(grads: tuple[torch.Tensor, ...], factors) -> torch.Tensor:
    """torch.stack([g * f for g, f in zip(grads, factors)]), each product written into its
    slice of the result."""
    shape = torch.broadcast_shapes(grads[0].shape, factors[0].shape)
    out = grads[0].new_empty((len(grads), *shape))
    for i, (g, f) in enumerate(zip(grads, factors, strict=True)):
        torch.mul(g, f, out=out[i])
    return out


def lerp_split(start: torch.Tensor, end: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``torch.lerp(start, end, weight).unbind(0)`` for a stacked weight (S, *shape) and
    start, end of that shape (same values and saved tensors as :func:`lerp`).

    The backward takes the slices' gradients one by one, without autograd stacking them
    into one more (S, ...) tensor, and writes the weight's gradient slice by slice."""
    if (start.shape != end.shape or weight.dim() != start.dim() + 1
            or torch.broadcast_shapes(weight.shape[1:], start.shape) != start.shape):
        return lerp(start, end, weight).unbind(0)
    if not torch.is_grad_enabled() or torch.jit.is_tracing():
        return torch.lerp(start, end, weight).unbind(0)
    return _LerpSplit.apply(start, end, weight)


def lerp_reference(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What :func:`lerp` computes, in torch's own ops."""
    return torch.lerp(start, end, weight)


def lerp_split_reference(start: torch.Tensor, end: torch.Tensor,
                         weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What :func:`lerp_split` computes, in torch's own ops."""
    return torch.lerp(start, end, weight).unbind(0)


__all__ = ["lerp", "lerp_reference", "lerp_split", "lerp_split_reference"]
