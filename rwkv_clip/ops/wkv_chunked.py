"""Chunked bidirectional WKV6 in Triton: the ``chunked`` variant of the CUDA backend.

Time runs in chunks of ``CHUNK`` tokens. Within a chunk the causal part, the anti-causal
part and the bonus ``u`` form one (CHUNK x CHUNK) tile built from the per-channel
cumulative log-decay; across chunks fp32 states carry the causal sum forward and the
anti-causal sum backward. Every exponent is a sum of log-decays (never positive), so
nothing overflows however strong the decay. The algorithm: docs/wkv.md.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..errors import WKVError
from .build import chunked_head_size_problem

CHUNK = 16  # tokens per chunk: the smallest tile tl.dot takes, so the exponents stay short
# products of fp32 operands on tensor cores: each operand split into two tf32 parts, three
# products, about fp32's accuracy (plain tf32 would leave 1e-3 errors in y)
DOT_PRECISION = "tf32x3"
# one compiled kernel for every batch size, length and head count (Triton would otherwise
# compile again for sizes of 1 and multiples of 16)
_SIZES = ["B", "T", "H"]


def channel_block(N: int) -> int:
    """Key/value channels per program: 32 where it divides N, else 16 (80 = 5 x 16), so
    no head size is padded to a power of two."""
    if N % 32 == 0:
        return 32
    problem = chunked_head_size_problem(N)
    if problem is not None:
        raise WKVError(f"rwkv_clip: {problem}")
    return 16


@triton.jit
def _chunk_decay(w_ptr, offs, mask, tau_local, L: tl.constexpr):
    """Per-channel log-decays of one chunk: a = -exp(w) (0 past the end), inclusive prefix
    sum P, exclusive prefix sum Px and the chunk total (the last row of P)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.where(mask, -tl.exp(w), 0.0)
    P = tl.cumsum(a, axis=0)
    Px = P - a
    Ptot = tl.sum(tl.where(tau_local[:, None] == L - 1, P, 0.0), axis=0)
    return a, P, Px, Ptot


@triton.jit
def _strict_lower_decay(P, Px, tau_local):
    """W[t, s, j] = exp(Px[t, j] - P[s, j]) for s < t (the decay over the tokens strictly
    between), exactly 1 for neighbours, 0 on and above the diagonal."""
    before = tau_local[None, :] < tau_local[:, None]
    neighbour = tau_local[None, :] == tau_local[:, None] - 1
    ex = tl.minimum(Px[:, None, :] - P[None, :, :], 0.0)
    W = tl.where(neighbour[:, :, None], 1.0, tl.exp(ex))
    return tl.where(before[:, :, None], W, 0.0)


@triton.jit(do_not_specialize=_SIZES)
def _wkv_fwd_kernel(r_ptr, k_ptr, v_ptr, w_ptr, u_ptr, y_ptr, B, T, H,
                    N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    PREC: tl.constexpr):
    """One (batch x head, key block x value block, direction) per program. Direction 0 is
    the causal sum with the diagonal, 1 the anti-causal one in reversed (logical) time.
    Writes its partial y to y_ptr[direction, key block]."""
    NVB: tl.constexpr = N // BV
    NKB: tl.constexpr = N // BK
    C = H * N
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    kb = tl.program_id(1) // NVB
    vb = tl.program_id(1) % NVB
    rev = tl.program_id(2)
    base = b.to(tl.int64) * T * C + h * N
    out = y_ptr + (rev * NKB + kb).to(tl.int64) * B * T * C + base
    jk = kb * BK + tl.arange(0, BK)
    iv = vb * BV + tl.arange(0, BV)
    tau_local = tl.arange(0, L)
    u = tl.load(u_ptr + h * N + jk).to(tl.float32)
    diagonal = (tau_local[:, None] == tau_local[None, :]) & (rev == 0)
    S = tl.zeros((BK, BV), dtype=tl.float32)
    for c in range(0, tl.cdiv(T, L)):
        tau = c * L + tau_local
        m = tau < T
        t = tl.where(rev == 1, T - 1 - tau, tau)
        row = base + t.to(tl.int64) * C
        ok = row[:, None] + jk[None, :]
        ov = row[:, None] + iv[None, :]
        a, P, Px, Ptot = _chunk_decay(w_ptr, ok, m[:, None], tau_local, L)
        r = tl.load(r_ptr + ok, mask=m[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + ok, mask=m[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + ov, mask=m[:, None], other=0.0).to(tl.float32)
        # earlier chunks: r decayed from the chunk start, times the state
        o = tl.dot(r * tl.exp(Px), S, input_precision=PREC)
        # this chunk: the tile, exact per channel, plus the bonus on the diagonal
        W = _strict_lower_decay(P, Px, tau_local)
        A = tl.sum(r[:, None, :] * k[None, :, :] * W, axis=2)
        bonus = tl.sum(r * u[None, :] * k, axis=1)
        A = tl.where(diagonal, bonus[:, None], A)
        o += tl.dot(A, v, input_precision=PREC)
        tl.store(out + (t.to(tl.int64) * C)[:, None] + iv[None, :], o, mask=m[:, None])
        kd = k * tl.exp(tl.minimum(Ptot[None, :] - P, 0.0))
        S = S * tl.exp(Ptot)[:, None] + tl.dot(tl.trans(kd), v, input_precision=PREC)


@triton.jit(do_not_specialize=_SIZES)
def _wkv_bwd_r_kernel(k_ptr, v_ptr, w_ptr, gy_ptr, gr_ptr, B, T, H,
                      N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      PREC: tl.constexpr):
    """Gradient of r without the diagonal, swept forward in (logical) time with the same
    state as the forward; partial over value blocks, written to gr_ptr[direction, vb]."""
    NVB: tl.constexpr = N // BV
    C = H * N
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    kb = tl.program_id(1) // NVB
    vb = tl.program_id(1) % NVB
    rev = tl.program_id(2)
    base = b.to(tl.int64) * T * C + h * N
    out = gr_ptr + (rev * NVB + vb).to(tl.int64) * B * T * C + base
    jk = kb * BK + tl.arange(0, BK)
    iv = vb * BV + tl.arange(0, BV)
    tau_local = tl.arange(0, L)
    S = tl.zeros((BK, BV), dtype=tl.float32)
    for c in range(0, tl.cdiv(T, L)):
        tau = c * L + tau_local
        m = tau < T
        t = tl.where(rev == 1, T - 1 - tau, tau)
        row = base + t.to(tl.int64) * C
        ok = row[:, None] + jk[None, :]
        ov = row[:, None] + iv[None, :]
        a, P, Px, Ptot = _chunk_decay(w_ptr, ok, m[:, None], tau_local, L)
        k = tl.load(k_ptr + ok, mask=m[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + ov, mask=m[:, None], other=0.0).to(tl.float32)
        gy = tl.load(gy_ptr + ov, mask=m[:, None], other=0.0).to(tl.float32)
        g = tl.exp(Px) * tl.dot(gy, tl.trans(S), input_precision=PREC)
        W = _strict_lower_decay(P, Px, tau_local)
        D = tl.dot(gy, tl.trans(v), input_precision=PREC)  # D[t, s] = gy[t] . v[s]
        g += tl.sum(D[:, :, None] * k[None, :, :] * W, axis=1)
        tl.store(out + (t.to(tl.int64) * C)[:, None] + jk[None, :], g, mask=m[:, None])
        kd = k * tl.exp(tl.minimum(Ptot[None, :] - P, 0.0))
        S = S * tl.exp(Ptot)[:, None] + tl.dot(tl.trans(kd), v, input_precision=PREC)


@triton.jit(do_not_specialize=_SIZES)
def _wkv_bwd_kv_kernel(r_ptr, k_ptr, v_ptr, w_ptr, gy_ptr, gk_ptr, gv_ptr, B, T, H,
                       N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       PREC: tl.constexpr):
    """Gradients of k (partial over value blocks, to gk_ptr[direction, vb]) and v (partial
    over key blocks, to gv_ptr[direction, kb]) without the diagonal, swept backward in
    (logical) time with the state dS of r^T gy decayed to the chunk's end."""
    NVB: tl.constexpr = N // BV
    NKB: tl.constexpr = N // BK
    C = H * N
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    kb = tl.program_id(1) // NVB
    vb = tl.program_id(1) % NVB
    rev = tl.program_id(2)
    base = b.to(tl.int64) * T * C + h * N
    out_k = gk_ptr + (rev * NVB + vb).to(tl.int64) * B * T * C + base
    out_v = gv_ptr + (rev * NKB + kb).to(tl.int64) * B * T * C + base
    jk = kb * BK + tl.arange(0, BK)
    iv = vb * BV + tl.arange(0, BV)
    tau_local = tl.arange(0, L)
    dS = tl.zeros((BK, BV), dtype=tl.float32)
    for cc in range(0, tl.cdiv(T, L)):
        c = tl.cdiv(T, L) - 1 - cc
        tau = c * L + tau_local
        m = tau < T
        t = tl.where(rev == 1, T - 1 - tau, tau)
        row = base + t.to(tl.int64) * C
        ok = row[:, None] + jk[None, :]
        ov = row[:, None] + iv[None, :]
        a, P, Px, Ptot = _chunk_decay(w_ptr, ok, m[:, None], tau_local, L)
        r = tl.load(r_ptr + ok, mask=m[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + ok, mask=m[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + ov, mask=m[:, None], other=0.0).to(tl.float32)
        gy = tl.load(gy_ptr + ov, mask=m[:, None], other=0.0).to(tl.float32)
        # later chunks: decay from s to the chunk's end, times the state
        to_end = tl.exp(tl.minimum(Ptot[None, :] - P, 0.0))
        gk = to_end * tl.dot(v, tl.trans(dS), input_precision=PREC)
        gv = tl.dot(k * to_end, dS, input_precision=PREC)
        # this chunk
        W = _strict_lower_decay(P, Px, tau_local)
        D = tl.dot(gy, tl.trans(v), input_precision=PREC)
        gk += tl.sum(D[:, :, None] * r[:, None, :] * W, axis=0)
        A = tl.sum(r[:, None, :] * k[None, :, :] * W, axis=2)
        gv += tl.dot(tl.trans(A), gy, input_precision=PREC)
        tl.store(out_k + (t.to(tl.int64) * C)[:, None] + jk[None, :], gk, mask=m[:, None])
        tl.store(out_v + (t.to(tl.int64) * C)[:, None] + iv[None, :], gv, mask=m[:, None])
        rd = r * tl.exp(Px)
        dS = dS * tl.exp(Ptot)[:, None] + tl.dot(tl.trans(rd), gy, input_precision=PREC)


def _config(r: Tensor, u: Tensor):
    B, T, C = r.shape
    H, N = u.shape
    blk = channel_block(N)
    prec = DOT_PRECISION
    grid = (B * H, (N // blk) ** 2, 2)
    return B, T, C, H, N, blk, prec, grid


def _on_device(x: Tensor):
    """Launch on the inputs' GPU (CPU tensors: the Triton interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def forward(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor) -> Tensor:
    """y (float32, (B, T, C)) of the bidirectional WKV6; inputs contiguous, on one device."""
    B, T, C, H, N, blk, prec, grid = _config(r, u)
    part = torch.empty((2 * (N // blk), B, T, C), dtype=torch.float32, device=r.device)
    with _on_device(r):
        _wkv_fwd_kernel[grid](r, k, v, w, u, part, B, T, H, N=N, L=CHUNK, BK=blk, BV=blk,
                              PREC=prec)
    return part.sum(0)


def backward(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor, gy: Tensor
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(gr, gk, gv, gw, gu) in float32. The kernels give the off-diagonal parts of gr, gk
    (causal and anti-causal apart) and gv; the diagonal (bonus u) terms are elementwise.
    gw from the cumulative-decay identity: the decay at token q sees every pair (t, s)
    with q strictly between, i.e. for the causal part the suffix sum over t > q of
    (r gr - k gk)[t] minus (k gk)[q], and the mirror image for the anti-causal part."""
    B, T, C, H, N, blk, prec, grid = _config(r, u)
    nb = N // blk
    dev = r.device
    gr_part = torch.empty((2, nb, B, T, C), dtype=torch.float32, device=dev)
    gk_part = torch.empty((2, nb, B, T, C), dtype=torch.float32, device=dev)
    gv_part = torch.empty((2, nb, B, T, C), dtype=torch.float32, device=dev)
    with _on_device(r):
        _wkv_bwd_r_kernel[grid](k, v, w, gy, gr_part, B, T, H, N=N, L=CHUNK, BK=blk, BV=blk,
                                PREC=prec)
        _wkv_bwd_kv_kernel[grid](r, k, v, w, gy, gk_part, gv_part, B, T, H, N=N, L=CHUNK,
                                 BK=blk, BV=blk, PREC=prec)
    shape = (B, T, H, N)
    gr_c, gr_a = gr_part.sum(1).view(2, *shape).unbind(0)
    gk_c, gk_a = gk_part.sum(1).view(2, *shape).unbind(0)
    gv = gv_part.sum((0, 1)).view(shape)
    rf, kf, vf, gyf, wf = (x.float().view(shape) for x in (r, k, v, gy, w))
    uf = u.float()
    d = (gyf * vf).sum(-1, keepdim=True)  # gy[t] . v[t], the diagonal of D
    gr = gr_c + gr_a + d * uf * kf
    gk = gk_c + gk_a + d * uf * rf
    gv = gv + gyf * (rf * uf * kf).sum(-1, keepdim=True)
    gu = (d * rf * kf).sum((0, 1))
    rgr_c, kgk_c, rgr_a, kgk_a = rf * gr_c, kf * gk_c, rf * gr_a, kf * gk_a
    after = (rgr_c - kgk_c).flip(1).cumsum(1).flip(1)  # sum over t >= q
    before = (rgr_a - kgk_a).cumsum(1)  # sum over t <= q
    between = torch.zeros_like(after)
    between[:, :-1] += after[:, 1:]
    between[:, 1:] += before[:, :-1]
    gw = -torch.exp(wf) * (between - kgk_c - kgk_a)
    # the first and last tokens lie between no pair: exactly 0, not a rounding residue
    gw[:, 0] = 0
    gw[:, -1] = 0
    return gr.view(B, T, C), gk.view(B, T, C), gv.view(B, T, C), gw.view(B, T, C), gu
