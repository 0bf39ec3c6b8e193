"""Checkpoint files: reading a state dict safely (``torch.save`` archives with
``weights_only=True``, ``.safetensors``), the DDP / torch.compile wrappers around modules and
keys, and the strict check of a state dict against a model."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import lora
from .errors import CheckpointError, ConfigError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and torch.compile's


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model under DDP / DataParallel (``.module``) and torch.compile
    (``._orig_mod``) wrappers, in any order."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, (nn.parallel.DistributedDataParallel,
                                                nn.DataParallel)):
            inner = model.module
        if inner is None:
            return model
        model = inner


def strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove DDP's ``module.`` and torch.compile's ``_orig_mod.`` from every key."""
    cleaned = {}
    for key, value in state_dict.items():
        # only leading wrappers (DDP around compile or the other way round); a name such
        # as "blocks.0.module.x" inside the model keeps its "module."
        stripped = True
        while stripped:
            stripped = False
            for prefix in WRAPPER_PREFIXES:
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
    return read_checkpoint(path, map_location, merge_lora).tensors


def read_checkpoint(path: str | os.PathLike, map_location=None, merge_lora: bool = True,
                    label: str | None = None) -> StateDict:
    """:func:`read_state_dict`'s weights with what the file says of their training: the
    model settings (:func:`saved_model_settings`) and the run's arguments. ``label``
    names the weights in messages (default: the path)."""
    path = Path(path)
    label = label or str(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.suffix.lower() == ".safetensors":
        tensors, metadata = _read_safetensors(path, map_location)
        return StateDict(strip_prefixes(tensors), label,
                         settings=safetensors_settings(metadata, f"checkpoint {path}"))
    outer = obj = load_torch_file(path, map_location)
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"checkpoint {path} does not hold a state dict of tensors")
    state = strip_prefixes(obj)
    run_args = saved_run_args(outer)
    if lora.has_adapters(state):
        if not merge_lora:
            raise CheckpointError(f"checkpoint {path} holds LoRA adapters: merge them into "
                                  "plain weights (python -m rwkv_clip.export --merge-lora)")
        settings = lora.settings_from_args(run_args, f"checkpoint {path}")
        state = lora.merge_state_dict(state, settings, f"checkpoint {path}")
    return StateDict(state, label, settings=saved_model_settings(outer, f"checkpoint {path}"),
                     run_args=run_args)


def saved_run_args(obj: Any) -> dict[str, Any] | None:
    """The training arguments a training checkpoint of ours holds (``train.py``'s
    namespace as a dict, under ``"args"``); None for a bare state dict."""
    args = obj.get("args") if isinstance(obj, dict) else None
    return args if isinstance(args, dict) else None


def saved_model_settings(obj: Any, source: str) -> dict[str, Any] | None:
    """The model settings (:data:`rwkv_clip.config.MODEL_KEYS`) a training checkpoint was
    trained with: its ``"model_config"``, else the config keys of its ``"args"``; None for
    a bare state dict. A key that is no config key in ``"model_config"``, or a value of the
    wrong type or range, is an error naming it: nothing is dropped unsaid."""
    from .config import MODEL_KEYS, check_fields

    if not isinstance(obj, dict):
        return None
    config, args = obj.get("model_config"), saved_run_args(obj)
    if isinstance(config, dict):
        params, where = dict(config), "saved model_config"
    elif args is not None:
        params = {k: v for k, v in args.items() if k in MODEL_KEYS and v is not None}
        where = "saved args"
    else:
        return None
    try:
        checked = check_fields(params, f"{source}'s {where}")
    except ConfigError as exc:
        raise CheckpointError(f"{exc} (the model settings it was trained with)") from None
    settings = {k: v for k, v in checked.items() if k in MODEL_KEYS}
    return settings or None


SETTINGS_METADATA_KEY = "rwkv_clip.model_settings"  # a .safetensors header's metadata


def safetensors_settings(metadata: dict[str, str] | None, source: str) -> dict[str, Any] | None:
    """The model settings an exported ``.safetensors`` records in its header (JSON under
    :data:`SETTINGS_METADATA_KEY`); None when it records none."""
    text = (metadata or {}).get(SETTINGS_METADATA_KEY)
    if text is None:
        return None
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{source}: its {SETTINGS_METADATA_KEY} metadata is not JSON "
                              f"({exc})") from None
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: its {SETTINGS_METADATA_KEY} metadata is not a JSON "
                              "object of model settings")
    return saved_model_settings({"model_config": params}, source)


def _read_safetensors(path: Path, map_location=None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """The tensors of a ``.safetensors`` file and its header's metadata."""
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file
    except ImportError:
        raise CheckpointError(f"checkpoint {path}: reading .safetensors needs the safetensors "
                              "package (pip install safetensors)") from None
    device = str(map_location) if map_location is not None else "cpu"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        return load_file(str(path), device=device), metadata
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}. "
                              "Expected a safetensors file of RWKV-CLIP's state dict") from None


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str,
                     hint: Callable[[], str] | None = None) -> None:
    """Raise one error listing every missing, unexpected and mis-shaped key; ``hint`` (called
    only on a mismatch) adds the fix to its first line.

    Weights of a SigLIP-trained model (with ``logit_bias``) give a model without one that
    parameter first, so every loader takes CLIP and SigLIP checkpoints alike."""
    if "logit_bias" in state_dict and getattr(model, "logit_bias", False) is None:
        model.set_logit_bias(0.0)  # type: ignore[operator]
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
              for k, v in state_dict.items() if k in expected and v.shape != expected[k].shape]
    if not (missing or unexpected or shapes):
        return
    hint_text = hint() if hint is not None else ""
    lines = [f"checkpoint {source} does not fit this model config{hint_text}"]
    for title, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("shape mismatches", shapes)):
        if items:
            shown = ", ".join(items[:12]) + (f", ... ({len(items) - 12} more)" if len(items) > 12 else "")
            lines.append(f"  {title} ({len(items)}): {shown}")
    if any(item.startswith("image_model.pos_embed:") for item in shapes):
        lines.append("  (pos_embed differs: the config's input_size/image_patch_size do not "
                     "match the image size the weights were trained at)")
    raise CheckpointError("\n".join(lines))


@dataclass(frozen=True)
class StateDict:
    """A state dict read from a checkpoint and where it came from (for messages)."""

    tensors: dict[str, torch.Tensor]
    label: str
    config: str | None = None  # the shipped config it was published for, if known
    # the model settings it was trained with (config keys), if the file records them
    settings: dict[str, Any] | None = None
    run_args: dict[str, Any] | None = None  # a training checkpoint's train.py arguments


POS_EMBED_KEY = "image_model.pos_embed"


def fit_image_size(model: nn.Module, tensors: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """``tensors`` with a ``pos_embed`` of another (square) patch grid than ``model``'s
    resized to the model's grid, bicubic as the image tower resizes it for other input
    sizes (and as open_clip loads weights at a ``--force-image-size``); the same values
    the original computes in its forward from the checkpoint's grid. Unchanged otherwise."""
    image = getattr(model, "image_model", None)
    src = tensors.get(POS_EMBED_KEY)
    dst = getattr(image, "pos_embed", None)
    if src is None or not isinstance(dst, torch.Tensor) or src.shape == dst.shape \
            or src.dim() != 3 or src.shape[-1] != dst.shape[-1]:
        return tensors
    from .layers.pos_embed import fit_pos_embed
    resized = fit_pos_embed(src, tuple(image.patch_resolution),  # type: ignore[union-attr]
                            image.interpolate_mode,  # type: ignore[union-attr]
                            image.num_extra_tokens)  # type: ignore[union-attr]
    return tensors if resized is None else {**tensors, POS_EMBED_KEY: resized}


def load_checked(model: nn.Module, weights: StateDict,
                 hint: Callable[[], str] | None = None) -> nn.Module:
    """Check ``weights`` against ``model`` (one error listing every difference) and load
    them strictly; values land on the model's device, in its dtypes. A ``pos_embed``
    trained at another image size is resized to the model's (:func:`fit_image_size`)."""
    tensors = fit_image_size(model, weights.tensors)
    check_state_dict(model, tensors, weights.label, hint)
    model.load_state_dict(tensors, strict=True)
    return model


DDP_PREFIX = "module."


def save_state_dict(state: dict[str, torch.Tensor], out: str | os.PathLike,
                    ddp_prefix: bool = False,
                    settings: dict[str, Any] | None = None) -> str:
    """Write ``state`` to ``out`` (``.safetensors`` or a ``torch.save`` file); returns
    the file's sha256. A ``.safetensors`` records ``settings`` (model config keys) in its
    header, where :func:`read_checkpoint` finds them; a ``.pt`` holds the bare state dict
    the original's loader expects."""
    out = Path(out)
    if ddp_prefix:
        state = {DDP_PREFIX + k: v for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix.lower() == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError("writing .safetensors needs the safetensors package "
                                  "(pip install safetensors)") from None
        # safetensors refuses tensors that share storage: give each its own
        metadata = {"format": "pt"}
        if settings:
            metadata[SETTINGS_METADATA_KEY] = json.dumps(settings)
        save_file({k: v.clone() for k, v in state.items()}, str(tmp), metadata=metadata)
        # safetensors writes its file 0600; a file to publish gets a new file's usual mode
        # (0644 under the common umask 022), as torch.save's .pt does
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
    else:
        torch.save(state, tmp)
    os.replace(tmp, out)
    return file_sha256(out)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
