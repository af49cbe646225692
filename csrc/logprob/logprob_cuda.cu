// CUDA kernels for packed-token log-softmax statistics and their backward (see areal_kernels.h).
//
// Forward: one thread block per token row; each thread keeps an online (max, sum-exp,
// sum e*(x-m)) over a strided slice of the vocabulary, and the block merges the partial
// statistics with warp shuffles.  Only [T]-sized statistics are written.
// Backward: a 2-D grid (rows x vocabulary chunks) writes the gradient in the logits' dtype.
// Accumulation is float32 (float64 for float64 logits).  Compiles with plain nvcc: no torch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "areal_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kBackwardChunk = 4096;  // vocabulary entries per backward block

template <typename A>
__device__ __forceinline__ A neg_inf();
template <>
__device__ __forceinline__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template <>
__device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

template <typename A>
__device__ __forceinline__ A exp_acc(A x);
template <>
__device__ __forceinline__ float exp_acc<float>(float x) { return expf(x); }
template <>
__device__ __forceinline__ double exp_acc<double>(double x) { return exp(x); }

template <typename A> __device__ __forceinline__ A to_acc(float v) { return static_cast<A>(v); }
template <typename A> __device__ __forceinline__ A to_acc(double v) { return static_cast<A>(v); }
template <typename A> __device__ __forceinline__ A to_acc(__half v) { return static_cast<A>(__half2float(v)); }
template <typename A> __device__ __forceinline__ A to_acc(__nv_bfloat16 v) { return static_cast<A>(__bfloat162float(v)); }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T> __device__ __forceinline__ T from_acc(double v) { return static_cast<T>(v); }

// Statistics of a set of values relative to their max m: s = sum e^(x-m), u = sum e^(x-m)(x-m).
template <typename A>
struct Stats {
  A m, s, u;
};

template <typename A>
__device__ __forceinline__ Stats<A> merge(const Stats<A>& a, const Stats<A>& b) {
  const A m = a.m > b.m ? a.m : b.m;
  if (!(m > neg_inf<A>())) return a;  // both empty
  Stats<A> r{m, A(0), A(0)};
  if (a.m > neg_inf<A>()) {
    const A c = exp_acc<A>(a.m - m);
    r.s += c * a.s;
    r.u += c * (a.u + (a.m - m) * a.s);
  }
  if (b.m > neg_inf<A>()) {
    const A c = exp_acc<A>(b.m - m);
    r.s += c * b.s;
    r.u += c * (b.u + (b.m - m) * b.s);
  }
  return r;
}

template <typename A>
__device__ __forceinline__ Stats<A> shfl_xor(const Stats<A>& v, int lane_mask) {
  return Stats<A>{__shfl_xor_sync(0xffffffffu, v.m, lane_mask),
                  __shfl_xor_sync(0xffffffffu, v.s, lane_mask),
                  __shfl_xor_sync(0xffffffffu, v.u, lane_mask)};
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
stats_kernel(const T* __restrict__ logits, int64_t V, int64_t stride,
             const int64_t* __restrict__ labels, int64_t vstart, A inv_t, A* __restrict__ M,
             A* __restrict__ S, A* __restrict__ XL, A* __restrict__ U) {
  const int64_t t = blockIdx.x;
  const T* row = logits + t * stride;
  Stats<A> st{neg_inf<A>(), A(0), A(0)};
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const A x = to_acc<A>(row[v]) * inv_t;
    if (x > st.m) {
      if (st.m > neg_inf<A>()) {
        const A c = exp_acc<A>(st.m - x);
        st.u = c * (st.u + (st.m - x) * st.s);
        st.s = c * st.s;
      }
      st.m = x;
      st.s += A(1);
    } else if (x > neg_inf<A>()) {
      const A d = x - st.m;
      const A e = exp_acc<A>(d);
      st.s += e;
      st.u += e * d;
    }
  }
  for (int off = 16; off > 0; off >>= 1) st = merge(st, shfl_xor(st, off));
  __shared__ Stats<A> warp_stats[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kThreads / 32 ? warp_stats[lane] : Stats<A>{neg_inf<A>(), A(0), A(0)};
    for (int off = 16; off > 0; off >>= 1) st = merge(st, shfl_xor(st, off));
    if (lane == 0) {
      M[t] = st.m;
      S[t] = st.s;
      if (U) U[t] = st.u;
      const int64_t l = labels[t] - vstart;
      XL[t] = (l >= 0 && l < V) ? to_acc<A>(row[l]) * inv_t : A(0);
    }
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
backward_kernel(const T* __restrict__ logits, int64_t V, int64_t stride,
                const int64_t* __restrict__ labels, int64_t vstart, A inv_t,
                const A* __restrict__ LSE, const A* __restrict__ G, const A* __restrict__ EX,
                const A* __restrict__ GE, T* __restrict__ grad, int64_t gstride) {
  const int64_t t = blockIdx.x;
  const int64_t v0 = static_cast<int64_t>(blockIdx.y) * kBackwardChunk;
  const int64_t v1 = v0 + kBackwardChunk < V ? v0 + kBackwardChunk : V;
  const T* row = logits + t * stride;
  T* grow = grad + t * gstride;
  const A lse = LSE[t], g = G[t];
  const bool ent = EX != nullptr && GE != nullptr;
  const A ge = ent ? GE[t] : A(0), ex = ent ? EX[t] : A(0);
  const int64_t l = labels[t] - vstart;
  for (int64_t v = v0 + threadIdx.x; v < v1; v += kThreads) {
    const A x = to_acc<A>(row[v]) * inv_t;
    const A p = exp_acc<A>(x - lse);
    A val = g * ((v == l ? A(1) : A(0)) - p);
    if (ent && p > A(0)) val -= ge * p * (x - ex);
    grow[v] = from_acc<T>(val * inv_t);
  }
}

template <typename T, typename A>
int launch_stats(const void* logits, int64_t T_, int64_t V, int64_t stride, const int64_t* labels,
                 int64_t vstart, double inv_t, void* m, void* s, void* xl, void* u,
                 cudaStream_t stream) {
  stats_kernel<T, A><<<static_cast<unsigned>(T_), kThreads, 0, stream>>>(
      static_cast<const T*>(logits), V, stride, labels, vstart, static_cast<A>(inv_t),
      static_cast<A*>(m), static_cast<A*>(s), static_cast<A*>(xl), static_cast<A*>(u));
  return cudaGetLastError() == cudaSuccess ? AREAL_OK : AREAL_CUDA_ERROR;
}

template <typename T, typename A>
int launch_backward(const void* logits, int64_t T_, int64_t V, int64_t stride,
                    const int64_t* labels, int64_t vstart, double inv_t, const void* lse,
                    const void* g, const void* ex, const void* ge, void* grad, int64_t gstride,
                    cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T_),
                  static_cast<unsigned>((V + kBackwardChunk - 1) / kBackwardChunk));
  backward_kernel<T, A><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(logits), V, stride, labels, vstart, static_cast<A>(inv_t),
      static_cast<const A*>(lse), static_cast<const A*>(g), static_cast<const A*>(ex),
      static_cast<const A*>(ge), static_cast<T*>(grad), gstride);
  return cudaGetLastError() == cudaSuccess ? AREAL_OK : AREAL_CUDA_ERROR;
}

}  // namespace

extern "C" int areal_logprob_stats_cuda(const void* logits, int dtype, int64_t T, int64_t V,
                                        int64_t stride, const int64_t* labels, int64_t vstart,
                                        double inv_temp, void* m, void* s, void* xlab, void* u,
                                        void* stream) {
  if (V <= 0 || T < 0 || T > 0x7fffffffLL) return AREAL_BAD_SHAPE;
  if (T == 0) return AREAL_OK;
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case AREAL_F32: return launch_stats<float, float>(logits, T, V, stride, labels, vstart, inv_temp, m, s, xlab, u, st);
    case AREAL_F16: return launch_stats<__half, float>(logits, T, V, stride, labels, vstart, inv_temp, m, s, xlab, u, st);
    case AREAL_BF16: return launch_stats<__nv_bfloat16, float>(logits, T, V, stride, labels, vstart, inv_temp, m, s, xlab, u, st);
    case AREAL_F64: return launch_stats<double, double>(logits, T, V, stride, labels, vstart, inv_temp, m, s, xlab, u, st);
    default: return AREAL_BAD_DTYPE;
  }
}

extern "C" int areal_logprob_backward_cuda(const void* logits, int dtype, int64_t T, int64_t V,
                                           int64_t stride, const int64_t* labels, int64_t vstart,
                                           double inv_temp, const void* lse, const void* g_lp,
                                           const void* ex, const void* g_ent, void* grad,
                                           int64_t gstride, void* stream) {
  if (V <= 0 || T < 0 || T > 0x7fffffffLL) return AREAL_BAD_SHAPE;
  if (T == 0) return AREAL_OK;
  auto st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case AREAL_F32: return launch_backward<float, float>(logits, T, V, stride, labels, vstart, inv_temp, lse, g_lp, ex, g_ent, grad, gstride, st);
    case AREAL_F16: return launch_backward<__half, float>(logits, T, V, stride, labels, vstart, inv_temp, lse, g_lp, ex, g_ent, grad, gstride, st);
    case AREAL_BF16: return launch_backward<__nv_bfloat16, float>(logits, T, V, stride, labels, vstart, inv_temp, lse, g_lp, ex, g_ent, grad, gstride, st);
    case AREAL_F64: return launch_backward<double, double>(logits, T, V, stride, labels, vstart, inv_temp, lse, g_lp, ex, g_ent, grad, gstride, st);
    default: return AREAL_BAD_DTYPE;
  }
}
