"""The RWKV channel mix after its token shift, shared by both towers:
``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` with ``(xk, xr)`` two lerps of the
token and its shifted neighbour.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops.lerp import lerp_split
from ..ops.relu_square import relu_square
from .time_mix import glue_dtype


def channel_mix(x: torch.Tensor, shift: Callable[[torch.Tensor], torch.Tensor],
                mix: torch.Tensor, key: nn.Module, receptance: nn.Module, value: nn.Module,
                key_norm: nn.Module | None = None, shifted_first: bool = False) -> torch.Tensor:
    """``(xk, xr) = lerp(x, shift(x), mix)`` (``lerp(shift(x), x, mix)`` with
    ``shifted_first``, the image tower's convention) for the stacked (2, 1, 1, C) ``mix``
    (in :func:`.time_mix.glue_dtype`, as x is cast); then
    ``sigmoid(receptance(xr)) * value(key_norm(relu(key(xk))^2))``."""
    x = x.to(glue_dtype(x))
    shifted = shift(x)
    xk, xr = lerp_split(shifted, x, mix) if shifted_first else lerp_split(x, shifted, mix)
    k = relu_square(key(xk), inplace=True)
    if key_norm is not None:
        k = key_norm(k)
    return torch.sigmoid(receptance(xr)) * value(k)
