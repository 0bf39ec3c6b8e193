"""Precision: one set of names and one builder for autocast, the GradScaler and TF32,
shared by training, evaluation and the memory planner.

Names are the original's ``--precision`` choices (:data:`PRECISIONS`); aliases resolve in
:func:`canonical_precision`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .errors import PrecisionError

# The original's --precision choices: fp32 (no autocast), tf32 (fp32 with TF32
# matmuls/convolutions on CUDA, no autocast), bf16 (bfloat16 autocast), fp16 (float16
# autocast with a GradScaler).
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16", "amp_bf16": "bf16", "amp_bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "16": "fp16", "half": "fp16", "amp": "fp16",
}

# The original's fp16 GradScaler settings (train.py: GradScaler(init_scale=128,
# growth_interval=200)).
SCALER_INIT_SCALE = 128.0
SCALER_GROWTH_INTERVAL = 200


def canonical_precision(name: str) -> str:
    """``name`` or one of its aliases (``amp`` / ``amp_bf16`` as in open_clip, ``float32``,
    ``32``, ...) -> one of :data:`PRECISIONS`; anything else is a
    :class:`~rwkv_clip.errors.PrecisionError`."""
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise PrecisionError(f"precision {name!r}: expected one of {', '.join(PRECISIONS)}")
    return _ALIASES[key]


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(canonical_precision(precision))


@dataclass(frozen=True)
class Precision:
    """Everything a precision name implies, for one device.

    ``autocast()`` returns a fresh context manager each call (a null context for fp32 and
    tf32); ``scaler()`` a new GradScaler for fp16 and None otherwise.
    """

    name: str
    device_type: str

    @property
    def dtype(self) -> torch.dtype | None:
        return autocast_dtype(self.name)

    @property
    def uses_autocast(self) -> bool:
        return self.dtype is not None

    def autocast(self) -> AbstractContextManager:
        dtype = self.dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    @property
    def autocast_factory(self) -> Callable[[], AbstractContextManager]:
        """A no-argument callable returning the autocast context (for step functions)."""
        return self.autocast

    def scaler(self) -> torch.amp.GradScaler | None:
        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(self.device_type, init_scale=SCALER_INIT_SCALE,
                                    growth_interval=SCALER_GROWTH_INTERVAL)


def get_precision(name: str, device: torch.device | str) -> Precision:
    """The :class:`Precision` for ``name`` on ``device``; tf32 on CUDA turns TF32 on (other
    names leave torch's switches as they are)."""
    device_type = torch.device(device).type
    canonical = canonical_precision(name)
    if canonical == "tf32" and device_type == "cuda":
        set_tf32(True)
    return Precision(canonical, device_type)


def set_tf32(enabled: bool) -> None:
    """TF32 matmuls and cuDNN convolutions on CUDA (the one place that switches them)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


__all__ = ["PRECISIONS", "Precision", "get_precision", "canonical_precision", "autocast_dtype",
           "set_tf32", "SCALER_INIT_SCALE", "SCALER_GROWTH_INTERVAL"]
