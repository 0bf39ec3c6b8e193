"""The time mix's head norm and gate in one Triton pass: ``rwkv_clip::glue_head_norm_gate``.

Per token and head, the WKV output y is normalised over the head's channels (GroupNorm
with one group per head: biased variance, ``eps``), scaled and shifted per channel, and
multiplied by ``silu(gate)``; the result is written once, in the gate's dtype. Arithmetic
in float32 throughout (the reference rounds the norm to the gate's dtype before the
product). The backward computes the statistics again from y (nothing but the inputs is
kept) and sums the weight and bias gradients per program, then once in torch. The bonus
term ``u`` is not here: the WKV kernels add it themselves.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_ROWS = 8
ROW_PROGRAMS = 256  # programs along the tokens in the backward (partial sums of gw, gb)
_SIZES = ["R", "C"]


@triton.jit
def _normalised(y_ptr, w_ptr, b_ptr, offs, cols, m, col_ok, eps, N: tl.constexpr):
    """z = (y - mean) / sqrt(var + eps) per row and the affine n = z w + b (float32)."""
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(y, axis=1) / N
    d = tl.where(m, y - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
    z = d * rstd[:, None]
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return z, z * w[None, :] + b[None, :], w, rstd


@triton.jit(do_not_specialize=_SIZES)
def _forward_kernel(y_ptr, w_ptr, b_ptr, gate_ptr, out_ptr, R, C, eps,
                    N: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr):
    """One block of rows and one head per program (NP: N rounded up to a power of two)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.arange(0, NP)
    col_ok = j < N
    cols = tl.program_id(1) * N + j
    m = (rows < R)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    _, n, _, _ = _normalised(y_ptr, w_ptr, b_ptr, offs, cols, m, col_ok, eps, N)
    a = tl.load(gate_ptr + offs, mask=m, other=0.0).to(tl.float32)
    out = n * a * tl.sigmoid(a)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=_SIZES)
def _backward_kernel(y_ptr, w_ptr, b_ptr, gate_ptr, g_ptr, gy_ptr, ggate_ptr, gw_ptr, gb_ptr,
                     R, C, eps, ITERS, N: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr):
    """``ITERS`` row blocks per program; gw_ptr, gb_ptr: float32 partial sums (program, C)."""
    j = tl.arange(0, NP)
    col_ok = j < N
    cols = tl.program_id(1) * N + j
    gw_acc = tl.zeros((NP,), dtype=tl.float32)
    gb_acc = tl.zeros((NP,), dtype=tl.float32)
    for it in range(ITERS):
        rows = (tl.program_id(0) * ITERS + it) * BR + tl.arange(0, BR)
        m = (rows < R)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        z, n, w, rstd = _normalised(y_ptr, w_ptr, b_ptr, offs, cols, m, col_ok, eps, N)
        a = tl.load(gate_ptr + offs, mask=m, other=0.0).to(tl.float32)
        go = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        gn = go * a * sig  # through out = n silu(a)
        ggate = go * n * sig * (1.0 + a * (1.0 - sig))
        tl.store(ggate_ptr + offs, ggate.to(ggate_ptr.dtype.element_ty), mask=m)
        gw_acc += tl.sum(gn * z, axis=0)
        gb_acc += tl.sum(gn, axis=0)
        gz = tl.where(m, gn * w[None, :], 0.0)
        mean_gz = tl.sum(gz, axis=1) / N
        mean_gzz = tl.sum(gz * z, axis=1) / N
        gy = rstd[:, None] * (gz - mean_gz[:, None] - z * mean_gzz[:, None])
        tl.store(gy_ptr + offs, gy.to(gy_ptr.dtype.element_ty), mask=m)
    part = tl.program_id(0).to(tl.int64) * C + cols
    tl.store(gw_ptr + part, gw_acc, mask=col_ok)
    tl.store(gb_ptr + part, gb_acc, mask=col_ok)


def _on_device(x: Tensor):
    """Launch on the inputs' GPU (CPU tensors: the Triton interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _check(y: Tensor, weight: Tensor, bias: Tensor, gate: Tensor, n_head: int) -> int:
    C = y.shape[-1]
    if (y.dim() != 3 or gate.shape != y.shape or weight.shape != (C,) or bias.shape != (C,)
            or C % n_head):
        raise ValueError(f"head_norm_gate: y {tuple(y.shape)}, gate {tuple(gate.shape)}, "
                         f"weight {tuple(weight.shape)}, bias {tuple(bias.shape)}, "
                         f"{n_head} heads: expected y and gate (B, T, C), weight and bias "
                         "(C,), C a multiple of the heads")
    return C // n_head


def forward(y: Tensor, weight: Tensor, bias: Tensor, gate: Tensor, n_head: int,
            eps: float) -> Tensor:
    """``group_norm(y) * silu(gate)`` (B, T, C) in gate's dtype; inputs contiguous."""
    N = _check(y, weight, bias, gate, n_head)
    B, T, C = y.shape
    out = torch.empty_like(gate)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(B * T, BLOCK_ROWS), n_head)
    with _on_device(y):
        _forward_kernel[grid](y, weight, bias, gate, out, B * T, C, eps, N=N,
                              NP=triton.next_power_of_2(N), BR=BLOCK_ROWS)
    return out


def backward(grad: Tensor, y: Tensor, weight: Tensor, bias: Tensor, gate: Tensor,
             n_head: int, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of y, weight, bias and gate, in their dtypes."""
    N = _check(y, weight, bias, gate, n_head)
    B, T, C = y.shape
    R = B * T
    gy, ggate = torch.empty_like(y), torch.empty_like(gate)
    if R == 0:
        return gy, torch.zeros_like(weight), torch.zeros_like(bias), ggate
    blocks = triton.cdiv(R, BLOCK_ROWS)
    iters = triton.cdiv(blocks, ROW_PROGRAMS)
    programs = triton.cdiv(blocks, iters)
    gw = torch.empty((programs, C), dtype=torch.float32, device=y.device)
    gb = torch.empty_like(gw)
    with _on_device(y):
        _backward_kernel[(programs, n_head)](y, weight, bias, gate, grad, gy, ggate, gw, gb,
                                             R, C, eps, ITERS=iters, N=N,
                                             NP=triton.next_power_of_2(N), BR=BLOCK_ROWS)
    return gy, gw.sum(0).to(weight.dtype), gb.sum(0).to(bias.dtype), ggate


@torch.library.custom_op("rwkv_clip::glue_head_norm_gate", mutates_args=())
def head_norm_gate_op(y: Tensor, weight: Tensor, bias: Tensor, gate: Tensor, n_head: int,
                      eps: float) -> Tensor:
    return forward(y.contiguous(), weight.contiguous(), bias.contiguous(), gate.contiguous(),
                   n_head, eps)


@torch.library.custom_op("rwkv_clip::glue_head_norm_gate_backward", mutates_args=())
def head_norm_gate_backward_op(grad: Tensor, y: Tensor, weight: Tensor, bias: Tensor,
                               gate: Tensor, n_head: int, eps: float
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return backward(grad.contiguous(), y.contiguous(), weight.contiguous(), bias.contiguous(),
                    gate.contiguous(), n_head, eps)


@head_norm_gate_op.register_fake
def _(y, weight, bias, gate, n_head, eps):
    return torch.empty_like(gate)


@head_norm_gate_backward_op.register_fake
def _(grad, y, weight, bias, gate, n_head, eps):
    return (torch.empty_like(y), torch.empty_like(weight), torch.empty_like(bias),
            torch.empty_like(gate))


def _setup(ctx, inputs, output) -> None:
    y, weight, bias, gate, ctx.n_head, ctx.eps = inputs
    ctx.save_for_backward(y, weight, bias, gate)


def _backward(ctx, grad):
    grads = head_norm_gate_backward_op(grad, *ctx.saved_tensors, ctx.n_head, ctx.eps)
    return (*grads, None, None)


head_norm_gate_op.register_autograd(_backward, setup_context=_setup)
