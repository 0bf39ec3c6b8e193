"""The CLIP wrapper (``get_model``), the factory ``create_RWKV_Model`` and checkpoint loading.

RWKV-CLIP has no projection heads: the image feature is the mean of the final patch
tokens (or the cls token), the text feature the mean over all ``ctx_len`` positions of
the L2-normalised per-token outputs (padding included). ``forward`` returns unnormalised
features and ``logit_scale.exp()``, exactly as the original.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import lora
from .config import ModelArgs, complete_args
from .errors import CheckpointError
from .image_rwkv import Image_RWKV
from .layers.time_mix import TimeMixBase
from .text_rwkv import Text_RWKV


class get_model(nn.Module):
    """RWKV-CLIP: ``image_model`` (Image_RWKV), ``text_model`` (Text_RWKV), ``logit_scale``."""

    def __init__(self, model_image_rwkv: Image_RWKV, model_text_rwkv: Text_RWKV,
                 image_cls_token: bool = False) -> None:
        super().__init__()
        self.text_model = model_text_rwkv
        self.image_model = model_image_rwkv
        self.image_cls_token = image_cls_token
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """(B, 3, S, S) normalised images -> (B, C) image features."""
        outs = self.image_model(image)[-1]
        if self.image_cls_token:
            features = outs[1]
        else:
            features = outs.mean(dim=(2, 3))  # global average over the patch grid
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """(B, ctx_len) token ids -> (B, C): mean of the L2-normalised token features."""
        tokens = F.normalize(self.text_model(text), dim=-1)
        features = tokens.mean(dim=1)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, image: torch.Tensor, text: torch.Tensor):
        return self.encode_image(image), self.encode_text(text), self.logit_scale.exp()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in backward (the original's ``with_cp``) in both towers."""
        self.image_model.with_cp = enable
        self.text_model.args.with_cp = enable

    def set_wkv_backend(self, backend: str | None) -> None:
        """Force a WKV backend ("cuda", "cpu", "reference") or None to follow the device."""
        for module in self.modules():
            if isinstance(module, TimeMixBase):  # every WKV call sits in a time mix
                module.wkv_backend = backend


RWKVCLIP = get_model  # a descriptive alias


def build_image_tower(args: ModelArgs) -> Image_RWKV:
    # complete_args(with_image=True) has checked that every image field is set
    size, patch, dims = args.input_size, args.image_patch_size, args.image_embed_dims
    depth, heads = args.image_depth, args.image_num_heads
    assert size is not None and patch is not None and dims is not None
    assert depth is not None and heads is not None
    return Image_RWKV(img_size=size, patch_size=patch, embed_dims=dims,
                      hidden_rate=args.image_hidden_rate, depth=depth, num_heads=heads,
                      output_cls_token=args.image_output_cls_token,
                      with_cls_token=args.image_with_cls_token,
                      drop_path_rate=args.drop_path_rate, with_cp=args.with_cp)


def create_RWKV_Model(args: Any, model_weight_path: str | os.PathLike | None = None,
                      map_location: str | torch.device | None = None) -> get_model:
    """Build RWKV-CLIP from a config namespace (``load_model_configs``) and optionally load
    weights (our checkpoints or the original's, ``module.``/``_orig_mod.`` prefixes ok).

    ``args`` is validated once here into a new ``ModelArgs`` (the towers share it, and
    ``set_grad_checkpointing`` changes only that copy, never the caller's object)."""
    args = complete_args(args, source="model args")
    image_tower = build_image_tower(args)  # image first: the original's random-draw order
    text_tower = Text_RWKV(args)
    model = get_model(image_tower, text_tower, image_cls_token=args.image_output_cls_token)
    if model_weight_path is not None:
        load_model_weight(model, model_weight_path, map_location=map_location)
    return model


def strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove DDP's ``module.`` and torch.compile's ``_orig_mod.`` from every key."""
    cleaned = {}
    for key, value in state_dict.items():
        # only leading wrappers (DDP around compile or the other way round); a name such
        # as "blocks.0.module.x" inside the model keeps its "module."
        stripped = True
        while stripped:
            stripped = False
            for prefix in ("module.", "_orig_mod."):
                if key.startswith(prefix):
                    key, stripped = key[len(prefix):], True
        cleaned[key] = value
    return cleaned


def load_torch_file(path: str | os.PathLike, map_location=None) -> Any:
    """``torch.load(weights_only=True)`` whose errors name the file and say what it is: a
    missing or empty file, something that is not a ``torch.save`` file at all (garbage,
    JSON, truncated), or one that holds pickled code (refused: loading it could run it)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(8)
    if not head:
        raise CheckpointError(f"{path} is not a PyTorch checkpoint (empty file)")
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # zip / legacy pickle
        looks = "; it looks like JSON" if head.lstrip()[:1] in (b"{", b"[") else ""
        raise CheckpointError(f"{path} is not a PyTorch checkpoint (starts with {head!r}, not "
                              f"a torch.save archive{looks})")
    try:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only met a global it will not call
        detail = str(exc).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        raise CheckpointError(f"cannot read checkpoint {path}: it holds Python objects other "
                              f"than tensors and containers, which are refused because "
                              f"loading them could run code ({detail})") from None
    except Exception as exc:  # a damaged archive: truncated copy, flipped bytes...
        detail = (str(exc).splitlines() or [""])[0]
        raise CheckpointError(f"{path} is not a PyTorch checkpoint (a damaged or truncated "
                              f"torch.save archive: {type(exc).__name__}: {detail})") from None


def read_state_dict(path: str | os.PathLike, map_location=None,
                    merge_lora: bool = True) -> dict[str, torch.Tensor]:
    """Load a checkpoint file safely: ``.safetensors``, or a ``torch.save`` file read
    with ``weights_only=True`` holding a plain state dict or one of our training
    checkpoints (``{"state_dict": ...}`` / ``{"model": ...}``). The adapters of a LoRA
    training checkpoint are merged into plain weights (:mod:`rwkv_clip.lora`); with
    ``merge_lora=False`` such a checkpoint is an error."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.suffix.lower() == ".safetensors":
        return strip_prefixes(_read_safetensors(path, map_location))
    outer = obj = load_torch_file(path, map_location)
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"checkpoint {path} does not hold a state dict of tensors")
    state = strip_prefixes(obj)
    if lora.has_adapters(state):
        if not merge_lora:
            raise CheckpointError(f"checkpoint {path} holds LoRA adapters: merge them into "
                                  "plain weights (python -m rwkv_clip.export --merge-lora)")
        settings = lora.settings_from_checkpoint(outer, f"checkpoint {path}")
        state = lora.merge_state_dict(state, settings, f"checkpoint {path}")
    return state


def _read_safetensors(path: Path, map_location=None) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise CheckpointError(f"checkpoint {path}: reading .safetensors needs the safetensors "
                              "package (pip install safetensors)") from None
    device = str(map_location) if map_location is not None else "cpu"
    try:
        return load_file(str(path), device=device)
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}. "
                              "Expected a safetensors file of RWKV-CLIP's state dict") from None


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise one error listing every missing, unexpected and mis-shaped key."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
              for k, v in state_dict.items() if k in expected and v.shape != expected[k].shape]
    if not (missing or unexpected or shapes):
        return
    lines = [f"checkpoint {source} does not fit this model config:"]
    for title, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("shape mismatches", shapes)):
        if items:
            shown = ", ".join(items[:12]) + (f", ... ({len(items) - 12} more)" if len(items) > 12 else "")
            lines.append(f"  {title} ({len(items)}): {shown}")
    if any(item.startswith("image_model.pos_embed:") for item in shapes):
        lines.append("  (pos_embed differs: the config's input_size/image_patch_size do not "
                     "match the image size the weights were trained at)")
    raise CheckpointError("\n".join(lines))


def load_model_weight(model: nn.Module, model_weight: str | os.PathLike,
                      map_location=None) -> nn.Module:
    """Load weights strictly; values land on the model's device, in its dtypes.

    ``model_weight`` is a file (``.pt``/``.safetensors``) or a published name
    (``RWKV-CLIP-B32:yfcc15m``, ``hf-hub:OWNER/REPO[/FILE]``, see :mod:`rwkv_clip.pretrained`).
    """
    from .pretrained import resolve_pretrained

    weights = resolve_pretrained(model_weight)
    state_dict = read_state_dict(weights.path, map_location=map_location)
    check_state_dict(model, state_dict, weights.label)
    model.load_state_dict(state_dict, strict=True)
    return model
