"""The time mix's ``ln_x``: a GroupNorm with one group per head, computed on the CPU as a
layer norm over each head's channels followed by the per-channel affine.

Normalising a (rows, C) tensor in H groups of N = C / H channels is normalising each
(row, head) slice of the (rows, H, N) view; the two differ only in float rounding
(relative 1e-6 in fp32). On the CPU torch's GroupNorm backward is slow; the layer norm's
backward is faster and saves what GroupNorm saves (the input and the per-(row, head) mean
and 1/std), so memory is unchanged. The parameters stay ``ln_x.weight`` / ``ln_x.bias``
of the ``nn.GroupNorm``.

GPUs, low-precision inputs, TorchScript traces and ``torch.compile`` keep
``nn.GroupNorm`` itself (inductor fuses it on its own). Under CPU autocast an fp32 input
takes this path too where a backward will follow (autocast runs GroupNorm in fp32 there,
and so does this); without grad GroupNorm's one fused pass is the cheaper forward.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _HeadNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
        # x (rows, H, N); weight, bias (H, N)
        z, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), None, None, eps)
        ctx.save_for_backward(x, mean, rstd, weight)
        return torch.addcmul(bias, z, weight)

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
    """``norm(y)`` for y (rows, C) and ``norm`` a GroupNorm over C channels in heads."""
    if (y.device.type != "cpu" or y.dtype not in (torch.float32, torch.float64) or y.dim() != 2
            or not norm.affine or norm.weight.dtype != y.dtype
            or torch.jit.is_tracing() or torch.compiler.is_compiling()
            or (torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled())):
        return norm(y)
    rows, C = y.shape
    H = norm.num_groups
    shape = (H, C // H)
    with torch.autocast("cpu", enabled=False):
        return _HeadNorm.apply(y.view(rows, *shape), norm.weight.view(shape),
                               norm.bias.view(shape), norm.eps).view(rows, C)


__all__ = ["head_group_norm"]
