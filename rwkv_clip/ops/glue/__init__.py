"""The towers' elementwise glue as fused operators: the token shift with its lerps, the
head norm with the gate, the squared ReLU.

Each op has a plain-PyTorch reference (:mod:`.reference`) and a Triton kernel pair
(forward, backward) registered as a ``torch.library`` custom op with its fake and autograd,
so ``torch.compile`` traces around it in one graph. The functions here pick the kernel for
CUDA tensors when Triton imports, the reference elsewhere. Which is faster than the
reference, eager or compiled, is measured by ``scripts/bench_glue.py`` (docs/glue.md).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from ..relu_square import relu_square as relu_square_fused
from .reference import (
    SHIFT_KINDS,
    Shift,
    head_norm_gate_reference,
    relu_square_reference,
    shift_lerp_reference,
    shift_reference,
)


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the ops below run their Triton kernels for x: CUDA tensors, Triton present."""
    return x.is_cuda and triton_importable()


def shift_lerp(x: torch.Tensor, weight: torch.Tensor, shift: Shift,
               shifted_first: bool = False) -> torch.Tensor:
    """The (S, B, T, C) mixes ``lerp(x, shift(x), weight)`` (``shifted_first``: ``lerp(
    shift(x), x, weight)``); x (B, T, C), weight (S, 1, 1, C) or (S, B, T, C) in x's dtype
    (:func:`.reference.shift_lerp_reference`)."""
    if not uses_triton(x):
        return shift_lerp_reference(x, weight, shift, shifted_first)
    from .shift_lerp_kernel import shift_lerp_op
    return shift_lerp_op(x, weight, shift.kind, shift.head_dim, shift.pixels, shift.grid[0],
                         shift.grid[1], shift.cls, shifted_first)


def head_norm_gate(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   gate: torch.Tensor, n_head: int, eps: float) -> torch.Tensor:
    """``group_norm(y, n_head, weight, bias, eps) * silu(gate)`` in gate's dtype
    (:func:`.reference.head_norm_gate_reference`)."""
    if not uses_triton(y):
        return head_norm_gate_reference(y, weight, bias, gate, n_head, eps)
    from .head_norm_gate_kernel import head_norm_gate_op
    return head_norm_gate_op(y, weight, bias, gate, n_head, eps)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """``square(relu(x))`` in x's dtype: the Triton op on CUDA, else
    :func:`rwkv_clip.ops.relu_square.relu_square` (reference: ``relu_square_reference``)."""
    if not uses_triton(x):
        return relu_square_fused(x)
    from .relu_square_kernel import relu_square_op
    return relu_square_op(x)


__all__ = ["SHIFT_KINDS", "Shift", "head_norm_gate", "head_norm_gate_reference", "relu_square",
           "relu_square_reference", "shift_lerp", "shift_lerp_reference", "shift_reference",
           "triton_importable", "uses_triton"]
