"""``Linear``: ``nn.Linear`` whose product is :func:`rwkv_clip.ops.products.linear`."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.products import linear


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, initialisation and state-dict keys) whose forward is
    :func:`rwkv_clip.ops.products.linear` (``F.linear``; the CPU's products in the dispatch
    table's switches)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)
