"""relu_square: the values, gradients and saved tensors of torch.square(torch.relu(x))."""
import pytest
import torch

from rwkv_clip.layers import relu_square


def _both(x: torch.Tensor, grad: torch.Tensor):
    out = []
    for f in (relu_square, lambda t: torch.square(torch.relu(t))):
        leaf = x.clone().requires_grad_(True)
        y = f(leaf)
        y.backward(grad)
        out.append((y.detach(), leaf.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bit_identical_to_the_plain_expression(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 40, generator=g).to(dtype)
    x[0, 0, :5] = 0.0  # relu's kink: the gradient there is zero in both
    grad = torch.randn(3, 7, 40, generator=g).to(dtype)
    (y, gx), (y_ref, gx_ref) = _both(x, grad)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert y.dtype == gx.dtype == dtype
    assert not gx[0, 0, :5].any()


def test_saves_one_tensor_of_the_input_size():
    x = torch.randn(4, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        relu_square(x)
    assert len(saved) == 1 and saved[0].shape == x.shape


def test_plain_expression_under_autocast_and_without_grad():
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = relu_square(x.bfloat16())
    assert type(y.grad_fn).__name__ == "PowBackward0"  # autocast's own op
    with torch.no_grad():
        assert relu_square(x).grad_fn is None
    assert type(relu_square(x).grad_fn).__name__.startswith("_ReluSquare")


def test_gradcheck():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(relu_square, (x,))
