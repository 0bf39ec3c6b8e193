"""Bidirectional WKV6 in chunks, in plain tensor operators: the form exported to ONNX.

No custom kernel, no data-dependent control flow: MatMul, Exp, Mul, ReduceSum, Add and
reshapes, with the chunk loop unrolled for the fixed sequence length of an export. Work
and memory grow linearly with T (maths at :func:`wkv6_bidirectional_chunked_plain` and
in docs/export.md).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

CHUNK = 8  # tokens per chunk: the (L, L, N) tile of weights stays small
MAX_CHUNKS = 200  # longer sequences take longer chunks: the unrolled scan stays this short


def chunk_length(T: int) -> int:
    """Tokens per chunk for T tokens: CHUNK, doubled while T needs over MAX_CHUNKS chunks
    (B/32's 49 image tokens: 7 chunks of 8; B/16 at 896 px, 3136 tokens: 196 of 16)."""
    L = CHUNK
    while math.ceil(T / L) > MAX_CHUNKS:
        L *= 2
    return min(L, T)


def _decay_exponents(L: int) -> tuple[Tensor, Tensor, Tensor]:
    """Matrices of 0 and -1 whose products with per-token log-decays d (L, M) give minus
    sums of only the terms involved (no difference of large sums, so weak decays after
    strong ones keep their digits):

    pair (L*L, L), row t*L + s: minus the sum of d[q] for min(s, t) < q < max(s, t), the
    exponent of the decay from s to t within the chunk (0 on the diagonal and for
    neighbours); start (L, L), row t: minus the sum for q < t, the decay from the chunk's
    start to t; end (L, L), row t: minus the sum for q > t, from t to the chunk's end.

    Made afresh on each call (a cached tensor would outlive the fake tensors of a trace).
    """
    q = torch.arange(L)
    t, s = q.view(L, 1, 1), q.view(1, L, 1)
    pair = (torch.minimum(s, t) < q) & (q < torch.maximum(s, t))
    start, end = q.view(1, L) < q.view(L, 1), q.view(1, L) > q.view(L, 1)
    return (-pair.reshape(L * L, L).to(torch.float64), -start.to(torch.float64),
            -end.to(torch.float64))


def wkv6_bidirectional_chunked_plain(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor,
                                     chunk: int | None = None) -> Tensor:
    """The bidirectional WKV6 of :func:`rwkv_clip.ops.wkv6_bidirectional`, in chunks.

    r, k, v, w: (B, T, C) with C = H * N; u: (H, N). Computes in float32, or float64 when
    any input is float64 (the dtype promotion of the reference); returns (B, T, C).

    ``y[t] = sum_s (r[t] * A[t, s] * k[s]) . v[s]`` with ``A[t, t] = u`` and, off the
    diagonal, the product of the per-step decays ``exp(-d[q])``, ``d = exp(w)``, over the
    steps strictly between s and t. Time is cut into chunks of L tokens (the last one
    padded with zeros, which add nothing). Within a chunk the (L, L) weights are formed
    per channel, exactly, from sums of d (:func:`_decay_exponents`). Across chunks two
    states of (N, N) per head carry the sums of ``k v^T``: forward for the earlier chunks,
    backward for the later ones, each step decayed by the chunk's total. Every exponent is
    a sum of d, never positive once negated, so nothing overflows however strong the decay.

    Inside, a chunk position leads, then all (batch, chunk, head) groups G, then the
    channel: the exponents of every group are one matrix product, and the broadcasts over
    positions run along long contiguous rows.
    """
    B, T, C = r.shape
    H, N = u.shape
    dtype = torch.promote_types(torch.float32, r.dtype)
    for x in (k, v, w, u):
        dtype = torch.promote_types(dtype, x.dtype)
    L = chunk or chunk_length(T)
    n = math.ceil(T / L)
    pad = n * L - T

    def positions_first(x: Tensor) -> Tensor:  # (B, T, C) -> (L, B, n, H, N), zeros past T
        x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, pad)) if pad else x.to(dtype)
        return x.reshape(-1, n, L, H, N).permute(2, 0, 1, 3, 4)

    r_, k_, v_ = positions_first(r), positions_first(k), positions_first(v)
    d = positions_first(torch.exp(w.to(dtype)))  # padded steps: d = 0, and k = v = 0
    batch = r_.shape[1]
    pair, start, end = (m.to(dtype=dtype, device=r.device) for m in _decay_exponents(L))
    d = d.reshape(L, -1)  # (L, G * N)
    within = torch.exp(torch.matmul(pair, d)).reshape(L, L, -1, N)  # (L_t, L_s, G, N)
    from_start = torch.exp(torch.matmul(start, d)).reshape(L, -1, N)  # (L, G, N)
    to_end = torch.exp(torch.matmul(end, d)).reshape(L, -1, N)

    # within each chunk: scores[t, s] = sum_j r[t, j] A[t, s, j] k[s, j], the diagonal
    # with u in place of A's exp(0) = 1
    rg, kg = r_.reshape(L, -1, N), k_.reshape(L, -1, N)  # (L, G, N)
    scores = (rg.unsqueeze(1) * within * kg.unsqueeze(0)).sum(dim=-1)  # (L_t, L_s, G)
    bonus = (r_ * (u.to(dtype) - 1) * k_).sum(dim=-1).reshape(L, 1, -1)  # (L_t, 1, G)
    scores = scores + torch.eye(L, dtype=dtype, device=r.device).unsqueeze(-1) * bonus
    vg = v_.reshape(L, -1, N).transpose(0, 1)  # (G, L, N)
    y = torch.matmul(scores.permute(2, 0, 1), vg)  # (G, L, N)
    if n > 1:
        y = y + _across_chunks(rg, kg, vg, from_start, to_end, d, batch, n, H, N)
    y = y.reshape(batch, n, H, L, N).permute(0, 1, 3, 2, 4).reshape(-1, n * L, C)
    return y[:, :T].contiguous() if pad else y


def _across_chunks(rg: Tensor, kg: Tensor, vg: Tensor, from_start: Tensor, to_end: Tensor,
                   d: Tensor, batch: int, n: int, H: int, N: int) -> Tensor:
    """What the other chunks add to each chunk's output, (G, L, N): per chunk the (N, N)
    sum of k v^T, each k decayed to the chunk's end (for the later chunks) or its start
    (for the earlier ones); a scan over the chunks, each step decaying the state by a
    whole chunk, hands each chunk the sums of the chunks before and after it."""
    L = rg.shape[0]

    def per_chunk(x: Tensor) -> tuple[Tensor, ...]:  # (G, ...) -> n x (B, 1, H, ...)
        return x.reshape(batch, n, H, *x.shape[1:]).split(1, dim=1)

    total = per_chunk(torch.exp(-d.reshape(L, -1, N).sum(dim=0)).unsqueeze(-1))  # (G, N, 1)
    kv_forward = per_chunk(torch.matmul((kg * to_end).permute(1, 2, 0), vg))  # (G, N, N)
    kv_backward = per_chunk(torch.matmul((kg * from_start).permute(1, 2, 0), vg))
    zero = torch.zeros_like(kv_forward[0])
    forward, backward = [zero], [zero]
    for c in range(1, n):
        forward.append(kv_forward[c - 1] if c == 1
                       else forward[-1] * total[c - 1] + kv_forward[c - 1])
        b = n - 1 - c
        backward.append(kv_backward[b + 1] if c == 1
                        else backward[-1] * total[b + 1] + kv_backward[b + 1])
    states = [torch.cat(s, dim=1).reshape(-1, N, N) for s in (forward, backward[::-1])]
    return (torch.matmul((rg * from_start).transpose(0, 1), states[0])
            + torch.matmul((rg * to_end).transpose(0, 1), states[1]))


__all__ = ["CHUNK", "MAX_CHUNKS", "chunk_length", "wkv6_bidirectional_chunked_plain"]
