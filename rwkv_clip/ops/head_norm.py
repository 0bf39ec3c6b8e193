"""The time mix's ``ln_x`` (a GroupNorm with one group per head) and its gate on the CPU:
a layer norm over each head's channels, then the per-channel affine, then
``* silu(gate)``. An implementation of the table's ``head_norm_gate`` op
(:mod:`rwkv_clip.ops.glue`); its reference is ``F.group_norm``.

The same values up to float rounding as GroupNorm, the same saved tensors (the input and
the per-(row, head) mean and 1/std), and a faster backward on the CPU.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _normalised(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x (rows, H, N); weight, bias (H, N)
    z, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), None, None, eps)
    return torch.addcmul(bias, z, weight), mean, rstd


class _HeadNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
        out, mean, rstd = _normalised(x, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, mean, rstd, weight = ctx.saved_tensors
        need_x, need_weight, need_bias, _ = ctx.needs_input_grad
        grad_x = grad_weight = grad_bias = None
        if need_weight:
            grad_weight = (grad * ((x - mean) * rstd)).sum(0)  # the normalised x, again
        if need_bias:
            grad_bias = grad.sum(0)
        if need_x:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad * weight, x, [x.shape[-1]], mean, rstd, None, None,
                [True, False, False])[0]
        return grad_x, grad_weight, grad_bias, None


def head_group_norm(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_head: int,
                    eps: float) -> torch.Tensor:
    """``F.group_norm(y, n_head, weight, bias, eps)`` for y (rows, C) in float32 or
    float64 with parameters of its dtype: each (row, head) slice of the (rows, H, N) view
    normalised, then the affine (outside autocast; without grad the two ops alone)."""
    rows, C = y.shape
    shape = (n_head, C // n_head)
    args = (y.reshape(rows, *shape), weight.view(shape), bias.view(shape), eps)
    with torch.autocast("cpu", enabled=False):
        if not torch.is_grad_enabled():
            return _normalised(*args)[0].view(rows, C)
        return _HeadNorm.apply(*args).view(rows, C)


def head_norm_gate_layer_norm(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                              gate: torch.Tensor, n_head: int, eps: float) -> torch.Tensor:
    """``group_norm(y, n_head, weight, bias, eps).to(gate.dtype) * silu(gate)`` for the
    WKV output y (B, T, C), through :func:`head_group_norm`."""
    B, T, C = y.shape
    normed = head_group_norm(y.reshape(B * T, C), weight, bias, n_head, eps).view(B, T, C)
    return normed.to(gate.dtype) * F.silu(gate)


__all__ = ["head_group_norm", "head_norm_gate_layer_norm"]
