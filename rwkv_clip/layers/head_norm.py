"""The time mix's ``ln_x``: a GroupNorm with one group per head, computed on the CPU as a
layer norm over each head's channels followed by the per-channel affine.

The CPU backward is faster than GroupNorm's at the same memory; the parameters stay
``ln_x.weight`` / ``ln_x.bias`` of the ``nn.GroupNorm`` (:func:`head_group_norm`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


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


def head_group_norm(y: torch.Tensor, norm: nn.GroupNorm) -> torch.Tensor:
    """``norm(y)`` for y (rows, C) and ``norm`` a GroupNorm over C channels in heads.

    Normalising in H groups of N = C / H channels is normalising each (row, head) slice of
    the (rows, H, N) view, so on the CPU this is a layer norm plus the per-channel affine:
    same values up to float rounding, a faster backward than torch's GroupNorm, and the
    same saved tensors (the input and the per-(row, head) mean and 1/std). Without grad
    the two ops alone, which also beat GroupNorm's forward on the CPU
    (docs/differences.md). GPUs, low-precision inputs, TorchScript
    traces and ``torch.compile`` keep ``nn.GroupNorm`` (inductor fuses it on its own)."""
    if (y.device.type != "cpu" or y.dtype not in (torch.float32, torch.float64) or y.dim() != 2
            or not norm.affine or norm.weight.dtype != y.dtype
            or torch.jit.is_tracing() or torch.compiler.is_compiling()):
        return norm(y)
    rows, C = y.shape
    H = norm.num_groups
    shape = (H, C // H)
    args = (y.view(rows, *shape), norm.weight.view(shape), norm.bias.view(shape), norm.eps)
    with torch.autocast("cpu", enabled=False):
        if not torch.is_grad_enabled():
            return _normalised(*args)[0].view(rows, C)
        return _HeadNorm.apply(*args).view(rows, C)


__all__ = ["head_group_norm"]
