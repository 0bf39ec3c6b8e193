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

    Works on the token-major layout itself, a (B, H, W, heads, head_dim) view of x
    (the original transposes to channel-major and back, two copies, and its
    zeros-then-assign writes the output twice): each quarter is copied once into an
    uninitialised output and only its border row/column is zeroed.
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
    grid = x.reshape(B, H, W, C // head_dim, head_dim)
    out = torch.empty_like(grid, memory_format=torch.contiguous_format)
    q, s = head_dim // 4, shift_pixel
    a, b, c = q, 2 * q, 3 * q
    out[:, :, s:, :, :a] = grid[:, :, :W - s, :, :a]      # from the left
    out[:, :, :s, :, :a] = 0
    out[:, :, :W - s, :, a:b] = grid[:, :, s:, :, a:b]    # from the right
    out[:, :, W - s:, :, a:b] = 0
    out[:, s:, :, :, b:c] = grid[:, :H - s, :, :, b:c]    # from above
    out[:, :s, :, :, b:c] = 0
    out[:, :H - s, :, :, c:] = grid[:, s:, :, :, c:]      # from below
    out[:, H - s:, :, :, c:] = 0
    out = out.view(B, H * W, C)
    if with_cls_token:
        out = torch.cat((out, cls_token), dim=1)
    return out


def bidirectional_shift_multihead(x: torch.Tensor, shift_pixel: int = 1,
                                  head_dim: int = 64) -> torch.Tensor:
    """Text shift: per head, the first half of channels from t-1, the second from t+1.

    In the token-major layout, as :func:`q_shift_multihead` (one copy, borders zeroed).
    """
    B, N, C = x.shape
    if C % head_dim or head_dim % 4:
        raise ValueError(f"shift: C={C}, head_dim={head_dim} (need C % head_dim == 0, "
                         "head_dim % 4 == 0)")
    seq = x.reshape(B, N, C // head_dim, head_dim)
    out = torch.empty_like(seq, memory_format=torch.contiguous_format)
    half, s = head_dim // 2, shift_pixel
    out[:, s:, :, :half] = seq[:, :N - s, :, :half]
    out[:, :s, :, :half] = 0
    out[:, :N - s, :, half:] = seq[:, s:, :, half:]
    out[:, N - s:, :, half:] = 0
    return out.view(B, N, C)
