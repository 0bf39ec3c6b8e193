"""Token shifts: the only way RWKV mixes neighbouring tokens outside the WKV scan.

Both shifts work per head: channels of each head are split into groups and each group
is taken from a different neighbour, with zeros where the neighbour does not exist.
"""
from __future__ import annotations

import torch


def q_shift_multihead(x: torch.Tensor, shift_pixel: int = 1, head_dim: int = 64,
                      patch_resolution: tuple[int, int] | None = None,
                      with_cls_token: bool = False) -> torch.Tensor:
    """Image shift: per head, channel quarters come from the left, right, up, down pixel.

    x: (B, N, C) tokens in row-major grid order; a cls token, if any, sits last and
    is passed through unshifted.
    """
    B, N, C = x.shape
    if C % head_dim or head_dim % 4:
        raise ValueError(f"q-shift: C={C}, head_dim={head_dim} (need C % head_dim == 0, "
                         "head_dim % 4 == 0)")
    if with_cls_token:
        x, cls_token = x[:, :-1], x[:, -1:]
    if patch_resolution is None:
        raise ValueError("q-shift needs the patch grid (patch_resolution=(H, W))")
    H, W = patch_resolution
    grid = x.transpose(1, 2).reshape(B, C // head_dim, head_dim, H, W)
    out = torch.zeros_like(grid)
    q, s = head_dim // 4, shift_pixel
    out[:, :, 0 * q:1 * q, :, s:] = grid[:, :, 0 * q:1 * q, :, :W - s]   # from the left
    out[:, :, 1 * q:2 * q, :, :W - s] = grid[:, :, 1 * q:2 * q, :, s:]   # from the right
    out[:, :, 2 * q:3 * q, s:, :] = grid[:, :, 2 * q:3 * q, :H - s, :]   # from above
    out[:, :, 3 * q:4 * q, :H - s, :] = grid[:, :, 3 * q:4 * q, s:, :]   # from below
    out = out.reshape(B, C, H * W).transpose(1, 2)
    if with_cls_token:
        out = torch.cat((out, cls_token), dim=1)
    return out


def bidirectional_shift_multihead(x: torch.Tensor, shift_pixel: int = 1,
                                  head_dim: int = 64) -> torch.Tensor:
    """Text shift: per head, the first half of channels from t-1, the second from t+1."""
    B, N, C = x.shape
    if C % head_dim or head_dim % 4:
        raise ValueError(f"shift: C={C}, head_dim={head_dim} (need C % head_dim == 0, "
                         "head_dim % 4 == 0)")
    seq = x.transpose(1, 2).reshape(B, C // head_dim, head_dim, N)
    out = torch.zeros_like(seq)
    half, s = head_dim // 2, shift_pixel
    out[:, :, :half, s:] = seq[:, :, :half, :N - s]
    out[:, :, half:, :N - s] = seq[:, :, half:, s:]
    return out.reshape(B, C, N).transpose(1, 2)
