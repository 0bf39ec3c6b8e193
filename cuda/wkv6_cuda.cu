// Bidirectional WKV6, port-faithful CUDA kernel (the oracle for faster variants).
//
// Same algorithm as RWKV-CLIP's kernel: one block per (batch, head), WKV_N threads,
// fp32 arithmetic, per-thread state rows of length WKV_N, and the decay gradient from
// row/column partial sums. Differences: inputs are read in their own dtype (fp32 / bf16 /
// fp16; w in fp32 or the input dtype), exp(-exp(w)) is formed in-kernel, the row sums of
// the decay gradient go to a (B, T, C) scratch in global memory instead of a per-thread
// array sized by a compile-time T_max, so every T >= 1 is handled (the decay gradient is
// exactly zero at the two ends and for T < 3), and launches go to the caller's stream.
//
// Notation (per batch, head; j = key channel, i = value channel), d = exp(-exp(w)):
//   y[t,i] = sum_j r[t,j] (u[j] k[t,j] v[t,i] + A[t-1][j,i] + B[t+1][j,i])
//   A[t] = d[t] (.) A[t-1] + k[t] v[t]^T,  B[t] = d[t] (.) B[t+1] + k[t] v[t]^T
//   Q[t] = sum_{s<t} D(s,t) r[s] g[s]^T,    P[t] = sum_{s>t} D(t,s) r[s] g[s]^T
// Built with -DWKV_EMULATE (tests/test_wkv_cuda_emulation.py), the kernels compile as
// plain C++ on a host with a shim that runs each block's threads as fibers switched at
// every __syncthreads, so the kernel logic is checked against the reference even where
// no GPU exists.
#include "wkv6_common.cuh"

namespace {

using namespace wkv;

// ------------------------------------------------------------------------- forward
// Thread i owns value channel i and keeps column i of the state (all key channels j).
template <typename F, typename FW>
__global__ void __launch_bounds__(WKV_N) wkv_forward(
    int T, int C, int H, const F* __restrict__ r, const F* __restrict__ k,
    const F* __restrict__ v, const FW* __restrict__ w, const float* __restrict__ u,
    float* __restrict__ y) {
    const int b = blockIdx.x / H, h = blockIdx.x % H, i = threadIdx.x;
    __shared__ __align__(16) float sr[WKV_N], sk[WKV_N], sd[WKV_N], su[WKV_N];
    su[i] = u[h * WKV_N + i];
    const int64_t base = (int64_t)b * T * C + h * WKV_N + i;

    float state[WKV_N];
    // causal direction with the bonus
#pragma unroll
    for (int j = 0; j < WKV_N; ++j) state[j] = 0.f;
    for (int t = 0; t < T; ++t) {
        const int64_t p = base + (int64_t)t * C;
        __syncthreads();
        sr[i] = to_f(r[p]);
        sk[i] = to_f(k[p]);
        sd[i] = decay_of(w[p]);
        __syncthreads();
        const float vi = to_f(v[p]);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < WKV_N; j += 4) {
            const float4 r4 = *reinterpret_cast<const float4*>(&sr[j]);
            const float4 k4 = *reinterpret_cast<const float4*>(&sk[j]);
            const float4 d4 = *reinterpret_cast<const float4*>(&sd[j]);
            const float4 u4 = *reinterpret_cast<const float4*>(&su[j]);
            float kv;
            kv = k4.x * vi; acc += r4.x * (u4.x * kv + state[j + 0]); state[j + 0] = state[j + 0] * d4.x + kv;
            kv = k4.y * vi; acc += r4.y * (u4.y * kv + state[j + 1]); state[j + 1] = state[j + 1] * d4.y + kv;
            kv = k4.z * vi; acc += r4.z * (u4.z * kv + state[j + 2]); state[j + 2] = state[j + 2] * d4.z + kv;
            kv = k4.w * vi; acc += r4.w * (u4.w * kv + state[j + 3]); state[j + 3] = state[j + 3] * d4.w + kv;
        }
        y[p] = acc;
    }
    // anti-causal direction, no bonus
#pragma unroll
    for (int j = 0; j < WKV_N; ++j) state[j] = 0.f;
    for (int t = T - 1; t >= 0; --t) {
        const int64_t p = base + (int64_t)t * C;
        __syncthreads();
        sr[i] = to_f(r[p]);
        sk[i] = to_f(k[p]);
        sd[i] = decay_of(w[p]);
        __syncthreads();
        const float vi = to_f(v[p]);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < WKV_N; j += 4) {
            const float4 r4 = *reinterpret_cast<const float4*>(&sr[j]);
            const float4 k4 = *reinterpret_cast<const float4*>(&sk[j]);
            const float4 d4 = *reinterpret_cast<const float4*>(&sd[j]);
            acc += r4.x * state[j + 0]; state[j + 0] = state[j + 0] * d4.x + k4.x * vi;
            acc += r4.y * state[j + 1]; state[j + 1] = state[j + 1] * d4.y + k4.y * vi;
            acc += r4.z * state[j + 2]; state[j + 2] = state[j + 2] * d4.z + k4.z * vi;
            acc += r4.w * state[j + 3]; state[j + 3] = state[j + 3] * d4.w + k4.w * vi;
        }
        y[p] += acc;
    }
}

// -------------------------------------------------------- backward: dr, dk, dv, du
// Thread i owns channel i: row i of A, B, Q, P (for dr_i, dk_i) and column i of Q, P
// (for dv_i). Three scans as in the original: forward, then two reverse scans.
template <typename F, typename FW>
__global__ void __launch_bounds__(WKV_N) wkv_backward_rkvu(
    int T, int C, int H, const F* __restrict__ r, const F* __restrict__ k,
    const F* __restrict__ v, const FW* __restrict__ w, const float* __restrict__ u,
    const float* __restrict__ gy, float* __restrict__ gr, float* __restrict__ gk,
    float* __restrict__ gv, float* __restrict__ gu) {
    const int b = blockIdx.x / H, h = blockIdx.x % H, i = threadIdx.x;
    __shared__ float sr[WKV_N], sk[WKV_N], sv[WKV_N], sd[WKV_N], sg[WKV_N], su[WKV_N];
    su[i] = u[h * WKV_N + i];
    __syncthreads();
    const float ui = su[i];
    const int64_t base = (int64_t)b * T * C + h * WKV_N + i;

    // scan 1, t ascending: A row (dr), Q row (dk), Q column (dv), bonus du
    {
        float a_row[WKV_N], q_row[WKV_N], q_col[WKV_N];
#pragma unroll
        for (int j = 0; j < WKV_N; ++j) a_row[j] = q_row[j] = q_col[j] = 0.f;
        float du = 0.f;
        for (int t = 0; t < T; ++t) {
            const int64_t p = base + (int64_t)t * C;
            __syncthreads();
            sr[i] = to_f(r[p]); sk[i] = to_f(k[p]); sv[i] = to_f(v[p]);
            sg[i] = gy[p]; sd[i] = decay_of(w[p]);
            __syncthreads();
            const float ri = sr[i], ki = sk[i], gi = sg[i], di = sd[i];
            float dr = 0.f, dk = 0.f, dv = 0.f, vg = 0.f;
#pragma unroll
            for (int j = 0; j < WKV_N; ++j) {
                const float kv = ki * sv[j];
                dr += (ui * kv + a_row[j]) * sg[j];
                vg += sv[j] * sg[j];
                dk += q_row[j] * sv[j];
                dv += q_col[j] * sk[j];
                a_row[j] = a_row[j] * di + kv;
                q_row[j] = q_row[j] * di + ri * sg[j];
                q_col[j] = q_col[j] * sd[j] + sr[j] * gi;
            }
            du += ri * ki * vg;
            gr[p] = dr; gk[p] = dk; gv[p] = dv;
        }
        gu[(int64_t)b * C + h * WKV_N + i] = du;
    }
    // scan 2, t descending: P row (dk with bonus), B row (dr)
    {
        float p_row[WKV_N], b_row[WKV_N];
#pragma unroll
        for (int j = 0; j < WKV_N; ++j) p_row[j] = b_row[j] = 0.f;
        for (int t = T - 1; t >= 0; --t) {
            const int64_t p = base + (int64_t)t * C;
            __syncthreads();
            sv[i] = to_f(v[p]); sg[i] = gy[p];
            __syncthreads();
            const float ri = to_f(r[p]), ki = to_f(k[p]), di = decay_of(w[p]);
            float dr = 0.f, dk = 0.f;
#pragma unroll
            for (int j = 0; j < WKV_N; ++j) {
                const float rg = ri * sg[j];
                dk += (ui * rg + p_row[j]) * sv[j];
                dr += b_row[j] * sg[j];
                p_row[j] = p_row[j] * di + rg;
                b_row[j] = b_row[j] * di + ki * sv[j];
            }
            gr[p] += dr; gk[p] += dk;
        }
    }
    // scan 3, t descending: P column (dv with bonus)
    {
        float p_col[WKV_N];
#pragma unroll
        for (int j = 0; j < WKV_N; ++j) p_col[j] = 0.f;
        for (int t = T - 1; t >= 0; --t) {
            const int64_t p = base + (int64_t)t * C;
            __syncthreads();
            sr[i] = to_f(r[p]); sk[i] = to_f(k[p]); sd[i] = decay_of(w[p]);
            __syncthreads();
            const float gi = gy[p];
            float dv = 0.f;
#pragma unroll
            for (int j = 0; j < WKV_N; ++j) {
                const float rg = sr[j] * gi;
                dv += (su[j] * rg + p_col[j]) * sk[j];
                p_col[j] = p_col[j] * sd[j] + rg;
            }
            gv[p] += dv;
        }
    }
}

// ------------------------------------------------------------------ backward: dw
// For one direction, in that direction's own time tau (t = tau or T-1-tau), channel i:
//   c[tau] = dL/dlog d[tau] = sum_{s < tau < s'} D(s,s') r[s'] k[s] (g[s'] . v[s])
//   c[0] = 0, c[1] = X[0], c[tau] = c[tau-1] + X[tau-1] - Y[tau]   (tau <= T-2), c[T-1] = 0
//   X[s]   = k[s] * ((d[s+1] P[s+1]) v[s])_i   row sums, one reverse scan, kept in xs
//            (global scratch laid out as the inputs: thread i's X[s] at base + s*C)
//   Y[tau] = r[tau] * ((d[tau-1] A[tau-2]) g[tau])_i   column sums, one forward scan
// dw = -exp(w) * (c_causal + c_anticausal). Thread i keeps one row of each state.
template <typename F, typename FW, bool REV>
__device__ __forceinline__ void decay_grad_direction(
    int T, int C, int64_t base, const F* __restrict__ r, const F* __restrict__ k,
    const F* __restrict__ v, const FW* __restrict__ w, const float* __restrict__ gy,
    float* __restrict__ gw, float* sv, float* sg, float* __restrict__ xs) {
    const int i = threadIdx.x;
    auto at = [&](int tau) -> int64_t { return base + (int64_t)(REV ? T - 1 - tau : tau) * C; };
    float z[WKV_N];
#pragma unroll
    for (int j = 0; j < WKV_N; ++j) z[j] = 0.f;
    for (int tau = T - 1; tau >= 2; --tau) {
        const int64_t p = at(tau), p1 = at(tau - 1), p2 = at(tau - 2);
        __syncthreads();
        sg[i] = gy[p];
        sv[i] = to_f(v[p2]);
        __syncthreads();
        const float ri = to_f(r[p]), di = decay_of(w[p1]);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < WKV_N; ++j) {
            z[j] = (z[j] + ri * sg[j]) * di;  // becomes d[tau-1] P[tau-1]
            sum += z[j] * sv[j];
        }
        xs[base + (int64_t)(tau - 2) * C] = sum * to_f(k[p2]);
    }
    float c = xs[base];
    {
        const int64_t p = at(1);
        const float val = c * neg_exp(w[p]);
        if (REV) gw[p] += val; else gw[p] = val;
    }
#pragma unroll
    for (int j = 0; j < WKV_N; ++j) z[j] = 0.f;  // now d[tau-1] A[tau-2]
    for (int tau = 2; tau <= T - 2; ++tau) {
        const int64_t p = at(tau), p1 = at(tau - 1), p2 = at(tau - 2);
        __syncthreads();
        sg[i] = gy[p];
        sv[i] = to_f(v[p2]);
        __syncthreads();
        const float ki = to_f(k[p2]), di = decay_of(w[p1]);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < WKV_N; ++j) {
            z[j] = (z[j] + ki * sv[j]) * di;
            sum += z[j] * sg[j];
        }
        c += xs[base + (int64_t)(tau - 1) * C] - sum * to_f(r[p]);
        const float val = c * neg_exp(w[p]);
        if (REV) gw[p] += val; else gw[p] = val;
    }
}

template <typename F, typename FW>
__global__ void __launch_bounds__(WKV_N) wkv_backward_w(
    int T, int C, int H, const F* __restrict__ r, const F* __restrict__ k,
    const F* __restrict__ v, const FW* __restrict__ w, const float* __restrict__ gy,
    float* __restrict__ gw, float* __restrict__ xs) {
    const int b = blockIdx.x / H, h = blockIdx.x % H, i = threadIdx.x;
    const int64_t base = (int64_t)b * T * C + h * WKV_N + i;
    __shared__ float sv[WKV_N], sg[WKV_N];
    // the two ends are never strictly between two steps
    gw[base] = 0.f;
    gw[base + (int64_t)(T - 1) * C] = 0.f;
    if (T < 3) return;
    decay_grad_direction<F, FW, false>(T, C, base, r, k, v, w, gy, gw, sv, sg, xs);
    decay_grad_direction<F, FW, true>(T, C, base, r, k, v, w, gy, gw, sv, sg, xs);
}

#ifndef WKV_EMULATE
template <typename F, typename FW>
void launch_forward(int B, int T, int C, int H, const void* r, const void* k, const void* v,
                    const void* w, const float* u, float* y, cudaStream_t s) {
    wkv_forward<F, FW><<<B * H, WKV_N, 0, s>>>(T, C, H, (const F*)r, (const F*)k, (const F*)v,
                                               (const FW*)w, u, y);
}

template <typename F, typename FW>
void launch_backward(int B, int T, int C, int H, const void* r, const void* k, const void* v,
                     const void* w, const float* u, const float* gy, float* gr, float* gk,
                     float* gv, float* gw, float* gu, float* work, cudaStream_t s) {
    wkv_backward_rkvu<F, FW><<<B * H, WKV_N, 0, s>>>(T, C, H, (const F*)r, (const F*)k,
                                                     (const F*)v, (const FW*)w, u, gy, gr, gk, gv, gu);
    wkv_backward_w<F, FW><<<B * H, WKV_N, 0, s>>>(T, C, H, (const F*)r, (const F*)k, (const F*)v,
                                                  (const FW*)w, gy, gw, work);
}

}  // namespace

// WKV_DISPATCH (wkv6_common.cuh): the same (r/k/v, w) dtype pairs in both variants.
bool wkv6_cuda_forward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                       const void* v, const void* w, const float* u, float* y, cudaStream_t s) {
    WKV_DISPATCH(launch_forward, B, T, C, H, r, k, v, w, u, y, s)
}

// work: B*T*C float32 scratch (no initial values needed).
bool wkv6_cuda_backward(int dt, int wdt, int B, int T, int C, int H, const void* r, const void* k,
                        const void* v, const void* w, const float* u, const float* gy, float* gr,
                        float* gk, float* gv, float* gw, float* gu, float* work, cudaStream_t s) {
    WKV_DISPATCH(launch_backward, B, T, C, H, r, k, v, w, u, gy, gr, gk, gv, gw, gu, work, s)
}
#else
}  // namespace
#endif  // WKV_EMULATE
