"""Pure-PyTorch bidirectional WKV6: the oracle the native kernels are tested against.

Works in any floating dtype (float64 included) on any device, and is differentiable by
plain autograd. It is a direct O(T) scan, two passes per call, so it is slow: the model
uses the native kernels by default and this only where asked (tests, exotic devices).
"""
import torch


def _causal_scan(r, k, v, decay, u):
    """One direction of WKV6. All inputs (B, H, T, N); u is (H, N) or None.

    y[t, i] = sum_j r[t, j] * (u[j] k[t, j] v[t, i] + S[t-1][j, i]) with
    S[t] = decay[t] * S[t-1] + k[t] v[t]^T, so step s reaches step t decayed by the
    product of decay[q] for s < q < t (strictly between).
    """
    B, H, T, N = r.shape
    state = r.new_zeros(B, H, N, N)
    outputs = []
    for t in range(T):
        kv = k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, N_j, N_i)
        seen = state if u is None else state + u[None, :, :, None] * kv
        outputs.append(torch.einsum("bhj,bhji->bhi", r[:, :, t], seen))
        state = state * decay[:, :, t, :, None] + kv
    return torch.stack(outputs, dim=2)


def wkv6_bidirectional_reference(r, k, v, w, u):
    """Bidirectional WKV6 as in RWKV-CLIP.

    r, k, v, w: (B, T, C) with C = H * N; u: (H, N). Per-step decay is exp(-exp(w)).
    Returns (B, T, C) in the promoted dtype of the inputs (float32 for the usual
    bf16/fp16/fp32 mix, float64 when the inputs are float64).
    """
    B, T, C = r.shape
    H, N = u.shape
    if C != H * N:
        raise ValueError(f"wkv6: channels {C} != heads {H} x head size {N}")
    dtype = torch.promote_types(torch.float32, r.dtype)
    for t in (k, v, w, u):
        dtype = torch.promote_types(dtype, t.dtype)

    def heads(x):
        return x.to(dtype).view(B, T, H, N).transpose(1, 2)

    r_, k_, v_ = heads(r), heads(k), heads(v)
    decay = torch.exp(-torch.exp(heads(w)))
    u_ = u.to(dtype)
    forward = _causal_scan(r_, k_, v_, decay, u_)
    flip = lambda x: x.flip(2)
    backward = flip(_causal_scan(flip(r_), flip(k_), flip(v_), flip(decay), None))
    return (forward + backward).transpose(1, 2).reshape(B, T, C)
