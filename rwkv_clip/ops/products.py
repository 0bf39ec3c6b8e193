"""The towers' matrix products: ``linear``, ``matmul`` and ``conv2d``.

Exactly ``F.linear``, ``a @ b`` and ``F.conv2d``, except on CPUs: under bf16/fp16 autocast
without native low-precision GEMMs they run autocast's arithmetic on the fp32 GEMM, and
wide fp32 ``Linear`` forwards may use oneDNN (both in docs/differences.md); the dispatch
table's switches ``lowp_matmul`` and ``linear`` say which (:mod:`rwkv_clip.cpu_gemm`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..cpu_gemm import cpu_linear_uses_onednn, cpu_matmul_in_fp32


def _upcast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when products on t's device are to be computed in fp32."""
    if t.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return None
    dtype = torch.get_autocast_dtype("cpu")
    if dtype not in (torch.bfloat16, torch.float16) or not cpu_matmul_in_fp32(dtype):
        return None
    return dtype


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
    bf16/fp16 autocast where :func:`rwkv_clip.cpu_gemm.cpu_matmul_in_fp32` says so (once per
    dtype), the operands are rounded as autocast would, multiplied by the fp32 GEMM and the
    result rounded back (docs/differences.md)."""
    dtype = _upcast_dtype(a)
    if dtype is None:
        if add is None:
            return torch.matmul(a, b)
        if a.dim() == 3 and b.dim() == 3:
            return torch.baddbmm(add, a, b)
        if a.dim() == 2 and b.dim() == 2:
            return torch.addmm(add, a, b)
        return torch.matmul(a, b) + add
    return _UpcastMatmul.apply(a.to(dtype), b.to(dtype), None if add is None else add.to(dtype))


# oneDNN pays off for wide products only: its per-call cost outweighs its speed on narrow
# ones (see docs/performance.md).
ONEDNN_MIN_FEATURES = 512


def _use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (min(weight.shape) >= ONEDNN_MIN_FEATURES and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and not torch.jit.is_tracing()
            and cpu_linear_uses_onednn())  # TorchScript traces keep aten.linear


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


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on the CPU as :func:`matmul` under low-precision autocast, and in
    fp32 possibly oneDNN's matmul for wide products
    (:func:`rwkv_clip.cpu_gemm.cpu_linear_uses_onednn`; docs/differences.md)."""
    dtype = _upcast_dtype(x)
    if dtype is None:
        if not _use_onednn(x, weight):
            return F.linear(x, weight, bias)
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # eager inference: the kernel itself, without the operator's Python dispatch
            return _onednn_matmul(x, weight, bias)
        return _onednn_linear(x, weight, bias)
    return _UpcastMatmul.apply(x.to(dtype), weight.to(dtype).t(),
                               None if bias is None else bias.to(dtype))


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
    dtype = _upcast_dtype(x)
    if dtype is None:
        return F.conv2d(x, weight, bias, stride, padding)
    return _UpcastConv2d.apply(x.to(dtype), weight.to(dtype),
                               None if bias is None else bias.to(dtype), stride, padding)
