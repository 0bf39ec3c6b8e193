"""The chunked (Triton) CUDA variant of the WKV operator, run on the CPU by Triton's
interpreter against the float64 reference: y and all five gradients, both head sizes,
every input dtype, sequence lengths around the chunk size and several chunks long, decays
from near 1 (w = -8) to underflow (w = +5).

Triton builds its own library functions (tl.sum, tl.cumsum) as interpreted or compiled
when it is imported, so ``TRITON_INTERPRET=1`` has to be set before that: the kernel cases
run in a subprocess (this file as a script), through the op's registered CUDA
implementation with CPU tensors, and report their errors as JSON.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from rwkv_clip.errors import WKVError
from rwkv_clip.ops import build, kernels
from rwkv_clip.ops.reference import wkv6_bidirectional_reference

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(B, T, H, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    C = H * N
    r = torch.randn(B, T, C, generator=g)
    k = torch.randn(B, T, C, generator=g) * 0.5
    v = torch.randn(B, T, C, generator=g)
    # each channel around its own level from -8 (decay exp(-e^-8), near 1) to +5 (exp(-148),
    # underflow), with per-token noise: long memories, cut-offs and mixtures in one head
    level = torch.linspace(-8, 5, C).view(1, 1, C)
    w = (level + 1.5 * torch.randn(B, T, C, generator=g)).clamp(-8, 5)
    u = torch.randn(H, N, generator=g) * 0.5
    gy = torch.randn(B, T, C, generator=g)
    return [r.to(dtype), k.to(dtype), v.to(dtype), w, u.to(dtype)], gy


def reference_grads(inputs, gy):
    xs = [x.double().requires_grad_() for x in inputs]
    y = wkv6_bidirectional_reference(*xs)
    grads = torch.autograd.grad(y, xs, gy.double(), allow_unused=True)
    return [y.detach()] + [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads,
                                                                                  strict=True)]


def max_errors(ours, refs, inputs):
    """Max |error| of y and each gradient relative to the largest reference value. gw's
    scale is at least that of the terms it is summed from (e^w k gk): where the exact gw is
    tiny next to them, the identity reproduces it only to their rounding."""
    w = inputs[3].double()
    errs = {}
    for name, a, b in zip("yrkvwu", ours, refs, strict=True):
        scale = b.abs().max()
        if name == "w":
            scale = torch.maximum(scale, (w.exp() * inputs[1].double() * refs[2]).abs().max())
        errs[name] = float((a.double() - b).abs().max() / scale.clamp_min(1e-12))
    return errs


TOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
# every sequence length of the issue once, head size and dtype rotating; head size 80 (25
# programs per head and direction in the interpreter) on the short ones, where it is cheap
CASES = [  # (T, N, dtype)
    (1, 80, "fp16"), (2, 64, "bf16"), (15, 80, "fp32"), (16, 80, "fp16"), (17, 80, "bf16"),
    (49, 64, "fp32"), (64, 64, "fp16"), (77, 64, "bf16"), (196, 64, "fp32"), (300, 64, "fp32"),
]
GROUPS = [CASES[0::2], CASES[1::2]]  # one subprocess each, about equal cost


def run_case(T: int, N: int, dtype: str) -> dict[str, float]:
    """Errors of the op's CUDA implementation (variant ``chunked``) on CPU tensors."""
    inputs, gy = make_inputs(1, T, 1, N, DTYPES[dtype], seed=T)
    refs = reference_grads(inputs, gy)
    y = kernels._wkv6_forward_cuda(*inputs, cuda_variant="chunked")
    grads = kernels._wkv6_backward_cuda(*inputs, gy, cuda_variant="chunked")
    if y.dtype != torch.float32 or y.shape != inputs[0].shape:
        raise AssertionError(f"y is {y.dtype} {tuple(y.shape)}")
    got = [(g.dtype, g.shape) for g in grads]
    if got != [(x.dtype, x.shape) for x in inputs]:
        raise AssertionError(f"gradient dtypes/shapes {got}")
    return max_errors([y, *grads], refs, inputs)


@pytest.mark.parametrize("group", range(len(GROUPS)))
def test_chunked_matches_float64_reference(group):
    cases = GROUPS[group]
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    arg = ";".join(f"{t},{n},{d}" for t, n, d in cases)
    res = subprocess.run([sys.executable, __file__, arg], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    failures = []
    for (T, N, dtype), errs in zip(cases, results, strict=True):
        print(f"T={T} N={N} {dtype}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
        bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
        if bad:
            failures.append(f"T={T} N={N} {dtype}: above {TOL[dtype]}: {bad}")
    assert not failures, "\n".join(failures)


def test_chunked_is_a_cuda_variant_with_head_sizes_in_blocks_of_16(monkeypatch):
    from rwkv_clip.ops import wkv_chunked
    assert build.resolve_cuda_variant("chunked") == "chunked"
    assert "chunked" not in build.CUDA_VARIANTS  # nothing for nvcc to build
    assert build.resolve_cuda_variant(None) == build.DEFAULT_CUDA_VARIANT == "fast"
    assert wkv_chunked.channel_block(64) == 32 and wkv_chunked.channel_block(80) == 16
    r = torch.zeros(1, 4, 72)  # 72 = 8 x 9: not a multiple of 16
    with pytest.raises(WKVError, match="head size N=72 .* chunked"):
        kernels.run_native("cuda", r, r, r, r, torch.zeros(1, 72), variant="chunked")
    from rwkv_clip.ops import WKV
    assert "N=72" in WKV.implementations["chunked"].supports(torch.device("cuda"), torch.float32,
                                                             {"T": 4, "N": 72})
    assert WKV.implementations["chunked"].supports(torch.device("cuda"), torch.float32,
                                                   {"T": 4, "N": 64}) is None


def test_chunked_empty_batch_launches_nothing(monkeypatch):
    from rwkv_clip.ops import wkv_chunked
    chunked = wkv_chunked

    def no_launch(*a, **k):
        raise AssertionError("nothing to launch for an empty batch")
    monkeypatch.setattr(chunked, "forward", no_launch)
    monkeypatch.setattr(chunked, "backward", no_launch)
    r = torch.randn(0, 5, 64, dtype=torch.bfloat16)
    u = torch.randn(1, 64)
    assert kernels._wkv6_forward_cuda(r, r, r, r, u, cuda_variant="chunked").shape == r.shape
    grads = kernels._wkv6_backward_cuda(r, r, r, r, u, torch.zeros(0, 5, 64),
                                        cuda_variant="chunked")
    assert [g.shape for g in grads] == [r.shape] * 4 + [u.shape]



def test_chunked_variant_traces_with_fake_cuda_tensors():
    """The op's fake kernels serve the chunked variant: shapes and dtypes of y and the five
    gradients on (fake) CUDA tensors, nothing launched, as torch.compile traces it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        r = torch.empty(2, 5, 160, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(2, 5, 160, device="cuda")
        u = torch.empty(2, 80, device="cuda", dtype=torch.bfloat16)
        y = kernels.run_native("cuda", r, r, r, w, u, variant="chunked")
        grads = torch.ops.rwkv_clip.wkv6_backward(r, r, r, w, u, y, "chunked")
        assert (y.shape, y.dtype, y.device.type) == (r.shape, torch.float32, "cuda")
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (r, r, r, w, u)]


def test_bench_wkv_times_the_sdpa_yardstick_beside_the_wkv(capsys):
    """scripts/bench_wkv.py: ``sdpa`` (flash attention at head size 64, no float64 check)
    timed beside a checked WKV backend in one JSON; ``--shapes issue47`` names the targets."""
    spec = importlib.util.spec_from_file_location("bench_wkv", REPO / "scripts" / "bench_wkv.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_shapes("issue47") == [(256, 49, 8, 80), (256, 77, 10, 64),
                                             (256, 196, 8, 80), (4, 3136, 12, 64),
                                             (1, 5000, 12, 64)]
    rc = bench.main(["--device", "cpu", "--dtype", "bf16", "--backends", "reference,sdpa",
                     "--shapes", "1,5,2,80", "--warmup", "0", "--repeats", "1", "--threads", "1"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["all_checks_passed"]
    backends = result["shapes"][0]["backends"]
    assert backends["reference"]["check_passed"]
    assert backends["sdpa"]["head_size"] == 64 and "max_rel_err" not in backends["sdpa"]
    assert backends["sdpa"]["fwd_ms"] > 0 and backends["sdpa"]["fwd_bwd_ms"] > 0


if __name__ == "__main__":  # the subprocess of test_chunked_matches_float64_reference
    specs = [c.split(",") for c in sys.argv[1].split(";")]
    print(json.dumps([run_case(int(t), int(n), d) for t, n, d in specs]))
