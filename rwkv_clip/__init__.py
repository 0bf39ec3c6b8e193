"""RWKV-CLIP: CLIP with bidirectional RWKV-6 image and text towers (notebook use: README.md).

Importing this package compiles nothing, reads no environment variables, starts no
process group and imports no torch: the public names load their modules on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ModelArgs, load_model_configs
    from .errors import CheckpointError, ConfigError
    from .factory import create_model_and_transforms, get_tokenizer
    from .image_rwkv import Image_RWKV
    from .layers import DropPath
    from .loss import ClipLoss
    from .model import create_RWKV_Model, get_model, load_model_weight
    from .ops import wkv6_bidirectional
    from .pretrained import list_pretrained
    from .text_rwkv import Text_RWKV
    from .tokenizer import tokenize
    from .transform import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, image_transform
    from .zero_shot_classifier import build_zero_shot_classifier, classify

__version__ = "0.1.0"

# Public name -> the module defining it, imported on first use: importing the package pulls
# in no torch, so torch-free modules (rwkv_clip.onnx: onnxruntime and numpy) stand alone.
_EXPORTS = {
    "ConfigError": "errors", "CheckpointError": "errors",
    "ModelArgs": "config", "load_model_configs": "config",
    "Image_RWKV": "image_rwkv", "DropPath": "layers", "ClipLoss": "loss",
    "create_RWKV_Model": "model",
    "get_model": "model", "load_model_weight": "model", "wkv6_bidirectional": "ops",
    "create_model_and_transforms": "factory", "get_tokenizer": "factory",
    "list_pretrained": "pretrained", "Text_RWKV": "text_rwkv", "tokenize": "tokenizer",
    "OPENAI_DATASET_MEAN": "transform", "OPENAI_DATASET_STD": "transform",
    "image_transform": "transform", "build_zero_shot_classifier": "zero_shot_classifier",
    "classify": "zero_shot_classifier",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    try:  # a submodule as an attribute (rwkv_clip.ops, ...), as after an eager import
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["load_model_configs", "create_RWKV_Model", "get_model", "Image_RWKV",
           "Text_RWKV", "DropPath", "ClipLoss", "tokenize", "image_transform",
           "load_model_weight", "wkv6_bidirectional", "ConfigError", "CheckpointError",
           "ModelArgs", "OPENAI_DATASET_MEAN", "OPENAI_DATASET_STD", "list_pretrained",
           "create_model_and_transforms", "get_tokenizer", "build_zero_shot_classifier",
           "classify", "__version__"]
