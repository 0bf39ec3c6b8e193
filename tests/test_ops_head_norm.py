"""head_group_norm: the time mix's GroupNorm as a per-head layer norm on the CPU (the
``layer-norm`` implementation of the table's ``head_norm_gate`` op)."""
import pytest
import torch
import torch.nn.functional as F

from rwkv_clip.ops import dispatch
from rwkv_clip.ops.glue import HEAD_NORM_GATE, head_norm_gate, head_norm_gate_reference
from rwkv_clip.ops.head_norm import head_group_norm as _head_group_norm


def head_group_norm(x, norm):
    return _head_group_norm(x, norm.weight, norm.bias, norm.num_groups, norm.eps)


def _norm(heads: int, channels: int, dtype=torch.float32, seed: int = 0) -> torch.nn.GroupNorm:
    torch.manual_seed(seed)
    norm = torch.nn.GroupNorm(heads, channels, eps=64e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    return norm


def _grads(fn, x, norm, grad_out):
    x = x.detach().requires_grad_()
    out = fn(x)
    return (out, *torch.autograd.grad(out, (x, norm.weight, norm.bias), grad_out))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("rows,heads,channels", [(98, 8, 640), (154, 10, 640), (7, 2, 6)])
def test_values_and_gradients_equal_group_norm(dtype, tol, rows, heads, channels):
    norm = _norm(heads, channels, dtype)
    x = torch.randn(rows, channels, dtype=dtype) * 3 + 1
    grad_out = torch.randn(rows, channels, dtype=dtype)
    ours = _grads(lambda t: head_group_norm(t, norm), x, norm, grad_out)
    torch_gn = _grads(norm, x, norm, grad_out)
    for name, a, b in zip(("out", "x", "weight", "bias"), ours, torch_gn, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert ((a - b).abs().max() / b.abs().max()).item() < tol, name


def test_gradcheck():
    norm = _norm(3, 12, torch.float64)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, w, b: head_group_norm(t, _with(norm, w, b)),
                                    (x, norm.weight, norm.bias))


def _with(norm, weight, bias):
    clone = torch.nn.GroupNorm(norm.num_groups, norm.num_channels, eps=norm.eps).double()
    clone.weight, clone.bias = weight, bias  # the tensors gradcheck perturbs
    return clone


def test_saves_what_group_norm_saves():
    """The input and per-(row, head) mean and 1/std: the memory planner's count."""
    norm = _norm(8, 640)
    x = torch.randn(98, 640, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        head_group_norm(x, norm)
    params = {norm.weight.data_ptr(), norm.bias.data_ptr()}
    sizes = sorted(t.numel() for t in saved if t.data_ptr() not in params)
    assert sizes == [98 * 8, 98 * 8, 98 * 640]


def test_fp32_input_under_cpu_autocast_is_normalised_in_fp32():
    norm = _norm(8, 64)
    x = torch.randn(10, 64, requires_grad=True)
    grad = torch.randn(10, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = head_group_norm(x, norm)
        theirs = norm(x)
    assert ours.dtype == theirs.dtype == torch.float32
    assert type(ours.grad_fn.next_functions[0][0]).__name__.startswith("_HeadNorm")
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        # without grad: the same two ops, the same values as the forward that saves
        inferred = head_group_norm(x, norm)
        assert inferred.dtype == torch.float32 and torch.equal(inferred, ours)
        assert torch.allclose(inferred, norm(x), rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(ours, (x, norm.weight, norm.bias), grad),
                    torch.autograd.grad(theirs, (x, norm.weight, norm.bias), grad), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_table_runs_it_only_where_it_is_group_norm():
    """float32 / float64 on the CPU with parameters of the input's dtype; bf16 inputs or
    parameters, and TorchScript traces, take the reference (F.group_norm)."""
    impl = HEAD_NORM_GATE.implementations["layer-norm"]
    cpu = torch.device("cpu")
    assert impl.supports(cpu, torch.float32, {"params": "float32"}) is None
    assert impl.supports(cpu, torch.float64, {"params": "float64"}) is None
    assert "float32 / float64" in impl.supports(cpu, torch.bfloat16, {"params": "bfloat16"})
    assert "float32 / float64" in impl.supports(cpu, torch.float32, {"params": "bfloat16"})
    norm = _norm(8, 64)
    y, gate = torch.randn(2, 5, 64), torch.randn(2, 5, 64)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, t, g):
            return head_norm_gate(t, self.norm.weight, self.norm.bias, g, 8, self.norm.eps)
    dispatch.reset()
    traced = torch.jit.trace(Wrapped(), (y, gate))
    graph = traced.inlined_graph.str()
    assert "group_norm" in graph and "layer_norm" not in graph
    expected = head_norm_gate_reference(y, norm.weight, norm.bias, gate, 8, norm.eps)
    assert torch.equal(traced(y, gate), expected)
    assert torch.equal(expected, F.group_norm(y.view(10, 64), 8, norm.weight, norm.bias,
                                              norm.eps).view(2, 5, 64) * F.silu(gate))
