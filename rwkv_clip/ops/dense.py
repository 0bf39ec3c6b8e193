"""Bidirectional WKV6 as one dense (T x T) mixing per head: the form exported to ONNX.

Only standard operators (Cast, CumSum, Sub, Exp, Where, Mul, ReduceSum, MatMul), no loop:
the exporter and onnxruntime see a plain graph (maths at :func:`wkv6_bidirectional_dense`
and in docs/export.md).
"""
from __future__ import annotations

import torch
from torch import Tensor


def wkv6_bidirectional_dense(r: Tensor, k: Tensor, v: Tensor, w: Tensor, u: Tensor) -> Tensor:
    """The bidirectional WKV6 of :func:`rwkv_clip.ops.wkv6_bidirectional`, without a scan.

    r, k, v, w: (B, T, C) with C = H * N; u: (H, N). Computes in float32, or float64
    when any input is float64 (the dtype promotion of the reference); returns (B, T, C).

    A sum over all positions s of ``r[t]·(A[t, s] * k[s]) v[s]`` with a per-channel weight
    ``A[t, s, j]``: the bonus ``u[j]`` on the diagonal and, off it, the decay products over
    the steps strictly between, ``prod_{min<q<max} exp(-exp(w[q, j]))``, built in log space
    from the cumulative sum ``C`` of ``exp(w)``: ``A[t, s] = exp(-(C[t-1] - C[s]))`` for
    ``s < t`` (mirrored for ``s > t``), an exponent never positive, so nothing overflows
    however strong the decay. Memory is O(B·C·T²).
    """
    B, T, C = r.shape
    H, N = u.shape
    dtype = torch.promote_types(torch.float32, r.dtype)
    for x in (k, v, w, u):
        dtype = torch.promote_types(dtype, x.dtype)

    def heads(x: Tensor) -> Tensor:  # (B, T, C) -> (B, H, T, N)
        return x.to(dtype).reshape(B, T, H, N).transpose(1, 2)

    r_, k_, v_, w_ = heads(r), heads(k), heads(v), heads(w)
    # C[t], the sum of exp(w) up to and with t, in float64: the exponents are differences
    # of these sums, and a float32 difference of two large sums would lose the digits of
    # a weak decay that follows strong ones
    inclusive = torch.cumsum(torch.exp(w_).to(torch.float64), dim=2)
    # C[t-1], shifted rather than C[t] - exp(w[t]), so neighbours get exactly exp(-0)
    exclusive = torch.cat((torch.zeros_like(inclusive[:, :, :1]), inclusive[:, :, :-1]), dim=2)
    # gap[t, s] = C[t-1] - C[s]: the decay exponent from s up to t for s < t; for s > t
    # the exponent is gap[s, t], the transpose
    gap = exclusive.unsqueeze(3) - inclusive.unsqueeze(2)  # (B, H, T_t, T_s, N)
    t_idx = torch.arange(T, device=r.device)
    before = (t_idx.view(T, 1) > t_idx.view(1, T)).view(1, 1, T, T, 1)  # s < t
    diagonal = (t_idx.view(T, 1) == t_idx.view(1, T)).view(1, 1, T, T, 1)
    exponent = torch.where(before, gap, gap.transpose(2, 3)).clamp_min(0).to(dtype)
    weight = torch.where(diagonal, u.to(dtype).view(1, H, 1, 1, N), torch.exp(-exponent))
    scores = (r_.unsqueeze(3) * weight * k_.unsqueeze(2)).sum(dim=-1)  # (B, H, T_t, T_s)
    y = torch.matmul(scores, v_)  # (B, H, T, N)
    return y.transpose(1, 2).reshape(B, T, C)


__all__ = ["wkv6_bidirectional_dense"]
