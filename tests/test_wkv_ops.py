"""The bidirectional WKV6 op: reference vs brute force, native kernels vs reference.

The CPU kernel runs the build of the machine's level (rwkv_clip.cpu_isa): the forced-path
stage runs this file again as on an AVX2 CPU; the narrower builds are also checked
explicitly (test_narrower_instruction_sets_match_the_reference)."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from rwkv_clip.ops import (
    WKVError,
    build,
    cache,
    dispatch,
    toolchain,
    wkv6_bidirectional,
    wkv6_bidirectional_reference,
)

pytestmark = pytest.mark.cpu_isa
HAS_GPU = torch.cuda.is_available()
HAS_NVCC = toolchain.find_cuda_home() is not None and torch.version.cuda is not None
HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None


def brute_force(r, k, v, w, u):
    """O(T^2) direct evaluation of the defining formula, float64."""
    B, T, C = r.shape
    H, N = u.shape
    r, k, v, w, u = (x.double() for x in (r, k, v, w, u))
    logd = -torch.exp(w).view(B, T, H, N)
    rr, kk, vv = (x.view(B, T, H, N) for x in (r, k, v))
    cum = torch.cumsum(logd, dim=1)  # cum[t] = sum_{q<=t} log d[q]
    y = torch.zeros(B, T, H, N, dtype=torch.float64)
    for t in range(T):
        for s in range(T):
            if s == t:
                a = u[None] * kk[:, s]
            elif s < t:  # decay over s < q < t
                a = torch.exp(cum[:, t - 1] - cum[:, s]) * kk[:, s]
            else:        # decay over t < q < s
                a = torch.exp(cum[:, s - 1] - cum[:, t]) * kk[:, s]
            y[:, t] += (rr[:, t] * a).sum(-1, keepdim=True) * vv[:, s]
    return y.view(B, T, C)


def make_inputs(B, T, H, N, dtype=torch.float64, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    C = H * N
    r = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, C, generator=g, dtype=torch.float64) * 0.5
    v = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(B, T, C, generator=g, dtype=torch.float64) * 0.7 - 1.5
    u = torch.randn(H, N, generator=g, dtype=torch.float64) * 0.5
    return [x.to(dtype).requires_grad_(requires_grad) for x in (r, k, v, w, u)]


def grads_of(fn, inputs, gy):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    y = fn(*xs)
    gs = torch.autograd.grad(y, xs, gy.to(y.dtype), allow_unused=True)
    gs = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, gs, strict=False)]
    return y.detach(), gs


def assert_close(a, b, rtol, name=""):
    a, b = a.double(), b.double()
    scale = b.abs().max().clamp_min(1e-6)
    err = (a - b).abs().max() / scale
    assert err <= rtol, f"{name}: max error {err:.3e} (relative to max |ref| {scale:.3e}) > {rtol}"


# ------------------------------------------------------------------- reference op
@pytest.mark.parametrize("B,T,H,N", [(2, 1, 2, 4), (1, 2, 1, 8), (2, 5, 2, 4), (1, 9, 3, 8)])
def test_reference_matches_brute_force(B, T, H, N):
    inputs = make_inputs(B, T, H, N)
    gy = torch.randn(B, T, H * N, dtype=torch.float64)
    y_ref, g_ref = grads_of(wkv6_bidirectional_reference, inputs, gy)
    y_bf, g_bf = grads_of(brute_force, inputs, gy)
    assert y_ref.dtype == torch.float64
    torch.testing.assert_close(y_ref, y_bf, rtol=1e-10, atol=1e-10)
    for name, a, b in zip("rkvwu", g_ref, g_bf, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"grad {name}")
    # the decay must matter once a step lies between two others
    if T >= 3:
        assert g_bf[3].abs().max() > 1e-3


def test_reference_gradcheck():
    inputs = make_inputs(1, 4, 2, 3)
    assert torch.autograd.gradcheck(wkv6_bidirectional_reference, inputs, eps=1e-6, atol=1e-7)


def test_reference_mixed_dtypes_return_float32():
    r, k, v, w, u = make_inputs(1, 3, 1, 4, dtype=torch.bfloat16, requires_grad=False)
    y = wkv6_bidirectional_reference(r, k, v, w.float(), u)
    assert y.dtype == torch.float32


# ---------------------------------------------------------------------- CPU kernel
cpu_kernel = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")

# T = 300 and 129: the tiled backward's chunks of 128 steps, a partial last one, both ways
CPU_SHAPES = [(2, 1, 2, 64), (2, 2, 1, 80), (1, 3, 2, 8), (2, 49, 1, 80), (1, 77, 2, 64),
              (1, 196, 1, 80), (3, 17, 2, 12), (1, 300, 1, 32), (1, 129, 1, 128)]


@cpu_kernel
@pytest.mark.parametrize("B,T,H,N", CPU_SHAPES)
def test_cpu_kernel_matches_reference(B, T, H, N):
    inputs = make_inputs(B, T, H, N, seed=B * 1000 + T)
    gy = torch.randn(B, T, H * N, dtype=torch.float64)
    y_ref, g_ref = grads_of(wkv6_bidirectional_reference, inputs, gy)
    f32 = [x.detach().float() for x in inputs]
    y, g = grads_of(lambda *a: wkv6_bidirectional(*a, backend="cpu"), f32, gy.float())
    assert y.dtype == torch.float32 and y.shape == (B, T, H * N)
    assert_close(y, y_ref, 1e-5, "y")
    for name, a, b, x in zip("rkvwu", g, g_ref, f32, strict=False):
        assert a.dtype == x.dtype and a.shape == x.shape
        assert_close(a, b, 2e-5, f"grad {name}")
    if T < 3:  # no step lies strictly between two others: dw is exactly zero
        assert torch.count_nonzero(g[3]) == 0


@cpu_kernel
def test_cpu_kernel_float64_inputs_exact():
    inputs = make_inputs(2, 11, 2, 8)
    gy = torch.randn(2, 11, 16, dtype=torch.float64)
    _, g_ref = grads_of(wkv6_bidirectional_reference, inputs, gy)
    y, g = grads_of(lambda *a: wkv6_bidirectional(*a, backend="cpu"), inputs, gy)
    assert y.dtype == torch.float32 and g[0].dtype == torch.float64
    for name, a, b in zip("rkvwu", g, g_ref, strict=False):
        assert_close(a, b, 1e-5, f"grad {name}")


@cpu_kernel
def test_cpu_kernel_bf16_inputs_and_bf16_params():
    """Text tower: bf16 activations, bf16 u; w fp32 (the usual mix) and bf16."""
    B, T, H, N = 2, 77, 2, 64
    base = make_inputs(B, T, H, N, requires_grad=False)
    r, k, v = (x.bfloat16() for x in base[:3])
    for w in (base[3].float(), base[3].bfloat16()):
        u = base[4].bfloat16()
        inputs = [r, k, v, w, u]
        gy = torch.randn(B, T, H * N)
        exact = [x.double() for x in inputs]  # the reference sees the same rounded values
        y_ref, g_ref = grads_of(wkv6_bidirectional_reference, exact, gy.double())
        y, g = grads_of(lambda *a: wkv6_bidirectional(*a, backend="cpu"), inputs, gy)
        assert y.dtype == torch.float32
        assert_close(y, y_ref, 1e-5, "y")
        for name, a, b, x in zip("rkvwu", g, g_ref, inputs, strict=False):
            assert a.dtype == x.dtype, f"grad {name} dtype {a.dtype} != {x.dtype}"
            assert_close(a, b, 1e-2, f"grad {name}")  # bf16 output rounding


@cpu_kernel
def test_cpu_kernel_non_contiguous_inputs():
    B, T, H, N = 2, 6, 2, 8
    inputs = make_inputs(B, T, H, N, dtype=torch.float32, requires_grad=False)
    r_t = inputs[0].transpose(0, 1).contiguous().transpose(0, 1)  # same values, odd strides
    assert not r_t.is_contiguous()
    y1 = wkv6_bidirectional(r_t, *inputs[1:], backend="cpu")
    y2 = wkv6_bidirectional_reference(*inputs)
    assert_close(y1, y2, 1e-5)


# --------------------------------------------------------------- backend selection
def test_backend_argument_and_override(monkeypatch):
    inputs = make_inputs(1, 3, 1, 4, dtype=torch.float64, requires_grad=False)
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "wkv=reference")
    y = wkv6_bidirectional(*inputs)
    assert y.dtype == torch.float64  # only the reference keeps float64
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "wkv=bogus")
    dispatch.reset()
    with pytest.raises(WKVError, match="bogus"):
        wkv6_bidirectional(*inputs)
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "wkv=cpu")
    dispatch.reset()
    # the argument wins over the environment
    y2 = wkv6_bidirectional(*inputs, backend="reference")
    torch.testing.assert_close(y, y2)
    with pytest.raises(WKVError, match="nope"):
        wkv6_bidirectional(*inputs, backend="nope")
    for name in ("cuda", "cuda-fast", "cuda-faithful"):  # "cuda": the old name of cuda-fast
        with pytest.raises(WKVError, match="needs CUDA tensors"):
            wkv6_bidirectional(*inputs, backend=name)


@cpu_kernel
def test_default_backend_on_cpu_is_native(monkeypatch):
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR, raising=False)
    inputs = make_inputs(1, 5, 1, 8, dtype=torch.float64, requires_grad=False)
    y = wkv6_bidirectional(*inputs)
    assert y.dtype == torch.float32  # the native kernel returns float32
    assert_close(y, wkv6_bidirectional_reference(*inputs), 1e-5)


# -------------------------------------------------------------------------- errors
def test_shape_errors():
    r, k, v, w, u = make_inputs(2, 4, 2, 8, dtype=torch.float32, requires_grad=False)
    with pytest.raises(WKVError, match="k has shape"):
        wkv6_bidirectional(r, k[:, :3], v, w, u)
    with pytest.raises(WKVError, match="not H x N"):
        wkv6_bidirectional(r, k, v, w, u[:, :4])
    with pytest.raises(WKVError, match=r"\(B, T, C\)"):
        wkv6_bidirectional(r[0], k, v, w, u)


def test_cuda_size_errors_before_anything_runs():
    with pytest.raises(WKVError, match="head size N=66"):
        build.check_cuda_head_size(66)
    with pytest.raises(WKVError, match="unknown CUDA WKV variant"):
        build.resolve_cuda_variant("turbo")


def test_cuda_kernels_take_an_empty_batch_without_launching(monkeypatch):
    """B = 0 would launch a grid of zero blocks (a CUDA error): zeros come back instead,
    nothing is built. The registered CUDA functions are called directly (no GPU here)."""
    from rwkv_clip.ops import kernels

    def no_build(*a, **k):
        raise AssertionError("nothing to build for an empty batch")
    monkeypatch.setattr(build, "get_cuda_kernel", no_build)
    r, k, v, w = (torch.randn(0, 5, 16, dtype=torch.bfloat16) for _ in range(4))
    u = torch.randn(2, 8)
    y = kernels._wkv6_forward_cuda(r, k, v, w, u)
    assert y.shape == (0, 5, 16) and y.dtype == torch.float32
    grads = kernels._wkv6_backward_cuda(r, k, v, w, u, torch.zeros(0, 5, 16))
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (r, k, v, w, u)]
    assert not grads[4].any()


def test_cuda_bad_head_size_raises_wkverror_without_compiling(monkeypatch):
    """run_native checks sizes before building: a fake CUDA call never reaches a compiler;
    the table's CUDA implementations say so in their supports()."""
    from rwkv_clip.ops import kernels

    def boom(*a, **k):
        raise AssertionError("must not build")

    monkeypatch.setattr(build, "get_cuda_kernel", boom)
    r = torch.zeros(1, 4, 6)
    with pytest.raises(WKVError, match="head size"):
        kernels.run_native("cuda", r, r, r, r, torch.zeros(1, 6))
    from rwkv_clip.ops import WKV
    for name in ("cuda-fast", "cuda-faithful"):
        assert "head size N=6" in WKV.implementations[name].supports(
            torch.device("cuda"), torch.float32, {"T": 4, "N": 6})


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(WKVError, match="C\\+\\+ compiler"):
        toolchain.check_cxx()
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_is_toolkit_root", lambda p: False)
    with pytest.raises(WKVError, match="CUDA toolkit"):
        toolchain.prepare_cuda_toolchain()


# ---------------------------------------------------------------------- CUDA kernel
@pytest.mark.slow
@pytest.mark.skipif(not HAS_NVCC, reason="no CUDA toolkit (nvcc)")
@pytest.mark.parametrize("variant", build.CUDA_VARIANTS)
def test_cuda_kernel_compiles(variant):
    mod = build.get_cuda_kernel(64, variant)
    assert hasattr(mod, "forward") and hasattr(mod, "backward")


# The CUDA kernels' logic is checked on the host, every dtype instantiation and long
# sequences included, in test_wkv_cuda_emulation.py.


GPU_SHAPES = [(2, 1, 2, 64), (2, 2, 2, 80), (3, 3, 2, 64), (2, 49, 2, 80), (2, 77, 3, 64),
              (2, 196, 2, 80), (1, 300, 1, 64), (1, 5000, 1, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("variant", build.CUDA_VARIANTS + build.TRITON_CUDA_VARIANTS)
@pytest.mark.parametrize("B,T,H,N", GPU_SHAPES)
def test_cuda_kernel_matches_reference(B, T, H, N, variant):
    inputs = make_inputs(B, T, H, N, seed=T)
    gy = torch.randn(B, T, H * N, dtype=torch.float64)
    y_ref, g_ref = grads_of(wkv6_bidirectional_reference, inputs, gy)
    dev = [x.detach().float().cuda() for x in inputs]
    from rwkv_clip.ops.kernels import run_native
    y, g = grads_of(lambda *a: run_native("cuda", *a, variant=variant), dev, gy.float().cuda())
    assert y.dtype == torch.float32
    assert_close(y.cpu(), y_ref, 1e-5, "y")
    for name, a, b in zip("rkvwu", g, g_ref, strict=False):
        assert a.dtype == torch.float32
        assert_close(a.cpu(), b, 5e-5, f"grad {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("variant", build.CUDA_VARIANTS + build.TRITON_CUDA_VARIANTS)
def test_cuda_kernel_bf16_inputs(variant):
    B, T, H, N = 2, 77, 2, 64
    base = make_inputs(B, T, H, N, requires_grad=False)
    inputs = [x.bfloat16() for x in base[:3]] + [base[3].float(), base[4].bfloat16()]
    gy = torch.randn(B, T, H * N)
    _, g_ref = grads_of(wkv6_bidirectional_reference, [x.double() for x in inputs], gy.double())
    y_ref = wkv6_bidirectional_reference(*[x.double() for x in inputs])
    from rwkv_clip.ops.kernels import run_native
    dev = [x.cuda() for x in inputs]
    y, g = grads_of(lambda *a: run_native("cuda", *a, variant=variant), dev, gy.cuda())
    assert_close(y.cpu(), y_ref, 1e-5, "y")
    for name, a, b, x in zip("rkvwu", g, g_ref, inputs, strict=False):
        assert a.dtype == x.dtype
        assert_close(a.cpu(), b, 1e-2, f"grad {name}")


# ------------------------------------------------------------- concurrent builds
@pytest.mark.slow
@cpu_kernel
def test_two_processes_build_the_same_kernel_into_a_fresh_cache(tmp_path):
    """torchrun ranks (or two pytest runs) building at once: one compiles, the other waits
    on the build folder's lock, both end with a working kernel."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = (
        "import torch; from rwkv_clip.ops import wkv6_bidirectional, wkv6_bidirectional_reference\n"
        "x = [torch.randn(1, 5, 8) for _ in range(4)]; u = torch.randn(1, 8)\n"
        "y = wkv6_bidirectional(*x, u, backend='cpu')\n"
        "assert torch.allclose(y, wkv6_bidirectional_reference(*x, u), atol=1e-5)\n"
        "print('OK')\n")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, RWKV_CLIP_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs, strict=False):
        assert p.returncode == 0 and "OK" in out, out[-3000:]


# ------------------------------------------------------- cache keys, locks, failed builds
def _spec(folder, **kw):
    fields = dict(what="test kernel", base_name="rwkv_clip_test",
                  sources=(folder / "wkv6_op.cpp", folder / "wkv6_cuda.cu"),
                  headers=(folder / "wkv6_common.cuh",), cflags=("-O3",),
                  cuda_cflags=("-O3",), arch_list="8.0;9.0+PTX")
    fields.update(kw)
    return cache.KernelSpec(**fields)


def _copy_sources(dst):
    dst.mkdir()
    for name in ("wkv6_op.cpp", "wkv6_cuda.cu", "wkv6_common.cuh"):
        shutil.copy(toolchain.source_dir() / name, dst / name)
    return dst


def test_cache_key_follows_sources_header_and_flags(tmp_path):
    a = _copy_sources(tmp_path / "checkout_a")
    b = _copy_sources(tmp_path / "checkout_b")
    key = _spec(a).key()
    assert _spec(a).key() == key          # identical inputs, identical folder
    assert _spec(b).key() == key          # a second checkout with the same sources shares it
    assert _spec(a).name == f"rwkv_clip_test_{key}"
    assert _spec(a, cflags=("-O2",)).key() != key
    assert _spec(a, cuda_cflags=("-O3", "-DWKV_N=80")).key() != key
    assert _spec(a, arch_list="8.0;9.0").key() != key
    with open(b / "wkv6_common.cuh", "a") as f:
        f.write("// an edit to the shared header only\n")
    assert _spec(b).key() != key
    assert _spec(a).key() == key          # checkout a is unaffected by b's edit
    (a / "wkv6_cuda.cu").write_text((a / "wkv6_cuda.cu").read_text() + "\n")
    assert _spec(a).key() != key


@pytest.mark.skipif(not HAS_NVCC, reason="no CUDA toolkit (nvcc)")
@pytest.mark.parametrize("variant", build.CUDA_VARIANTS)
def test_cuda_spec_hashes_every_included_header(variant):
    import re
    spec = build.cuda_kernel_spec(64, variant)
    local_includes = set()
    for src in spec.sources:
        local_includes.update(re.findall(r'#include "([^"]+)"', src.read_text()))
    assert local_includes == {"wkv6_common.cuh"}
    assert {h.name for h in spec.headers} == local_includes
    assert "-DWKV_N=64" in spec.cuda_cflags and spec.arch_list in spec.what


def test_cuda_arch_list_without_gpu_ends_in_ptx(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    archs = toolchain.cuda_arch_list()
    assert archs == "7.5;8.0;9.0+PTX"
    flags = toolchain.cuda_gencode_flags(archs)
    assert flags[-2:] == ["-gencode=arch=compute_90,code=sm_90",
                          "-gencode=arch=compute_90,code=compute_90"]
    assert "-gencode=arch=compute_75,code=sm_75" in flags
    assert not any("compute_80,code=compute_80" in f for f in flags)  # PTX of the top arch only
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6 9.0a")  # the user's list, as given
    assert toolchain.cuda_arch_list() == "8.6;9.0a"
    assert toolchain.cuda_gencode_flags("9.0a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    with pytest.raises(WKVError, match="sm_80"):
        toolchain.cuda_gencode_flags("sm_80")


def test_build_lock_held_too_long_times_out_naming_the_lock(tmp_path):
    import os
    import time

    from rwkv_clip.errors import KernelBuildError
    lock = tmp_path / "build.lock"
    with cache.build_lock(lock, timeout=5):
        t0 = time.monotonic()
        with pytest.raises(KernelBuildError) as info:
            with cache.build_lock(lock, timeout=0.5):
                pytest.fail("a second holder got the lock")
        assert 0.4 < time.monotonic() - t0 < 5
    msg = str(info.value)
    assert str(lock) in msg and f"pid {os.getpid()}" in msg and cache.LOCK_TIMEOUT_ENV_VAR in msg
    with cache.build_lock(lock, timeout=0.5):  # released on exit
        pass


def test_lock_of_a_killed_builder_does_not_block(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    lock = tmp_path / "build.lock"
    code = ("import sys, time\nfrom pathlib import Path\nfrom rwkv_clip.ops import cache\n"
            f"with cache.build_lock(Path({str(lock)!r}), 5):\n"
            "    print('locked', flush=True); time.sleep(600)\n")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        from rwkv_clip.errors import KernelBuildError
        with pytest.raises(KernelBuildError, match="build.lock"):
            with cache.build_lock(lock, timeout=0.3):
                pass
        os.kill(proc.pid, signal.SIGKILL)  # a builder killed mid-build
        proc.wait(timeout=30)
        t0 = time.monotonic()
        with cache.build_lock(lock, timeout=10):
            pass
        assert time.monotonic() - t0 < 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
@pytest.mark.parametrize("case", ["syntax error", "bogus flag"])
def test_failed_compile_raises_kernel_build_error_with_compiler_output(
        tmp_path, monkeypatch, capsys, case):
    from rwkv_clip.errors import KernelBuildError
    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "broken_kernel.cpp"
    if case == "syntax error":
        src.write_text("int broken_function( { return 0; }\n")
        spec = cache.KernelSpec(what="a test (syntax error)", base_name="rwkv_clip_test_syntax",
                                sources=(src,))
        expected = "broken_kernel.cpp"
    else:
        src.write_text("int fine_function() { return 0; }\n")
        spec = cache.KernelSpec(what="a test (bogus flag)", base_name="rwkv_clip_test_flag",
                                sources=(src,), cflags=("-fno-such-flag-rwkv-clip",))
        expected = "-fno-such-flag-rwkv-clip"
    with pytest.raises(KernelBuildError) as info:
        build.build_kernel(spec)
    msg = str(info.value)
    assert isinstance(info.value, WKVError)
    assert spec.what in msg and "last lines of the compiler output" in msg
    assert expected in msg.split("compiler output:", 1)[1]
    assert "error" in msg.split("compiler output:", 1)[1].lower()
    err = capsys.readouterr().err
    assert err.count("building the WKV kernel for") == 1
    assert f"building the WKV kernel for {spec.what} (first use)" in err
    assert not (tmp_path / "cache" / "kernels" / spec.name / "built.json").exists()


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_build_cli_failure_is_one_error_line_and_exit_2(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, RWKV_CLIP_CACHE=str(tmp_path / "cache"), CXX="false",
               PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "rwkv_clip.ops", "build", "--no-cuda"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    # one error line, the compiler's last lines indented below it
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("python -m rwkv_clip.ops: error: ")]
    assert len(errors) == 1
    assert "building the WKV kernel for CPU" in errors[0]
    assert "Traceback" not in res.stderr


# ------------------------------------------------------- the op as a PyTorch operator
@pytest.fixture(autouse=True)
def _fresh_dispatch():
    """The table's override is read once per process; every test starts from the env."""
    dispatch.reset()
    yield
    dispatch.reset()


def _op_inputs(B, T, H, N, dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = H * N
    xs = [torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g) * 0.5,
          torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g) * 0.7 - 1.5,
          torch.randn(H, N, generator=g) * 0.5]
    return [x.to(dt) for x, dt in zip(xs, dtypes, strict=True)]


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OP_CASES = [((2, 5, 2, 8), (F32,) * 5), ((1, 1, 1, 64), (F32,) * 5), ((2, 7, 1, 80), (F32,) * 5),
            ((2, 4, 2, 12), (BF16, BF16, BF16, F32, BF16)), ((1, 3, 1, 32), (F16,) * 5)]


@cpu_kernel
@pytest.mark.parametrize("shape,dtypes", OP_CASES)
def test_opcheck_cpu(shape, dtypes):
    xs = [x.requires_grad_() for x in _op_inputs(*shape, dtypes)]
    torch.library.opcheck(torch.ops.rwkv_clip.wkv6_forward.default, tuple(xs))
    gy = torch.randn(shape[0], shape[1], shape[2] * shape[3])
    torch.library.opcheck(torch.ops.rwkv_clip.wkv6_backward.default,
                          tuple(x.detach() for x in xs) + (gy,))


@pytest.mark.parametrize("dtypes", [(F32,) * 5, (BF16, BF16, BF16, F32, BF16), (F16,) * 5])
def test_fake_tensors_give_shapes_and_dtypes_without_a_kernel(dtypes, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def no_build(*a, **k):
        raise AssertionError("fake / meta tensors must not build or run a kernel")

    monkeypatch.setattr(build, "get_cpu_kernel", no_build)
    monkeypatch.setattr(build, "get_cuda_kernel", no_build)
    B, T, H, N = 3, 9, 2, 16
    with FakeTensorMode():
        xs = [x.requires_grad_() for x in _op_inputs(B, T, H, N, dtypes)]
        y = wkv6_bidirectional(*xs)
        assert y.shape == (B, T, H * N) and y.dtype == torch.float32
        grads = torch.autograd.grad(y.sum(), xs)
        for g, x in zip(grads, xs, strict=True):
            assert g.shape == x.shape and g.dtype == x.dtype
    with torch.device("meta"):  # what the memory planner uses
        xs = _op_inputs(B, T, H, N, dtypes)
    y = wkv6_bidirectional(*xs)
    assert y.device.type == "meta" and y.shape == (B, T, H * N) and y.dtype == torch.float32
    gs = torch.ops.rwkv_clip.wkv6_backward(*xs, torch.empty(B, T, H * N, device="meta"))
    assert [(g.shape, g.dtype) for g in gs] == [(x.shape, x.dtype) for x in xs]


@cpu_kernel
def test_dispatch_override_is_read_once(monkeypatch):
    inputs = make_inputs(1, 3, 1, 4, dtype=torch.float64, requires_grad=False)
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "wkv=reference")
    assert wkv6_bidirectional(*inputs).dtype == torch.float64   # the reference keeps float64
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "wkv=cpu")
    assert wkv6_bidirectional(*inputs).dtype == torch.float64   # not looked up again
    dispatch.reset()
    assert wkv6_bidirectional(*inputs).dtype == torch.float32   # the native kernel


def _model_step(model, image, text):
    model.zero_grad(set_to_none=True)
    image_features, text_features, logit_scale = model(image, text)
    from rwkv_clip import ClipLoss
    loss = ClipLoss()(torch.nn.functional.normalize(image_features, dim=-1),
                      torch.nn.functional.normalize(text_features, dim=-1), logit_scale)
    loss.backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.detach().clone()
             for name, p in model.named_parameters() if p.grad is not None}
    return image_features.detach(), text_features.detach(), loss.detach(), grads


@pytest.mark.slow
@cpu_kernel
def test_compiled_model_matches_eager_with_no_graph_break():
    """torch.compile(model, fullgraph=True) with inductor on CPU: forward and backward of
    the tiny config equal to eager (fp32) within 1e-5; fullgraph makes any break an error."""
    import sys
    from pathlib import Path

    import torch._dynamo
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_util import tiny_model
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    image = torch.randn(4, 3, 16, 16, generator=g)
    text = torch.randint(1, 1000, (4, 77), generator=g)
    text[:, 12:] = 0
    eager = _model_step(model, image, text)
    torch._dynamo.reset()
    compiled_model = torch.compile(model, fullgraph=True, backend="inductor")
    compiled = _model_step(compiled_model, image, text)
    assert torch._dynamo.utils.counters["graph_break"] == {}
    for name, a, b in zip(("image", "text", "loss"), compiled[:3], eager[:3], strict=True):
        assert_close(a, b, 1e-5, name)
    assert compiled[3].keys() == eager[3].keys() and len(eager[3]) > 10
    for name, grad in eager[3].items():
        assert_close(compiled[3][name], grad, 1e-5, f"grad {name}")


# ------------------------------------------------------- the CPU kernel's instruction set
@pytest.fixture
def uncapped(monkeypatch):
    """The CPU at its own level for one test: the forced-path stage's caps
    (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA; rwkv_clip.cpu_isa) lifted, for the tests
    of the native build and of the levels /proc/cpuinfo alone decides."""
    from rwkv_clip import cpu_isa
    for name in cpu_isa.CAP_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    cpu_isa._cpu_info.cache_clear()
    yield
    cpu_isa._cpu_info.cache_clear()


def test_cpu_build_targets_this_machines_instruction_set(monkeypatch, uncapped):
    """The CPU kernel is built with -march=native, named after the level and the exact
    feature set the compiler enables; another feature set is another cache entry, and the
    portable build (explicit flags from /proc/cpuinfo) is yet another."""
    native = toolchain.cpu_native_isa()
    if native is None:
        pytest.skip("the compiler does not take -march=native here")
    tag, flags = native
    assert flags == ["-march=native"]
    cpu_flags = toolchain._cpu_flags()
    level = tag.split("_")[0]
    if "avx512_bf16" in cpu_flags:
        assert level in ("avx512bf16", "amx"), tag
    elif "avx512f" in cpu_flags:
        assert level == "avx512", tag
    elif "avx2" in cpu_flags:
        assert level == "avx2", tag
    spec, portable = build.cpu_kernel_spec(), build.cpu_kernel_spec(portable=True)
    assert "-march=native" in spec.cflags and spec.base_name.endswith(tag)
    assert "-march=native" not in portable.cflags
    assert portable.base_name == f"rwkv_clip_wkv6_cpu_{toolchain.cpu_isa_flags()[0]}"
    assert spec.key() != portable.key()
    # a CPU with one feature less gets a different build folder
    cxx_target = toolchain._native_target.__wrapped__  # the uncached probe
    cpu, features = cxx_target(shutil.which("c++") or "g++")
    monkeypatch.setattr(toolchain, "_native_target", lambda cxx: (cpu, features[1:]))
    other = build.cpu_kernel_spec()
    assert other.base_name != spec.base_name and other.name != spec.name


def test_a_lock_timeout_is_not_a_failed_native_build(tmp_path, monkeypatch, uncapped):
    """Waiting too long for another builder's lock neither marks the native build as
    failed (that would pin this cache to the portable build) nor builds the portable one."""
    from rwkv_clip.errors import KernelLockTimeoutError
    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "check_cxx", lambda: None)
    monkeypatch.setattr(build, "cpu_native_isa", lambda: ("fake_native", ["-march=native"]))
    tried = []

    def slow_holder(spec, verbose=False):
        tried.append(spec.base_name)
        raise KernelLockTimeoutError(f"timed out waiting for {spec.name}/build.lock")
    monkeypatch.setattr(build, "build_kernel", slow_holder)
    native, _ = build.cpu_kernel_specs()
    with pytest.raises(KernelLockTimeoutError):
        build.get_cpu_kernel()
    assert tried == [native.base_name]
    assert build.cpu_kernel_specs()[0] == native  # still tried first next time


def test_portable_isa_levels_follow_cpuinfo(monkeypatch, uncapped):
    cases = [({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
              "avx512bf16", "-mavx512bf16"),
             ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512", "-mavx512f"),
             ({"avx2", "fma", "avx512f"}, "avx2", "-mavx2"), ({"sse4_2"}, "base", None)]
    for flags, tag, flag in cases:
        monkeypatch.setattr(toolchain, "_cpu_flags", lambda f=flags: set(f))
        got_tag, got_flags = toolchain.cpu_isa_flags()
        assert got_tag == tag and (flag in got_flags if flag else got_flags == [])
    assert "-mavx512bf16" not in toolchain.ISA_LEVELS[1][2]


@pytest.mark.slow
@cpu_kernel
@pytest.mark.parametrize("cpu_flags,defines", [({"avx2", "fma"}, ()), (set(), ()),
                                               (set(), ("-DWKV_SCALAR_LANE_SUMS",))],
                         ids=["avx2", "base", "base-scalar-lane-sums"])
def test_narrower_instruction_sets_match_the_reference(tmp_path, monkeypatch, cpu_flags,
                                                       defines):
    """The portable builds for CPUs with fewer vector registers (AVX2: 16; none: SSE2)
    take other tile shapes in the backward, and compilers without vector shuffles sum the
    lanes one by one: forward and gradients against the reference."""
    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(toolchain, "_cpu_flags", lambda: set(cpu_flags))
    spec = build.cpu_kernel_spec(portable=True)
    assert "-mavx512f" not in spec.cflags
    spec = dataclasses.replace(spec, cflags=(*spec.cflags, *defines))
    mod = build.build_kernel(spec)
    for B, T, H, N in ((1, 150, 2, 64), (2, 33, 1, 80)):
        inputs = make_inputs(B, T, H, N, seed=T)
        gy = torch.randn(B, T, H * N, dtype=torch.float64)
        y_ref, g_ref = grads_of(wkv6_bidirectional_reference, inputs, gy)
        r, k, v, w, u = (x.detach().float().contiguous() for x in inputs)
        assert_close(mod.forward(r, k, v, w, u), y_ref, 1e-5, "y")
        grads = mod.backward(r, k, v, w, u, gy.float().contiguous())
        for name, a, b in zip("rkvwu", grads, g_ref, strict=True):
            assert_close(a, b, 2e-5, f"grad {name}")


@pytest.mark.slow
@cpu_kernel
def test_native_build_failure_falls_back_to_the_portable_build(tmp_path, monkeypatch, capsys,
                                                               uncapped):
    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(toolchain, "cpu_native_isa", lambda: ("broken_isa", ["-mno-such-isa-flag"]))
    monkeypatch.setattr(build, "cpu_native_isa", toolchain.cpu_native_isa)
    monkeypatch.setattr(build, "_loaded", {})
    mod = build.get_cpu_kernel()
    assert "did not compile" in capsys.readouterr().err
    portable = build.cpu_kernel_spec(portable=True)
    assert cache.is_built(portable) and build.cpu_kernel_specs() == [portable]
    x = [torch.randn(1, 6, 8) for _ in range(4)]
    u = torch.randn(1, 8)
    assert_close(mod.forward(*x, u), wkv6_bidirectional_reference(*x, u), 1e-5)
