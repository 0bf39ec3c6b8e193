"""The field's anchor for the WKV benchmark: flash-linear-attention's RWKV-6 kernels
(``fla.ops.rwkv6``, from the fla-core wheel) wrapped as our bidirectional operator.

fla computes the causal RWKV-6 recurrence in layout (B, T, H, N) with the decay given in
log space (per-step decay exp(g)) and a query scale (default 1/sqrt(N)). Our operator is
bidirectional with per-step decay exp(-exp(w)) and no scale, so

    y = causal(r, k, v, g, u) + flip(causal(flip(r), flip(k), flip(v), flip(g), 0))

with g = -exp(w) and scale = 1.0, where flip reverses time: the second pass is the
time-reversed scan without the bonus, exactly as the reference builds it. Both passes
share one recurrence convention (output reads the state before step t's update), which
the benchmark's float64 check confirms before anything is timed.

Backends: ``fla-chunk`` (chunk_rwkv6), ``fla-fused-recurrent`` (fused_recurrent_rwkv6),
both Triton, CUDA only; ``fla-naive`` (fla's own pure-PyTorch recurrence) runs on CPU, so
the adapter itself is tested where there is no GPU.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

FLA_BACKENDS = ("fla-chunk", "fla-fused-recurrent", "fla-naive")


def _causal_fn(name: str) -> Callable[..., torch.Tensor]:
    """Causal RWKV-6 of fla in layout (B, T, H, N): f(r, k, v, g, u) -> (B, T, H, N)."""
    if name == "fla-chunk":
        from fla.ops.rwkv6 import chunk_rwkv6
        return lambda r, k, v, g, u: chunk_rwkv6(r, k, v, g, u, scale=1.0)[0]
    if name == "fla-fused-recurrent":
        from fla.ops.rwkv6 import fused_recurrent_rwkv6
        return lambda r, k, v, g, u: fused_recurrent_rwkv6(r, k, v, g, u, scale=1.0)[0]
    if name == "fla-naive":
        from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6

        def naive(r, k, v, g, u):  # this one wants (B, H, T, N)
            heads_first = [x.transpose(1, 2) for x in (r, k, v, g)]
            return naive_recurrent_rwkv6(*heads_first, u, scale=1.0)[0].transpose(1, 2)
        return naive
    raise ValueError(f"unknown fla backend {name!r}; expected one of {FLA_BACKENDS}")


def make_fla_backend(name: str) -> Callable[..., torch.Tensor]:
    """Our bidirectional WKV6 signature f(r, k, v, w, u) -> float32 (B, T, C) on fla."""
    causal = _causal_fn(name)

    def bidirectional(r, k, v, w, u):
        B, T, C = r.shape
        H, N = u.shape
        dtype = r.dtype

        def split(x):  # (B, T, C) -> (B, T, H, N) in the activations' dtype
            return x.to(dtype).reshape(B, T, H, N).contiguous()

        r4, k4, v4 = split(r), split(k), split(v)
        g4 = (-torch.exp(w.float())).reshape(B, T, H, N).contiguous()  # log decay, fp32
        u_ = u.to(dtype)

        def flip(x):
            return x.flip(1).contiguous()

        fwd = causal(r4, k4, v4, g4, u_)
        bwd = causal(flip(r4), flip(k4), flip(v4), flip(g4), torch.zeros_like(u_)).flip(1)
        return (fwd.float() + bwd.float()).reshape(B, T, C)

    return bidirectional
