"""relu_square: the values, gradients and saved tensors of torch.square(torch.relu(x))."""
import pytest
import torch

from rwkv_clip.ops.relu_square import relu_square


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


def test_cpu_autocast_takes_the_short_backward_and_no_grad_none():
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = relu_square(x.bfloat16())
    assert type(y.grad_fn).__name__.startswith("_ReluSquare") and y.dtype == torch.bfloat16
    with torch.no_grad():
        assert relu_square(x).grad_fn is None
    assert type(relu_square(x).grad_fn).__name__.startswith("_ReluSquare")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_without_grad_overwrites_the_scratch_bit_identically(dtype):
    x = torch.randn(3, 5, 40).to(dtype)
    expected = torch.square(torch.relu(x))
    scratch = x.clone()
    with torch.no_grad():
        out = relu_square(scratch, inplace=True)
    assert out.data_ptr() == scratch.data_ptr() and torch.equal(out, expected)
    leaf = x.clone().requires_grad_(True)  # with grad: the input is left alone
    relu_square(leaf, inplace=True).sum().backward()
    assert torch.equal(leaf.detach(), x)


def test_gradcheck():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(relu_square, (x,))
