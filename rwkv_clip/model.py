"""The CLIP wrapper (``get_model``), the original's factory ``create_RWKV_Model`` and
``load_model_weight``.

RWKV-CLIP has no projection heads: both features are means of the towers' token outputs
(:meth:`get_model.encode_image`, :meth:`get_model.encode_text`).
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint_files import load_checked
from .config import (
    REBUILD_CHOICES,
    ModelArgs,
    complete_args,
    kept_settings_note,
    with_checkpoint_settings,
)
from .errors import ConfigError
from .image_rwkv import Image_RWKV
from .layers.time_mix import TimeMixBase
from .pretrained import load_weights
from .text_rwkv import Text_RWKV

# open_clip's SigLIP models: init_logit_scale ln 10, init_logit_bias -10
SIGLIP_LOGIT_SCALE = math.log(10.0)
SIGLIP_LOGIT_BIAS = -10.0


class get_model(nn.Module):
    """RWKV-CLIP: ``image_model`` (Image_RWKV), ``text_model`` (Text_RWKV), ``logit_scale``."""

    def __init__(self, model_image_rwkv: Image_RWKV, model_text_rwkv: Text_RWKV,
                 image_cls_token: bool = False) -> None:
        super().__init__()
        self.text_model = model_text_rwkv
        self.image_model = model_image_rwkv
        self.image_cls_token = image_cls_token
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))
        self.logit_bias: nn.Parameter | None = None  # SigLIP only (set_logit_bias)

    def set_logit_bias(self, value: float | None) -> None:
        """Give the model SigLIP's ``logit_bias`` parameter with ``value`` (a CLIP model has
        none, so its state dict keeps the original's keys), or remove it (None)."""
        if value is None:
            self.logit_bias = None
            return
        scale = self.logit_scale
        self.logit_bias = nn.Parameter(torch.full((), float(value), dtype=scale.dtype,
                                                  device=scale.device))

    def init_siglip(self) -> None:
        """open_clip's SigLIP initialisation: logit_scale ln 10, logit_bias -10."""
        with torch.no_grad():
            self.logit_scale.fill_(SIGLIP_LOGIT_SCALE)
        self.set_logit_bias(SIGLIP_LOGIT_BIAS)

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """(B, 3, S, S) normalised images -> (B, C) image features: the mean of the final
        patch tokens (or the cls token)."""
        outs = self.image_model(image)[-1]
        if self.image_cls_token:
            features = outs[1]
        else:
            features = outs.mean(dim=(2, 3))  # global average over the patch grid
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """(B, ctx_len) token ids -> (B, C): mean of the L2-normalised token features over
        all ``ctx_len`` positions (padding included)."""
        tokens = F.normalize(self.text_model(text), dim=-1)
        features = tokens.mean(dim=1)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, image: torch.Tensor, text: torch.Tensor):
        """Unnormalised image and text features and ``logit_scale.exp()``, exactly as the
        original; a SigLIP model also returns ``logit_bias``, fourth (as open_clip's)."""
        image_features, text_features = self.encode_image(image), self.encode_text(text)
        if self.logit_bias is not None:
            return image_features, text_features, self.logit_scale.exp(), self.logit_bias
        return image_features, text_features, self.logit_scale.exp()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in backward (the original's ``with_cp``) in both towers."""
        self.image_model.with_cp = enable
        self.text_model.args.with_cp = enable

    def set_rebuild(self, rebuild: str) -> None:
        """Where the activation-memory policy applies in both towers (the config key
        ``rebuild``: ``auto``, ``always``, ``never``)."""
        if rebuild not in REBUILD_CHOICES:
            raise ConfigError(f"rebuild={rebuild!r}: expected one of {', '.join(REBUILD_CHOICES)}")
        self.image_model.rebuild = rebuild
        self.text_model.args.rebuild = rebuild

    def set_wkv_backend(self, backend: str | None) -> None:
        """Pin the WKV implementation (a name of the dispatch table's ``wkv`` op, e.g.
        "cpu", "reference", "cuda-fast"; "cuda" stands for "cuda-fast"), or None / "auto"
        to let the table choose (docs/wkv.md)."""
        for module in self.modules():
            if isinstance(module, TimeMixBase):  # every WKV call sits in a time mix
                module.wkv_backend = backend


def create_RWKV_Model(args: Any, model_weight_path: str | os.PathLike | None = None,
                      map_location: str | torch.device | None = None, *,
                      checkpoint_settings: bool = True) -> get_model:
    """Build RWKV-CLIP from a config namespace (``load_model_configs``) and optionally load
    weights (our checkpoints or the original's, ``module.``/``_orig_mod.`` prefixes ok).

    A training checkpoint records the model settings it was trained with (context
    length, image size, ...): they replace ``args``' with one printed line where they
    differ; ``checkpoint_settings=False`` keeps ``args`` as given (one line says which
    settings then contradict the checkpoint's).

    ``args`` is validated once here into a new ``ModelArgs`` (the towers share it, and
    ``set_grad_checkpointing`` changes only that copy, never the caller's object)."""
    args = complete_args(args, source="model args")
    weights = None
    if model_weight_path is not None:
        weights = load_weights(model_weight_path, map_location=map_location)
        if checkpoint_settings:
            args = with_checkpoint_settings(args, weights, "args", _say)
        elif note := kept_settings_note(args, weights):
            _say(note)
    image_tower = Image_RWKV.from_args(args)  # image first: the original's random-draw order
    text_tower = Text_RWKV(args)
    model = get_model(image_tower, text_tower, image_cls_token=args.image_output_cls_token)
    if weights is not None:
        load_checked(model, weights)
    return model


def _say(msg: str) -> None:
    print(msg, flush=True)


def load_model_weight(model: nn.Module, model_weight: str | os.PathLike,
                      map_location=None) -> nn.Module:
    """Load weights strictly; values land on the model's device, in its dtypes. The model
    keeps its settings: where a training checkpoint records others (a context length, an
    image size), one printed line says so.

    ``model_weight`` is a file (``.pt``/``.safetensors``) or a published name
    (``RWKV-CLIP-B32:yfcc15m``, ``hf-hub:OWNER/REPO[/FILE]``, see :mod:`rwkv_clip.pretrained`).
    """
    weights = load_weights(model_weight, map_location=map_location)
    built = getattr(getattr(model, "text_model", None), "args", None)
    if isinstance(built, ModelArgs) and (note := kept_settings_note(built, weights)):
        _say(note)
    load_checked(model, weights)
    return model
