// What the two CUDA WKV6 variants (wkv6_cuda.cu, wkv6_cuda_fast.cu) share: size checks,
// dtype conversions, the decay formula and the (r/k/v dtype, w dtype) dispatch. Keeping
// them here is what stops the two files from drifting apart (each dispatches on w's dtype
// the same way). rwkv_clip/ops/build.py hashes this header into the kernel cache key, so
// editing it rebuilds both variants.
//
// Built with -DWKV_EMULATE (tests/test_wkv_cuda_emulation.py) everything compiles as plain C++ with
// a host shim that also stands in for __nv_bfloat16 / __half and their conversions
// (round to nearest even, as the device's), so every instantiation runs on a host.
#pragma once

#ifndef WKV_EMULATE
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include <stdint.h>

#ifndef WKV_N
#error "compile with -DWKV_N=<head size>"
#endif
static_assert(WKV_N % 4 == 0, "WKV_N must be a multiple of 4");

namespace wkv {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ void from_f(float x, float* dst) { *dst = x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void from_f(float x, __nv_bfloat16* dst) { *dst = __float2bfloat16(x); }
__device__ __forceinline__ void from_f(float x, __half* dst) { *dst = __float2half(x); }

// -exp(w): the log of the per-step decay d = exp(-exp(w)); dw = -exp(w) * dL/dlog d.
template <typename FW>
__device__ __forceinline__ float neg_exp(FW w) { return -__expf(to_f(w)); }
template <typename FW>
__device__ __forceinline__ float decay_of(FW w) { return __expf(neg_exp(w)); }

}  // namespace wkv

// dtype codes (wkv6_op.cpp): 0 = float32, 1 = bfloat16, 2 = float16. r, k, v share dtype
// `dt`; w's dtype `wdt` is float32 or `dt`. Any other pair returns false (the binding
// turns that into an error naming both dtypes) instead of reinterpreting w's bytes.
#define WKV_DISPATCH(FN, ...)                                                          \
    if (dt == 0 && wdt == 0) FN<float, float>(__VA_ARGS__);                            \
    else if (dt == 1 && wdt == 0) FN<__nv_bfloat16, float>(__VA_ARGS__);               \
    else if (dt == 1 && wdt == 1) FN<__nv_bfloat16, __nv_bfloat16>(__VA_ARGS__);       \
    else if (dt == 2 && wdt == 0) FN<__half, float>(__VA_ARGS__);                      \
    else if (dt == 2 && wdt == 2) FN<__half, __half>(__VA_ARGS__);                     \
    else return false;                                                                 \
    return true;
