"""The RWKV channel mix after its token shift, shared by both towers:
``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` with ``(xk, xr)`` two lerps of the
token and its shifted neighbour.

The products and lerps save their inputs for the backward: the shifted tokens and the two
mixes (3C per token) and the squared ReLU (the hidden width, 4-5C). Where the block
rebuilds (:mod:`.recompute`), the backward makes those again from tensors it keeps anyway.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from .lerp import lerp_split
from .recompute import RecomputedSaves
from .relu_square import rebuild_relu_square, relu_square


def channel_mix(x: torch.Tensor, shift: Callable[[torch.Tensor], torch.Tensor],
                mix: torch.Tensor, key: nn.Module, receptance: nn.Module, value: nn.Module,
                key_norm: nn.Module | None = None, shifted_first: bool = False) -> torch.Tensor:
    """``(xk, xr) = lerp(x, shift(x), mix)`` (``lerp(shift(x), x, mix)`` with
    ``shifted_first``, the image tower's convention) for the stacked (2, 1, 1, C) ``mix``;
    then ``sigmoid(receptance(xr)) * value(key_norm(relu(key(xk))^2))``."""
    with RecomputedSaves(x) as saves:
        shifted = shift(x)
        shifted_again = None  # registered before the lerp saves it
        if saves.active and x.requires_grad:
            shifted_again = saves.add(shifted, functools.partial(shift, x))
        xk, xr = lerp_split(shifted, x, mix) if shifted_first else lerp_split(x, shifted, mix)
        if shifted_again is not None and xk.requires_grad and xk._base is not None:
            def mixes() -> torch.Tensor:
                again = shifted_again()
                return torch.lerp(again, x, mix) if shifted_first else torch.lerp(x, again, mix)
            saves.add(xk._base, mixes)
        k = relu_square(key(xk), inplace=True)
        if key_norm is not None:
            k = key_norm(k)
        elif saves.active and (rebuild := rebuild_relu_square(k)) is not None:
            saves.add(k, rebuild)
        return torch.sigmoid(receptance(xr)) * value(k)
