"""Convolutional patch embedding (the state-dict layout of mmcv's PatchEmbed)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.products import conv2d


def _pair(x: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(x, int):
        return (x, x)
    a, b = x
    return (int(a), int(b))


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens: ``projection`` is a Conv2d with bias.

    Inputs whose sides are not multiples of the patch size are zero-padded at the
    bottom/right first (mmcv's "corner" adaptive padding), so any image size works.
    """

    def __init__(self, in_channels: int = 3, embed_dims: int = 768, patch_size: int = 16,
                 input_size: int | tuple[int, int] = 224) -> None:
        super().__init__()
        self.patch_size = _pair(patch_size)
        self.projection = nn.Conv2d(in_channels, embed_dims, kernel_size=self.patch_size,
                                    stride=self.patch_size, bias=True)
        self.init_out_size = self.output_size(_pair(input_size))

    def output_size(self, hw: tuple[int, int]) -> tuple[int, int]:
        (h, w), (ph, pw) = hw, self.patch_size
        return (-(-h // ph), -(-w // pw))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        grid = self.output_size((int(x.shape[-2]), int(x.shape[-1])))
        pad_h = grid[0] * self.patch_size[0] - x.shape[-2]
        pad_w = grid[1] * self.patch_size[1] - x.shape[-1]
        if pad_h or pad_w:
            x = F.pad(x, [0, pad_w, 0, pad_h])
        proj = self.projection
        x = conv2d(x, proj.weight, proj.bias, self.patch_size)  # (B, C, H', W')
        return x.flatten(2).transpose(1, 2), grid
