"""The RWKV channel mix after its token shift, shared by both towers:
``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` with ``(xk, xr)`` two lerps of the
token and its shifted neighbour.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.glue import Shift, relu_square, shift_lerp
from .time_mix import glue_dtype


def channel_mix(x: torch.Tensor, shift: Shift, mix: torch.Tensor, key: nn.Module,
                receptance: nn.Module, value: nn.Module, key_norm: nn.Module | None = None,
                shifted_first: bool = False) -> torch.Tensor:
    """``(xk, xr) = lerp(x, shift(x), mix)`` (``lerp(shift(x), x, mix)`` with
    ``shifted_first``, the image tower's convention) for the stacked (2, 1, 1, C) ``mix``
    (in :func:`.time_mix.glue_dtype`, as x is cast); then
    ``sigmoid(receptance(xr)) * value(key_norm(relu(key(xk))^2))``."""
    x = x.to(glue_dtype(x))
    xk, xr = shift_lerp(x, mix, shift, shifted_first)
    k = relu_square(key(xk), inplace=True)
    if key_norm is not None:
        k = key_norm(k)
    return torch.sigmoid(receptance(xr)) * value(k)
