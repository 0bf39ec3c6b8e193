"""``Linear``: ``nn.Linear`` whose product is :func:`rwkv_clip.ops.products.linear`."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.products import linear


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, initialisation and state-dict keys) whose forward is
    :func:`rwkv_clip.ops.products.linear` (``F.linear``; on the CPU the dispatch
    table's ``linear`` and ``lowp_matmul`` choose the GEMM)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)
