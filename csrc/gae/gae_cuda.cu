// CUDA kernel: GAE over packed sequences as a segmented reverse scan.
//
// One thread block per sequence walks it from the end in tiles of kThreads * kItems tokens
// (scan order j = 0, 1, ... is position hi-1, hi-2, ...).  Two block scans per tile, each
// carried across tiles by a running-prefix callback:
//   1. V_next: exclusive "last masked-in value" scan seeded with the bootstrap value;
//   2. A: inclusive scan of affine maps x -> delta + c*x (c = gamma*lambda on masked-in
//      tokens, identity on masked-out ones); A_t is the composed map applied to 0.
// Masked-out and out-of-range tokens are identity elements, so the recurrence runs over the
// masked-in tokens only.  Compiles with plain nvcc (CUB ships with the CUDA toolkit).
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "areal_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kItems = 4;
constexpr int kTile = kThreads * kItems;

struct LastValid {
  float value;
  int valid;
};

struct LastValidOp {
  __device__ __forceinline__ LastValid operator()(const LastValid& a, const LastValid& b) const {
    return b.valid ? b : a;
  }
};

// x -> d + c * x; op(a, b) applies a first, then b.
struct Affine {
  float c;
  float d;
};

struct AffineOp {
  __device__ __forceinline__ Affine operator()(const Affine& a, const Affine& b) const {
    return Affine{a.c * b.c, b.d + b.c * a.d};
  }
};

template <typename T, typename Op>
struct RunningPrefix {
  T running;
  __device__ __forceinline__ T operator()(const T& tile_aggregate) {
    const T old = running;
    running = Op()(running, tile_aggregate);
    return old;
  }
};

__global__ void __launch_bounds__(kThreads)
gae_kernel(const float* __restrict__ rewards, const float* __restrict__ values,
           const int32_t* __restrict__ cu_seqlens, int64_t T, const float* __restrict__ bootstrap,
           const uint8_t* __restrict__ loss_mask, float gamma, float gl, float* __restrict__ adv,
           float* __restrict__ ret) {
  using ValueScan = cub::BlockScan<LastValid, kThreads>;
  using AffineScan = cub::BlockScan<Affine, kThreads>;
  __shared__ union {
    typename ValueScan::TempStorage value;
    typename AffineScan::TempStorage affine;
  } temp;

  const int b = blockIdx.x;
  const int64_t lo = cu_seqlens[b];
  int64_t hi = cu_seqlens[b + 1];
  hi = hi < T ? hi : T;
  if (hi <= lo) return;
  RunningPrefix<LastValid, LastValidOp> vprefix{LastValid{bootstrap ? bootstrap[b] : 0.f, 1}};
  RunningPrefix<Affine, AffineOp> aprefix{Affine{1.f, 0.f}};

  for (int64_t tile = 0; tile < hi - lo; tile += kTile) {
    int64_t pos[kItems];
    bool in[kItems];
    float v[kItems], r[kItems];
    LastValid lv[kItems];
    for (int i = 0; i < kItems; ++i) {
      pos[i] = hi - 1 - (tile + threadIdx.x * kItems + i);
      in[i] = pos[i] >= lo && (loss_mask == nullptr || loss_mask[pos[i]] != 0);
      v[i] = in[i] ? values[pos[i]] : 0.f;
      r[i] = in[i] ? rewards[pos[i]] : 0.f;
      lv[i] = LastValid{v[i], in[i] ? 1 : 0};
    }
    LastValid next[kItems];
    ValueScan(temp.value).ExclusiveScan(lv, next, LastValidOp(), vprefix);
    __syncthreads();
    Affine f[kItems];
    for (int i = 0; i < kItems; ++i) {
      f[i] = in[i] ? Affine{gl, r[i] + gamma * next[i].value - v[i]} : Affine{1.f, 0.f};
    }
    AffineScan(temp.affine).InclusiveScan(f, f, AffineOp(), aprefix);
    __syncthreads();
    for (int i = 0; i < kItems; ++i) {
      if (pos[i] >= lo) {
        adv[pos[i]] = in[i] ? f[i].d : 0.f;
        ret[pos[i]] = in[i] ? f[i].d + v[i] : 0.f;
      }
    }
  }
}

}  // namespace

extern "C" int areal_gae_cuda(const float* rewards, const float* values,
                              const int32_t* cu_seqlens, int64_t num_seqs, int64_t T,
                              const float* bootstrap, const uint8_t* loss_mask, double gamma,
                              double lam, float* adv, float* ret, void* stream) {
  if (num_seqs < 0 || num_seqs > 0x7fffffffLL || T < 0) return AREAL_BAD_SHAPE;
  if (num_seqs == 0 || T == 0) return AREAL_OK;
  gae_kernel<<<static_cast<unsigned>(num_seqs), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      rewards, values, cu_seqlens, T, bootstrap, loss_mask, static_cast<float>(gamma),
      static_cast<float>(gamma * lam), adv, ret);
  return cudaGetLastError() == cudaSuccess ? AREAL_OK : AREAL_CUDA_ERROR;
}
