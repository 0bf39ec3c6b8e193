"""``torch.lerp`` with a backward that reduces broadcast operands in fewer passes.

The towers mix each token with its shifted neighbours by ``lerp(x, shifted, weight)``,
five (or two) mixes at once with a stacked weight that broadcasts x and shifted over the
stack. autograd's lerp backward forms ``grad * (1 - weight)``, ``grad * weight`` and
``grad * (end - start)`` at the stack's full size and reduces each; here the start
gradient is ``sum(grad) - sum(grad * weight)`` reduced first: no ``1 - weight`` tensor and
one full-size product fewer. In bf16/fp16 that difference would cancel, so the start
gradient keeps torch's ``grad * (1 - weight)``. The forward is ``torch.lerp`` itself and
the saved tensors are the same three.
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
    """``torch.lerp(start, end, weight)`` (same values, same saved tensors)."""
    return _Lerp.apply(start, end, weight)
