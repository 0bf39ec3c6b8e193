"""The towers' matrix products: ``linear``, ``matmul`` and ``conv2d``.

Exactly ``F.linear``, ``a @ b`` and ``F.conv2d``, except on CPUs, where two ops of the
dispatch table choose (docs/differences.md): ``lowp_matmul``, whether bf16/fp16 autocast
products run autocast's arithmetic on the fp32 GEMM (:func:`cpu_matmul_in_fp32`), and
``linear``, whether an fp32 ``Linear`` runs torch's GEMM (``aten``) or oneDNN's matmul
(``onednn``), per product shape and pass.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from ..errors import DispatchError
from . import dispatch

_F = TypeVar("_F", bound=Callable)
LOWP_DTYPES = (torch.bfloat16, torch.float16)


def assume_constant_result(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result``: traced calls of ``fn`` become the
    constant it returns. Written out because torch's function imports ``torch._dynamo``,
    a large part of the import time of every process though nothing is compiled; the mark
    is the attribute ``torch._dynamo.assume_constant_result`` sets (a test checks that it
    still is)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# dtype -> (the table's generation it was decided in, fp32 or not)
_decided: dict[torch.dtype, tuple[int, bool]] = {}
# the product that decides when the caller names none: the towers' typical width
DEFAULT_PRODUCT = (256, 512, 512)


@assume_constant_result  # traced calls read the choice made here
def cpu_matmul_in_fp32(dtype: torch.dtype, product: tuple[int, int, int] | None = None) -> bool:
    """Whether the towers' matmuls and convolutions under CPU ``dtype`` autocast (bf16 or
    fp16) run as fp32 GEMMs on the rounded operands (see :mod:`rwkv_clip.ops.products`):
    the table's ``lowp_matmul`` choice for ``dtype`` (``fp32`` against ``native``, torch's
    own low-precision GEMM, many times slower where the CPU has no native GEMM of that
    dtype). Decided on the first call per dtype, timed at ``product`` (M, K, N: the
    caller's GEMM; default :data:`DEFAULT_PRODUCT`), and kept until the table's choices
    change (a pin, :func:`rwkv_clip.ops.dispatch.reset`). Other dtypes: False."""
    if dtype not in LOWP_DTYPES:
        return False
    known = _decided.get(dtype)
    if known is not None and known[0] == dispatch.generation:
        return known[1]
    m, k, n = product or DEFAULT_PRODUCT
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype)
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        in_fp32 = dispatch.choose("lowp_matmul", (a, b)).name == "fp32"
    _decided[dtype] = (dispatch.generation, in_fp32)
    return in_fp32


def _upcast_dtype(t: torch.Tensor, product: tuple[int, int, int]) -> torch.dtype | None:
    """The autocast dtype when products on t's device are to be computed in fp32
    (``product``: this GEMM's M, K, N, the size the first one per dtype is timed at)."""
    if t.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return None
    dtype = torch.get_autocast_dtype("cpu")
    if dtype not in LOWP_DTYPES or not cpu_matmul_in_fp32(dtype, product):
        return None
    return dtype


def _gemm_size(a: torch.Tensor, k: int, n: int) -> tuple[int, int, int]:
    return (a.numel() // max(a.shape[-1], 1), k, n)


class _UpcastMatmul(torch.autograd.Function):
    """``a @ b (+ bias)`` of low-precision operands through the fp32 GEMM.

    a: (..., M, K); b: (K, N), or (G, K, N) with a (G, M, K); bias: broadcasting to the
    product, or None. The output and every gradient have their operand's dtype (the low
    precision).
    """

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.bias_shape = None if bias is None else bias.shape
        with torch.autocast("cpu", enabled=False):
            out = torch.matmul(a.float(), b.float())
            if bias is not None:
                out += bias.float()
            return out.to(a.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_a = grad_b = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            g = grad.float()
            if ctx.needs_input_grad[0]:
                grad_a = torch.matmul(g, b.float().mT).to(a.dtype)
            if ctx.needs_input_grad[1]:
                if b.dim() == 2:  # sum over every leading dimension of a
                    gb = a.reshape(-1, a.shape[-1]).float().t() @ g.reshape(-1, g.shape[-1])
                else:
                    gb = torch.matmul(a.float().mT, g)
                grad_b = gb.to(b.dtype)
            if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
                grad_bias = g.sum_to_size(ctx.bias_shape).to(a.dtype)
        return grad_a, grad_b, grad_bias


def matmul(a: torch.Tensor, b: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (b 2-D, or batched as ``torch.bmm``), plus ``add`` (broadcasting to the
    product) where given, in the GEMM's own pass (``addmm`` / ``baddbmm``). Under CPU
    bf16/fp16 autocast where :func:`cpu_matmul_in_fp32` says so (once per
    dtype), the operands are rounded as autocast would, multiplied by the fp32 GEMM and the
    result rounded back (docs/differences.md)."""
    dtype = _upcast_dtype(a, _gemm_size(a, b.shape[-2], b.shape[-1]))
    if dtype is None:
        if add is None:
            return torch.matmul(a, b)
        if a.dim() == 3 and b.dim() == 3:
            return torch.baddbmm(add, a, b)
        if a.dim() == 2 and b.dim() == 2:
            return torch.addmm(add, a, b)
        return torch.matmul(a, b) + add
    return _UpcastMatmul.apply(a.to(dtype), b.to(dtype), None if add is None else add.to(dtype))


# An operator (torch.library), so that torch.compile keeps it as one opaque call: inductor
# would otherwise see aten.linear and run MKL's sgemm (its own lowering of the oneDNN op
# needs frozen weights). In the backward the input gradient's product is oneDNN's too in
# eager mode, the other products torch's (visible to the compiler); the saved tensors are
# F.linear's.
@torch.library.custom_op("rwkv_clip::onednn_linear", mutates_args=(), device_types="cpu")
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``F.linear`` computed by oneDNN's matmul."""
    return _onednn_matmul(x, weight, bias)


def _onednn_matmul(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_onednn_linear.register_fake
def _onednn_linear_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _onednn_linear_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _onednn_linear_backward(ctx: Any, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        # g @ weight: oneDNN too (as a linear with the transposed weight) in eager mode,
        # where it beats MKL's sgemm as in the forward; compiled graphs keep the mm
        grad_x = (g @ weight if torch.compiler.is_compiling()
                  else _onednn_matmul(g, weight.t(), None)).view(x.shape)
    if ctx.needs_input_grad[1]:
        grad_w = g.t() @ x.reshape(-1, x.shape[-1])
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g.sum(0)
    return grad_x, grad_w, grad_b


_onednn_linear.register_autograd(_onednn_linear_backward, setup_context=_onednn_linear_setup)


def _linear_reference(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _linear_aten(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's ``F.linear`` (on x86 CPUs MKL's sgemm); its own function, not the
    reference's, so that it is the default where nothing was timed (``torch.compile``)."""
    return F.linear(x, weight, bias)


def _linear_onednn(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # eager inference: the kernel itself, without the operator's Python dispatch
        return _onednn_matmul(x, weight, bias)
    return _onednn_linear(x, weight, bias)


def _onednn_supports(device: torch.device, dtype: torch.dtype, shape) -> str | None:
    if device.type != "cpu" or dtype != torch.float32:
        return f"runs float32 on the CPU, not {dtype} on {device}"
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN matmul (torch.backends.mkldnn)"
    return None


def _aten_supports(device: torch.device, dtype: torch.dtype, shape) -> str | None:
    return None if dtype.is_floating_point else f"takes floating dtypes, not {dtype}"


def _linear_check_inputs(device, dtype, attrs, shape):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 64, generator=g), torch.randn(48, 64, generator=g) / 8, \
        torch.randn(48, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, w, b)], {}


def _linear_shape_class(x, weight, bias=None) -> dict[str, int]:
    return {"K": int(weight.shape[1]), "N": int(weight.shape[0])}


LINEAR = dispatch.register_op(dispatch.Op(
    name="linear", reference=_linear_reference, check_inputs=_linear_check_inputs,
    tolerance={torch.float64: 1e-10, torch.float32: 1e-5},
    shape_class=_linear_shape_class, aliases={"mkl": {"cpu": "aten"}}, on_export="aten",
    reference_competes=True, error=DispatchError))
LINEAR.register(dispatch.Implementation("aten", _linear_aten, _aten_supports,
                                        ("cpu", "cuda", "mps", "xpu")))
LINEAR.register(dispatch.Implementation("onednn", _linear_onednn, _onednn_supports, ("cpu",),
                                        takes_float64=False))


def _matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in the operands' own dtype (torch's GEMM of that dtype)."""
    with torch.autocast("cpu", enabled=False):
        return torch.matmul(a, b)


def _matmul_in_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _UpcastMatmul.apply(a, b, None)


def _lowp_supports(device: torch.device, dtype: torch.dtype, shape) -> str | None:
    if device.type != "cpu" or dtype not in LOWP_DTYPES:
        return f"runs bfloat16 / float16 on the CPU, not {dtype} on {device}"
    return None


def _lowp_check_inputs(device, dtype, attrs, shape):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 32, generator=g) / 8
    return [t.to(device=device, dtype=dtype) for t in (a, b)], {}


def _lowp_shape_class(a, b) -> dict[str, int]:
    return {"M": int(a.shape[0]), "K": int(a.shape[1]), "N": int(b.shape[1])}


LOWP_MATMUL = dispatch.register_op(dispatch.Op(
    name="lowp_matmul", reference=_matmul_reference, check_inputs=_lowp_check_inputs,
    # relative to max |reference|: the operands are rounded to bf16/fp16 either way
    tolerance={torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3},
    shape_class=_lowp_shape_class, reference_competes=True, error=DispatchError))
LOWP_MATMUL.register(dispatch.Implementation("fp32", _matmul_in_fp32, _lowp_supports, ("cpu",),
                                             takes_float64=False))
LOWP_MATMUL.register(dispatch.Implementation("native", _matmul_reference, _lowp_supports,
                                             ("cpu",), takes_float64=False))


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on the CPU as :func:`matmul` under low-precision autocast, and in
    fp32 torch's GEMM or oneDNN's matmul, whichever the table's ``linear`` op chose for
    this product (docs/differences.md)."""
    dtype = _upcast_dtype(x, _gemm_size(x, weight.shape[1], weight.shape[0]))
    if dtype is not None:
        return _UpcastMatmul.apply(x.to(dtype), weight.to(dtype).t(),
                                   None if bias is None else bias.to(dtype))
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return F.linear(x, weight, bias)
    return dispatch.choose("linear", (x, weight, bias)).fn(x, weight, bias)


class _UpcastConv2d(torch.autograd.Function):
    """``F.conv2d`` (no dilation, one group) of low-precision operands in fp32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: tuple[int, int], padding: tuple[int, int]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.conv = (stride, padding, bias is not None)
        with torch.autocast("cpu", enabled=False):
            return F.conv2d(x.float(), weight.float(), None if bias is None else bias.float(),
                            stride, padding).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        stride, padding, has_bias = ctx.conv
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                has_bias and ctx.needs_input_grad[2]]
        with torch.autocast("cpu", enabled=False):
            gx, gw, gb = torch.ops.aten.convolution_backward(
                grad.float(), x.float(), weight.float(),
                [weight.shape[0]] if has_bias else None, list(stride), list(padding),
                [1, 1], False, [0, 0], 1, mask)
        return (None if gx is None else gx.to(x.dtype), None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(x.dtype), None, None)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           stride: tuple[int, int], padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``F.conv2d`` with ``stride`` and ``padding``; on the CPU under low-precision
    autocast as :func:`matmul` (docs/differences.md)."""
    k = weight.shape[1] * weight.shape[2] * weight.shape[3]
    m = x.shape[0] * (x.shape[2] // stride[0]) * (x.shape[3] // stride[1])
    dtype = _upcast_dtype(x, (m, k, weight.shape[0]))
    if dtype is None:
        return F.conv2d(x, weight, bias, stride, padding)
    return _UpcastConv2d.apply(x.to(dtype), weight.to(dtype),
                               None if bias is None else bias.to(dtype), stride, padding)
