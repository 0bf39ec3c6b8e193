"""The RWKV channel mix after its token shift, shared by both towers:
``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` with ``(xk, xr)`` two lerps of the
token and its shifted neighbour.

The products and lerps save their inputs for the backward: the input, the shifted tokens
and the two mixes (4C per token) and the squared ReLU (the hidden width, 4-5C). Where the block
rebuilds (:mod:`.recompute`), the backward makes those again from tensors it keeps anyway.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .lerp import shifted_tokens, token_mixes
from .recompute import RecomputedSaves
from .relu_square import rebuild_relu_square, relu_square
from .time_mix import glued_input


def channel_mix(x: torch.Tensor, shift: Callable[[torch.Tensor], torch.Tensor],
                mix: torch.Tensor, key: nn.Module, receptance: nn.Module, value: nn.Module,
                key_norm: nn.Module | None = None, shifted_first: bool = False,
                input_again: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """``(xk, xr) = lerp(x, shift(x), mix)`` (``lerp(shift(x), x, mix)`` with
    ``shifted_first``, the image tower's convention) for the stacked (2, 1, 1, C) ``mix``
    (in :func:`.time_mix.glue_dtype`, as x is cast); then
    ``sigmoid(receptance(xr)) * value(key_norm(relu(key(xk))^2))``. ``input_again``, where
    given, makes x again in the backward."""
    with RecomputedSaves(x) as saves:
        x = glued_input(x, saves, input_again)
        shifted, shifted_again = shifted_tokens(x, shift, saves)
        xk, xr = token_mixes(x, shifted, mix, saves, shifted_again, lambda: mix, shifted_first)
        k = relu_square(key(xk), inplace=True)
        if key_norm is not None:
            k = key_norm(k)
        elif saves.active and (rebuild := rebuild_relu_square(k)) is not None:
            saves.add(k, rebuild)
        return torch.sigmoid(receptance(xr)) * value(k)
