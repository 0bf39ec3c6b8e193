// Bidirectional WKV6 on the CPU: forward and backward, fp32 math, any T >= 1, any N.
//
// Semantics (per batch b, head h; j indexes the key channel, i the value channel):
//   y[t,i] = sum_j r[t,j] * ( u[j] k[t,j] v[t,i] + A[t-1][j,i] + B[t+1][j,i] )
//   A[t] = d[t] (.) A[t-1] + k[t] v[t]^T   (causal state, rows scaled by d)
//   B[t] = d[t] (.) B[t+1] + k[t] v[t]^T   (anti-causal state)
//   d = exp(-exp(w))
//
// Backward, with g = dL/dy:
//   forward scan  (t ascending):  A and Q[t] = sum_{s<t} D(s,t) r[s] g[s]^T
//   reverse scan  (t descending): B and P[t] = sum_{s>t} D(t,s) r[s] g[s]^T
//   dr[t] += A[t-1] g[t] + B[t+1] g[t]; dk[t] += Q[t] v[t] + P[t] v[t];
//   dv[t] += Q[t]^T k[t] + P[t]^T k[t]; plus the bonus (u) terms.
//   The log-decay adjoint of channel j at step t collects every path that crosses t:
//     dlogd[t] = sum_{s<t} k dk_P[s] - sum_{s<=t} r dr_A[s]
//              + sum_{s>t} k dk_Q[s] - sum_{s>=t} r dr_B[s]
//   (products per channel), and dw = -exp(w) * dlogd.
//
// Work is split over (batch x head) with OpenMP. Inputs are read in their own dtypes
// (fp32 / bf16 / fp16 / fp64, each tensor its own) into fp32 scratch rows and gradients
// are written in the inputs' dtypes, so the caller never makes dtype copies. Scratch is
// thread_local and only grows, so after the first call nothing is allocated but the
// outputs. Inner loops run over channels with unit stride and compile-time trip counts
// (N = 32, 64, 80, 128) for the compiler to vectorise; for those head sizes the forward
// and the backward keep their states in registers, tile by tile (forward_tiles,
// backward_tiles_one_way), and exp is a vectorisable polynomial.
//
// The two functions are registered as operators of a library named after the build
// (TORCH_LIBRARY, loaded with torch.ops.load_library), not as a Python module: that needs
// only ATen's tensor and the registration headers, not torch/extension.h (all of torch's
// C++ API and pybind11), and so compiles in about half the time on first use.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename S>
inline void load_rows(const S* src, float* dst, int64_t T, int64_t C, int64_t N) {
    for (int64_t t = 0; t < T; ++t) {
        const S* s = src + t * C;
        float* d = dst + t * N;
        for (int64_t i = 0; i < N; ++i) d[i] = static_cast<float>(s[i]);
    }
}

// Copy the (T, N) slab of one (batch, head) from a (B, T, C) tensor into fp32 rows.
inline void load_slab(const at::Tensor& x, int64_t offset, float* dst, int64_t T, int64_t C, int64_t N) {
    switch (x.scalar_type()) {
        case at::kFloat: load_rows(x.data_ptr<float>() + offset, dst, T, C, N); break;
        case at::kBFloat16: load_rows(x.data_ptr<at::BFloat16>() + offset, dst, T, C, N); break;
        case at::kHalf: load_rows(x.data_ptr<at::Half>() + offset, dst, T, C, N); break;
        case at::kDouble: load_rows(x.data_ptr<double>() + offset, dst, T, C, N); break;
        default: TORCH_CHECK(false, "wkv6_cpu: unsupported dtype ", x.scalar_type());
    }
}

template <typename S>
inline void store_rows(const float* src, S* dst, int64_t T, int64_t C, int64_t N) {
    for (int64_t t = 0; t < T; ++t) {
        const float* s = src + t * N;
        S* d = dst + t * C;
        for (int64_t i = 0; i < N; ++i) d[i] = static_cast<S>(s[i]);
    }
}

inline void store_slab(const float* src, at::Tensor& x, int64_t offset, int64_t T, int64_t C, int64_t N) {
    switch (x.scalar_type()) {
        case at::kFloat: store_rows(src, x.data_ptr<float>() + offset, T, C, N); break;
        case at::kBFloat16: store_rows(src, x.data_ptr<at::BFloat16>() + offset, T, C, N); break;
        case at::kHalf: store_rows(src, x.data_ptr<at::Half>() + offset, T, C, N); break;
        case at::kDouble: store_rows(src, x.data_ptr<double>() + offset, T, C, N); break;
        default: TORCH_CHECK(false, "wkv6_cpu: unsupported dtype ", x.scalar_type());
    }
}

template <typename V>
inline void grow(V& vec, int64_t n) {
    if (static_cast<int64_t>(vec.size()) < n) vec.resize(n);
}

// fp32 slabs of one (batch, head): r, k, v, decay, -exp(w), gy, y as (T, N) rows, and u.
struct Slabs {
    std::vector<float> r, k, v, d, ew, g, u, state, y;
    void resize(int64_t n, int64_t N, bool with_g) {  // grows only
        grow(r, n); grow(k, n); grow(v, n); grow(d, n); grow(ew, n); grow(u, N); grow(y, n);
        grow(state, N * N);
        if (with_g) grow(g, n);
    }
};

// Each OpenMP worker keeps its scratch between calls (the pool's threads persist).
Slabs& thread_slabs() {
    static thread_local Slabs s;
    return s;
}

// Read u's head h (any float dtype) as fp32.
inline void load_u(const at::Tensor& u, int64_t h, int64_t N, float* dst) {
    load_slab(u, h * N, dst, 1, N, N);
}

// exp(x) for float, branch-free so that `omp simd` loops vectorise it (std::exp is a
// scalar libm call: it took a quarter of the forward). x = n ln2 + r, |r| <= ln2 / 2,
// e^r by the Cephes degree-6 polynomial; max relative error 8e-8 on [-87, 88], inputs
// clamped to that range (exp(-87) is 1.6e-38: a decay of zero for every purpose here).
// Needs -fno-trapping-math to vectorise (build.py passes it).
inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r -= n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

inline void load_inputs(Slabs& s, const at::Tensor& r, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& w, int64_t off, int64_t T, int64_t C, int64_t N) {
    load_slab(r, off, s.r.data(), T, C, N);
    load_slab(k, off, s.k.data(), T, C, N);
    load_slab(v, off, s.v.data(), T, C, N);
    load_slab(w, off, s.ew.data(), T, C, N);
    const int64_t n = T * N;
    float* ew = s.ew.data();
    float* d = s.d.data();
#pragma omp simd
    for (int64_t q = 0; q < n; ++q) {
        const float e = -exp_approx(ew[q]);
        ew[q] = e;
        d[q] = exp_approx(e);
    }
}

// 8 floats as one vector (GCC/Clang vector extension: AVX registers with -mavx2, pairs of
// SSE registers without); loads and stores through memcpy, so no alignment is assumed.
typedef float vf8 __attribute__((vector_size(32)));

inline vf8 load8(const float* p) {
    vf8 x;
    std::memcpy(&x, p, sizeof x);
    return x;
}

inline void store8(float* p, vf8 x) { std::memcpy(p, &x, sizeof x); }

// Both directions of the forward pass for head sizes that are multiples of 16, with the
// state held in registers: the state is cut into tiles of 4 key channels x 16 value
// channels (eight vectors). Time runs in chunks of CHUNK steps; within a chunk each tile
// runs through every step before the next tile, so a chunk's rows of r, k, v, d and y
// stay in cache while every tile passes over them, and a tile's state goes to memory only
// between chunks. Each direction is its own instantiation, walking the rows by pointer.
// y is a contiguous (T, N) slab. The bonus term is added by the caller.
template <int N, bool REVERSE>
void forward_tiles_one_way(const float* r, const float* k, const float* v, const float* d,
                           float* y, float* state, int64_t T) {
    constexpr int64_t CHUNK = 256;
    constexpr int64_t STEP = REVERSE ? -N : N;  // row stride in the scan's direction
    std::fill(state, state + N * N, 0.0f);
    for (int64_t c0 = 0; c0 < T; c0 += CHUNK) {
        const int64_t len = std::min(T - c0, CHUNK);
        const int64_t row = (REVERSE ? T - 1 - c0 : c0) * N;  // the chunk's first row
        float* tile = state;  // 64 floats per tile, tiles in (i0, j0) order
        for (int i0 = 0; i0 < N; i0 += 16) {
            for (int j0 = 0; j0 < N; j0 += 4, tile += 64) {
                vf8 s00 = load8(tile), s01 = load8(tile + 8), s10 = load8(tile + 16),
                    s11 = load8(tile + 24), s20 = load8(tile + 32), s21 = load8(tile + 40),
                    s30 = load8(tile + 48), s31 = load8(tile + 56);
                const float* rt = r + row + j0;
                const float* kt = k + row + j0;
                const float* dt = d + row + j0;
                const float* vt = v + row + i0;
                float* yt = y + row + i0;
                for (int64_t n = 0; n < len;
                     ++n, rt += STEP, kt += STEP, dt += STEP, vt += STEP, yt += STEP) {
                    const vf8 v0 = load8(vt), v1 = load8(vt + 8);
                    // y uses the state before this step's update (A[t-1] / B[t+1])
                    vf8 y0 = rt[0] * s00 + rt[1] * s10;
                    vf8 y1 = rt[0] * s01 + rt[1] * s11;
                    y0 += rt[2] * s20 + rt[3] * s30;
                    y1 += rt[2] * s21 + rt[3] * s31;
                    s00 = dt[0] * s00 + kt[0] * v0;
                    s01 = dt[0] * s01 + kt[0] * v1;
                    s10 = dt[1] * s10 + kt[1] * v0;
                    s11 = dt[1] * s11 + kt[1] * v1;
                    s20 = dt[2] * s20 + kt[2] * v0;
                    s21 = dt[2] * s21 + kt[2] * v1;
                    s30 = dt[3] * s30 + kt[3] * v0;
                    s31 = dt[3] * s31 + kt[3] * v1;
                    store8(yt, load8(yt) + y0);
                    store8(yt + 8, load8(yt + 8) + y1);
                }
                store8(tile, s00); store8(tile + 8, s01); store8(tile + 16, s10);
                store8(tile + 24, s11); store8(tile + 32, s20); store8(tile + 40, s21);
                store8(tile + 48, s30); store8(tile + 56, s31);
            }
        }
    }
}

template <int N>
void forward_tiles(const float* r, const float* k, const float* v, const float* d, float* y,
                   float* state, int64_t T) {
    static_assert(N % 16 == 0, "tiles of 16 value channels");
    forward_tiles_one_way<N, false>(r, k, v, d, y, state, T);
    forward_tiles_one_way<N, true>(r, k, v, d, y, state, T);
}

// One direction of the forward pass, accumulated into y (T, N rows of the output), for
// head sizes forward_tiles does not take. NC > 0 fixes the head size at compile time;
// NC == 0 uses n.
template <int NC>
void forward_scan(const float* r, const float* k, const float* v, const float* d,
                  const float* u, float* state, float* y, int64_t T, int64_t C, int64_t n,
                  bool reverse) {
    const int64_t N = NC > 0 ? NC : n;
    std::fill(state, state + N * N, 0.0f);
    for (int64_t step = 0; step < T; ++step) {
        const int64_t t = reverse ? T - 1 - step : step;
        const float* rt = r + t * N;
        const float* kt = k + t * N;
        const float* vt = v + t * N;
        const float* dt = d + t * N;
        float* yt = y + t * C;
        if (u != nullptr) {  // the bonus term of the causal direction: (sum_j r u k) v[t, i]
            float ruk = 0.0f;
#pragma omp simd reduction(+ : ruk)
            for (int64_t j = 0; j < N; ++j) ruk += rt[j] * u[j] * kt[j];
#pragma omp simd
            for (int64_t i = 0; i < N; ++i) yt[i] += ruk * vt[i];
        }
        for (int64_t j = 0; j < N; ++j) {
            float* row = state + j * N;
            const float rj = rt[j], kj = kt[j], dj = dt[j];
#pragma omp simd
            for (int64_t i = 0; i < N; ++i) {
                const float s = row[i];
                yt[i] += rj * s;
                row[i] = dj * s + kj * vt[i];
            }
        }
    }
}

// y[t] += (sum_j r[t,j] u[j] k[t,j]) v[t]: the bonus (current-token) term.
template <int N>
void add_bonus(const float* r, const float* k, const float* v, const float* u, float* y,
               int64_t T, int64_t C) {
    for (int64_t t = 0; t < T; ++t) {
        const float* rt = r + t * N;
        const float* kt = k + t * N;
        const float* vt = v + t * N;
        float* yt = y + t * C;
        float ruk = 0.0f;
#pragma omp simd reduction(+ : ruk)
        for (int64_t j = 0; j < N; ++j) ruk += rt[j] * u[j] * kt[j];
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) yt[i] += ruk * vt[i];
    }
}

// Steps per chunk of the tiled backward (backward_tiles_one_way).
constexpr int64_t BACK_CHUNK = 128;

// Per-thread backward scratch.
struct BackScratch {
    std::vector<float> X, Y;          // kv-built state and rg-built state (N x N)
    std::vector<float> dr, dk, dv;    // gradient rows (T x N)
    std::vector<float> gw;            // final dw rows (T x N)
    std::vector<double> lam;          // log-decay adjoint partial sums (T x N)
    std::vector<double> run_a, run_b; // running per-channel sums (N)
    std::vector<float> sx, sy;        // per-step row reductions (BACK_CHUNK x N)
    void resize(int64_t T, int64_t N) {  // grows only
        grow(X, N * N); grow(Y, N * N);
        grow(dr, T * N); grow(dk, T * N); grow(dv, T * N); grow(gw, T * N);
        grow(lam, T * N);
        grow(run_a, N); grow(run_b, N);
        grow(sx, BACK_CHUNK * N); grow(sy, BACK_CHUNK * N);
    }
    void start_direction(int64_t N) {  // both states and the running sums to zero
        std::fill(X.begin(), X.begin() + N * N, 0.0f);
        std::fill(Y.begin(), Y.begin() + N * N, 0.0f);
        std::fill(run_a.begin(), run_a.begin() + N, 0.0);
        std::fill(run_b.begin(), run_b.begin() + N, 0.0);
    }
};

BackScratch& thread_back_scratch() {
    static thread_local BackScratch s;
    return s;
}

// One direction of the backward pass. X accumulates k v^T (read with g -> dr),
// Y accumulates r g^T (read with v -> dk, with k -> dv). Both are used, then updated.
template <int NC>
void backward_scan(const Slabs& in, BackScratch& s, int64_t T, int64_t n, bool reverse) {
    const int64_t N = NC > 0 ? NC : n;
    s.start_direction(N);
    float* X = s.X.data();
    float* Y = s.Y.data();
    double* ra = s.run_a.data();  // running sum of r * (X g)
    double* rb = s.run_b.data();  // running sum of k * (Y v)
    float* sx = s.sx.data();
    float* sy = s.sy.data();
    for (int64_t step = 0; step < T; ++step) {
        const int64_t t = reverse ? T - 1 - step : step;
        const float* rt = in.r.data() + t * N;
        const float* kt = in.k.data() + t * N;
        const float* vt = in.v.data() + t * N;
        const float* dt = in.d.data() + t * N;
        const float* gt = in.g.data() + t * N;
        float* dvt = s.dv.data() + t * N;
        for (int64_t j = 0; j < N; ++j) {
            float* xrow = X + j * N;
            float* yrow = Y + j * N;
            const float rj = rt[j], kj = kt[j], dj = dt[j];
            float ax = 0.0f, ay = 0.0f;
#pragma omp simd reduction(+ : ax, ay)
            for (int64_t i = 0; i < N; ++i) {
                const float x = xrow[i];
                const float y = yrow[i];
                ax += x * gt[i];
                ay += y * vt[i];
                dvt[i] += kj * y;
                xrow[i] = dj * x + kj * vt[i];
                yrow[i] = dj * y + rj * gt[i];
            }
            sx[j] = ax;
            sy[j] = ay;
        }
        float* drt = s.dr.data() + t * N;
        float* dkt = s.dk.data() + t * N;
        double* lam = s.lam.data() + t * N;
        for (int64_t j = 0; j < N; ++j) {
            drt[j] += sx[j];
            dkt[j] += sy[j];
            ra[j] += static_cast<double>(rt[j]) * sx[j];
            rb[j] += static_cast<double>(kt[j]) * sy[j];
        }
        if (!reverse) {
            // forward scan: X = A (gives dr_A), Y = Q (gives dk_Q).
            // lam[t] = -sum_{s<=t} r dr_A - sum_{s<=t} k dk_Q   (total of k dk_Q added later)
            for (int64_t j = 0; j < N; ++j) lam[j] = -ra[j] - rb[j];
        } else {
            // reverse scan: X = B (gives dr_B), Y = P (gives dk_P).
            // lam[t] += -sum_{s>=t} r dr_B - sum_{s>=t} k dk_P   (totals added at the end)
            for (int64_t j = 0; j < N; ++j) lam[j] -= ra[j] + rb[j];
        }
    }
}

// Lane c of the result is the sum of a[c]'s lanes, for LANES = 4 (the low half of the
// result) or 8 vectors: pairs of vectors interleaved and added, then pairs of those, then
// the two 128-bit halves (in-lane shuffles, one cross-lane at the end). Compilers without
// __builtin_shufflevector (GCC < 12), or a build defining WKV_SCALAR_LANE_SUMS (tests),
// sum lane by lane.
template <int LANES>
inline vf8 lane_sums(const vf8* a) {
#if !defined(WKV_SCALAR_LANE_SUMS) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
    auto pair = [](vf8 p, vf8 q) {
        return __builtin_shufflevector(p, q, 0, 8, 1, 9, 4, 12, 5, 13) +
               __builtin_shufflevector(p, q, 2, 10, 3, 11, 6, 14, 7, 15);
    };
    auto quad = [](vf8 p, vf8 q) {
        return __builtin_shufflevector(p, q, 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(p, q, 2, 3, 10, 11, 6, 7, 14, 15);
    };
    const vf8 lo = quad(pair(a[0], a[1]), pair(a[2], a[3]));
    const vf8 hi = LANES == 8 ? quad(pair(a[4], a[5]), pair(a[6], a[7])) : lo;
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
#else
    vf8 out = {};
    for (int c = 0; c < LANES; ++c)
        for (int l = 0; l < 8; ++l) out[c] += a[c][l];
    return out;
#endif
}

// p[0:LANES] += the first LANES lanes of x, as one vector operation.
template <int LANES>
inline void add_lanes(float* p, vf8 x) {
    if constexpr (LANES == 8) {
        store8(p, load8(p) + x);
    } else {
        typedef float vf4 __attribute__((vector_size(16)));
        vf4 a, b;
        std::memcpy(&a, p, sizeof a);
        std::memcpy(&b, &x, sizeof b);
        a += b;
        std::memcpy(p, &a, sizeof a);
    }
}

// One direction of the backward pass for head sizes that are multiples of 8, the two
// states in registers (the tiled form of backward_scan, same sums in another order).
// A tile is 8 key channels j (one vector) x I value channels i, of X and of Y: X[., i]
// and Y[., i] are vectors over j, so sum_i X g and sum_i Y v (-> dr, dk) are vector FMAs,
// and only sum_j k Y (-> dv) needs lane sums. Time runs in chunks of BACK_CHUNK steps,
// every tile passing over the chunk's rows while they are in cache; the chunk's dr and dk
// rows collect in sx, sy, then go into the running sums in scan order.
template <int N, bool REVERSE>
void backward_tiles_one_way(const Slabs& in, BackScratch& s, int64_t T) {
    static_assert(N % 8 == 0, "tiles of 8 key channels");
#if defined(__AVX512F__)
    constexpr int I = 8;  // 32 vector registers hold two 8 x 8 tiles
#else
    constexpr int I = 4;  // 16 registers: two 8 x 4 tiles
#endif
    constexpr int64_t STEP = REVERSE ? -N : N;
    s.start_direction(N);
    float* sx = s.sx.data();  // the chunk's sum_i X g and sum_i Y v rows, in scan order
    float* sy = s.sy.data();
    for (int64_t c0 = 0; c0 < T; c0 += BACK_CHUNK) {
        const int64_t len = std::min(T - c0, BACK_CHUNK);
        const int64_t row = (REVERSE ? T - 1 - c0 : c0) * N;  // the chunk's first row
        std::fill(sx, sx + len * N, 0.0f);
        std::fill(sy, sy + len * N, 0.0f);
        float* xtile = s.X.data();
        float* ytile = s.Y.data();
        for (int j0 = 0; j0 < N; j0 += 8) {
            for (int i0 = 0; i0 < N; i0 += I, xtile += 8 * I, ytile += 8 * I) {
                vf8 x[I], y[I];
#pragma GCC unroll 8
                for (int c = 0; c < I; ++c) {
                    x[c] = load8(xtile + 8 * c);
                    y[c] = load8(ytile + 8 * c);
                }
                const float* rt = in.r.data() + row + j0;
                const float* kt = in.k.data() + row + j0;
                const float* dt = in.d.data() + row + j0;
                const float* gt = in.g.data() + row + i0;
                const float* vt = in.v.data() + row + i0;
                float* dvt = s.dv.data() + row + i0;
                float* sxt = sx + j0;
                float* syt = sy + j0;
                for (int64_t n = 0; n < len; ++n, rt += STEP, kt += STEP, dt += STEP,
                     gt += STEP, vt += STEP, dvt += STEP, sxt += N, syt += N) {
                    const vf8 rj = load8(rt), kj = load8(kt), dj = load8(dt);
                    // the state before this step's update (A[t-1] / Q[t], B[t+1] / P[t])
                    vf8 ax = x[0] * gt[0], ay = y[0] * vt[0];
                    vf8 ky[I];
                    ky[0] = kj * y[0];
#pragma GCC unroll 8
                    for (int c = 1; c < I; ++c) {
                        ax += x[c] * gt[c];
                        ay += y[c] * vt[c];
                        ky[c] = kj * y[c];
                    }
                    const vf8 dv = lane_sums<I>(ky);
                    add_lanes<I>(dvt, dv);
#pragma GCC unroll 8
                    for (int c = 0; c < I; ++c) {
                        x[c] = dj * x[c] + kj * vt[c];
                        y[c] = dj * y[c] + rj * gt[c];
                    }
                    store8(sxt, load8(sxt) + ax);
                    store8(syt, load8(syt) + ay);
                }
#pragma GCC unroll 8
                for (int c = 0; c < I; ++c) {
                    store8(xtile + 8 * c, x[c]);
                    store8(ytile + 8 * c, y[c]);
                }
            }
        }
        double* ra = s.run_a.data();  // running sums of r * (X g) and k * (Y v)
        double* rb = s.run_b.data();
        for (int64_t n = 0; n < len; ++n) {  // in scan order: the running sums
            const int64_t t = REVERSE ? T - 1 - c0 - n : c0 + n;
            const float* rt = in.r.data() + t * N;
            const float* kt = in.k.data() + t * N;
            float* drt = s.dr.data() + t * N;
            float* dkt = s.dk.data() + t * N;
            double* lam = s.lam.data() + t * N;
            const float* sxn = sx + n * N;
            const float* syn = sy + n * N;
#pragma omp simd
            for (int64_t j = 0; j < N; ++j) {
                drt[j] += sxn[j];
                dkt[j] += syn[j];
                ra[j] += static_cast<double>(rt[j]) * sxn[j];
                rb[j] += static_cast<double>(kt[j]) * syn[j];
                if constexpr (REVERSE)  // the two directions' parts: see backward_scan
                    lam[j] -= ra[j] + rb[j];
                else
                    lam[j] = -ra[j] - rb[j];
            }
        }
    }
}

void check_args(const at::Tensor& r, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& w, const at::Tensor& u) {
    TORCH_CHECK(r.dim() == 3, "wkv6_cpu: r must be (B, T, C)");
    for (const at::Tensor* x : {&r, &k, &v, &w}) {
        TORCH_CHECK(x->sizes() == r.sizes(), "wkv6_cpu: r, k, v, w must have the same shape");
        TORCH_CHECK(x->is_contiguous(), "wkv6_cpu: inputs must be contiguous");
        TORCH_CHECK(x->device().is_cpu(), "wkv6_cpu: inputs must be CPU tensors");
    }
    TORCH_CHECK(u.dim() == 2 && u.size(0) * u.size(1) == r.size(2),
                "wkv6_cpu: u must be (H, N) with H * N == C");
    TORCH_CHECK(u.is_contiguous() && u.device().is_cpu(), "wkv6_cpu: u must be a contiguous CPU tensor");
    TORCH_CHECK(r.size(1) >= 1, "wkv6_cpu: T must be >= 1");
}

template <int NC>
void forward_impl(const at::Tensor& r, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& w, const at::Tensor& u, at::Tensor& y) {
    const int64_t B = r.size(0), T = r.size(1), C = r.size(2);
    const int64_t H = u.size(0), N = u.size(1);
    float* yp = y.data_ptr<float>();
    const int nthreads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(B * H)));
#pragma omp parallel num_threads(nthreads)
    {
        Slabs& in = thread_slabs();
        in.resize(T * N, N, false);
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            const int64_t b = bh / H, h = bh % H;
            const int64_t off = b * T * C + h * N;
            load_inputs(in, r, k, v, w, off, T, C, N);
            load_u(u, h, N, in.u.data());
            float* yb = yp + off;
            if constexpr (NC > 0 && NC % 16 == 0) {
                float* ys = in.y.data();  // contiguous rows: see forward_tiles
                std::fill(ys, ys + T * N, 0.0f);
                add_bonus<NC>(in.r.data(), in.k.data(), in.v.data(), in.u.data(), ys, T, N);
                forward_tiles<NC>(in.r.data(), in.k.data(), in.v.data(), in.d.data(), ys,
                                  in.state.data(), T);
                store_slab(ys, y, off, T, C, N);
            } else {
                for (int64_t t = 0; t < T; ++t) std::fill(yb + t * C, yb + t * C + N, 0.0f);
                forward_scan<NC>(in.r.data(), in.k.data(), in.v.data(), in.d.data(),
                                 in.u.data(), in.state.data(), yb, T, C, N, false);
                forward_scan<NC>(in.r.data(), in.k.data(), in.v.data(), in.d.data(), nullptr,
                                 in.state.data(), yb, T, C, N, true);
            }
        }
    }
}

template <int NC>
void backward_impl(const at::Tensor& r, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& w, const at::Tensor& u, const at::Tensor& gy,
                   at::Tensor& gr, at::Tensor& gk, at::Tensor& gv, at::Tensor& gw,
                   float* gup) {
    const int64_t B = r.size(0), T = r.size(1), C = r.size(2);
    const int64_t H = u.size(0), N = u.size(1);  // gup: (B, H, N) partial sums of gu
    const int nthreads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(B * H)));
#pragma omp parallel num_threads(nthreads)
    {
        Slabs& in = thread_slabs();
        in.resize(T * N, N, true);
        BackScratch& s = thread_back_scratch();
        s.resize(T, N);
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            const int64_t b = bh / H, h = bh % H;
            const int64_t off = b * T * C + h * N;
            load_inputs(in, r, k, v, w, off, T, C, N);
            load_slab(gy, off, in.g.data(), T, C, N);
            load_u(u, h, N, in.u.data());
            const float* uh = in.u.data();
            // Bonus terms: y[t,i] += (sum_j r u k) v[t,i].
            float* gub = gup + bh * N;
            std::fill(gub, gub + N, 0.0f);
            for (int64_t t = 0; t < T; ++t) {
                const float* rt = in.r.data() + t * N;
                const float* kt = in.k.data() + t * N;
                const float* vt = in.v.data() + t * N;
                const float* gt = in.g.data() + t * N;
                float vg = 0.0f, ruk = 0.0f;
#pragma omp simd reduction(+ : vg, ruk)
                for (int64_t i = 0; i < N; ++i) {
                    vg += vt[i] * gt[i];
                    ruk += rt[i] * uh[i] * kt[i];
                }
                float* drt = s.dr.data() + t * N;
                float* dkt = s.dk.data() + t * N;
                float* dvt = s.dv.data() + t * N;
#pragma omp simd
                for (int64_t j = 0; j < N; ++j) {
                    drt[j] = uh[j] * kt[j] * vg;
                    dkt[j] = uh[j] * rt[j] * vg;
                    dvt[j] = ruk * gt[j];
                    gub[j] += rt[j] * kt[j] * vg;
                }
            }
            if constexpr (NC > 0 && NC % 8 == 0)
                backward_tiles_one_way<NC, false>(in, s, T);
            else
                backward_scan<NC>(in, s, T, N, false);
            // run_b now holds sum over all t of k dk_Q: the "s > t" part needs it.
            std::vector<double>& lam = s.lam;
            const double* total_b = s.run_b.data();
            for (int64_t t = 0; t < T; ++t) {
                double* lt = lam.data() + t * N;
#pragma omp simd
                for (int64_t j = 0; j < N; ++j) lt[j] += total_b[j];
            }
            if constexpr (NC > 0 && NC % 8 == 0)
                backward_tiles_one_way<NC, true>(in, s, T);
            else
                backward_scan<NC>(in, s, T, N, true);
            // run_b now holds sum over all t of k dk_P: the "s < t" part needs it.
            for (int64_t t = 0; t < T; ++t) {
                const float* ewt = in.ew.data() + t * N;
                float* gwt = s.gw.data() + t * N;
                const double* lt = lam.data() + t * N;
                // No step lies strictly between two others at the ends: exactly zero there.
                const bool edge = (t == 0 || t == T - 1);
                const double* total_p = s.run_b.data();
#pragma omp simd
                for (int64_t j = 0; j < N; ++j)
                    gwt[j] = edge ? 0.0f : static_cast<float>((lt[j] + total_p[j]) * ewt[j]);
            }
            store_slab(s.dr.data(), gr, off, T, C, N);
            store_slab(s.dk.data(), gk, off, T, C, N);
            store_slab(s.dv.data(), gv, off, T, C, N);
            store_slab(s.gw.data(), gw, off, T, C, N);
        }
    }
}

template <typename Fn>
void dispatch_n(int64_t N, Fn&& fn) {
    switch (N) {
        case 32: fn(std::integral_constant<int, 32>()); break;
        case 64: fn(std::integral_constant<int, 64>()); break;
        case 80: fn(std::integral_constant<int, 80>()); break;
        case 128: fn(std::integral_constant<int, 128>()); break;
        default: fn(std::integral_constant<int, 0>()); break;
    }
}

at::Tensor wkv6_forward(const at::Tensor& r, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& w, const at::Tensor& u) {
    check_args(r, k, v, w, u);
    at::Tensor y = at::empty(r.sizes(), r.options().dtype(at::kFloat));
    dispatch_n(u.size(1), [&](auto nc) { forward_impl<decltype(nc)::value>(r, k, v, w, u, y); });
    return y;
}

std::vector<at::Tensor> wkv6_backward(const at::Tensor& r, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& w, const at::Tensor& u, const at::Tensor& gy) {
    check_args(r, k, v, w, u);
    TORCH_CHECK(gy.sizes() == r.sizes() && gy.is_contiguous(), "wkv6_cpu: gy must be contiguous (B, T, C)");
    at::Tensor gr = at::empty_like(r), gk = at::empty_like(k), gv = at::empty_like(v), gw = at::empty_like(w);
    at::Tensor gu = at::empty_like(u);
    const int64_t B = r.size(0), H = u.size(0), N = u.size(1);
    // per-(batch, head) partial sums of gu, reduced over the batch below; kept by the
    // calling thread between calls, like the workers' scratch
    static thread_local std::vector<float> gu_part, gu_sum;
    grow(gu_part, B * H * N);
    grow(gu_sum, H * N);
    dispatch_n(N, [&](auto nc) {
        backward_impl<decltype(nc)::value>(r, k, v, w, u, gy, gr, gk, gv, gw, gu_part.data());
    });
    for (int64_t q = 0; q < H * N; ++q) {
        double acc = 0.0;
        for (int64_t b = 0; b < B; ++b) acc += gu_part[b * H * N + q];
        gu_sum[q] = static_cast<float>(acc);
    }
    store_slab(gu_sum.data(), gu, 0, 1, H * N, H * N);
    return {gr, gk, gv, gw, gu};
}

}  // namespace

// forward(r, k, v, w, u) -> y (float32); backward(r, k, v, w, u, gy) -> [gr, gk, gv, gw, gu].
// The builder names the library (TORCH_EXTENSION_NAME) after the build and its folder: a
// namespace can be registered once per process, and one build can be loaded from two
// cache folders.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &wkv6_forward);
    m.def("backward", &wkv6_backward);
}
