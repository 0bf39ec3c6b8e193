"""rwkv_clip.ops.lerp: torch.lerp's values, gradients (gradcheck) and saved tensors."""
import pytest
import torch

from rwkv_clip.ops.lerp import lerp, lerp_split

SHAPES = [  # (start/end, weight): the towers' three uses
    ((2, 5, 8), (5, 2, 5, 8)),     # the stacked data-dependent weights
    ((2, 5, 8), (1, 1, 8)),        # time_maa_x
    ((2, 5, 8), (2, 1, 1, 8)),     # the channel mix's two parameters
]


@pytest.mark.parametrize("shape,weight_shape", SHAPES)
def test_values_and_gradcheck(shape, weight_shape):
    torch.manual_seed(0)
    x, e = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    w = torch.rand(weight_shape, dtype=torch.float64)
    assert torch.equal(lerp(x, e, w), torch.lerp(x, e, w))
    inputs = tuple(t.clone().requires_grad_() for t in (x, e, w))
    assert torch.autograd.gradcheck(lerp, inputs)
    g = torch.randn(torch.broadcast_shapes(shape, weight_shape), dtype=torch.float64)
    ours = torch.autograd.grad(lerp(*inputs), inputs, g)
    theirs = torch.autograd.grad(torch.lerp(*inputs), inputs, g)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_and_full_precision_gradients_match_torch(dtype):
    torch.manual_seed(1)
    x, e = torch.randn(3, 7, 16), torch.randn(3, 7, 16)
    w = torch.rand(5, 3, 7, 16) * 0.2 + 0.8  # near 1: where sum(g) - sum(g w) cancels
    g = torch.randn(5, 3, 7, 16)
    inputs = [t.to(dtype).requires_grad_() for t in (x, e, w)]
    ours = torch.autograd.grad(lerp(*inputs), inputs, g.to(dtype))
    theirs = torch.autograd.grad(torch.lerp(*inputs), inputs, g.to(dtype))
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 0.0  # bf16: torch's own formula, bit for bit
        assert ((a.float() - b.float()).abs().max() <= tol * b.float().abs().max()).item()


def test_saves_what_torch_lerp_saves():
    x, e = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 3, 4, requires_grad=True)
    w = torch.rand(5, 2, 3, 4, requires_grad=True)

    def saved(fn):
        out = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: out.append(t.shape) or t,
                                                      lambda t: t):
            fn(x, e, w)
        return sorted(out)
    assert saved(lerp) == saved(torch.lerp)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True), (True, False, True)])
def test_gradients_of_a_subset(needs):
    torch.manual_seed(2)
    base = (torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.rand(5, 2, 5, 8))
    ours = [t.clone().requires_grad_(n) for t, n in zip(base, needs, strict=True)]
    theirs = [t.clone().requires_grad_(n) for t, n in zip(base, needs, strict=True)]
    g = torch.randn(5, 2, 5, 8)
    lerp(*ours).backward(g)
    torch.lerp(*theirs).backward(g)
    for a, b, n in zip(ours, theirs, needs, strict=True):
        assert (a.grad is None) == (not n)
        if n:
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)


SPLIT_SHAPES = [((2, 5, 8), (5, 2, 5, 8)), ((2, 5, 8), (2, 1, 1, 8))]  # time mix, channel mix


@pytest.mark.parametrize("shape,weight_shape", SPLIT_SHAPES)
def test_split_values_and_gradcheck(shape, weight_shape):
    torch.manual_seed(3)
    x, e = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    w = torch.rand(weight_shape, dtype=torch.float64)
    ours = lerp_split(x, e, w)
    assert len(ours) == weight_shape[0]
    for a, b in zip(ours, torch.lerp(x, e, w).unbind(0), strict=True):
        assert torch.equal(a, b)
    inputs = tuple(t.clone().requires_grad_() for t in (x, e, w))
    assert torch.autograd.gradcheck(lambda *t: torch.stack(lerp_split(*t)), inputs)
    # an output nobody uses gets a zero gradient
    used = torch.autograd.grad(lerp_split(*inputs)[0].sum(), inputs)
    expected = torch.autograd.grad(torch.lerp(*inputs)[0].sum(), inputs)
    for a, b in zip(used, expected, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,weight_shape", SPLIT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_gradients_match_torch(dtype, shape, weight_shape):
    torch.manual_seed(4)
    base = (torch.randn(shape), torch.randn(shape), torch.rand(weight_shape) * 0.2 + 0.8)
    g = torch.randn(torch.broadcast_shapes(shape, weight_shape)).to(dtype)
    inputs = [t.to(dtype).requires_grad_() for t in base]
    ours = torch.autograd.grad(lerp_split(*inputs), inputs, g.unbind(0))
    theirs = torch.autograd.grad(torch.lerp(*inputs), inputs, g)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == dtype and a.shape == b.shape
        tol = 1e-5 if dtype == torch.float32 else 0.0  # bf16: torch's own products and sums
        assert ((a.float() - b.float()).abs().max() <= tol * b.float().abs().max()).item()


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True)])
def test_split_gradients_of_a_subset(needs):
    torch.manual_seed(5)
    base = (torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.rand(5, 2, 5, 8))
    ours = [t.clone().requires_grad_(n) for t, n in zip(base, needs, strict=True)]
    theirs = [t.clone().requires_grad_(n) for t, n in zip(base, needs, strict=True)]
    g = torch.randn(5, 2, 5, 8)
    torch.autograd.backward(lerp_split(*ours), g.unbind(0))
    torch.lerp(*theirs).backward(g)
    for a, b, n in zip(ours, theirs, needs, strict=True):
        assert (a.grad is None) == (not n)
        if n:
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
