"""The RWKV channel mix after its token shift, shared by both towers:
``sigmoid(receptance(xr)) * value(relu(key(xk))^2)`` with ``(xk, xr)`` two lerps of the
token and its shifted neighbour.

The products save their inputs for the backward: the two mixes (2C per token) and the
squared ReLU (the hidden width, 4-5C). Those are rebuilt by the backward from tensors it
keeps anyway (:mod:`.recompute`), about a quarter of a block's saved activations.
"""
from __future__ import annotations

import torch
from torch import nn

from .lerp import lerp_split
from .recompute import RecomputedSaves
from .relu_square import rebuild_relu_square, relu_square


def channel_mix(start: torch.Tensor, end: torch.Tensor, mix: torch.Tensor, key: nn.Module,
                receptance: nn.Module, value: nn.Module,
                key_norm: nn.Module | None = None) -> torch.Tensor:
    """``(xk, xr) = lerp(start, end, mix)`` for the stacked (2, 1, 1, C) ``mix``; then
    ``sigmoid(receptance(xr)) * value(key_norm(relu(key(xk))^2))``."""
    with RecomputedSaves(start) as saves:
        xk, xr = lerp_split(start, end, mix)
        if saves.active and xk.requires_grad and xk._base is not None:
            saves.add(xk._base, lambda: torch.lerp(start, end, mix))
        k = relu_square(key(xk), inplace=True)
        if key_norm is not None:
            k = key_norm(k)
        elif saves.active and (rebuild := rebuild_relu_square(k)) is not None:
            saves.add(k, rebuild)
        return torch.sigmoid(receptance(xr)) * value(k)
