"""Image tower: Vision-RWKV 6 (``Image_RWKV``), state-dict compatible with RWKV-CLIP.

Parameters are created in the original's order, so a seeded CPU build draws the same
random numbers as the original.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint as cp
from torch import nn

from .activation_memory import residual_branch
from .config import ModelArgs
from .layers import (
    DropPath,
    Linear,
    PatchEmbed,
    channel_mix,
    resize_pos_embed,
)
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


def image_shift(head_size: int, pixels: int, patch_resolution: tuple[int, int] | None,
                with_cls_token: bool) -> Shift:
    """The image tower's q-shift on the patch grid (a cls token, if any, last)."""
    if patch_resolution is None:
        raise ValueError("q-shift needs the patch grid (patch_resolution=(H, W))")
    grid = (int(patch_resolution[0]), int(patch_resolution[1]))
    return Shift("q", head_size, pixels, grid, with_cls_token)


class VRWKV_SpatialMix_V6(TimeMixBase):
    def __init__(self, n_embd: int, n_head: int, n_layer: int, layer_id: int,
                 shift_mode: str = "q_shift_multihead", shift_pixel: int = 1,
                 init_mode: str = "fancy", key_norm: bool = False,
                 with_cls_token: bool = False) -> None:
        super().__init__()
        if shift_mode != "q_shift_multihead" or init_mode != "fancy":
            raise ValueError("Image_RWKV supports shift_mode='q_shift_multihead' and "
                             f"init_mode='fancy' only, got {shift_mode!r}, {init_mode!r}")
        self.layer_id, self.n_layer, self.n_embd = layer_id, n_layer, n_embd
        self.attn_sz = n_embd
        self.n_head = n_head
        self.head_size = n_embd // n_head
        self._init_time_params()
        self.with_cls_token = with_cls_token
        self.shift_pixel = shift_pixel
        self.key = Linear(n_embd, self.attn_sz, bias=False)
        self.value = Linear(n_embd, self.attn_sz, bias=False)
        self.receptance = Linear(n_embd, self.attn_sz, bias=False)
        self.gate = Linear(n_embd, self.attn_sz, bias=False)
        self.key_norm = nn.LayerNorm(n_embd) if key_norm else None
        self.output = Linear(self.attn_sz, n_embd, bias=False)
        self.ln_x = nn.GroupNorm(n_head, self.attn_sz, eps=1e-5)

    @torch.no_grad()
    def _init_time_params(self) -> None:
        for name, value in fancy_time_mix_init(self.n_embd, self.layer_id, self.n_layer).items():
            setattr(self, f"time_maa_{name}", nn.Parameter(value))
        self.time_maa_w1 = nn.Parameter(
            torch.zeros(self.n_embd, TIME_MIX_EXTRA_DIM * 5).uniform_(-1e-4, 1e-4))
        self.time_maa_w2 = nn.Parameter(
            torch.zeros(5, TIME_MIX_EXTRA_DIM, self.n_embd).uniform_(-1e-4, 1e-4))
        decay = fancy_decay_init(self.attn_sz, self.layer_id, self.n_layer)
        self.time_decay = nn.Parameter(torch.tensor(decay).view(1, 1, self.attn_sz))
        self.time_decay_w1 = nn.Parameter(
            torch.zeros(self.n_embd, TIME_DECAY_EXTRA_DIM).uniform_(-1e-4, 1e-4))
        self.time_decay_w2 = nn.Parameter(
            torch.zeros(TIME_DECAY_EXTRA_DIM, self.attn_sz).uniform_(-1e-4, 1e-4))
        bonus = fancy_bonus_init(self.attn_sz, self.layer_id, self.n_layer)
        self.time_faaaa = nn.Parameter(torch.tensor(bonus).view(self.n_head, self.head_size))

    def token_shift(self, patch_resolution: tuple[int, int] | None = None,
                    **shift_kwargs: Any) -> Shift:
        return image_shift(self.head_size, self.shift_pixel, patch_resolution,
                           self.with_cls_token)

    def forward(self, x: torch.Tensor, patch_resolution=None,
                **shift_kwargs: Any) -> torch.Tensor:
        return super().forward(x, patch_resolution=patch_resolution, **shift_kwargs)


class VRWKV_ChannelMix_V6(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_layer: int, layer_id: int,
                 shift_mode: str = "q_shift_multihead", shift_pixel: int = 1,
                 hidden_rate: int = 4, init_mode: str = "fancy", key_norm: bool = False,
                 with_cls_token: bool = False) -> None:
        super().__init__()
        self.layer_id, self.n_layer, self.n_embd = layer_id, n_layer, n_embd
        self.n_head = n_head
        self.head_size = n_embd // n_head
        with torch.no_grad():  # mix weights: channel i keeps (i / C) ** (1 - depth) of itself
            remaining_depth = 1.0 - layer_id / n_layer
            channel_fraction = torch.arange(n_embd, dtype=torch.float32) / n_embd
            channel_fraction = channel_fraction.view(1, 1, n_embd)
            self.spatial_mix_k = nn.Parameter(torch.pow(channel_fraction, remaining_depth))
            self.spatial_mix_r = nn.Parameter(torch.pow(channel_fraction, remaining_depth))
        self.with_cls_token = with_cls_token
        self.shift_pixel = shift_pixel
        hidden_sz = hidden_rate * n_embd
        self.key = Linear(n_embd, hidden_sz, bias=False)
        self.key_norm = nn.LayerNorm(hidden_sz) if key_norm else None
        self.receptance = Linear(n_embd, n_embd, bias=False)
        self.value = Linear(hidden_sz, n_embd, bias=False)

    def forward(self, x: torch.Tensor, patch_resolution=None) -> torch.Tensor:
        shift = image_shift(self.head_size, self.shift_pixel, patch_resolution,
                            self.with_cls_token)
        # Note the convention: spatial_mix_* weights x itself (the text tower's time_maa_k
        # weights the shifted neighbour instead): x * m + shifted * (1 - m), both in one lerp.
        # (under autocast the glue dtype: the one key/receptance cast to anyway)
        mix = torch.cat((self.spatial_mix_k, self.spatial_mix_r)).unsqueeze(1).to(glue_dtype(x))
        return channel_mix(x, shift, mix, self.key, self.receptance, self.value, self.key_norm,
                           shifted_first=True)


class Block_V6(nn.Module):
    """Pre-norm residual block (``ln0`` on the first layer only), with optional layer
    scale (``gamma1/2``) and post-norm variants of Vision-RWKV."""

    def __init__(self, n_embd: int, n_head: int, n_layer: int, layer_id: int,
                 shift_mode: str = "q_shift_multihead", shift_pixel: int = 1,
                 drop_path: float = 0.0, hidden_rate: int = 4, init_mode: str = "fancy",
                 init_values: float | None = None, post_norm: bool = False,
                 key_norm: bool = False, with_cls_token: bool = False,
                 with_cp: bool = False, rebuild: str = "auto") -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        if layer_id == 0:
            self.ln0 = nn.LayerNorm(n_embd)
        self.att = VRWKV_SpatialMix_V6(n_embd=n_embd, n_head=n_head, n_layer=n_layer,
                                       layer_id=layer_id, shift_mode=shift_mode,
                                       shift_pixel=shift_pixel, init_mode=init_mode,
                                       key_norm=key_norm, with_cls_token=with_cls_token)
        self.ffn = VRWKV_ChannelMix_V6(n_embd=n_embd, n_head=n_head, n_layer=n_layer,
                                       layer_id=layer_id, shift_mode=shift_mode,
                                       shift_pixel=shift_pixel, hidden_rate=hidden_rate,
                                       init_mode=init_mode, key_norm=key_norm,
                                       with_cls_token=with_cls_token)
        self.layer_scale = init_values is not None
        self.post_norm = post_norm
        if init_values is not None:
            self.gamma1 = nn.Parameter(init_values * torch.ones(n_embd))
            self.gamma2 = nn.Parameter(init_values * torch.ones(n_embd))
        self.with_cp = with_cp
        self.rebuild = rebuild  # the activation-memory policy's scope (config key rebuild)

    def _residual(self, branch, norm, gamma, x, patch_resolution):
        def run(t: torch.Tensor) -> torch.Tensor:
            if self.post_norm:
                return norm(branch(t, patch_resolution))
            return branch(norm(t), patch_resolution)
        out = residual_branch(run, x, branch, self.rebuild)
        return x + self.drop_path(out if gamma is None else gamma * out)

    def _inner_forward(self, x: torch.Tensor, patch_resolution) -> torch.Tensor:
        if self.layer_id == 0:
            x = self.ln0(x)
        x = self._residual(self.att, self.ln1, getattr(self, "gamma1", None), x, patch_resolution)
        return self._residual(self.ffn, self.ln2, getattr(self, "gamma2", None), x,
                              patch_resolution)

    def forward(self, x: torch.Tensor, patch_resolution=None) -> torch.Tensor:
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(self._inner_forward, x, patch_resolution, use_reentrant=False)
        return self._inner_forward(x, patch_resolution)


class Image_RWKV(nn.Module):
    """Vision-RWKV 6 backbone. ``forward`` returns a tuple with one entry per
    ``out_indices`` layer: the patch-token map (B, C, H', W'), or ``[map, cls]`` when
    ``output_cls_token``. The cls token, if used, is appended after the patches.

    Patch embedding -> learned position embedding -> ``depth`` RWKV blocks (spatial mix
    with a 2-D q-shift and bidirectional WKV, then channel mix) -> final LayerNorm ``ln1``.
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_channels: int = 3,
                 out_indices: int | Sequence[int] = -1, drop_rate: float = 0.0,
                 embed_dims: int = 192, num_heads: int = 3, depth: int = 12,
                 drop_path_rate: float = 0.0, shift_pixel: int = 1,
                 shift_mode: str = "q_shift_multihead", init_mode: str = "fancy",
                 post_norm: bool = False, key_norm: bool = False,
                 init_values: float | None = None, hidden_rate: int = 4,
                 final_norm: bool = True, interpolate_mode: str = "bicubic",
                 output_cls_token: bool = False, with_cls_token: bool = False,
                 with_cp: bool = False, rebuild: str = "auto") -> None:
        super().__init__()
        if output_cls_token and not with_cls_token:
            raise ValueError("output_cls_token=True needs with_cls_token=True")
        if embed_dims % num_heads or (embed_dims // num_heads) % 4:
            raise ValueError(f"embed_dims {embed_dims} / num_heads {num_heads} must give an "
                             "integer head size that is a multiple of 4")
        self.embed_dims = embed_dims
        self.num_extra_tokens = 0  # the cls token is appended, not part of pos_embed
        self.num_layers = depth
        self.drop_path_rate = drop_path_rate
        self.with_cls_token = with_cls_token
        self.output_cls_token = output_cls_token
        if with_cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims))
        self.patch_embed = PatchEmbed(in_channels, embed_dims, patch_size, img_size)
        self.patch_resolution = self.patch_embed.init_out_size
        num_patches = self.patch_resolution[0] * self.patch_resolution[1]
        self.interpolate_mode = interpolate_mode
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dims))
        self.drop_after_pos = nn.Dropout(p=drop_rate)
        self.out_indices = self._normalise_out_indices(out_indices, depth)
        dpr = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()
        self.layers = nn.ModuleList(
            Block_V6(n_embd=embed_dims, n_head=num_heads, n_layer=depth, layer_id=i,
                     shift_mode=shift_mode, shift_pixel=shift_pixel, drop_path=dpr[i],
                     hidden_rate=hidden_rate, init_mode=init_mode, init_values=init_values,
                     post_norm=post_norm, key_norm=key_norm, with_cls_token=with_cls_token,
                     with_cp=with_cp, rebuild=rebuild)
            for i in range(depth))
        self.final_norm = final_norm
        if final_norm:
            self.ln1 = nn.LayerNorm(embed_dims)

    @classmethod
    def from_args(cls, args: ModelArgs) -> Image_RWKV:
        """The image tower of a validated model config (``complete_args`` has checked that
        every image field is set)."""
        size, patch, dims = args.input_size, args.image_patch_size, args.image_embed_dims
        depth, heads = args.image_depth, args.image_num_heads
        assert size is not None and patch is not None and dims is not None
        assert depth is not None and heads is not None
        return cls(img_size=size, patch_size=patch, embed_dims=dims,
                   hidden_rate=args.image_hidden_rate, depth=depth, num_heads=heads,
                   output_cls_token=args.image_output_cls_token,
                   with_cls_token=args.image_with_cls_token,
                   drop_path_rate=args.drop_path_rate, with_cp=args.with_cp,
                   rebuild=args.rebuild)

    @staticmethod
    def _normalise_out_indices(out_indices, depth: int) -> list[int]:
        indices = [out_indices] if isinstance(out_indices, int) else list(out_indices)
        indices = [i + depth if i < 0 else i for i in indices]
        bad = [i for i in indices if not 0 <= i < depth]
        if bad:
            raise ValueError(f"out_indices {bad} outside 0..{depth - 1}")
        return indices

    @property
    def with_cp(self) -> bool:
        return all(layer.with_cp for layer in self.layers)

    @with_cp.setter
    def with_cp(self, value: bool) -> None:
        for layer in self.layers:
            assert isinstance(layer, Block_V6)
            layer.with_cp = bool(value)

    @property
    def rebuild(self) -> str:
        """The config key rebuild of the blocks (set on all of them at once)."""
        layer = self.layers[0]
        assert isinstance(layer, Block_V6)
        return layer.rebuild

    @rebuild.setter
    def rebuild(self, value: str) -> None:
        for layer in self.layers:
            assert isinstance(layer, Block_V6)
            layer.rebuild = value

    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Patches + (resized if needed) position embedding (+ cls token last)."""
        x, patch_resolution = self.patch_embed(x)
        x = x + resize_pos_embed(self.pos_embed, self.patch_resolution, patch_resolution,
                                 mode=self.interpolate_mode,
                                 num_extra_tokens=self.num_extra_tokens)
        if self.with_cls_token:
            x = torch.cat((x, self.cls_token.expand(x.shape[0], -1, -1)), dim=1)
        return self.drop_after_pos(x), patch_resolution

    def _collect(self, x: torch.Tensor, patch_resolution):
        B, _, C = x.shape
        patches = x[:, :-1] if self.with_cls_token else x
        patch_map = patches.reshape(B, *patch_resolution, C).permute(0, 3, 1, 2)
        return [patch_map, x[:, -1]] if self.output_cls_token else patch_map

    def forward(self, x: torch.Tensor) -> tuple:
        x, patch_resolution = self.embed(x)
        outs = []
        for i, layer in enumerate(self.layers):
            x = layer(x, patch_resolution)
            if i == len(self.layers) - 1 and self.final_norm:
                x = self.ln1(x)
            if i in self.out_indices:
                outs.append(self._collect(x, patch_resolution))
        return tuple(outs)
