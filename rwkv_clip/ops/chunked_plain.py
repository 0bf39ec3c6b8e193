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

CHUNK = 16  # tokens per chunk: the (L, L, N) tile of weights stays small


def _between_sums(L: int) -> Tensor:
    """The 0/1 matrix (L*L + 2L, L) whose product with per-token log-decays d (L, N) gives,
    as sums of only the terms involved (no difference of large sums, so weak decays after
    strong ones keep their digits):

    rows t*L + s: the sum of d[q] for min(s, t) < q < max(s, t), the exponent of the decay
    from s to t within the chunk (0 on the diagonal and for neighbours);
    rows L*L + t: the sum of d[q] for q < t, the decay from the chunk start to t;
    rows L*L + L + t: the sum of d[q] for q > t, the decay from t to the chunk end.

    Made afresh on each call (a cached tensor would outlive the fake tensors of a trace).
    """
    q = torch.arange(L)
    t, s = q.view(L, 1, 1), q.view(1, L, 1)
    pair = (torch.minimum(s, t) < q) & (q < torch.maximum(s, t))
    before = q.view(1, L) < q.view(L, 1)
    after = q.view(1, L) > q.view(L, 1)
    return torch.cat((pair.reshape(L * L, L), before, after)).to(torch.float64)


def wkv6_bidirectional_chunked_plain(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor,
                                     chunk: int | None = None) -> Tensor:
    """The bidirectional WKV6 of :func:`rwkv_clip.ops.wkv6_bidirectional`, in chunks.

    r, k, v, w: (B, T, C) with C = H * N; u: (H, N). Computes in float32, or float64 when
    any input is float64 (the dtype promotion of the reference); returns (B, T, C).

    ``y[t] = sum_s (r[t] * A[t, s] * k[s]) . v[s]`` with ``A[t, t] = u`` and, off the
    diagonal, the product of the per-step decays ``exp(-d[q])``, ``d = exp(w)``, over the
    steps strictly between s and t. Time is cut into chunks of L tokens (the last one
    padded with zeros, which add nothing). Within a chunk the (L, L) weights are formed
    per channel, exactly, from sums of d (:func:`_between_sums`). Across chunks two states
    of (N, N) per head carry the sums of ``k v^T``: forward for the earlier chunks, backward
    for the later ones, each step decayed by the chunk's total. Every exponent is a sum of
    d, never positive once negated, so nothing overflows however strong the decay.
    """
    B, T, C = r.shape
    H, N = u.shape
    dtype = torch.promote_types(torch.float32, r.dtype)
    for x in (k, v, w, u):
        dtype = torch.promote_types(dtype, x.dtype)
    L = chunk or min(CHUNK, T)
    n = math.ceil(T / L)
    pad = n * L - T

    def chunks(x: Tensor) -> Tensor:  # (B, T, C) -> (B, H, n, L, N), zeros past T
        x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, pad)) if pad else x.to(dtype)
        return x.reshape(-1, n, L, H, N).permute(0, 3, 1, 2, 4)

    r_, k_, v_ = chunks(r), chunks(k), chunks(v)
    d = chunks(torch.exp(w.to(dtype)))  # padded steps: d = 0, no decay, and k = v = 0
    decays = torch.exp(-torch.matmul(_between_sums(L).to(dtype=dtype, device=r.device), d))
    within = decays[..., :L * L, :].reshape(-1, H, n, L, L, N)
    from_start = decays[..., L * L:L * L + L, :]  # (B, H, n, L, N)
    to_end = decays[..., L * L + L:, :]

    # within each chunk: scores[t, s] = sum_j r[t, j] A[t, s, j] k[s, j], the diagonal
    # with u in place of A's exp(0) = 1
    scores = (r_.unsqueeze(4) * within * k_.unsqueeze(3)).sum(dim=-1)  # (B, H, n, L, L)
    bonus = (r_ * (u.to(dtype).view(1, H, 1, 1, N) - 1) * k_).sum(dim=-1)  # (B, H, n, L)
    scores = scores + bonus.unsqueeze(-1) * torch.eye(L, dtype=dtype, device=r.device)
    y = torch.matmul(scores, v_)
    if n == 1:
        return _tokens(y, T)

    # across chunks: per chunk the (N, N) sum of k v^T, each k decayed to the chunk's end
    # (for the later chunks) or to its start (for the earlier ones); a scan over the
    # chunks, each step decaying the state by a whole chunk, hands each chunk the sums of
    # the chunks before it and after it
    total = torch.exp(-d.sum(dim=3)).unsqueeze(-1).split(1, dim=2)  # n x (B, H, 1, N, 1)
    kv_forward = torch.matmul((k_ * to_end).transpose(-1, -2), v_).split(1, dim=2)
    kv_backward = torch.matmul((k_ * from_start).transpose(-1, -2), v_).split(1, dim=2)
    zero = torch.zeros_like(kv_forward[0])
    forward, backward = [zero], [zero]
    for c in range(1, n):
        forward.append(kv_forward[c - 1] if c == 1
                       else forward[-1] * total[c - 1] + kv_forward[c - 1])
        b = n - 1 - c
        backward.append(kv_backward[b + 1] if c == 1
                        else backward[-1] * total[b + 1] + kv_backward[b + 1])
    states = torch.cat((torch.cat(forward, dim=2), torch.cat(backward[::-1], dim=2)), dim=3)
    y = y + torch.matmul(torch.cat((r_ * from_start, r_ * to_end), dim=-1), states)
    return _tokens(y, T)


def _tokens(y: Tensor, T: int) -> Tensor:
    """(B, H, n, L, N) -> (B, T, C): the chunks back in token order, the padding dropped."""
    B, H, n, L, N = y.shape
    y = y.permute(0, 2, 3, 1, 4).reshape(-1, n * L, H * N)
    return y[:, :T].contiguous() if n * L > T else y


__all__ = ["CHUNK", "wkv6_bidirectional_chunked_plain"]
