"""``torch.square(torch.relu(x))``, the channel mixes' activation, with a shorter backward.

autograd runs the pair's backward as pow's (``grad * (2 * r.pow(1))``, three passes over
the (B, T, 4C) tensor) then relu's mask (a fourth); here it is ``(grad * r) * 2``, two
passes, from the one tensor both save (r = relu(x)). The values are bit-identical: the
forward is the same two ops, and scaling by 2 commutes with rounding (where r is 0 the
product is a zero too, the mask's job). Under autocast the plain expression is kept,
so that autocast's own casting rules (pow runs in fp32 on CUDA) apply unchanged.
"""
from __future__ import annotations

from typing import Any

import torch


class _ReluSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        r = torch.relu(x)
        ctx.save_for_backward(r)
        return torch.square(r)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (r,) = ctx.saved_tensors
        return (grad * r).mul_(2)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """``torch.square(torch.relu(x))`` (same values and saved tensor)."""
    if (torch.is_autocast_enabled(x.device.type) or not torch.is_grad_enabled()
            or torch.jit.is_tracing()):
        return torch.square(torch.relu(x))
    return _ReluSquare.apply(x)
