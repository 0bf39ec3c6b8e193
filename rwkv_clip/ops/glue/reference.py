"""The towers' elementwise glue in plain PyTorch: the oracle the fused kernels are tested
against, and what runs where they cannot (no CUDA device, no Triton).

Each function is the layers' arithmetic written as the same torch ops (so the values are
bit-identical to the layers'), outside autocast: the inputs' dtypes decide.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..relu_square import relu_square_reference

SHIFT_KINDS = ("sequence", "q")


@dataclass(frozen=True)
class Shift:
    """A per-head token shift. ``"sequence"`` (text tower): the first half of each head's
    channels from token t - pixels, the second from t + pixels. ``"q"`` (image tower): the
    head's channel quarters from the left, right, upper and lower neighbour on the
    ``grid`` (H, W) of row-major tokens, with a cls token (``cls``) last and unshifted.
    Zeros where the neighbour does not exist."""

    kind: str
    head_dim: int
    pixels: int = 1
    grid: tuple[int, int] = (0, 0)
    cls: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SHIFT_KINDS:
            raise ValueError(f"shift kind {self.kind!r}: expected one of {SHIFT_KINDS}")
        parts = 4 if self.kind == "q" else 2
        if self.head_dim % parts:
            raise ValueError(f"{self.kind} shift: head_dim={self.head_dim} is not a multiple "
                             f"of {parts}")

    def check(self, x: torch.Tensor) -> None:
        """x (B, T, C) fits: C in whole heads, T the grid's tokens (plus the cls token)."""
        B, T, C = x.shape
        if C % self.head_dim:
            raise ValueError(f"shift: C={C} is not a multiple of head_dim={self.head_dim}")
        if self.kind == "q" and T != self.grid[0] * self.grid[1] + int(self.cls):
            raise ValueError(f"q shift: {T} tokens, grid {self.grid}"
                             + (" plus a cls token" if self.cls else ""))


def shift_reference(x: torch.Tensor, shift: Shift) -> torch.Tensor:
    """``shift`` applied to x (B, T, C): copies into a zero tensor."""
    shift.check(x)
    B, T, C = x.shape
    hd, s = shift.head_dim, shift.pixels
    if shift.kind == "sequence":
        seq = x.reshape(B, T, C // hd, hd)
        out = torch.zeros_like(seq)
        half = hd // 2
        out[:, s:, :, :half] = seq[:, :max(T - s, 0), :, :half]
        out[:, :max(T - s, 0), :, half:] = seq[:, s:, :, half:]
        return out.view(B, T, C)
    H, W = shift.grid
    tokens = x[:, :H * W]
    grid = tokens.reshape(B, H, W, C // hd, hd)
    out = torch.zeros_like(grid)
    q = hd // 4
    out[:, :, s:, :, :q] = grid[:, :, :max(W - s, 0), :, :q]                # from the left
    out[:, :, :max(W - s, 0), :, q:2 * q] = grid[:, :, s:, :, q:2 * q]      # from the right
    out[:, s:, :, :, 2 * q:3 * q] = grid[:, :max(H - s, 0), :, :, 2 * q:3 * q]  # from above
    out[:, :max(H - s, 0), :, :, 3 * q:] = grid[:, s:, :, :, 3 * q:]        # from below
    out = out.view(B, H * W, C)
    return torch.cat((out, x[:, H * W:]), dim=1) if shift.cls else out


def shift_lerp_reference(x: torch.Tensor, weight: torch.Tensor, shift: Shift,
                         shifted_first: bool = False) -> torch.Tensor:
    """The stacked mixes ``lerp(x, shift(x), weight)`` (``lerp(shift(x), x, weight)`` with
    ``shifted_first``, the image channel mix's convention): x (B, T, C), weight (S, 1, 1, C)
    or (S, B, T, C) in x's dtype; returns (S, B, T, C)."""
    shifted = shift_reference(x, shift)
    start, end = (shifted, x) if shifted_first else (x, shifted)
    return torch.lerp(start, end, weight)


def head_norm_gate_reference(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                             gate: torch.Tensor, n_head: int, eps: float) -> torch.Tensor:
    """``group_norm(y, n_head, weight, bias, eps).to(gate.dtype) * silu(gate)``: the time
    mix's per-head ``ln_x`` of the WKV output y (B, T, C) and its gate, in gate's dtype.
    The norm computes in the parameters' dtype (float32, as autocast runs it), the gate in
    gate's dtype."""
    B, T, C = y.shape
    normed = F.group_norm(y.to(weight.dtype).view(B * T, C), n_head, weight, bias, eps)
    return normed.view(B, T, C).to(gate.dtype) * F.silu(gate)


__all__ = ["SHIFT_KINDS", "Shift", "head_norm_gate_reference", "relu_square_reference",
           "shift_lerp_reference", "shift_reference"]
