"""Text tower: bidirectional RWKV-6 (``Text_RWKV``), state-dict compatible with RWKV-CLIP.

``time_decay`` and ``time_faaaa`` are bfloat16 parameters, as in the original.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils.checkpoint as cp
from torch import nn

from .activation_memory import residual_branch
from .config import ModelArgs, complete_args
from .layers import Linear, channel_mix
from .layers.time_mix import (
    TIME_DECAY_EXTRA_DIM,
    TIME_MIX_EXTRA_DIM,
    TimeMixBase,
    fancy_bonus_init,
    fancy_decay_init,
    fancy_time_mix_init,
    glue_dtype,
)
from .ops.glue import Shift


class RWKV_Tmix_V6(TimeMixBase):
    def __init__(self, args, layer_id: int) -> None:
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        self.head_size = args.head_size
        self.n_head = args.dim_att // self.head_size
        self._init_time_params(args, layer_id)
        self.receptance = Linear(args.n_embd, args.dim_att, bias=False)
        self.key = Linear(args.n_embd, args.dim_att, bias=False)
        self.value = Linear(args.n_embd, args.dim_att, bias=False)
        self.output = Linear(args.dim_att, args.n_embd, bias=False)
        self.gate = Linear(args.n_embd, args.dim_att, bias=False)
        self.ln_x = nn.GroupNorm(self.n_head, args.dim_att,
                                 eps=1e-5 * args.head_size_divisor ** 2)

    @torch.no_grad()
    def _init_time_params(self, args, layer_id: int) -> None:
        for name, value in fancy_time_mix_init(args.n_embd, layer_id, args.n_layer).items():
            setattr(self, f"time_maa_{name}", nn.Parameter(value))
        self.time_maa_w1 = nn.Parameter(torch.zeros(args.n_embd, TIME_MIX_EXTRA_DIM * 5))
        self.time_maa_w2 = nn.Parameter(
            torch.zeros(5, TIME_MIX_EXTRA_DIM, args.n_embd).uniform_(-0.01, 0.01))
        decay = torch.tensor(fancy_decay_init(args.dim_att, layer_id, args.n_layer))
        self.time_decay = nn.Parameter(decay.to(torch.bfloat16).view(1, 1, args.dim_att))
        self.time_decay_w1 = nn.Parameter(torch.zeros(args.n_embd, TIME_DECAY_EXTRA_DIM))
        self.time_decay_w2 = nn.Parameter(
            torch.zeros(TIME_DECAY_EXTRA_DIM, args.dim_att).uniform_(-0.01, 0.01))
        bonus = torch.tensor(fancy_bonus_init(args.dim_att, layer_id, args.n_layer))
        self.time_faaaa = nn.Parameter(bonus.to(torch.bfloat16).view(self.n_head, self.head_size))

    def token_shift(self, **shift_kwargs: Any) -> Shift:
        return Shift("sequence", self.head_size, 1)


class RWKV_CMix_V6(nn.Module):
    def __init__(self, args, layer_id: int) -> None:
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        with torch.no_grad():
            remaining_depth = 1.0 - layer_id / args.n_layer
            channel_fraction = (torch.arange(args.n_embd, dtype=torch.float32) / args.n_embd)
            channel_fraction = channel_fraction.view(1, 1, args.n_embd)
            self.time_maa_k = nn.Parameter(1.0 - torch.pow(channel_fraction, remaining_depth))
            self.time_maa_r = nn.Parameter(1.0 - torch.pow(channel_fraction, remaining_depth))
        self.key = Linear(args.n_embd, args.dim_ffn, bias=False)
        self.receptance = Linear(args.n_embd, args.n_embd, bias=False)
        self.value = Linear(args.dim_ffn, args.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Opposite convention to the image tower: time_maa_* weights the neighbour,
        # x + (shift(x) - x) * m, both in one lerp (in the autocast dtype under autocast).
        mix = torch.cat((self.time_maa_k, self.time_maa_r)).unsqueeze(1).to(glue_dtype(x))
        return channel_mix(x, Shift("sequence", self.args.head_size, 1), mix, self.key,
                           self.receptance, self.value)


class Block(nn.Module):
    """Residual block; dropout wraps the whole residual sum, as in the original."""

    tiny_mask: torch.Tensor  # a buffer, registered only with tiny attention

    def __init__(self, args, layer_id: int) -> None:
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        self.ln1 = nn.LayerNorm(args.n_embd)
        self.ln2 = nn.LayerNorm(args.n_embd)
        if layer_id == 0:
            self.ln0 = nn.LayerNorm(args.n_embd)
            if args.pos_emb > 0:
                self.pos_emb_x = nn.Parameter(torch.zeros((1, args.pos_emb, args.n_embd)))
                self.pos_emb_y = nn.Parameter(torch.zeros((args.pos_emb, 1, args.n_embd)))
        self.att = RWKV_Tmix_V6(args, layer_id)
        self.ffn = RWKV_CMix_V6(args, layer_id)
        self.has_tiny_att = args.tiny_att_dim > 0 and layer_id == args.tiny_att_layer
        if self.has_tiny_att:
            self.tiny_ln = nn.LayerNorm(args.n_embd)
            self.tiny_q = Linear(args.n_embd, args.tiny_att_dim, bias=False)
            self.tiny_k = Linear(args.n_embd, args.tiny_att_dim, bias=False)
            self.tiny_v = Linear(args.n_embd, args.n_embd, bias=False)
            self.register_buffer("tiny_mask", torch.tril(torch.ones(args.ctx_len, args.ctx_len)))
        self.drop0 = nn.Dropout(p=args.dropout)
        self.drop1 = nn.Dropout(p=args.dropout)

    def _tiny_attention(self, x: torch.Tensor, x_emb: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        normed = self.tiny_ln(x)
        q, k = self.tiny_q(normed)[:, :T], self.tiny_k(normed)[:, :T]
        c = (q @ k.transpose(-2, -1)) * (self.args.tiny_att_dim ** -0.5)
        c = c.masked_fill(self.tiny_mask[:T, :T] == 0, 0)
        return x + c @ self.tiny_v(x_emb)

    def _inner_forward(self, x: torch.Tensor, x_emb: torch.Tensor | None) -> torch.Tensor:
        T = x.shape[1]
        if self.layer_id == 0:
            x = self.ln0(x)
            if self.args.pos_emb > 0:
                x = x + (self.pos_emb_x + self.pos_emb_y).reshape(T + 1, -1)[:-1, :]
        rebuild = self.args.rebuild
        x = self.drop0(x + residual_branch(lambda t: self.att(self.ln1(t)), x, self.att, rebuild))
        x = self.drop1(x + residual_branch(lambda t: self.ffn(self.ln2(t)), x, self.ffn, rebuild))
        if self.has_tiny_att:
            assert x_emb is not None, "tiny attention reads the token embeddings"
            x = self._tiny_attention(x, x_emb)
        return x

    def forward(self, x: torch.Tensor, x_emb: torch.Tensor | None = None) -> torch.Tensor:
        if self.args.with_cp and x.requires_grad:
            return cp.checkpoint(self._inner_forward, x, x_emb, use_reentrant=False)
        return self._inner_forward(x, x_emb)


# Linear weights the text init zeroes, and the orthogonal-init scales of the others.
_ZERO_INIT = (".att.output.", ".ffn.value.", ".ffn.receptance.", ".ffnPre.value.",
              ".ffnPre.receptance.", "head_q.", ".oo.", ".rr.")
_INIT_SCALES = ((".att.key.", 0.1), (".ffn.key.", 0.5), (".att.gate.", 0.1))
_ROUNDING = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _init_scale(name: str) -> float:
    if name == "emb.weight":
        return -1e-4  # negative: uniform(-1e-4, 1e-4) instead of orthogonal
    scale = 1.0
    if any(z in name for z in _ZERO_INIT):
        scale = 0.0
    if name == "head.weight":
        scale = 0.5
    if "head_k." in name:
        scale = 0.1
    for key, value in _INIT_SCALES:
        if key in name:
            scale = value
    return scale


def _keeps_constructed_value(name: str, tensor: torch.Tensor) -> bool:
    return (tensor.dim() < 2 or "ln_" in name or ".ln" in name or "time_" in name
            or "_mask" in name or "pos_emb" in name or ".mask." in name)


def text_initialization(model: Text_RWKV, generator: torch.Generator | None = None) -> dict:
    """The original's ``generate_init_weight_V6``, runnable on CPU.

    Orthogonal init (gain sqrt(rows/cols) for tall matrices, times a per-name scale),
    zeros for the output-side projections, tiny uniform embedding, ``ln_x.weight =
    ((1+layer)/n_layer)**0.7``, constructed values for the rest; every value is then
    rounded to the training precision (bf16/fp16) as the original does. The random
    draws use ``generator`` (the original draws them on the CUDA generator, so the
    default CPU generator is left untouched by default too).
    """
    args = model.args
    new_state = {}
    for name, tensor in model.state_dict().items():
        if _keeps_constructed_value(name, tensor):
            if "ln_x.weight" in name:
                layer_scale = (1 + int(name.split(".")[1])) / args.n_layer
                value = tensor * 0.0 + layer_scale ** 0.7
            else:
                value = tensor
        else:
            value = _init_matrix(name, tuple(tensor.shape), generator)
        dtype = _ROUNDING.get(str(args.precision))
        new_state[name] = value.to(dtype) if dtype is not None else value
    return new_state


def _init_matrix(name: str, shape: tuple[int, int], generator) -> torch.Tensor:
    scale = _init_scale(name)
    gain = math.sqrt(shape[0] / shape[1]) if shape[0] > shape[1] else 1.0
    out = torch.empty(shape)
    if scale == 0:
        return out.zero_()
    if scale < 0:
        return out.uniform_(scale, -scale, generator=generator)
    return nn.init.orthogonal_(out, gain=gain * scale, generator=generator)


class Text_RWKV(nn.Module):
    """Token embedding -> ``n_layer`` blocks (time mix with a per-head forward/backward
    token shift and bidirectional WKV, then channel mix) -> ``ln_out``. Configured by the
    original's ``args`` namespace (see :mod:`rwkv_clip.config`)."""

    def __init__(self, args) -> None:
        super().__init__()
        # a ModelArgs is validated when built (create_RWKV_Model passes its one copy)
        self.args = args = (args if isinstance(args, ModelArgs) else
                            complete_args(args, source="Text_RWKV args", with_image=False))
        self.emb = nn.Embedding(args.vocab_size, args.n_embd)
        self.blocks = nn.ModuleList(Block(args, i) for i in range(args.n_layer))
        self.ln_out = nn.LayerNorm(args.n_embd)
        if args.head_qk > 0:
            self.head_q = Linear(args.n_embd, args.head_qk, bias=False)
            self.head_k = Linear(args.n_embd, args.head_qk, bias=False)
            # The original's LM copy head: kept so its checkpoints load, but the CLIP
            # text feature never uses it. Frozen, it is outside DDP's gradient reduction
            # (find_unused_parameters=False would fail on parameters that get no grad).
            self.head_q.requires_grad_(False)
            self.head_k.requires_grad_(False)
            self.register_buffer("copy_mask", torch.tril(torch.ones(args.ctx_len, args.ctx_len)))
        if args.dropout > 0:
            self.drop0 = nn.Dropout(p=args.dropout)
        if args.text_initialization:
            generator = torch.Generator().manual_seed(torch.initial_seed())
            self.load_state_dict(text_initialization(self, generator), strict=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T <= ctx_len) -> per-token features (B, T, n_embd) after ln_out."""
        if idx.dim() != 2:
            raise ValueError(f"Text_RWKV expects token ids of shape (B, T), got {tuple(idx.shape)}")
        if idx.shape[1] > self.args.ctx_len:
            raise ValueError(f"text has {idx.shape[1]} tokens but the model's ctx_len is "
                             f"{self.args.ctx_len} (tokenize(texts, context_length="
                             f"{self.args.ctx_len}) or get_tokenizer(model_name) make them)")
        x = x_emb = self.emb(idx)
        if self.args.dropout > 0:
            x = self.drop0(x)
        for block in self.blocks:
            x = block(x, x_emb if self.args.tiny_att_dim > 0 else None)
        return self.ln_out(x)
