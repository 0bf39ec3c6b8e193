"""Token shifts against their definition, element by element (cls token, wider shifts)."""
import pytest
import torch

from rwkv_clip.ops.shift import bidirectional_shift_multihead, q_shift_multihead


def _q_shift_by_definition(x, s, head_dim, H, W, cls):
    B, N, C = x.shape
    out = torch.zeros_like(x)
    q = head_dim // 4
    for n in range(H * W):
        h, w = divmod(n, W)
        for c in range(C):
            part = (c % head_dim) // q  # 0 left, 1 right, 2 above, 3 below
            hh, ww = (h, w - s) if part == 0 else (h, w + s) if part == 1 else \
                (h - s, w) if part == 2 else (h + s, w)
            if 0 <= hh < H and 0 <= ww < W:
                out[:, n, c] = x[:, hh * W + ww, c]
    if cls:
        out[:, -1] = x[:, -1]
    return out


@pytest.mark.parametrize("cls,s", [(False, 1), (True, 1), (False, 2)])
def test_q_shift_matches_definition(cls, s):
    H, W, C, hd = 3, 4, 16, 8
    x = torch.randn(2, H * W + cls, C)
    expected = _q_shift_by_definition(x, s, hd, H, W, cls)
    assert torch.equal(q_shift_multihead(x, s, hd, (H, W), cls), expected)


def test_bidirectional_shift_matches_definition_and_grad():
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = bidirectional_shift_multihead(x, 1, 8)
    expected = torch.zeros_like(x)
    for t in range(5):
        for c in range(16):
            src = t - 1 if c % 8 < 4 else t + 1
            if 0 <= src < 5:
                expected[:, t, c] = x[:, src, c]
    assert torch.equal(out, expected)
    grad, = torch.autograd.grad(out.sum(), x)  # each kept value is read exactly once
    edge = torch.ones(5, 16)
    edge[-1, :4] = edge[-1, 8:12] = 0  # t = 4 feeds no t + 1 in the first halves
    edge[0, 4:8] = edge[0, 12:] = 0
    assert torch.equal(grad[0], edge)


@pytest.mark.parametrize("cls,s", [(False, 1), (True, 1), (False, 2)])
def test_shift_gradients_are_the_adjoint(cls, s):
    """<shift(x), g> == <x, grad>: backward (the opposite shift) is the transpose."""
    H, W, C, hd = 3, 4, 16, 8
    x = torch.randn(2, H * W + cls, C, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, H * W + cls, C, dtype=torch.float64)
    out = q_shift_multihead(x, s, hd, (H, W), cls)
    grad, = torch.autograd.grad(out, x, g)
    assert torch.allclose((out * g).sum(), (x * grad).sum(), rtol=1e-12)
    assert torch.autograd.gradcheck(lambda t: q_shift_multihead(t, s, hd, (H, W), cls), (x,))
    y = torch.randn(2, 6, C, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: bidirectional_shift_multihead(t, s, hd), (y,))


@pytest.mark.parametrize("op,shape", [("q_shift", (2, 3, 4, 2, 8)), ("sequence_shift", (2, 5, 2, 8))])
@pytest.mark.parametrize("adjoint", [False, True])
def test_shift_operators_pass_opcheck(op, shape, adjoint):
    """Schema, fake (meta) implementation and autograd registration of the two operators
    that torch.compile sees as opaque calls."""
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.rwkv_clip, op).default, (x, 1, adjoint))


def test_shifts_are_single_opaque_calls_in_a_compiled_graph():
    """dynamo records each shift as one rwkv_clip operator call (no indexing to fuse)."""
    from torch._dynamo.testing import EagerAndRecordGraphs
    backend = EagerAndRecordGraphs()
    x = torch.randn(2, 12, 16)
    f = torch.compile(lambda t: q_shift_multihead(t, 1, 8, (3, 4)) + bidirectional_shift_multihead(t, 1, 8),
                      backend=backend, fullgraph=True)
    assert torch.equal(f(x), q_shift_multihead(x, 1, 8, (3, 4)) + bidirectional_shift_multihead(x, 1, 8))
    code = backend.graphs[0].code
    assert "rwkv_clip.q_shift" in code and "rwkv_clip.sequence_shift" in code
    assert "slice" not in code and "setitem" not in code
