"""The towers' elementwise glue as ops of the dispatch table (:mod:`rwkv_clip.ops.dispatch`):
the token shift with its lerps, the head norm with the gate, the squared ReLU.

Each op has its plain-PyTorch reference (:mod:`.reference`), an implementation that keeps
autograd's work down in eager mode (the CPU's numerics), and a Triton kernel pair
registered as a ``torch.library`` custom op with its fake and autograd (CUDA; CPU tensors
under Triton's interpreter, ``TRITON_INTERPRET=1``). The table checks each against the
reference and times the survivors where they run (docs/glue.md).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from .. import dispatch
from ..head_norm import head_norm_gate_layer_norm
from ..lerp import lerp_split
from ..relu_square import relu_square as relu_square_short_backward
from ..shift import shift_tokens
from .reference import (
    SHIFT_KINDS,
    Shift,
    head_norm_gate_reference,
    relu_square_reference,
    shift_lerp_reference,
    shift_reference,
)

_TRITON_DTYPES = (torch.float32, torch.bfloat16)
# relative to max |reference| (dispatch.check): float64 arithmetic, float32 arithmetic,
# one rounding of a bf16 / fp16 result (the interpreter truncates: up to a step of the peak)
GLUE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3,
                  torch.bfloat16: 1.6e-2}


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_supports(device: torch.device, dtype: torch.dtype, shape) -> str | None:
    if not triton_importable():
        return "needs Triton, which is not installed"
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        return f"needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {device}"
    if dtype not in _TRITON_DTYPES or shape.get("out", "float32") not in ("float32", "bfloat16"):
        return f"takes float32 and bfloat16, not {dtype}"
    return None


def _any_float(device: torch.device, dtype: torch.dtype, shape) -> str | None:
    return None if dtype.is_floating_point else f"takes floating dtypes, not {dtype}"


def _cpu_float(device: torch.device, dtype: torch.dtype, shape) -> str | None:
    if device.type != "cpu":
        return f"needs CPU tensors, got {device}"
    if dtype not in (torch.float32, torch.float64) or shape.get("params") != dispatch.dtype_name(dtype):
        return f"takes float32 / float64 inputs and parameters, not {dtype}"
    return None


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _glue_op(name: str, reference, check_inputs, shape_class, triton,
             eager: dispatch.Implementation, on_export: str) -> dispatch.Op:
    """Register a glue op with its three implementations: the Triton kernels, the eager
    one (``eager``) and the reference, a contender too (plain torch ops may win)."""
    op = dispatch.register_op(dispatch.Op(
        name=name, reference=reference, check_inputs=check_inputs, tolerance=GLUE_TOLERANCE,
        shape_class=shape_class, error=ConfigError, on_export=on_export,
        reference_competes=True))
    op.register(dispatch.Implementation("triton", triton, _triton_supports, ("cuda",),
                                        takes_float64=False))
    op.register(eager)
    op.register(dispatch.Implementation("reference", reference, _any_float,
                                        ("cpu", "cuda", "mps", "xpu")))
    return op


# ----------------------------------------------------------------------- shift_lerp
def _shift_lerp_shape(x: Tensor, weight: Tensor, shift: Shift, shifted_first: bool = False):
    return {"kind": shift.kind, "S": int(weight.shape[0]), "full": int(weight.shape[1] != 1),
            "T": int(x.shape[1]), "C": int(x.shape[2])}


def _shift_lerp_check_inputs(device, dtype, attrs, shape):
    """x (2, T, 16) for a small shift of the call's kind (a 3 x 4 grid), a weight of the
    call's stack and layout, some weights past [0, 1] (both of lerp's branches)."""
    call: Shift = attrs["shift"]
    small = Shift("q", 4, 1, (3, 4), call.cls) if call.kind == "q" else Shift("sequence", 4, 1)
    T = 12 + int(call.cls) if call.kind == "q" else 7
    g = _generator()
    x = torch.randn(2, T, 16, generator=g)
    S = int(shape.get("S", 2))
    rows = (2, T) if shape.get("full") else (1, 1)
    weight = torch.rand(S, *rows, 16, generator=g) * 1.4 - 0.2
    return ([x.to(device, dtype), weight.to(device, dtype)],
            {"shift": small, "shifted_first": bool(attrs.get("shifted_first", False))})


def _shift_lerp_reference(x, weight, shift: Shift, shifted_first: bool = False
                          ) -> tuple[Tensor, ...]:
    return shift_lerp_reference(x, weight, shift, shifted_first).unbind(0)


def _shift_lerp_copies(x, weight, shift: Shift, shifted_first: bool = False):
    shifted = shift_tokens(x, shift)
    return lerp_split(shifted, x, weight) if shifted_first else lerp_split(x, shifted, weight)


def _shift_lerp_triton(x, weight, shift: Shift, shifted_first: bool = False):
    from .shift_lerp_kernel import shift_lerp_op
    return shift_lerp_op(x.contiguous(), weight.contiguous(), shift.kind, shift.head_dim,
                         shift.pixels, shift.grid[0], shift.grid[1], shift.cls,
                         shifted_first).unbind(0)


SHIFT_LERP = _glue_op(
    "shift_lerp", _shift_lerp_reference, _shift_lerp_check_inputs, _shift_lerp_shape,
    _shift_lerp_triton, dispatch.Implementation("copies", _shift_lerp_copies, _any_float,
                                                ("cpu", "cuda")), on_export="copies")


def shift_lerp(x: Tensor, weight: Tensor, shift: Shift,
               shifted_first: bool = False) -> tuple[Tensor, ...]:
    """The S mixes ``lerp(x, shift(x), weight[s])`` (``shifted_first``: ``lerp(shift(x),
    x, weight[s])``) for x (B, T, C) and a stacked weight (S, 1, 1, C) or (S, B, T, C) in
    x's dtype, by the table's ``shift_lerp`` op."""
    shift.check(x)
    attrs = {"shift": shift, "shifted_first": shifted_first}
    mixes: tuple[Tensor, ...] = dispatch.choose("shift_lerp", (x, weight), attrs=attrs).fn(
        x, weight, **attrs)
    return mixes


# ------------------------------------------------------------------- head_norm_gate
def _head_norm_gate_shape(y, weight, bias, gate, n_head: int, eps: float):
    return {"H": int(n_head), "C": int(y.shape[-1]), "params": dispatch.dtype_name(weight.dtype),
            "out": dispatch.dtype_name(gate.dtype)}


def _head_norm_gate_check_inputs(device, dtype, attrs, shape):
    """y (2, 3, 2 x 16) around the WKV output's scale, parameters in y's dtype, the gate
    in the call's gate dtype where it is lower (float64 checks: y's)."""
    g = _generator()
    y = torch.randn(2, 3, 32, generator=g) * 3 + 1
    weight, bias = torch.rand(32, generator=g) + 0.5, torch.randn(32, generator=g)
    gate = torch.randn(2, 3, 32, generator=g)
    out = getattr(torch, str(shape.get("out", "float32")))
    gate_dtype = dtype if dtype == torch.float64 else out
    return ([y.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype),
             gate.to(device, gate_dtype)], {"n_head": 2, "eps": float(attrs.get("eps", 1e-5))})


def _head_norm_gate_triton(y, weight, bias, gate, n_head: int, eps: float):
    from .head_norm_gate_kernel import head_norm_gate_op
    return head_norm_gate_op(y.contiguous(), weight, bias, gate.contiguous(), n_head, eps)


HEAD_NORM_GATE = _glue_op(
    "head_norm_gate", head_norm_gate_reference, _head_norm_gate_check_inputs,
    _head_norm_gate_shape, _head_norm_gate_triton,
    dispatch.Implementation("layer-norm", head_norm_gate_layer_norm, _cpu_float, ("cpu",)),
    on_export="reference")


def head_norm_gate(y: Tensor, weight: Tensor, bias: Tensor, gate: Tensor, n_head: int,
                   eps: float) -> Tensor:
    """``group_norm(y, n_head, weight, bias, eps).to(gate.dtype) * silu(gate)`` for the
    WKV output y (B, T, C), by the table's ``head_norm_gate`` op."""
    attrs = {"n_head": n_head, "eps": eps}
    return dispatch.choose("head_norm_gate", (y, weight, bias, gate),
                           attrs=attrs).fn(y, weight, bias, gate, **attrs)


# ---------------------------------------------------------------------- relu_square
def _relu_square_shape(x: Tensor, inplace: bool = False):
    return {"C": int(x.shape[-1])}


def _relu_square_check_inputs(device, dtype, attrs, shape):
    x = torch.randn(3, 40, generator=_generator())
    x[0, :5] = 0  # relu's kink
    return [x.to(device, dtype)], {"inplace": False}


def _relu_square_reference(x: Tensor, inplace: bool = False) -> Tensor:
    return relu_square_reference(x)


def _relu_square_triton(x: Tensor, inplace: bool = False) -> Tensor:
    from .relu_square_kernel import relu_square_op
    return relu_square_op(x)


RELU_SQUARE = _glue_op(
    "relu_square", _relu_square_reference, _relu_square_check_inputs, _relu_square_shape,
    _relu_square_triton, dispatch.Implementation("short-backward", relu_square_short_backward,
                                                 _any_float, ("cpu", "cuda")),
    on_export="reference")


def relu_square(x: Tensor, inplace: bool = False) -> Tensor:
    """``square(relu(x))`` in x's dtype, by the table's ``relu_square`` op; ``inplace``: x
    is the caller's scratch, which an implementation may overwrite where nothing needs
    its gradient."""
    return dispatch.choose("relu_square", (x,), attrs={"inplace": inplace}).fn(x, inplace=inplace)


def uses_triton(x: Tensor) -> bool:
    """Whether the Triton kernels can run for x at all: CUDA tensors (or the interpreter),
    Triton present. The table decides whether they do."""
    return _triton_supports(x.device, x.dtype, {}) is None


__all__: list[Any] = [
    "GLUE_TOLERANCE", "HEAD_NORM_GATE", "RELU_SQUARE", "SHIFT_KINDS", "SHIFT_LERP", "Shift",
    "head_norm_gate", "head_norm_gate_reference", "relu_square", "relu_square_reference",
    "shift_lerp", "shift_lerp_reference", "shift_reference", "triton_importable", "uses_triton"]
