"""The RWKV-6 time mix shared by both towers: data-dependent lerp, decay, WKV, gate.

Each tower subclasses :class:`TimeMixBase`, creating the parameters in its own order
(state-dict names and the order of random draws follow the original) and naming its own
token shift; the arithmetic below is common to both. The shift with its lerps, the head
norm with the gate and the WKV are ops of the dispatch table (:mod:`rwkv_clip.ops`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..ops import wkv6_bidirectional
from ..ops.glue import Shift, head_norm_gate, shift_lerp
from ..ops.products import matmul
from .linear import Linear

TIME_MIX_EXTRA_DIM = 32    # rank of the LoRA that makes the five lerp weights data-dependent
TIME_DECAY_EXTRA_DIM = 64  # rank of the LoRA that makes the decay data-dependent


def fancy_time_mix_init(n_embd: int, layer_id: int, n_layer: int) -> dict[str, torch.Tensor]:
    """The original's layer-dependent lerp weights (time_maa_x/w/k/v/r/g)."""
    depth_fraction = _depth_ratio(layer_id, n_layer)
    remaining_depth = 1.0 - layer_id / n_layer
    channel_fraction = (torch.arange(n_embd, dtype=torch.float32) / n_embd).view(1, 1, n_embd)
    pow_a = torch.pow(channel_fraction, remaining_depth)
    pow_half = torch.pow(channel_fraction, 0.5 * remaining_depth)
    return {"x": 1.0 - pow_a, "w": 1.0 - pow_a, "k": 1.0 - pow_a,
            "v": 1.0 - (pow_a + 0.3 * depth_fraction), "r": 1.0 - pow_half, "g": 1.0 - pow_half}


def _depth_ratio(layer_id: int, n_layer: int) -> float:
    # The original divides by (n_layer - 1); a one-layer tower would divide by zero.
    return layer_id / (n_layer - 1) if n_layer > 1 else 0.0


def fancy_decay_init(dim_att: int, layer_id: int, n_layer: int) -> list[float]:
    """time_decay: -6 + 5 * (n / (C-1)) ** (0.7 + 1.3 * depth ratio), per channel.

    Computed in Python floats, as the original, so the rounding to the parameter's
    dtype (float32 image, bfloat16 text) gives bit-identical values.
    """
    depth_fraction = _depth_ratio(layer_id, n_layer)
    return [-6 + 5 * (n / (dim_att - 1)) ** (0.7 + 1.3 * depth_fraction) for n in range(dim_att)]


def fancy_bonus_init(dim_att: int, layer_id: int, n_layer: int) -> list[float]:
    """time_faaaa (the bonus u): a depth-scaled ramp plus a period-3 zigzag."""
    depth_fraction = _depth_ratio(layer_id, n_layer)
    return [depth_fraction * (1 - (n / (dim_att - 1))) + ((n + 1) % 3 - 1) * 0.1
            for n in range(dim_att)]


def glue_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the token-shift / lerp / LoRA glue for input x.

    Without autocast, x's dtype (the original's arithmetic). Under autocast, the autocast
    dtype: every lerp feeds a matmul that autocast would cast to it anyway, so x and
    the float32 ``time_maa_*`` are cast once instead of each lerp being promoted back to
    float32 and then copied down (the original's promotion). The golden bf16-autocast
    checks (tests/test_model_parity.py) bound the difference this makes.
    """
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class TimeMixBase(nn.Module):
    """Shared forward of the RWKV-6 time mix; subclasses own parameters and shift."""

    n_head: int
    wkv_backend: str | None = None  # a pinned WKV implementation; None: the dispatch table's
    # created by the subclasses (their order fixes the state-dict order and random draws)
    time_maa_x: nn.Parameter
    time_maa_w: nn.Parameter
    time_maa_k: nn.Parameter
    time_maa_v: nn.Parameter
    time_maa_r: nn.Parameter
    time_maa_g: nn.Parameter
    time_maa_w1: nn.Parameter
    time_maa_w2: nn.Parameter
    time_decay: nn.Parameter
    time_decay_w1: nn.Parameter
    time_decay_w2: nn.Parameter
    time_faaaa: nn.Parameter
    receptance: Linear
    key: Linear
    value: Linear
    gate: Linear
    output: Linear
    ln_x: nn.GroupNorm

    def token_shift(self, **shift_kwargs: Any) -> Shift:
        """The tower's token shift (:class:`rwkv_clip.ops.glue.Shift`)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, **shift_kwargs: Any) -> torch.Tensor:
        """The time mix of x (B, T, C).

        The six lerps ``x + (shift(x) - x) * m`` are ``torch.lerp(x, shift(x), m)``, the
        five data-dependent ones as one stacked lerp. Under autocast the glue runs in the
        autocast dtype (:func:`glue_dtype`); the decay logits w keep the original promotion
        (``time_decay`` + LoRA: float32 in the image tower, bf16 in the text).
        """
        B, T, C = x.shape
        x = x.to(glue_dtype(x))
        shift = self.token_shift(**shift_kwargs)
        # data-dependent lerp weights: a rank-32 tanh LoRA per mix, added to time_maa_*
        (mix_input,) = shift_lerp(x, self.time_maa_x.to(x.dtype).unsqueeze(0), shift)
        lora = torch.tanh(matmul(mix_input, self.time_maa_w1)).view(B * T, 5, -1).transpose(0, 1)
        maa = torch.cat((self.time_maa_w, self.time_maa_k, self.time_maa_v, self.time_maa_r,
                         self.time_maa_g)).to(x.dtype)  # (5, 1, C)
        weights = matmul(lora, self.time_maa_w2, add=maa).view(5, B, T, C)
        xw, xk, xv, xr, xg = shift_lerp(x, weights, shift)
        del mix_input, lora, weights  # (5, B, T, C) and more: freed before the WKV's peak
        r, k, v = self.receptance(xr), self.key(xk), self.value(xv)
        gate = self.gate(xg)
        # data-dependent decay: time_decay plus a rank-64 tanh LoRA
        w = self.time_decay + matmul(torch.tanh(matmul(xw, self.time_decay_w1)),
                                     self.time_decay_w2)
        y = wkv6_bidirectional(r, k, v, w, self.time_faaaa, backend=self.wkv_backend)
        key_norm: nn.Module | None = getattr(self, "key_norm", None)
        if key_norm is not None:
            y = key_norm(y)
        # ln_x (one group per head) times silu(gate), in gate's dtype (what output casts to)
        return self.output(head_norm_gate(y, self.ln_x.weight, self.ln_x.bias, gate,
                                          self.ln_x.num_groups, self.ln_x.eps))
