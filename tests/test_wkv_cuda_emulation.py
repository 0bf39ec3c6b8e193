"""The CUDA WKV kernels' logic, run on the host against the reference: the .cu sources
compile as plain C++ with -DWKV_EMULATE and the shim below (each block's WKV_N threads
are fibers switched at every __syncthreads; __nv_bfloat16 / __half are 16-bit stand-ins
rounding to nearest even as the device's conversions, arithmetic in float). Every dtype
instantiation the kernels dispatch to runs here, and sequences past any fixed length."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
from test_wkv_ops import assert_close, grads_of, make_inputs

from rwkv_clip.ops import toolchain, wkv6_bidirectional, wkv6_bidirectional_reference

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPE_CODE = {F32: 0, BF16: 1, F16: 2}  # wkv6_common.cuh's dispatch codes

EMU_SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <ucontext.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))
#define __expf expf
struct float4 { float x, y, z, w; };
struct Dim3 { int x, y; };
static Dim3 threadIdx, blockIdx;

// --- the half types: 16-bit storage, float arithmetic through the conversions
struct __nv_bfloat16 { uint16_t bits; };
struct __half { uint16_t bits; };
inline uint32_t emu_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float emu_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
// the part of `mant` below bit `shift`, rounded to nearest even into what is above it
inline uint32_t emu_round_shift(uint32_t mant, int shift) {
    const uint32_t kept = mant >> shift;
#ifdef WKV_EMU_TRUNCATE
    return kept;
#else
    const uint32_t rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return kept + (rest > half || (rest == half && (kept & 1u)));
#endif
}
inline float __bfloat162float(__nv_bfloat16 x) { return emu_float(uint32_t(x.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16(float f) {
    const uint32_t u = emu_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t(0x7fff)};  // NaN, as the device
    const uint32_t sign = u & 0x80000000u, mag = u & 0x7fffffffu;     // carries into the
    return {uint16_t((sign >> 16) | emu_round_shift(mag, 16))};       // exponent: to inf
}
inline float __half2float(__half x) {
    const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16, e = (x.bits >> 10) & 0x1fu,
                   m = x.bits & 0x3ffu;
    if (e == 0) return emu_float(sign) + (sign ? -1.f : 1.f) * std::ldexp(float(m), -24);
    if (e == 31) return emu_float(sign | 0x7f800000u | (m << 13));
    return emu_float(sign | ((e + 112u) << 23) | (m << 13));
}
inline __half __float2half(float f) {
    const uint32_t u = emu_bits(f), a = u & 0x7fffffffu;
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    if (a > 0x7f800000u) return {uint16_t(0x7fff)};                   // NaN, as the device
    if (a >= 0x38800000u) {                                           // a normal half or more
        const uint32_t h = (((a >> 23) - 112u) << 10) + emu_round_shift(a & 0x7fffffu, 13);
        return {uint16_t(sign | (h >= 0x7c00u ? 0x7c00u : h))};       // overflow: inf
    }
    if (a < 0x33000000u) return {sign};                               // below 2^-25: zero
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;                // subnormal half:
    return {uint16_t(sign | emu_round_shift(mant, 126 - int(a >> 23)))};  // units of 2^-24
}
extern "C" void emu_round(int dt, const float* x, float* out, long n) {
    for (long q = 0; q < n; ++q)
        out[q] = dt == 1 ? __bfloat162float(__float2bfloat16(x[q]))
                         : __half2float(__float2half(x[q]));
}

// --- threads as fibers: each runs to its next __syncthreads, then the next thread runs
static ucontext_t g_scheduler;
static std::vector<ucontext_t> g_threads;
static std::vector<char> g_finished;
static int g_current;
static std::function<void()>* g_kernel;
static void fiber_main() {
    (*g_kernel)();
    g_finished[g_current] = 1;
    swapcontext(&g_threads[g_current], &g_scheduler);
}
inline void __syncthreads() { swapcontext(&g_threads[g_current], &g_scheduler); }
inline float atomicAdd(float* p, float x) { const float old = *p; *p = old + x; return old; }
// Blocks one after another, in reverse order; within a block the threads take turns in
// alternating order between barriers, so a missing barrier reads stale shared memory.
template <typename Fn>
static void run_blocks(int nx, int ny, Fn fn) {
    std::function<void()> kernel = fn;
    g_kernel = &kernel;
    std::vector<std::vector<char>> stacks(WKV_N, std::vector<char>(1 << 18));
    for (int b = nx * ny - 1; b >= 0; --b) {
        g_threads.assign(WKV_N, ucontext_t{});
        g_finished.assign(WKV_N, 0);
        for (int i = 0; i < WKV_N; ++i) {
            getcontext(&g_threads[i]);
            g_threads[i].uc_stack.ss_sp = stacks[i].data();
            g_threads[i].uc_stack.ss_size = stacks[i].size();
            g_threads[i].uc_link = &g_scheduler;
            makecontext(&g_threads[i], fiber_main, 0);
        }
        for (int round = 0;; ++round) {
            int done = 0;
            for (int q = 0; q < WKV_N; ++q) {
                const int i = (round & 1) ? WKV_N - 1 - q : q;
                if (!g_finished[i]) {
                    g_current = i;
                    threadIdx.x = i; threadIdx.y = 0;
                    blockIdx.x = b % nx; blockIdx.y = b / nx;
                    swapcontext(&g_scheduler, &g_threads[i]);
                }
                done += g_finished[i];
            }
            if (done == WKV_N) break;
            if (done != 0) {
                std::fprintf(stderr, "emulator: the threads of a block reach different numbers "
                                     "of __syncthreads\n");
                std::abort();
            }
        }
    }
}
"""

# Entry points over every (r/k/v dtype, w dtype) pair, through the kernels' own dispatch
# macro. Outputs: y float32; gradients as the variant writes them.
EMU_HARNESS = {
    "faithful": r"""
template <typename F, typename FW>
void fwd(int B, int T, int C, int H, const void* r, const void* k, const void* v, const void* w,
         const float* u, float* y) {
    run_blocks(B * H, 1, [=] { wkv_forward<F, FW>(T, C, H, (const F*)r, (const F*)k, (const F*)v,
                                                  (const FW*)w, u, y); });
}
template <typename F, typename FW>
void bwd(int B, int T, int C, int H, const void* r, const void* k, const void* v, const void* w,
         const float* u, const float* gy, void* gr, void* gk, void* gv, void* gw, float* gu) {
    std::vector<float> work((size_t)B * T * C, 1e30f);  // garbage: nothing may read it first
    float* wk = work.data();
    run_blocks(B * H, 1, [=] {
        wkv_backward_rkvu<F, FW>(T, C, H, (const F*)r, (const F*)k, (const F*)v, (const FW*)w, u,
                                 gy, (float*)gr, (float*)gk, (float*)gv, gu); });
    run_blocks(B * H, 1, [=] {
        wkv_backward_w<F, FW>(T, C, H, (const F*)r, (const F*)k, (const F*)v, (const FW*)w, gy,
                              (float*)gw, wk); });
}
""",
    "fast": r"""
template <typename F, typename FW>
void fwd(int B, int T, int C, int H, const void* r, const void* k, const void* v, const void* w,
         const float* u, float* y) {
    std::memset(y, 0, sizeof(float) * B * T * C);
    run_blocks(B * H, 2, [=] { fast_forward<F, FW>(T, C, H, (const F*)r, (const F*)k, (const F*)v,
                                                   (const FW*)w, u, y); });
}
template <typename F, typename FW>
void bwd(int B, int T, int C, int H, const void* r, const void* k, const void* v, const void* w,
         const float* u, const float* gy, void* gr, void* gk, void* gv, void* gw, float* gu) {
    const long n = (long)B * T * C;
    std::vector<float> work(5 * n, 1e30f);  // garbage except the zeroed dv part
    std::memset(work.data() + 4 * n, 0, sizeof(float) * n);
    float* wk = work.data();
    run_blocks(B * H, 6, [=] {
        fast_backward_scans<F, FW>(T, C, H, (const F*)r, (const F*)k, (const F*)v, (const FW*)w, gy,
                                   wk, wk + n, wk + 2 * n, wk + 3 * n, wk + 4 * n); });
    run_blocks(B * H, 1, [=] {
        fast_backward_combine<F, FW>(T, C, H, (const F*)r, (const F*)k, (const F*)v, (const FW*)w,
                                     u, gy, wk, wk + n, wk + 2 * n, wk + 3 * n, wk + 4 * n,
                                     (F*)gr, (F*)gk, (F*)gv, (FW*)gw, gu); });
}
""",
}
EMU_ENTRY = r"""
extern "C" bool emu_forward(int dt, int wdt, int B, int T, int C, int H, const void* r,
                            const void* k, const void* v, const void* w, const float* u, float* y) {
    WKV_DISPATCH(fwd, B, T, C, H, r, k, v, w, u, y)
}
extern "C" bool emu_backward(int dt, int wdt, int B, int T, int C, int H, const void* r,
                             const void* k, const void* v, const void* w, const float* u,
                             const float* gy, void* gr, void* gk, void* gv, void* gw, float* gu) {
    WKV_DISPATCH(bwd, B, T, C, H, r, k, v, w, u, gy, gr, gk, gv, gw, gu)
}
"""
EMU_SOURCES = {"faithful": "wkv6_cuda.cu", "fast": "wkv6_cuda_fast.cu"}


def _compile(folder, name, source, defines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shim.h").write_text(EMU_SHIM)
    src = folder / f"{name}.cpp"
    src.write_text(source)
    so = folder / f"{name}.so"
    cmd = [CXX, "-std=c++20", "-O2", "-fPIC", "-shared", "-Wno-unknown-pragmas", "-DWKV_EMULATE",
           *defines, f"-I{folder}", str(src), "-o", str(so)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return ctypes.CDLL(str(so))


class Emulator:
    """One variant at one head size, every dtype instantiation; calls return torch tensors."""

    def __init__(self, folder, variant, N, truncate=False):
        self.variant, self.N = variant, N
        cu = toolchain.source_dir() / EMU_SOURCES[variant]
        name = f"emu_{variant}_{N}" + ("_truncate" if truncate else "")
        source = f'#include "shim.h"\n#include "{cu}"\n' + EMU_HARNESS[variant] + EMU_ENTRY
        defines = [f"-DWKV_N={N}"] + (["-DWKV_EMU_TRUNCATE"] if truncate else [])
        self.lib = _compile(folder / name, name, source, defines)
        self.lib.emu_forward.restype = ctypes.c_bool
        self.lib.emu_backward.restype = ctypes.c_bool

    def run(self, r, k, v, w, u, gy):
        """(y, [gr, gk, gv, gw, gu]); r/k/v one dtype, w float32 or that dtype, u/gy float32."""
        B, T, C = r.shape
        H = C // self.N
        ptr = lambda t: ctypes.c_void_p(t.data_ptr())
        xs = [x.contiguous() for x in (r, k, v, w)]
        u, gy = u.float().contiguous(), gy.float().contiguous()
        codes = (DTYPE_CODE[r.dtype], DTYPE_CODE[w.dtype])
        y = torch.full((B, T, C), float("nan"))
        assert self.lib.emu_forward(*codes, B, T, C, H, *map(ptr, xs), ptr(u), ptr(y))
        out_dtypes = ([r.dtype] * 3 + [w.dtype]) if self.variant == "fast" else [F32] * 4
        grads = [torch.full((B, T, C), float("nan"), dtype=dt) for dt in out_dtypes]
        gu = torch.full((B, C), float("nan"))
        assert self.lib.emu_backward(*codes, B, T, C, H, *map(ptr, xs), ptr(u), ptr(gy),
                                     *map(ptr, grads), ptr(gu))
        return y, grads + [gu.sum(0).view(H, self.N)]


@pytest.fixture(scope="module")
def emulators(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wkv_emulation")
    built: dict[tuple, Emulator] = {}

    def get(variant, N, truncate=False):
        key = (variant, N, truncate)
        if key not in built:
            built[key] = Emulator(folder, variant, N, truncate)
        return built[key]
    return get


# ------------------------------------------------------------- the half stand-ins
def _rounding_probe():
    """Floats around every rounding case of both formats: ties, just off ties, subnormals,
    overflow, signed zeros, infinities, and random values over the whole range."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-30, 20, (20000,), generator=g))
    bits = torch.randint(0, 2**31 - 1, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    special = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 65536.0, 1e6, -1e6, 2.0**-24,
               2.0**-25, 1.5 * 2.0**-25, 2.0**-26, 2.0**-14, 2.0**-14 * (1 - 2.0**-11),
               3.0e38, float("inf"), float("-inf"), 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11,
               1 + 3 * 2.0**-11, 1 + 2.0**-8 + 2.0**-20, 1 + 2.0**-11 + 2.0**-20]
    return torch.cat([rand, bits.view(torch.float32), torch.tensor(special)]).float()


def _emulated_round(lib, dt, x):
    out = torch.empty_like(x)
    lib.emu_round(DTYPE_CODE[dt], ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                  ctypes.c_long(x.numel()))
    return out


@pytest.mark.parametrize("dt", [BF16, F16])
def test_half_stand_ins_round_to_nearest_even_like_the_device(tmp_path, dt):
    """The stand-ins' float -> half -> float equals torch's (round to nearest even, as
    CUDA's __float2bfloat16 / __float2half) bit for bit; a truncating one is caught."""
    source = '#define WKV_N 4\n#include "shim.h"\n'
    x = _rounding_probe()
    x = x[~torch.isnan(x)]
    expected = x.to(dt).float()
    got = _emulated_round(_compile(tmp_path / "rne", "rne", source, []), dt, x)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), \
        f"{int((got.view(torch.int32) != expected.view(torch.int32)).sum())} values differ"
    nan = _emulated_round(_compile(tmp_path / "rne", "rne", source, []), dt,
                          torch.tensor([float("nan")]))
    assert torch.isnan(nan).all()
    wrong = _emulated_round(_compile(tmp_path / "trunc", "trunc", source,
                                     ["-DWKV_EMU_TRUNCATE"]), dt, x)
    assert (wrong.view(torch.int32) != expected.view(torch.int32)).float().mean() > 0.2


# ------------------------------------------------------------------- fp32 kernels
@pytest.mark.parametrize("variant", ["faithful", "fast"])
@pytest.mark.parametrize("N", [8, 12])
def test_cuda_kernel_logic_emulated_on_cpu(emulators, variant, N):
    emu = emulators(variant, N)
    for B, T, H in [(1, 1, 2), (2, 2, 1), (1, 3, 2), (2, 4, 1), (1, 9, 2), (1, 16, 1)]:
        inputs = make_inputs(B, T, H, N, seed=T + N)
        gy = torch.randn(B, T, H * N, dtype=torch.float64)
        y_ref, g_ref = grads_of(wkv6_bidirectional_reference, inputs, gy)
        y, grads = emu.run(*[x.detach().float() for x in inputs], gy)
        assert_close(y, y_ref, 1e-5, f"{variant} y T={T}")
        for name, a, b in zip("rkvwu", grads, g_ref, strict=True):
            assert_close(a, b, 2e-5, f"{variant} grad {name} (B={B}, T={T}, H={H}, N={N})")


# -------------------------------------------------------- bf16 / fp16 instantiations
HALF_PAIRS = [(BF16, F32), (BF16, BF16), (F16, F32), (F16, F16)]


def _half_case(dt, wdt, B=2, T=21, H=2, N=8, seed=3):
    """Inputs stored in (dt, wdt) and the float64 reference on exactly those values."""
    base = make_inputs(B, T, H, N, seed=seed, requires_grad=False)
    stored = [x.to(dt) for x in base[:3]] + [base[3].to(wdt), base[4].float()]
    gy = torch.randn(B, T, H * N, generator=torch.Generator().manual_seed(seed + 1))
    y_ref, g_ref = grads_of(wkv6_bidirectional_reference, [x.double() for x in stored],
                            gy.double())
    return stored, gy, y_ref, g_ref


def _rounding_mismatches(got, exact):
    """Fraction of elements of ``got`` (a half dtype) that differ from the exact value
    rounded to nearest even in that dtype, and the largest difference in units of the
    last place beyond what fp32 arithmetic explains (2e-5 of the largest value)."""
    want = exact.to(got.dtype)
    differ = got != want
    info = torch.finfo(got.dtype)
    _, exponent = torch.frexp(want.double())  # |want| in [2^(e-1), 2^e)
    ulp = torch.exp2(exponent.double() - 1) * info.eps
    ulp = ulp.clamp_min(info.smallest_normal * info.eps)  # subnormals: one fixed step
    beyond = ((got.double() - want.double()).abs() - 2e-5 * exact.abs().max()).clamp_min(0)
    return differ.float().mean().item(), (beyond / ulp).max().item()


@pytest.mark.parametrize("variant", ["faithful", "fast"])
@pytest.mark.parametrize("dt,wdt", HALF_PAIRS)
def test_half_instantiations_emulated(emulators, variant, dt, wdt):
    """Inputs read in bf16 / fp16 (w in fp32 or that dtype) give the reference's result on
    the same values; the fast variant writes its gradients in the inputs' dtypes, each
    the exact gradient rounded to nearest even (up to the fp32 arithmetic's last bit)."""
    stored, gy, y_ref, g_ref = _half_case(dt, wdt)
    y, grads = emulators(variant, 8).run(*stored, gy)
    assert y.dtype == F32
    assert_close(y, y_ref, 1e-5, "y")
    for name, a, b, x in zip("rkvwu", grads, g_ref, stored, strict=True):
        assert a.dtype == (x.dtype if variant == "fast" else F32)
        if a.dtype == F32:
            assert_close(a, b, 2e-5, f"grad {name}")
            continue
        frac, worst = _rounding_mismatches(a, b)
        assert frac <= 0.02 and worst <= 1.0 + 1e-6, \
            f"grad {name}: {frac:.1%} not rounded to nearest even, worst {worst:.2f} ulp"


@pytest.mark.parametrize("dt", [BF16, F16])
def test_half_rounding_check_catches_truncation(emulators, dt):
    """The same check on a build whose stand-ins truncate instead of rounding fails."""
    stored, gy, _, g_ref = _half_case(dt, dt)
    _, grads = emulators("fast", 8, truncate=True).run(*stored, gy)
    fractions = [_rounding_mismatches(a, b)[0] for a, b in zip(grads[:3], g_ref[:3], strict=True)]
    assert min(fractions) > 0.2, fractions


# ------------------------------------------------------------------------- long T
def _long_inputs(T, H=1, N=8, seed=0):
    """Half the channels decay slowly (d = exp(-exp(w)) between 0.9975 and 0.99988), so
    the state carries information across thousands of steps."""
    r, k, v, w, u = make_inputs(1, T, H, N, seed=seed, requires_grad=False)
    slow = torch.linspace(-9.0, -6.0, N // 2, dtype=torch.float64)
    w = w.view(1, T, H, N).clone()
    w[..., : N // 2] = slow + 0.1 * w[..., : N // 2]
    return [r, k, v, w.view(1, T, H * N), u]


@pytest.fixture(scope="module")
def long_reference():
    """float64 reference forward and gradients for each long T (computed once)."""
    cache: dict[int, tuple] = {}

    def get(T):
        if T not in cache:
            inputs = _long_inputs(T)
            gy = torch.randn(1, T, 8, generator=torch.Generator().manual_seed(T),
                             dtype=torch.float64)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # thousands of tiny ops: threads only add overhead
            try:
                cache[T] = (inputs, gy, *grads_of(wkv6_bidirectional_reference, inputs, gy))
            finally:
                torch.set_num_threads(threads)
        return cache[T]
    return get


# longer than 1024 px images at patch 16 (4096 tokens)
LONG_T = [5000]


@pytest.mark.parametrize("T", LONG_T)
@pytest.mark.parametrize("variant", ["faithful", "fast"])
def test_long_sequences_emulated(emulators, long_reference, variant, T):
    """Long T on the CUDA kernels: nothing in them is sized by T."""
    inputs, gy, y_ref, g_ref = long_reference(T)
    y, grads = emulators(variant, 8).run(*[x.float() for x in inputs], gy)
    assert_close(y, y_ref, 1e-5, f"{variant} y T={T}")
    for name, a, b in zip("rkvwu", grads, g_ref, strict=True):
        assert_close(a, b, 2e-5, f"{variant} grad {name} T={T}")
    assert g_ref[3][..., :4].abs().max() > 1e-3  # the slow channels' decay gradient matters


@pytest.mark.parametrize("T", LONG_T)
def test_long_sequences_cpu_kernel(long_reference, T):
    inputs, gy, y_ref, g_ref = long_reference(T)
    f32 = [x.float() for x in inputs]
    y, grads = grads_of(lambda *a: wkv6_bidirectional(*a, backend="cpu"), f32, gy.float())
    assert_close(y, y_ref, 1e-5, f"cpu y T={T}")
    for name, a, b in zip("rkvwu", grads, g_ref, strict=True):
        assert_close(a, b, 2e-5, f"cpu grad {name} T={T}")
