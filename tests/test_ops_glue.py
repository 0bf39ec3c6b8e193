"""The fused glue ops (rwkv_clip.ops.glue): each reference against the layers' own maths,
bit for bit, and each Triton kernel pair, through its custom op and autograd, against the
reference in float64: forward and every gradient, fp32 and bf16.

The kernels run on the CPU under Triton's interpreter, in a subprocess (this file as a
script), because ``TRITON_INTERPRET=1`` must be set before Triton is imported; the
``gpu`` tests run the same cases on CUDA. The interpreter's cast from float32 to bf16
truncates where a GPU rounds to nearest, so in bf16 the interpreted kernels are held to
a tolerance (one bf16 step) and only the GPU test asks for the squared ReLU's exact bits.
A slow test compiles every kernel variant for sm_90 without a GPU (what the interpreter
leaves unchecked: lowering, types, layouts).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rwkv_clip.ops import glue
from rwkv_clip.ops.glue import (
    Shift,
    head_norm_gate_reference,
    relu_square_reference,
    shift_lerp_reference,
    shift_reference,
)
from rwkv_clip.ops.lerp import lerp_split
from rwkv_clip.ops.relu_square import relu_square
from rwkv_clip.ops.shift import bidirectional_shift_multihead, q_shift_multihead

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |ours - float64 reference| / max |reference|: fp32 arithmetic; bf16 outputs (one bf16
# step, 2^-7, is 7.8e-3 of a value; the interpreter truncates, so up to a step of the peak)
TOL = {"fp32": 1e-5, "bf16": 1.6e-2}


# ----------------------------------------------------------------------- the references
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("pixels", [1, 2])
def test_shift_reference_is_the_layers_shift(dtype, pixels):
    g = torch.Generator().manual_seed(pixels)
    x = torch.randn(2, 3 * 4, 32, generator=g).to(DTYPES[dtype])
    assert torch.equal(shift_reference(x, Shift("q", 16, pixels, (3, 4))),
                       q_shift_multihead(x, pixels, 16, (3, 4)))
    with_cls = torch.randn(2, 3 * 4 + 1, 32, generator=g).to(DTYPES[dtype])
    assert torch.equal(shift_reference(with_cls, Shift("q", 16, pixels, (3, 4), cls=True)),
                       q_shift_multihead(with_cls, pixels, 16, (3, 4), with_cls_token=True))
    seq = torch.randn(2, 7, 32, generator=g).to(DTYPES[dtype])
    assert torch.equal(shift_reference(seq, Shift("sequence", 8, pixels)),
                       bidirectional_shift_multihead(seq, pixels, 8))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_shift_lerp_reference_is_the_layers_mixes(dtype):
    """The time mix's five data-dependent lerps (weight (5, B, T, C)), its first lerp and
    the image channel mix's two (weights (S, 1, 1, C), the neighbour first)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 32, generator=g).to(DTYPES[dtype])
    shift = Shift("q", 16, 1, (3, 4))
    shifted = q_shift_multihead(x, 1, 16, (3, 4))
    five = torch.rand(5, 2, 12, 32, generator=g).to(DTYPES[dtype])
    assert torch.equal(shift_lerp_reference(x, five, shift),
                       torch.stack(lerp_split(x, shifted, five)))
    first = torch.rand(1, 1, 1, 32, generator=g).to(DTYPES[dtype])
    assert torch.equal(shift_lerp_reference(x, first, shift)[0], torch.lerp(x, shifted, first[0]))
    two = torch.rand(2, 1, 1, 32, generator=g).to(DTYPES[dtype])
    assert torch.equal(shift_lerp_reference(x, two, shift, shifted_first=True),
                       torch.stack(lerp_split(shifted, x, two)))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_head_norm_gate_reference_is_the_layers_output_glue(dtype):
    """``ln_x`` (an nn.GroupNorm, as the GPU runs it) cast to the gate's dtype, times
    silu(gate): TimeMixBase.output_projection's arithmetic before ``output``."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(2, 5, 160, generator=g)
    gate = torch.randn(2, 5, 160, generator=g).to(DTYPES[dtype])
    ln_x = nn.GroupNorm(2, 160, eps=1e-5 * 64)
    with torch.no_grad():
        ln_x.weight.normal_(generator=g)
        ln_x.bias.normal_(generator=g)
    expected = ln_x(y.view(10, 160)).view(2, 5, 160).to(gate.dtype) * F.silu(gate)
    got = head_norm_gate_reference(y, ln_x.weight, ln_x.bias, gate, 2, ln_x.eps)
    assert got.dtype == gate.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_relu_square_reference_is_the_layers_activation(dtype):
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(2)).to(DTYPES[dtype])
    x[0, :5] = 0
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = relu_square_reference(ours), relu_square(theirs)
    assert out.dtype == x.dtype and torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(ours.grad, theirs.grad)


def test_shift_refuses_what_it_cannot_shift():
    with pytest.raises(ValueError, match="head_dim=6 .* multiple of 4"):
        Shift("q", 6)
    with pytest.raises(ValueError, match="shift kind 'left'"):
        Shift("left", 8)
    with pytest.raises(ValueError, match="11 tokens, grid"):
        shift_reference(torch.zeros(1, 11, 16), Shift("q", 8, 1, (3, 4)))


def test_cpu_tensors_cannot_take_the_kernels_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(1, 4, 8)
    assert not glue.uses_triton(x)
    assert torch.equal(glue.relu_square(x - 1), torch.zeros_like(x))


# ----------------------------------------------------------------------- the kernels
# (op, dtype, parameters); the interpreter runs each program in Python, so shapes are small
CASES = [
    ("shift_lerp", "fp32", {"shift": ["q", 8, 1, [3, 4], False], "B": 2, "S": 5, "full": True,
                            "shifted_first": False}),
    ("shift_lerp", "bf16", {"shift": ["q", 16, 1, [2, 3], True], "B": 3, "S": 2,
                            "full": False, "shifted_first": True, "row_programs": 2}),
    ("shift_lerp", "fp32", {"shift": ["q", 80, 1, [2, 2], False], "B": 1, "S": 2,
                            "full": False, "shifted_first": True}),  # two channel blocks
    ("shift_lerp", "bf16", {"shift": ["sequence", 8, 1, [0, 0], False], "B": 2, "T": 7,
                            "S": 5, "full": True, "shifted_first": False}),
    ("shift_lerp", "fp32", {"shift": ["sequence", 8, 2, [0, 0], False], "B": 5, "T": 6,
                            "S": 1, "full": False, "shifted_first": False,
                            "row_programs": 2}),
    ("head_norm_gate", "fp32", {"B": 2, "T": 5, "H": 2, "N": 80, "eps": 1e-5}),
    ("head_norm_gate", "bf16", {"B": 5, "T": 7, "H": 3, "N": 64, "eps": 1e-5 * 64,
                                "row_programs": 2}),
    ("relu_square", "fp32", {"shape": [3, 1500]}),
    ("relu_square", "bf16", {"shape": [3, 1500]}),
]


def _inputs(op: str, dtype: torch.dtype, p: dict, device: str, g: torch.Generator):
    """The op's inputs (float32 draws rounded to dtype), its arguments, and the upstream
    gradient."""
    def rand(*shape, scale=1.0, low=0.0):
        return (torch.rand(*shape, generator=g) * scale + low).to(dtype).to(device)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if op == "shift_lerp":
        kind, hd, pixels, grid, cls = p["shift"]
        shift = Shift(kind, hd, pixels, tuple(grid), cls)
        T = grid[0] * grid[1] + int(cls) if kind == "q" else p["T"]
        C = 4 * hd if hd < 80 else 2 * hd
        B, S = p["B"], p["S"]
        x = randn(B, T, C)
        # lerp weights around [0, 1], some past either end (both of torch.lerp's branches)
        weight = rand(S, B, T, C, scale=1.4, low=-0.2) if p["full"] else \
            rand(S, 1, 1, C, scale=1.4, low=-0.2)
        return [x, weight], (shift, p["shifted_first"]), randn(S, B, T, C)
    if op == "head_norm_gate":
        B, T, H, N = p["B"], p["T"], p["H"], p["N"]
        y = (torch.randn(B, T, H * N, generator=g) * 3 + 1).to(device)  # WKV out: float32
        weight = (torch.rand(H * N, generator=g) + 0.5).to(device)
        bias = torch.randn(H * N, generator=g).to(device)
        return [y, weight, bias, randn(B, T, H * N)], (H, p["eps"]), randn(B, T, H * N)
    x = randn(*p["shape"])
    x.view(-1)[:7] = 0  # relu's kink: no gradient at 0
    return [x], (), randn(*p["shape"])


def _call(op: str, inputs, args, reference: bool):
    if op == "shift_lerp":
        x, weight = inputs
        shift, shifted_first = args
        if reference:
            return shift_lerp_reference(x, weight, shift, shifted_first)
        from rwkv_clip.ops.glue.shift_lerp_kernel import shift_lerp_op
        return shift_lerp_op(x, weight, shift.kind, shift.head_dim, shift.pixels,
                             shift.grid[0], shift.grid[1], shift.cls, shifted_first)
    if op == "head_norm_gate":
        if reference:
            return head_norm_gate_reference(*inputs, *args)
        from rwkv_clip.ops.glue.head_norm_gate_kernel import head_norm_gate_op
        return head_norm_gate_op(*inputs, *args)
    if reference:
        return relu_square_reference(*inputs)
    from rwkv_clip.ops.glue.relu_square_kernel import relu_square_op
    return relu_square_op(*inputs)


def run_case(op: str, dtype: str, p: dict, device: str) -> dict:
    """Errors of the op's Triton kernels (forward and each input's gradient, through
    autograd) against the float64 reference on the same inputs, relative to the largest
    reference value; ``exact``: output and gradients equal the reference run in the
    inputs' own dtypes, bit for bit."""
    if "row_programs" in p:  # several row blocks per program: the partial-sum loop
        from rwkv_clip.ops.glue import head_norm_gate_kernel, shift_lerp_kernel
        module = shift_lerp_kernel if op == "shift_lerp" else head_norm_gate_kernel
        kept = module.ROW_PROGRAMS
        module.ROW_PROGRAMS = p["row_programs"]
        try:
            return run_case(op, dtype, {k: v for k, v in p.items() if k != "row_programs"},
                            device)
        finally:
            module.ROW_PROGRAMS = kept
    inputs, args, grad = _inputs(op, DTYPES[dtype], p, device, torch.Generator().manual_seed(7))
    ours = [t.clone().requires_grad_() for t in inputs]
    out = _call(op, ours, args, reference=False)
    grads = torch.autograd.grad(out, ours, grad)
    wide = [t.double().requires_grad_() for t in inputs]
    ref = _call(op, wide, args, reference=True)
    ref_grads = torch.autograd.grad(ref, wide, grad.double())
    same = [t.clone().requires_grad_() for t in inputs]
    plain = _call(op, same, args, reference=True)
    plain_grads = torch.autograd.grad(plain, same, grad)
    errors = {}
    for name, a, b, like in zip(["out"] + [f"grad{i}" for i in range(len(inputs))],
                                [out, *grads], [ref, *ref_grads], [ref, *inputs], strict=True):
        if a.shape != b.shape or a.dtype != (plain.dtype if name == "out" else like.dtype):
            raise AssertionError(f"{op} {name}: {a.dtype} {tuple(a.shape)}")
        errors[name] = float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12))
    exact = all(torch.equal(a, b) for a, b in zip([out, *grads], [plain, *plain_grads],
                                                   strict=True))
    return {"errors": errors, "exact": exact}


def _failures(results) -> list[str]:
    bad = []
    for (op, dtype, p), res in zip(CASES, results, strict=True):
        over = {k: v for k, v in res["errors"].items() if not v <= TOL[dtype]}
        if over:
            bad.append(f"{op} {dtype} {p}: above {TOL[dtype]}: {over}")
    return bad


def test_kernels_match_the_float64_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for (op, dtype, _), r in zip(CASES, results, strict=True):
        print(op, dtype, " ".join(f"{k}={v:.1e}" for k, v in r["errors"].items()), r["exact"])
    assert not _failures(results), "\n".join(_failures(results))
    # float32 squared ReLU: the same two roundings as torch's, so the same bits
    assert results[CASES.index(("relu_square", "fp32", {"shape": [3, 1500]}))]["exact"]


def opcheck_all() -> dict[str, dict[str, str]]:
    """torch.library.opcheck of each op (schema, fake kernel against the real one, autograd
    registration, tracing by AOTAutograd with dynamic shapes), on the CPU tensors the
    interpreter takes."""
    from rwkv_clip.ops.glue.head_norm_gate_kernel import head_norm_gate_op
    from rwkv_clip.ops.glue.relu_square_kernel import relu_square_op
    from rwkv_clip.ops.glue.shift_lerp_kernel import shift_lerp_op
    g = torch.Generator().manual_seed(5)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()
    calls = {
        "shift_lerp_q_full": (shift_lerp_op, (leaf(2, 12, 32), leaf(5, 2, 12, 32), "q", 16, 1,
                                              3, 4, False, False)),
        "shift_lerp_sequence_per_channel": (shift_lerp_op, (leaf(2, 6, 32), leaf(2, 1, 1, 32),
                                                            "sequence", 8, 1, 0, 0, False,
                                                            True)),
        "head_norm_gate": (head_norm_gate_op, (leaf(2, 5, 32), leaf(32), leaf(32),
                                               leaf(2, 5, 32), 2, 1e-5)),
        "relu_square": (relu_square_op, (leaf(3, 70),)),
    }
    return {name: torch.library.opcheck(op, args) for name, (op, args) in calls.items()}


@pytest.mark.slow  # a minute or two: opcheck runs each op several times, interpreted
def test_ops_pass_opcheck_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, __file__, "opcheck"], env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for name, checks in results.items():
        assert set(checks) >= {"test_schema", "test_autograd_registration", "test_faketensor",
                               "test_aot_dispatch_dynamic"}, name
        assert set(checks.values()) == {"SUCCESS"}, (name, checks)


def _signature(kernel, types: dict[str, str], consts: dict) -> dict[str, str]:
    return {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}


@pytest.mark.slow  # about 30 s: Triton's whole pipeline, ptxas included, per variant
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_sm90_without_a_gpu(dtype):
    """Every kernel, forward and backward, in the variants the towers use (q shift with and
    without cls token, sequence shift; 5 full, 2 and 1 per-channel weights; heads of 64 and
    80), compiled by Triton for an H100/H200 (sm_90) down to a cubin: what the interpreter
    does not check (types, layouts, lowering). Nothing runs."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rwkv_clip.ops.glue import head_norm_gate_kernel as hn
    from rwkv_clip.ops.glue import relu_square_kernel as rs
    from rwkv_clip.ops.glue import shift_lerp_kernel as sl

    def compile_(kernel, types, consts, **options):
        names = kernel.arg_names
        src = ASTSource(kernel, _signature(kernel, types, consts),
                        constexprs={(names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"], kernel.fn.__name__

    t, i32 = f"*{dtype}", "i32"
    sizes = dict.fromkeys(("R", "T", "C", "GH", "GW", "PIX", "w_stride_s", "w_stride_r",
                           "ITERS", "n"), i32)
    for S, HD, q, cls, first in ((5, 80, True, False, False), (2, 80, True, True, True),
                                 (1, 64, False, False, False)):
        consts = dict(S=S, HD=HD, QSHIFT=q, CLS=cls, SHIFTED_FIRST=first,
                      BR=sl.BLOCK_ROWS, BC=sl.BLOCK_CHANNELS)
        compile_(sl._forward_kernel, dict(sizes, x_ptr=t, w_ptr=t, out_ptr=t), consts)
        for full in (True, False):
            compile_(sl._backward_kernel,
                     dict(sizes, x_ptr=t, w_ptr=t, g_ptr=t, gx_ptr=t,
                          gw_ptr=t if full else "*fp32"),
                     dict(consts, FULL=full, SP=triton.next_power_of_2(S)),
                     num_warps=sl.BACKWARD_WARPS)
    f32 = "*fp32"
    for N in (64, 80):
        consts = dict(N=N, NP=triton.next_power_of_2(N), BR=hn.BLOCK_ROWS)
        norm = dict(sizes, y_ptr=f32, w_ptr=f32, b_ptr=f32, gate_ptr=t, eps="fp32")
        compile_(hn._forward_kernel, dict(norm, out_ptr=t), consts)
        compile_(hn._backward_kernel, dict(norm, g_ptr=t, gy_ptr=f32, ggate_ptr=t,
                                           gw_ptr=f32, gb_ptr=f32), consts)
    compile_(rs._forward_kernel, dict(sizes, x_ptr=t, out_ptr=t), dict(BLOCK=rs.BLOCK))
    compile_(rs._backward_kernel, dict(sizes, x_ptr=t, g_ptr=t, gx_ptr=t), dict(BLOCK=rs.BLOCK))


def test_ops_trace_with_fake_cuda_tensors():
    """Through the dispatchers on (fake) CUDA tensors: the custom ops' fake kernels, each
    way, give the reference's shapes and dtypes, nothing launched (torch.compile's view of
    them)."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.rwkv_clip
    with FakeTensorMode():
        x = torch.empty(2, 12, 32, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(5, 2, 12, 32, device="cuda", dtype=torch.bfloat16)
        mixes = torch.stack(glue.shift_lerp(x, w, Shift("q", 16, 1, (3, 4))))
        assert glue.uses_triton(x) and (mixes.shape, mixes.dtype) == ((5, 2, 12, 32), x.dtype)
        grads = ops.glue_shift_lerp_backward(mixes, x, w, "q", 16, 1, 3, 4, False, False)
        assert [(t.shape, t.dtype) for t in grads] == [(x.shape, x.dtype), (w.shape, w.dtype)]
        y = torch.empty(2, 12, 32, device="cuda")
        p = torch.empty(32, device="cuda")
        out = glue.head_norm_gate(y, p, p, x, 2, 1e-5)
        assert (out.shape, out.dtype) == (x.shape, x.dtype)
        grads = ops.glue_head_norm_gate_backward(out, y, p, p, x, 2, 1e-5)
        assert [(t.shape, t.dtype) for t in grads] == [(y.shape, y.dtype), (p.shape, p.dtype),
                                                       (p.shape, p.dtype), (x.shape, x.dtype)]
        k = glue.relu_square(x)
        assert (k.shape, k.dtype) == (x.shape, x.dtype)
        gk = ops.glue_relu_square_backward(k, x)
        assert (gk.shape, gk.dtype) == (x.shape, x.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernels_match_the_float64_reference_on_cuda(case):
    op, dtype, p = CASES[case]
    res = run_case(op, dtype, p, "cuda")
    over = {k: v for k, v in res["errors"].items() if not v <= TOL[dtype]}
    assert not over, f"{op} {dtype} {p}: above {TOL[dtype]}: {over}"
    if op == "relu_square":  # rounding to nearest on a GPU: torch's bits in both dtypes
        assert res["exact"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_ops_compile_in_one_graph_on_cuda():
    """torch.compile(fullgraph=True) of a function of all three ops equals its eager run,
    forward and gradients."""
    from rwkv_clip.compiling import compile_model

    shift = Shift("q", 16, 1, (3, 4))

    def block(x, w, y, p, b):
        mixes = glue.shift_lerp(x, w, shift)
        gated = glue.head_norm_gate(y, p, b, mixes[0], 2, 1e-5)
        return glue.relu_square(gated + mixes[1])

    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 12, 32, generator=g), torch.rand(2, 2, 12, 32, generator=g),
              torch.randn(2, 12, 32, generator=g), torch.rand(32, generator=g) + 0.5,
              torch.randn(32, generator=g)]
    results = []
    for fn in (block, compile_model(block, fullgraph=True, dynamic=False)):
        leaves = [t.cuda().requires_grad_() for t in inputs]
        out = fn(*leaves)
        results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":  # the subprocess of the interpreter tests
    torch.set_num_threads(1)
    if sys.argv[1:] == ["opcheck"]:
        print(json.dumps(opcheck_all()))
    else:
        print(json.dumps([run_case(op, dtype, p, "cpu") for op, dtype, p in CASES]))
