"""The CPU GEMM policy of the towers' matrix products (:mod:`rwkv_clip.ops.products`):
whether low-precision autocast products run as fp32 GEMMs on rounded operands, and whether
fp32 ``Linear`` forwards run oneDNN's matmul. Each is a switch of the dispatch table
(:class:`rwkv_clip.ops.dispatch.Switch`): a rule on the CPU chooses (``auto``) unless
``$RWKV_CLIP_DISPATCH`` or :func:`rwkv_clip.ops.dispatch.pin` names a choice
(``lowp_matmul=native|fp32``, ``linear=onednn|mkl``)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from .cpu_isa import cpu_info, native_lowp_gemm
from .errors import PrecisionError
from .ops import dispatch

_F = TypeVar("_F", bound=Callable)


def assume_constant_result(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result``: traced calls of ``fn`` become the
    constant it returns. Written out because torch's function imports ``torch._dynamo``,
    a large part of the import time of every process though nothing is compiled; the mark
    is the attribute ``torch._dynamo.assume_constant_result`` sets (a test checks that it
    still is)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


LOWP_MATMUL = dispatch.register_switch(dispatch.Switch("lowp_matmul", ("native", "fp32")))
LINEAR = dispatch.register_switch(dispatch.Switch("linear", ("onednn", "mkl")))


@assume_constant_result  # traced calls read the choice made here
def cpu_matmul_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the towers' matmuls and convolutions under CPU ``dtype`` autocast (bf16 or
    fp16) run as fp32 GEMMs on the rounded operands (see :mod:`rwkv_clip.ops.products`).

    The switch ``lowp_matmul``: ``auto`` (default): on x86 CPUs without native GEMMs of
    that dtype (bf16: AVX512-BF16 or AMX; fp16: AMX-FP16;
    :func:`rwkv_clip.cpu_isa.native_lowp_gemm`, so capped by ``ONEDNN_MAX_CPU_ISA``), where
    torch emulates them many times slower than fp32; ``native``: never; ``fp32``: always.
    The rule's answer is kept per dtype (:func:`cpu_matmul_choice_reset` forgets it).
    """
    return _cpu_matmul_in_fp32(dtype, dispatch.pinned(LOWP_MATMUL.name))


def cpu_matmul_choice_reset() -> None:
    """Forget the answers of :func:`cpu_matmul_in_fp32` and :func:`cpu_linear_uses_onednn`
    (the CPU is read again on next use)."""
    _cpu_matmul_in_fp32.cache_clear()
    _cpu_linear_uses_onednn.cache_clear()


@functools.cache
def _cpu_matmul_in_fp32(dtype: torch.dtype, pinned: str | None) -> bool:
    if pinned is not None:
        in_fp32 = pinned == "fp32"
    elif not cpu_info().x86:
        in_fp32 = False  # other CPUs: leave torch's kernels alone
    elif dtype in (torch.bfloat16, torch.float16):
        in_fp32 = not native_lowp_gemm("bf16" if dtype == torch.bfloat16 else "fp16")
    else:
        in_fp32 = False
    dispatch.record_switch(LOWP_MATMUL.name, "fp32" if in_fp32 else "native", dtype,
                           "pinned" if pinned else "rule", "autocast products")
    return in_fp32


@assume_constant_result
def cpu_linear_uses_onednn() -> bool:
    """Whether the towers' fp32 ``Linear`` forwards on the CPU run oneDNN's matmul
    (``torch.ops.mkldnn._linear_pointwise``) instead of torch's default (MKL's sgemm).

    The switch ``linear``: ``auto`` (default): on AMD x86 CPUs, where MKL's sgemm trails
    oneDNN's JIT kernels on the towers' wide products (see docs/performance.md); torch's
    default elsewhere. ``onednn`` / ``mkl`` force either. Only products with both weight
    dimensions >= 512 qualify (narrower ones are slower); of the backward products, the
    input gradient's is oneDNN's too in eager mode, the weight gradient's torch's. The
    rule's answer is kept (:func:`cpu_matmul_choice_reset` forgets it). TorchScript traces
    keep ``aten.linear``; ``torch.compile`` sees the operator ``rwkv_clip::onednn_linear``.
    """
    return _cpu_linear_uses_onednn(dispatch.pinned(LINEAR.name))


@functools.cache
def _cpu_linear_uses_onednn(pinned: str | None) -> bool:
    available = (torch.backends.mkldnn.is_available()
                 and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if pinned == "onednn" and not available:
        raise PrecisionError(f"{dispatch.OVERRIDE_ENV_VAR} or pin linear=onednn: this torch "
                             "build has no oneDNN matmul (torch.backends.mkldnn); expected "
                             "auto or mkl here")
    if pinned is not None:
        onednn = pinned == "onednn"
    else:
        info = cpu_info()
        onednn = available and info.x86 and info.vendor == "AuthenticAMD"
    dispatch.record_switch(LINEAR.name, "onednn" if onednn else "mkl", torch.float32,
                           "pinned" if pinned else "rule", "both widths >= 512")
    return onednn


__all__ = ["cpu_matmul_in_fp32", "cpu_matmul_choice_reset", "cpu_linear_uses_onednn",
           "assume_constant_result", "LINEAR", "LOWP_MATMUL"]
