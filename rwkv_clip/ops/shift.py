"""Token shifts: the only way RWKV mixes neighbouring tokens outside the WKV scan, as
copies (the ``copies`` implementation of the table's ``shift_lerp`` op, :mod:`.glue`).

Both shifts work per head: channels of each head are split into groups and each group is
taken from a different neighbour, with zeros where the neighbour does not exist. Backward
is the opposite shift (:func:`_register`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .glue.reference import Shift


def _q_shift_grid(grid: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    """grid: (B, H, W, heads, head_dim). Quarters of each head from the left, right, up,
    down neighbour (``adjoint``: from the right, left, down, up: the transpose)."""
    H, W, hd = grid.shape[1], grid.shape[2], grid.shape[4]
    out = torch.empty_like(grid, memory_format=torch.contiguous_format)
    q = hd // 4
    left, right, up, down = slice(0, q), slice(q, 2 * q), slice(2 * q, 3 * q), slice(3 * q, hd)
    if adjoint:
        left, right, up, down = right, left, down, up
    out[:, :, s:, :, left] = grid[:, :, :W - s, :, left]      # from the left
    out[:, :, :s, :, left] = 0
    out[:, :, :W - s, :, right] = grid[:, :, s:, :, right]    # from the right
    out[:, :, W - s:, :, right] = 0
    out[:, s:, :, :, up] = grid[:, :H - s, :, :, up]          # from above
    out[:, :s, :, :, up] = 0
    out[:, :H - s, :, :, down] = grid[:, s:, :, :, down]      # from below
    out[:, H - s:, :, :, down] = 0
    return out


def _sequence_shift(seq: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    """seq: (B, N, heads, head_dim). First half of each head from t - s, second from
    t + s (``adjoint``: the other way round)."""
    N, hd = seq.shape[1], seq.shape[3]
    out = torch.empty_like(seq, memory_format=torch.contiguous_format)
    back, ahead = slice(0, hd // 2), slice(hd // 2, hd)
    if adjoint:
        back, ahead = ahead, back
    out[:, s:, :, back] = seq[:, :N - s, :, back]
    out[:, :s, :, back] = 0
    out[:, :N - s, :, ahead] = seq[:, s:, :, ahead]
    out[:, N - s:, :, ahead] = 0
    return out


# Both shifts are operators (torch.library): to torch.compile each is one opaque call to
# the copies above. Traced as indexing, inductor turns every shift and the lerps it feeds
# into per-element gathers, slower than eager's shift + lerp.
@torch.library.custom_op("rwkv_clip::q_shift", mutates_args=())
def _q_shift_op(grid: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    return _q_shift_grid(grid, s, adjoint)


@torch.library.custom_op("rwkv_clip::sequence_shift", mutates_args=())
def _sequence_shift_op(seq: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    return _sequence_shift(seq, s, adjoint)


def _shift_fake(x: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _shift_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _, ctx.s, ctx.adjoint = inputs


def _register(op: Any) -> None:
    """Fake and autograd for a shift operator. A shift is linear and its adjoint is the
    opposite shift (each group taken from the other side, zeros at the other border), so
    backward is one more shift: one pass over the gradient instead of the clone per slice
    assignment and the zero-filled full-size gradient per source slice that autograd would
    chain through the in-place copies."""
    def backward(ctx: Any, grad: torch.Tensor):  # the adjoint: the opposite shift
        return op(grad, ctx.s, not ctx.adjoint), None, None
    op.register_fake(_shift_fake)
    op.register_autograd(backward, setup_context=_shift_setup)


_register(_q_shift_op)
_register(_sequence_shift_op)


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
    out = _q_shift_op(grid, shift_pixel, False).view(B, H * W, C)
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
    return _sequence_shift_op(seq, shift_pixel, False).view(B, N, C)


def shift_tokens(x: torch.Tensor, shift: Shift) -> torch.Tensor:
    """x (B, T, C) shifted by ``shift`` (:class:`rwkv_clip.ops.glue.Shift`)."""
    if shift.kind == "q":
        return q_shift_multihead(x, shift.pixels, shift.head_dim, shift.grid, shift.cls)
    return bidirectional_shift_multihead(x, shift.pixels, shift.head_dim)
