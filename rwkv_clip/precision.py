"""Precision: one set of names and one builder for autocast, the GradScaler and TF32,
shared by training, evaluation and the memory planner.

Names (the original's ``--precision`` choices):

* ``fp32``: no autocast;
* ``tf32``: fp32 with TF32 matmuls/convolutions on CUDA (no autocast);
* ``bf16``: bfloat16 autocast;
* ``fp16``: float16 autocast with a GradScaler (init scale 128, growth interval 200, as
  the original's trainer).

Aliases some users type (``amp`` / ``amp_bf16`` as in open_clip, ``float32``, ``32``, ...)
resolve to these names in :func:`canonical_precision`; everything else is a
:class:`~rwkv_clip.errors.PrecisionError`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

import torch

from .errors import PrecisionError

_F = TypeVar("_F", bound=Callable)

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
    """``name`` or one of its aliases -> one of :data:`PRECISIONS`."""
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


def assume_constant_result(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result``: traced calls of ``fn`` become the
    constant it returns. Written out because torch's function imports ``torch._dynamo``
    first, which took 2.4 of the 5 s that importing ``rwkv_clip`` cost every process (a
    CLI's ``--help`` or one-line error included) though nothing is compiled; the mark is
    the attribute ``torch._dynamo.assume_constant_result`` sets (a test checks that it
    still is)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


CPU_LOWP_MATMUL_ENV = "RWKV_CLIP_CPU_LOWP_MATMUL"
CPU_LOWP_MATMUL_CHOICES = ("auto", "native", "fp32")


@assume_constant_result  # traced calls read the choice made once here
def cpu_matmul_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the towers' matmuls and convolutions under CPU ``dtype`` autocast (bf16 or
    fp16) run as fp32 GEMMs on the rounded operands (see :mod:`rwkv_clip.layers.linear`).

    ``auto`` (default): on x86 CPUs without native GEMMs of that dtype (bf16: AVX512-BF16
    or AMX; fp16: AMX-FP16), where torch emulates them 20-35x slower than fp32; ``native``:
    never; ``fp32``: always. Read once per dtype from ``RWKV_CLIP_CPU_LOWP_MATMUL``
    (:func:`cpu_matmul_choice_reset` forgets the choices).
    """
    return _cpu_matmul_in_fp32(dtype)


def cpu_matmul_choice_reset() -> None:
    """Forget the choices of :func:`cpu_matmul_in_fp32` and :func:`cpu_linear_uses_onednn`
    (they are read again on next use)."""
    _cpu_matmul_in_fp32.cache_clear()
    _cpu_linear_uses_onednn.cache_clear()


def env_choice(name: str, choices: tuple[str, ...],
               error: type[Exception] = PrecisionError) -> str:
    """The environment variable ``name`` (default ``auto``), one of ``choices``; any other
    value raises ``error`` naming the variable and the choices. The CPU knobs' reader
    (this module's and :mod:`rwkv_clip.host_memory`'s)."""
    choice = os.environ.get(name, "auto").strip().lower() or "auto"
    if choice not in choices:
        raise error(f"{name}={choice!r}: expected one of {', '.join(choices)}")
    return choice


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@functools.cache
def _cpu_matmul_in_fp32(dtype: torch.dtype) -> bool:
    choice = env_choice(CPU_LOWP_MATMUL_ENV, CPU_LOWP_MATMUL_CHOICES)
    if choice != "auto":
        return choice == "fp32"
    if not _is_x86():
        return False  # other CPUs: leave torch's kernels alone
    if dtype == torch.bfloat16:
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    elif dtype == torch.float16:
        native = torch.cpu._is_amx_fp16_supported()
    else:
        return False
    return not native


CPU_LINEAR_ENV = "RWKV_CLIP_CPU_LINEAR"
CPU_LINEAR_CHOICES = ("auto", "onednn", "mkl")


@assume_constant_result
def cpu_linear_uses_onednn() -> bool:
    """Whether the towers' fp32 ``Linear`` forwards on the CPU run oneDNN's matmul
    (``torch.ops.mkldnn._linear_pointwise``) instead of torch's default (MKL's sgemm).

    ``auto`` (default): on AMD x86 CPUs, where MKL's sgemm trails oneDNN's JIT kernels on
    the B/32 towers' 640- to 3200-wide products (measured on an AVX2 EPYC, 2 threads:
    5-14% per product; B/32 inference 0.92x -> 1.03x open_clip's, training 0.97x -> 1.01x
    at batch 4); torch's default elsewhere. ``onednn`` / ``mkl`` force either. Only
    products with both weight dimensions >= 512 qualify (narrower ones were slower), and
    the backward products stay torch's. Read once from ``RWKV_CLIP_CPU_LINEAR``
    (:func:`cpu_matmul_choice_reset` forgets it). TorchScript traces keep ``aten.linear``;
    ``torch.compile`` sees the operator ``rwkv_clip::onednn_linear``.
    """
    return _cpu_linear_uses_onednn()


@functools.cache
def _cpu_linear_uses_onednn() -> bool:
    choice = env_choice(CPU_LINEAR_ENV, CPU_LINEAR_CHOICES)
    available = (torch.backends.mkldnn.is_available()
                 and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if choice == "onednn" and not available:
        raise PrecisionError(f"{CPU_LINEAR_ENV}=onednn: this torch build has no oneDNN "
                             "matmul (torch.backends.mkldnn); expected auto or mkl here")
    if choice != "auto":
        return choice == "onednn"
    return available and _is_x86() and _cpu_vendor() == "AuthenticAMD"


def _cpu_vendor() -> str:
    """The x86 vendor string (``GenuineIntel``, ``AuthenticAMD``; "" where unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def set_tf32(enabled: bool) -> None:
    """TF32 matmuls and cuDNN convolutions on CUDA (the one place that switches them)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


__all__ = ["PRECISIONS", "Precision", "get_precision", "canonical_precision", "autocast_dtype",
           "set_tf32", "cpu_matmul_in_fp32", "cpu_matmul_choice_reset", "CPU_LOWP_MATMUL_ENV",
           "cpu_linear_uses_onednn", "CPU_LINEAR_ENV",
           "SCALER_INIT_SCALE", "SCALER_GROWTH_INTERVAL"]
