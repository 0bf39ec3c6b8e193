// Python bindings of the CUDA WKV6 kernels (faithful and fast variants share this file).
// Sizes are compile-time: WKV_N (head size) and WKV_TMAX (longest sequence).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

bool wkv6_cuda_forward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                       const void* v, const void* w, const float* u, float* y, cudaStream_t s);
bool wkv6_cuda_backward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                        const void* v, const void* w, const float* u, const float* gy, float* gr,
                        float* gk, float* gv, float* gw, float* gu, cudaStream_t s);

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

void check(int64_t B, int64_t T, int64_t C, int64_t H, const std::vector<torch::Tensor>& ts) {
    TORCH_CHECK(H * WKV_N == C, "wkv6_cuda: built for head size ", WKV_N, " but C / H = ", C / H);
    TORCH_CHECK(T >= 1 && T <= WKV_TMAX, "wkv6_cuda: T = ", T, " outside 1..", WKV_TMAX);
    for (const auto& t : ts) {
        TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "wkv6_cuda: tensors must be contiguous CUDA tensors");
        TORCH_CHECK(t.device() == ts[0].device(), "wkv6_cuda: tensors on different devices");
    }
    TORCH_CHECK(B * T * C <= INT64_MAX / 2 && B * H <= INT32_MAX, "wkv6_cuda: too large");
}

void forward(int64_t B, int64_t T, int64_t C, int64_t H, torch::Tensor r, torch::Tensor k,
             torch::Tensor v, torch::Tensor w, torch::Tensor u, torch::Tensor y) {
    check(B, T, C, H, {r, k, v, w, u, y});
    TORCH_CHECK(u.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
                "wkv6_cuda: u and y must be float32");
    TORCH_CHECK(k.scalar_type() == r.scalar_type() && v.scalar_type() == r.scalar_type(),
                "wkv6_cuda: r, k, v must share one dtype");
    const at::cuda::OptionalCUDAGuard guard(r.device());
    const bool ok = wkv6_cuda_forward(dtype_code(r), dtype_code(w), B, T, C, H, r.data_ptr(),
                                      k.data_ptr(), v.data_ptr(), w.data_ptr(), u.data_ptr<float>(),
                                      y.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(ok, "wkv6_cuda: no kernel for r dtype ", r.scalar_type(), " with w dtype ", w.scalar_type());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void backward(int64_t B, int64_t T, int64_t C, int64_t H, torch::Tensor r, torch::Tensor k,
              torch::Tensor v, torch::Tensor w, torch::Tensor u, torch::Tensor gy, torch::Tensor gr,
              torch::Tensor gk, torch::Tensor gv, torch::Tensor gw, torch::Tensor gu) {
    check(B, T, C, H, {r, k, v, w, u, gy, gr, gk, gv, gw, gu});
    for (const auto& t : {u, gy, gr, gk, gv, gw, gu})
        TORCH_CHECK(t.scalar_type() == at::kFloat, "wkv6_cuda: u, gy and gradients must be float32");
    TORCH_CHECK(k.scalar_type() == r.scalar_type() && v.scalar_type() == r.scalar_type(),
                "wkv6_cuda: r, k, v must share one dtype");
    const at::cuda::OptionalCUDAGuard guard(r.device());
    const bool ok = wkv6_cuda_backward(
        dtype_code(r), dtype_code(w), B, T, C, H, r.data_ptr(), k.data_ptr(), v.data_ptr(),
        w.data_ptr(), u.data_ptr<float>(), gy.data_ptr<float>(), gr.data_ptr<float>(),
        gk.data_ptr<float>(), gv.data_ptr<float>(), gw.data_ptr<float>(), gu.data_ptr<float>(),
        at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(ok, "wkv6_cuda: no kernel for r dtype ", r.scalar_type(), " with w dtype ", w.scalar_type());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &forward, "bidirectional WKV6 forward (CUDA)");
    m.def("backward", &backward, "bidirectional WKV6 backward (CUDA)");
    m.attr("head_size") = WKV_N;
    m.attr("t_max") = WKV_TMAX;
}
