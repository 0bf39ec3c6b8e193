"""The towers' products under CPU low-precision autocast (rwkv_clip.ops.products).

Where the policy applies, a product is the fp32 GEMM of the operands rounded as autocast
rounds them, rounded back: checked bit for bit against that recipe, against torch's own
bf16/fp16 kernels within one rounding step, for the gradients' values and dtypes, and for
what autograd saves (the memory planner's accounting).
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F

from rwkv_clip.errors import DispatchError
from rwkv_clip.layers.linear import Linear
from rwkv_clip.ops import dispatch
from rwkv_clip.ops.products import (
    LINEAR,
    LOWP_MATMUL,
    conv2d,
    cpu_matmul_in_fp32,
    linear,
    matmul,
)

pytestmark = pytest.mark.cpu_isa


@pytest.fixture
def policy(choose):
    """The low-precision switch (RWKV_CLIP_DISPATCH=lowp_matmul=...) for one test."""
    return lambda choice: choose("lowp_matmul", choice)


@pytest.fixture
def fp32_linear(choose):
    """The fp32 Linear switch (RWKV_CLIP_DISPATCH=linear=...) for one test."""
    return lambda choice: choose("linear", choice)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    """A dispatch cache of the test's own: what it times is not kept for other tests."""
    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path))
    dispatch.reset()
    yield
    dispatch.reset()


def _slowed(op: dispatch.Op, name: str, monkeypatch, seconds: float = 0.02) -> None:
    """Make implementation ``name`` of ``op`` slower by ``seconds`` a call (same values)."""
    impl = op.implementations[name]

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return impl.fn(*args, **kwargs)
    monkeypatch.setitem(op.implementations, name, dataclasses.replace(impl, fn=slow))


def _linear_choice(k: int = 512, n: int = 512) -> str:
    x, w = torch.randn(4, k), torch.randn(n, k)
    return dispatch.choose("linear", (x, w, None)).name


@pytest.mark.parametrize("slow,in_fp32", [("native", True), ("fp32", False)])
def test_auto_times_the_low_precision_gemms(own_cache, monkeypatch, slow, in_fp32):
    """``auto`` checks torch's bf16 GEMM and the fp32 GEMM of the rounded operands
    against the float64 product, times both at the first product's size and keeps the
    faster for the dtype (a CPU without native bf16 GEMMs makes torch's many times
    slower; here one is slowed on purpose)."""
    _slowed(LOWP_MATMUL, slow, monkeypatch)
    assert cpu_matmul_in_fp32(torch.bfloat16, (64, 128, 96)) is in_fp32
    record = dispatch.choices()["lowp_matmul cpu bfloat16 M=64 K=128 N=96"]
    assert record["how"] == "auto" and set(record["times_ms"]) == {"native", "fp32"}
    assert record["times_ms"][slow] >= 20 > min(record["times_ms"].values())
    assert cpu_matmul_in_fp32(torch.float32) is False
    timed = dispatch.counters["timed"]  # one decision per dtype: another size asks nothing
    assert cpu_matmul_in_fp32(torch.bfloat16, (8, 8, 8)) is in_fp32
    assert dispatch.counters["timed"] == timed


@pytest.mark.parametrize("slow", ["aten", "onednn"])
def test_auto_times_the_fp32_linear_per_shape_and_pass(own_cache, monkeypatch, slow):
    if LINEAR.implementations["onednn"].supports(torch.device("cpu"), torch.float32, {}):
        pytest.skip("torch built without oneDNN")
    _slowed(LINEAR, slow, monkeypatch)
    fast = ({"aten", "onednn"} - {slow}).pop()
    assert _linear_choice(64, 32) == fast
    x, w = torch.randn(4, 64), torch.randn(32, 64, requires_grad=True)
    assert dispatch.choose("linear", (x, w, None)).name == fast  # with gradients: timed again
    chosen = dispatch.choices()
    assert {"linear cpu float32 K=64 N=32", "linear cpu float32 K=64 N=32 pass=fwd+bwd"} \
        <= set(chosen)
    assert all(r["times_ms"][slow] >= 20 for r in chosen.values())


def test_linear_timing_is_cached_for_later_processes(own_cache):
    name = _linear_choice(48, 40)
    dispatch.reset()
    timed = dispatch.counters["timed"]
    assert _linear_choice(48, 40) == name and dispatch.counters["timed"] == timed
    assert dispatch.choices()["linear cpu float32 K=48 N=40"]["how"] == "cache"


def test_policy_choices(policy):
    policy("native")
    assert cpu_matmul_in_fp32(torch.bfloat16) is False
    policy("fp32")
    assert cpu_matmul_in_fp32(torch.bfloat16) is True
    assert cpu_matmul_in_fp32(torch.float16) is True
    policy("fast please")
    with pytest.raises(DispatchError, match="^unknown lowp_matmul implementation 'fast please' "
                                            r"\(from RWKV_CLIP_DISPATCH\); expected one of "
                                            "auto, fp32, native$"):
        cpu_matmul_in_fp32(torch.bfloat16)


def test_policy_pinned_through_dispatch_pin(policy):
    """dispatch.pin takes the products' ops too (the override wins over it)."""
    try:
        dispatch.pin({"lowp_matmul": "fp32"})
        assert cpu_matmul_in_fp32(torch.bfloat16) is True
        dispatch.pin("lowp_matmul=native,linear=mkl")
        assert cpu_matmul_in_fp32(torch.bfloat16) is False and _linear_choice() == "aten"
        policy("fp32")
        dispatch.pin({"lowp_matmul": "native"})
        assert cpu_matmul_in_fp32(torch.bfloat16) is True
    finally:
        dispatch.pin({})


def test_no_autocast_is_plain_torch(policy, fp32_linear):
    policy("fp32")
    fp32_linear("mkl")
    torch.manual_seed(0)
    layer = Linear(24, 16, bias=True)
    x = torch.randn(3, 5, 24)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert isinstance(layer, torch.nn.Linear)
    assert list(layer.state_dict()) == ["weight", "bias"]
    w = torch.randn(24, 8)
    assert torch.equal(matmul(x, w), x @ w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_is_the_fp32_gemm_of_the_rounded_operands(policy, dtype):
    policy("fp32")
    torch.manual_seed(1)
    x = torch.randn(4, 7, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    g = torch.randn(4, 7, 48)
    with torch.autocast("cpu", dtype=dtype):
        out = linear(x, w, b)
    assert out.dtype == dtype
    recipe = (x.detach().to(dtype).float() @ w.detach().to(dtype).float().t()
              + b.detach().to(dtype).float()).to(dtype)
    assert torch.equal(out, recipe)
    out.backward(g.to(dtype))
    grads = [t.grad.clone() for t in (x, w, b)]
    # torch's own low-precision kernels: the same values within one rounding step
    policy("native")
    for t in (x, w, b):
        t.grad = None
    with torch.autocast("cpu", dtype=dtype):
        native = linear(x, w, b)
    assert _rel(out, native) < 1e-2
    native.backward(g.to(dtype))
    for ours, theirs in zip(grads, (x.grad, w.grad, b.grad), strict=True):
        assert ours.dtype == theirs.dtype == torch.float32
        assert _rel(ours, theirs) < 2e-2
    # the weight gradient was rounded to the autocast dtype, as autocast's cast rounds it
    assert torch.equal(grads[1], grads[1].to(dtype).float())


def test_batched_matmul_and_its_gradients(policy):
    policy("fp32")
    torch.manual_seed(2)
    a = torch.randn(5, 30, 8).to(torch.bfloat16).requires_grad_()
    b = torch.randn(5, 8, 40).to(torch.bfloat16).requires_grad_()
    g = torch.randn(5, 30, 40).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = matmul(a, b)
    out.backward(g)
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = torch.bmm(a32, b32)
    ref.backward(g.float())
    assert torch.equal(out, ref.to(torch.bfloat16))
    assert a.grad.dtype == b.grad.dtype == torch.bfloat16
    assert torch.allclose(a.grad.float(), a32.grad, rtol=8e-3, atol=1e-6)
    assert torch.allclose(b.grad.float(), b32.grad, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("choice", ["fp32", "native"])
def test_matmul_with_a_broadcast_addend_is_baddbmm(policy, choice):
    """matmul(a, b, add): the addend (the lerp weights' time_maa_*, (G, 1, N)) in the
    product's pass, its gradient summed to its shape; plain fp32 is torch.baddbmm itself."""
    torch.manual_seed(3)
    a = torch.randn(5, 30, 8, requires_grad=True)
    b = torch.randn(5, 8, 40, requires_grad=True)
    add = torch.randn(5, 1, 40, requires_grad=True)
    g = torch.randn(5, 30, 40)
    ours = matmul(a, b, add=add)
    assert torch.equal(ours, torch.baddbmm(add, a, b))
    policy(choice)
    leaves = [t.detach().to(torch.bfloat16).requires_grad_() for t in (a, b, add)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = matmul(*leaves[:2], add=leaves[2])
    out.backward(g.to(torch.bfloat16))
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = torch.bmm(*ref_leaves[:2]) + ref_leaves[2]
    ref.backward(g.to(torch.bfloat16).float())
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)
    for mine, theirs in zip(leaves, ref_leaves, strict=True):
        assert mine.grad.dtype == torch.bfloat16 and mine.grad.shape == theirs.shape
        assert torch.allclose(mine.grad.float(), theirs.grad, rtol=2e-2, atol=5e-2)


def test_conv2d_matches_torch_within_rounding(policy):
    policy("fp32")
    torch.manual_seed(3)
    x = torch.randn(2, 3, 20, 20, requires_grad=True)
    w = torch.randn(16, 3, 4, 4, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv2d(x, w, b, (4, 4))
    assert out.dtype == torch.bfloat16
    recipe = F.conv2d(x.detach().bfloat16().float(), w.detach().bfloat16().float(),
                      b.detach().bfloat16().float(), (4, 4)).bfloat16()
    assert torch.equal(out, recipe)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    policy("native")
    for t in (x, w, b):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = conv2d(x, w, b, (4, 4))
    assert _rel(out, native) < 1e-2
    native.float().square().sum().backward()
    for ours, theirs in zip(grads, (x.grad, w.grad, b.grad), strict=True):
        assert ours.dtype == theirs.dtype == torch.float32
        assert _rel(ours, theirs) < 3e-2


def _saved_bytes(fn) -> list[tuple[torch.dtype, int]]:
    saved: list[tuple[torch.dtype, int]] = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sorted(saved, key=str)


def test_autograd_saves_what_autocast_saves(policy):
    """The planner counts a product as saving its low-precision input and weight."""
    torch.manual_seed(4)
    layer = Linear(32, 24)
    x = torch.randn(6, 32, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
    policy("fp32")
    ours = _saved_bytes(run)
    policy("native")
    theirs = _saved_bytes(run)
    assert ours == theirs == [(torch.bfloat16, 6 * 32), (torch.bfloat16, 24 * 32)]


onednn = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available()
         and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="torch built without oneDNN")


def test_fp32_linear_pins(fp32_linear, own_cache):
    fp32_linear("mkl")  # the name of torch's default on x86, kept as a pin
    assert _linear_choice() == "aten"
    fp32_linear("blas")
    with pytest.raises(DispatchError, match="unknown linear implementation 'blas'.*expected one "
                                            "of auto, aten, onednn, mkl$"):
        _linear_choice()


def test_forced_onednn_without_onednn_is_one_error(fp32_linear, monkeypatch, own_cache):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    fp32_linear("onednn")
    with pytest.raises(DispatchError, match="linear implementation 'onednn' .*cannot run here: "
                                            "this torch build has no oneDNN matmul"):
        _linear_choice()
    fp32_linear("auto")  # auto quietly keeps torch's default
    assert _linear_choice() == "aten"


@onednn
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_torch_and_keeps_its_gradients(fp32_linear, bias):
    """oneDNN's forward and input gradient are F.linear's within fp32 rounding; the
    weight and bias gradients are autograd's own products, bit for bit."""
    fp32_linear("onednn")
    torch.manual_seed(5)
    layer = Linear(512, 520, bias=bias)
    x = torch.randn(3, 11, 512, requires_grad=True)
    y = layer(x)
    assert y.grad_fn is not None and "onednn_linear" in y.grad_fn.name()
    y_ref = F.linear(x, layer.weight, layer.bias)
    assert _rel(y, y_ref) < 1e-5  # fp32 sums in another order
    g = torch.randn_like(y)
    params = (x, layer.weight) + ((layer.bias,) if bias else ())
    ours, theirs = torch.autograd.grad(y, params, g), torch.autograd.grad(y_ref, params, g)
    assert ours[0].shape == theirs[0].shape and _rel(ours[0], theirs[0]) < 1e-5
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    with torch.no_grad():  # no autograd node; a strided input is fine
        xt = torch.randn(11, 3, 512).transpose(0, 1)
        assert _rel(layer(xt), F.linear(xt, layer.weight, layer.bias)) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):  # never under autocast
        assert layer(x).dtype == torch.bfloat16
    narrow = Linear(512, 128)  # a pin holds for every product
    assert "onednn_linear" in narrow(x).grad_fn.name()


@onednn
def test_onednn_linear_saves_what_linear_saves(fp32_linear):
    torch.manual_seed(6)
    layer = Linear(512, 512, bias=False)
    x = torch.randn(6, 512, requires_grad=True)
    fp32_linear("onednn")
    ours = _saved_bytes(lambda: layer(x))
    fp32_linear("mkl")
    theirs = _saved_bytes(lambda: layer(x))
    assert sorted(ours) == sorted(theirs) == [(torch.float32, 6 * 512), (torch.float32, 512 * 512)]


@onednn
def test_traced_graphs_keep_aten_linear(fp32_linear):
    fp32_linear("onednn")
    layer = Linear(512, 512)
    graph = str(torch.jit.trace(layer, torch.randn(2, 512)).graph)
    assert "aten::linear" in graph and "mkldnn" not in graph


@onednn
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_operator_passes_opcheck(bias):
    """Schema, fake implementation (torch.compile traces it as one call) and autograd."""
    torch.manual_seed(7)
    x = torch.randn(2, 3, 512, requires_grad=True)
    w = torch.randn(512, 512, requires_grad=True)
    b = torch.randn(512, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.rwkv_clip.onednn_linear.default, (x, w, b),
                          atol=1e-4, rtol=1e-5)


@onednn
@pytest.mark.slow
def test_onednn_linear_compiles_fullgraph_forward_and_backward(fp32_linear):
    fp32_linear("onednn")
    torch.manual_seed(8)
    layer = Linear(512, 512, bias=True)
    x = torch.randn(4, 512, requires_grad=True)
    compiled = torch.compile(lambda t: torch.tanh(layer(t)), fullgraph=True, dynamic=False)
    y, y_ref = compiled(x), torch.tanh(layer(x))
    assert torch.allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    params = (x, layer.weight, layer.bias)
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(y_ref, params, g),
                    strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
