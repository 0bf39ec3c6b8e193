// Python bindings of the CUDA WKV6 kernels. The same file serves both variants:
// the port-faithful one (wkv6_cuda.cu) and, with -DWKV_VARIANT_FAST, the fast one
// (wkv6_cuda_fast.cu). The head size WKV_N is compile-time; any sequence length T >= 1 runs.
//
//   forward(r, k, v, w, u) -> y                       (float32, (B, T, C))
//   backward(r, k, v, w, u, gy) -> [gr, gk, gv, gw, gu]
//     faithful: all float32; fast: gr/gk/gv in r's dtype, gw in w's dtype, gu float32 (H, N)
// r, k, v share one dtype (float32 / bfloat16 / float16); w is float32 or that dtype;
// u and gy are float32.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#ifdef WKV_VARIANT_FAST
bool wkv6_fast_forward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                       const void* v, const void* w, const float* u, float* y, cudaStream_t s);
bool wkv6_fast_backward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                        const void* v, const void* w, const float* u, const float* gy, float* work,
                        void* gr, void* gk, void* gv, void* gw, float* gu, cudaStream_t s);
#else
bool wkv6_cuda_forward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                       const void* v, const void* w, const float* u, float* y, cudaStream_t s);
bool wkv6_cuda_backward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                        const void* v, const void* w, const float* u, const float* gy, float* gr,
                        float* gk, float* gv, float* gw, float* gu, float* work, cudaStream_t s);
#endif

namespace {

int dtype_code(const torch::Tensor& x) {
    switch (x.scalar_type()) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: TORCH_CHECK(false, "wkv6_cuda: unsupported dtype ", x.scalar_type());
    }
    return -1;
}

struct Sizes { int B, T, C, H; };

Sizes check(const torch::Tensor& r, const torch::Tensor& k, const torch::Tensor& v,
            const torch::Tensor& w, const torch::Tensor& u) {
    TORCH_CHECK(r.dim() == 3, "wkv6_cuda: r must be (B, T, C)");
    TORCH_CHECK(u.dim() == 2 && u.size(1) == WKV_N, "wkv6_cuda: built for head size ", WKV_N,
                ", u must be (H, ", WKV_N, ")");
    const int64_t B = r.size(0), T = r.size(1), C = r.size(2), H = u.size(0);
    TORCH_CHECK(H * WKV_N == C, "wkv6_cuda: C = ", C, " is not H x ", WKV_N);
    TORCH_CHECK(T >= 1, "wkv6_cuda: T = ", T, ", expected at least 1");
    TORCH_CHECK(B * H <= INT32_MAX && T <= INT32_MAX && B * T * C < (int64_t(1) << 62),
                "wkv6_cuda: too large");
    for (const torch::Tensor* t : {&r, &k, &v, &w, &u}) {
        TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "wkv6_cuda: inputs must be contiguous CUDA tensors");
        TORCH_CHECK(t->device() == r.device(), "wkv6_cuda: inputs on different devices");
    }
    for (const torch::Tensor* t : {&k, &v, &w})
        TORCH_CHECK(t->sizes() == r.sizes(), "wkv6_cuda: r, k, v, w must have the same shape");
    TORCH_CHECK(k.scalar_type() == r.scalar_type() && v.scalar_type() == r.scalar_type(),
                "wkv6_cuda: r, k, v must share one dtype");
    TORCH_CHECK(u.scalar_type() == at::kFloat, "wkv6_cuda: u must be float32");
    return {int(B), int(T), int(C), int(H)};
}

torch::Tensor forward(torch::Tensor r, torch::Tensor k, torch::Tensor v, torch::Tensor w, torch::Tensor u) {
    const Sizes s = check(r, k, v, w, u);
    const at::cuda::OptionalCUDAGuard guard(r.device());
    auto f32 = r.options().dtype(at::kFloat);
#ifdef WKV_VARIANT_FAST
    torch::Tensor y = torch::zeros({s.B, s.T, s.C}, f32);
    const bool ok = wkv6_fast_forward(
#else
    torch::Tensor y = torch::empty({s.B, s.T, s.C}, f32);
    const bool ok = wkv6_cuda_forward(
#endif
        dtype_code(r), dtype_code(w), s.B, s.T, s.C, s.H, r.data_ptr(), k.data_ptr(), v.data_ptr(),
        w.data_ptr(), u.data_ptr<float>(), y.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(ok, "wkv6_cuda: no kernel for r dtype ", r.scalar_type(), " with w dtype ", w.scalar_type());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}

std::vector<torch::Tensor> backward(torch::Tensor r, torch::Tensor k, torch::Tensor v,
                                    torch::Tensor w, torch::Tensor u, torch::Tensor gy) {
    const Sizes s = check(r, k, v, w, u);
    TORCH_CHECK(gy.sizes() == r.sizes() && gy.is_contiguous() && gy.scalar_type() == at::kFloat &&
                gy.device() == r.device(), "wkv6_cuda: gy must be contiguous float32 like r");
    const at::cuda::OptionalCUDAGuard guard(r.device());
    auto f32 = r.options().dtype(at::kFloat);
    torch::Tensor gu = torch::empty({s.B, s.C}, f32);
#ifdef WKV_VARIANT_FAST
    torch::Tensor gr = torch::empty_like(r), gk = torch::empty_like(k), gv = torch::empty_like(v);
    torch::Tensor gw = torch::empty_like(w);
    const int64_t n = int64_t(s.B) * s.T * s.C;
    torch::Tensor work = torch::empty({5 * n}, f32);
    work.narrow(0, 4 * n, n).zero_();
    const bool ok = wkv6_fast_backward(
        dtype_code(r), dtype_code(w), s.B, s.T, s.C, s.H, r.data_ptr(), k.data_ptr(), v.data_ptr(),
        w.data_ptr(), u.data_ptr<float>(), gy.data_ptr<float>(), work.data_ptr<float>(),
        gr.data_ptr(), gk.data_ptr(), gv.data_ptr(), gw.data_ptr(), gu.data_ptr<float>(),
        at::cuda::getCurrentCUDAStream());
#else
    torch::Tensor gr = torch::empty({s.B, s.T, s.C}, f32), gk = torch::empty_like(gr),
                  gv = torch::empty_like(gr), gw = torch::empty_like(gr), work = torch::empty_like(gr);
    const bool ok = wkv6_cuda_backward(
        dtype_code(r), dtype_code(w), s.B, s.T, s.C, s.H, r.data_ptr(), k.data_ptr(), v.data_ptr(),
        w.data_ptr(), u.data_ptr<float>(), gy.data_ptr<float>(), gr.data_ptr<float>(),
        gk.data_ptr<float>(), gv.data_ptr<float>(), gw.data_ptr<float>(), gu.data_ptr<float>(),
        work.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
#endif
    TORCH_CHECK(ok, "wkv6_cuda: no kernel for r dtype ", r.scalar_type(), " with w dtype ", w.scalar_type());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {gr, gk, gv, gw, gu.sum(0).view({s.H, WKV_N})};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &forward, "bidirectional WKV6 forward (CUDA): y = f(r, k, v, w, u), float32");
    m.def("backward", &backward, "bidirectional WKV6 backward (CUDA): [gr, gk, gv, gw, gu]");
    m.attr("head_size") = WKV_N;
#ifdef WKV_VARIANT_FAST
    m.attr("variant") = "fast";
#else
    m.attr("variant") = "faithful";
#endif
}
