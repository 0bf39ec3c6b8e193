"""Resize a learned 2-D position embedding to another patch grid."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def resize_pos_embed(pos_embed: torch.Tensor, src_shape: tuple[int, int],
                     dst_shape: tuple[int, int], mode: str = "bicubic",
                     num_extra_tokens: int = 0) -> torch.Tensor:
    """(1, extra + h*w, C) -> (1, extra + h'*w', C); identity when the grid is unchanged.

    Interpolation as mmcls (bicubic, align_corners=False); extra (cls) tokens at the
    front are kept as they are.
    """
    if tuple(src_shape) == tuple(dst_shape):
        return pos_embed
    _, length, channels = pos_embed.shape
    src_h, src_w = src_shape
    if length != src_h * src_w + num_extra_tokens:
        raise ValueError(f"pos_embed has {length} tokens, expected {src_h}x{src_w}"
                         f"+{num_extra_tokens}")
    extra = pos_embed[:, :num_extra_tokens]
    grid = pos_embed[:, num_extra_tokens:].reshape(1, src_h, src_w, channels).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=tuple(dst_shape), mode=mode, align_corners=False)
    return torch.cat((extra, grid.flatten(2).transpose(1, 2)), dim=1)


def fit_pos_embed(pos_embed: torch.Tensor, dst_shape: tuple[int, int], mode: str = "bicubic",
                  num_extra_tokens: int = 0) -> torch.Tensor | None:
    """A checkpoint's (1, extra + s*s, C) embedding of a square grid resized to
    ``dst_shape`` (computed in float32, returned in its dtype); None when it is not a
    square grid's, so the caller reports the mismatch."""
    if pos_embed.dim() != 3 or pos_embed.shape[1] <= num_extra_tokens:
        return None
    tokens = pos_embed.shape[1] - num_extra_tokens
    side = math.isqrt(tokens)
    if side * side != tokens:
        return None
    resized = resize_pos_embed(pos_embed.float(), (side, side), dst_shape, mode,
                               num_extra_tokens)
    return resized.to(pos_embed.dtype)
