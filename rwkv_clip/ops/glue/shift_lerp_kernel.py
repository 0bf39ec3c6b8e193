"""Token shift and lerps in one Triton pass: ``rwkv_clip::glue_shift_lerp``.

The forward reads each token and, per channel group, its shifted neighbour straight from
x (the shifted tensor is never written) and writes the S mixes ``lerp(x, shift(x), w_s)``.
The backward reads the mixes' gradients at the token and at its neighbour under the
opposite shift (the shift's adjoint), so the gradient of x is one pass too; the weight's
gradient is written in full for a (S, B, T, C) weight and summed per channel (partial sums
per program, then one torch sum) for a (S, 1, 1, C) one. Arithmetic in float32, torch.lerp's
two-branch formula, one rounding to the output dtype.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import Shift

BLOCK_ROWS = 4       # tokens per block
BLOCK_CHANNELS = 256  # channels per block
# programs along the tokens for a per-channel weight: each sums its rows' weight gradient,
# and those partial sums (ROW_PROGRAMS x S x C floats) are added up afterwards
ROW_PROGRAMS = 128
# the backward holds about twice the forward's values per element (both gradients, the
# neighbour's): twice the threads per block keep it near 100 registers a thread for S = 5
# (four warps: 150; four warps with the mixes unrolled: 255 and a spill) on sm_90
BACKWARD_WARPS = 8
_SIZES = ["R", "T", "C", "GH", "GW"]


@triton.jit
def _source(rows, cols, T, GH, GW, PIX, HD: tl.constexpr, QSHIFT: tl.constexpr,
            CLS: tl.constexpr, ADJOINT: tl.constexpr):
    """The flat row each (row, channel) is taken from under the shift (``ADJOINT``: the
    opposite shift) and whether that neighbour exists."""
    t = rows % T
    i = cols % HD
    if QSHIFT:
        quarter = i // (HD // 4)  # 0 left, 1 right, 2 up, 3 down
        if ADJOINT:
            quarter = quarter ^ 1
        dw = tl.where(quarter == 0, -PIX, tl.where(quarter == 1, PIX, 0))
        dh = tl.where(quarter == 2, -PIX, tl.where(quarter == 3, PIX, 0))
        h = t // GW
        w = t % GW
        sh = h[:, None] + dh[None, :]
        sw = w[:, None] + dw[None, :]
        ok = (sh >= 0) & (sh < GH) & (sw >= 0) & (sw < GW)
        src_t = sh * GW + sw
        if CLS:  # the cls token (last) is its own neighbour
            is_cls = (t == GH * GW)[:, None]
            src_t = tl.where(is_cls, t[:, None], src_t)
            ok = ok | is_cls
    else:
        back = i < HD // 2
        if ADJOINT:
            back = i >= HD // 2
        src_t = t[:, None] + tl.where(back, -PIX, PIX)[None, :]
        ok = (src_t >= 0) & (src_t < T)
    return rows[:, None] + (src_t - t[:, None]), ok


@triton.jit
def _lerp(a, b, w):
    """torch.lerp's formula: a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w)."""
    d = b - a
    return tl.where(tl.abs(w) < 0.5, a + w * d, b - d * (1.0 - w))


@triton.jit(do_not_specialize=_SIZES)
def _forward_kernel(x_ptr, w_ptr, out_ptr, R, T, C, GH, GW, PIX, w_stride_s, w_stride_r,
                    S: tl.constexpr, HD: tl.constexpr, QSHIFT: tl.constexpr,
                    CLS: tl.constexpr, SHIFTED_FIRST: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    src, ok = _source(rows, cols, T, GH, GW, PIX, HD, QSHIFT, CLS, False)
    shifted = tl.load(x_ptr + src.to(tl.int64) * C + cols[None, :], mask=m & ok,
                      other=0.0).to(tl.float32)
    if SHIFTED_FIRST:
        a, b = shifted, x
    else:
        a, b = x, shifted
    w_offs = rows.to(tl.int64)[:, None] * w_stride_r + cols[None, :]
    for s in tl.static_range(S):
        w = tl.load(w_ptr + s * w_stride_s + w_offs, mask=m, other=0.0).to(tl.float32)
        out = _lerp(a, b, w)
        tl.store(out_ptr + s * R.to(tl.int64) * C + offs,
                 out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=_SIZES)
def _backward_kernel(x_ptr, w_ptr, g_ptr, gx_ptr, gw_ptr, R, T, C, GH, GW, PIX,
                     w_stride_s, w_stride_r, ITERS,
                     S: tl.constexpr, SP: tl.constexpr, HD: tl.constexpr,
                     QSHIFT: tl.constexpr, CLS: tl.constexpr, SHIFTED_FIRST: tl.constexpr,
                     FULL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """``ITERS`` row blocks per program. FULL: gw (S, R, C) in the weight's dtype; else
    float32 partial sums gw[program, s, c] (SP: S rounded up to a power of two)."""
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    col_ok = cols < C
    RC = R.to(tl.int64) * C
    gw_acc = tl.zeros((SP, BC), dtype=tl.float32)
    s_index = tl.arange(0, SP)
    for it in range(ITERS):
        rows = (tl.program_id(0) * ITERS + it) * BR + tl.arange(0, BR)
        m = (rows < R)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        src, ok = _source(rows, cols, T, GH, GW, PIX, HD, QSHIFT, CLS, False)
        shifted = tl.load(x_ptr + src.to(tl.int64) * C + cols[None, :], mask=m & ok,
                          other=0.0).to(tl.float32)
        adj, adj_ok = _source(rows, cols, T, GH, GW, PIX, HD, QSHIFT, CLS, True)
        adj_ok = m & adj_ok
        adj_offs = adj.to(tl.int64) * C + cols[None, :]
        # d out / d start = 1 - w, d out / d end = w; x is the start unless SHIFTED_FIRST
        if SHIFTED_FIRST:
            diff = x - shifted  # end - start
        else:
            diff = shifted - x
        w_offs = rows.to(tl.int64)[:, None] * w_stride_r + cols[None, :]
        w_adj_offs = adj.to(tl.int64) * w_stride_r + cols[None, :]
        gx = tl.zeros((BR, BC), dtype=tl.float32)
        for s in range(S):  # a loop, not unrolled: fewer values live at once
            g = tl.load(g_ptr + s * RC + offs, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + s * w_stride_s + w_offs, mask=m, other=0.0).to(tl.float32)
            g_adj = tl.load(g_ptr + s * RC + adj_offs, mask=adj_ok, other=0.0).to(tl.float32)
            w_adj = tl.load(w_ptr + s * w_stride_s + w_adj_offs, mask=adj_ok,
                            other=0.0).to(tl.float32)
            if SHIFTED_FIRST:  # x is the end: w here; its neighbour's start: 1 - w there
                gx += g * w + g_adj * (1.0 - w_adj)
            else:
                gx += g * (1.0 - w) + g_adj * w_adj
            gw = g * diff
            if FULL:
                tl.store(gw_ptr + s * RC + offs, gw.to(gw_ptr.dtype.element_ty), mask=m)
            else:
                gw_acc += tl.where(s_index[:, None] == s, tl.sum(gw, axis=0)[None, :], 0.0)
        tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=m)
    if not FULL:
        part = gw_ptr + (tl.program_id(0) * S + s_index).to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(part, gw_acc, mask=(s_index < S)[:, None] & col_ok[None, :])


def _on_device(x: Tensor):
    """Launch on the inputs' GPU (CPU tensors: the Triton interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _weight_layout(x: Tensor, weight: Tensor) -> tuple[int, int, int, bool]:
    """(S, stride between mixes, stride between rows, full) of a (S, 1, 1, C) or
    (S, B, T, C) weight."""
    B, T, C = x.shape
    S = weight.shape[0]
    if weight.dim() != 4 or weight.shape[3] != C or weight.shape[1:3] not in ((1, 1), (B, T)):
        raise ValueError(f"shift_lerp: weight {tuple(weight.shape)} for x {tuple(x.shape)}: "
                         f"expected (S, 1, 1, {C}) or (S, {B}, {T}, {C})")
    full = tuple(weight.shape[1:3]) == (B, T)
    return S, (B * T * C if full else C), (C if full else 0), full


def _shift_args(shift: Shift) -> dict:
    return {"GH": shift.grid[0], "GW": max(shift.grid[1], 1), "PIX": shift.pixels,
            "HD": shift.head_dim, "QSHIFT": shift.kind == "q", "CLS": shift.cls}


def forward(x: Tensor, weight: Tensor, shift: Shift, shifted_first: bool) -> Tensor:
    """(S, B, T, C) mixes, x's dtype; x (B, T, C) and weight contiguous, one dtype."""
    shift.check(x)
    B, T, C = x.shape
    S, stride_s, stride_r, _ = _weight_layout(x, weight)
    out = x.new_empty((S, B, T, C))
    R = B * T
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(R, BLOCK_ROWS), triton.cdiv(C, BLOCK_CHANNELS))
    with _on_device(x):
        _forward_kernel[grid](x, weight, out, R, T, C, w_stride_s=stride_s, w_stride_r=stride_r,
                              S=S, SHIFTED_FIRST=shifted_first, BR=BLOCK_ROWS,
                              BC=BLOCK_CHANNELS, **_shift_args(shift))
    return out


def backward(grad: Tensor, x: Tensor, weight: Tensor, shift: Shift,
             shifted_first: bool) -> tuple[Tensor, Tensor]:
    """(grad of x, grad of weight) in their dtypes and shapes; grad (S, B, T, C)."""
    B, T, C = x.shape
    S, stride_s, stride_r, full = _weight_layout(x, weight)
    R = B * T
    gx = torch.empty_like(x)
    if R * C == 0:
        return gx, torch.zeros_like(weight)
    blocks = triton.cdiv(R, BLOCK_ROWS)
    iters = 1 if full else triton.cdiv(blocks, ROW_PROGRAMS)
    programs = triton.cdiv(blocks, iters)
    if full:
        gw = torch.empty_like(weight)
    else:
        gw = torch.empty((programs, S, C), dtype=torch.float32, device=x.device)
    with _on_device(x):
        _backward_kernel[(programs, triton.cdiv(C, BLOCK_CHANNELS))](
            x, weight, grad, gx, gw, R, T, C, w_stride_s=stride_s, w_stride_r=stride_r,
            ITERS=iters, S=S, SP=triton.next_power_of_2(S), SHIFTED_FIRST=shifted_first,
            FULL=full, BR=BLOCK_ROWS, BC=BLOCK_CHANNELS, num_warps=BACKWARD_WARPS,
            **_shift_args(shift))
    if not full:
        gw = gw.sum(0).view(S, 1, 1, C).to(weight.dtype)
    return gx, gw


# The operator torch.compile sees (one opaque call each way); the shift travels as its
# fields, the schema's plain types.
@torch.library.custom_op("rwkv_clip::glue_shift_lerp", mutates_args=())
def shift_lerp_op(x: Tensor, weight: Tensor, kind: str, head_dim: int, pixels: int,
                  grid_h: int, grid_w: int, cls: bool, shifted_first: bool) -> Tensor:
    return forward(x.contiguous(), weight.contiguous(),
                   Shift(kind, head_dim, pixels, (grid_h, grid_w), cls), shifted_first)


@torch.library.custom_op("rwkv_clip::glue_shift_lerp_backward", mutates_args=())
def shift_lerp_backward_op(grad: Tensor, x: Tensor, weight: Tensor, kind: str, head_dim: int,
                           pixels: int, grid_h: int, grid_w: int, cls: bool,
                           shifted_first: bool) -> tuple[Tensor, Tensor]:
    return backward(grad.contiguous(), x.contiguous(), weight.contiguous(),
                    Shift(kind, head_dim, pixels, (grid_h, grid_w), cls), shifted_first)


@shift_lerp_op.register_fake
def _(x, weight, kind, head_dim, pixels, grid_h, grid_w, cls, shifted_first):
    return x.new_empty((weight.shape[0], *x.shape))


@shift_lerp_backward_op.register_fake
def _(grad, x, weight, kind, head_dim, pixels, grid_h, grid_w, cls, shifted_first):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    x, weight, *ctx.args = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = shift_lerp_backward_op(grad, x, weight, *ctx.args)
    return gx, gw, *([None] * len(ctx.args))


shift_lerp_op.register_autograd(_backward, setup_context=_setup)
