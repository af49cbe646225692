// areal-mega packed-sequence kernels: the C ABI shared by the CPU (.cpp) and CUDA (.cu) kernels.
//
// The kernels see raw pointers only (no torch headers), so every .cu file compiles with plain
// nvcc and every CPU kernel compiles with a plain C++ compiler; the torch bindings in
// csrc/bindings/ validate tensors and call these entry points.
//
// Log-prob statistics, per token t of one vocabulary shard x = logits[t, :] * inv_temp of
// width V starting at global id vocab_start (acc = double for AREAL_F64 logits, else float):
//   m[t]    = max_v x_v
//   s[t]    = sum_v exp(x_v - m)
//   xlab[t] = x_{label - vocab_start} if the label falls in this shard, else 0
//   u[t]    = sum_v exp(x_v - m) * (x_v - m)        (only when u != NULL)
// Backward: grad[t, v] = inv_temp * (g_lp[t] * (1[v == label] - p) - g_ent[t] * p * (x_v - ex[t]))
//   with p = exp(x_v - lse[t]); g_ent / ex may be NULL (no entropy term).
//
// GAE over packed sequences: see areal_mega/ops/gae.py for the exact recurrence.
// All functions return 0 on success, or a nonzero code (see areal_status_string).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum areal_dtype { AREAL_F32 = 0, AREAL_F64 = 1, AREAL_F16 = 2, AREAL_BF16 = 3 };

enum areal_status {
  AREAL_OK = 0,
  AREAL_BAD_DTYPE = 1,
  AREAL_BAD_SHAPE = 2,
  AREAL_CUDA_ERROR = 3,
};

static inline const char* areal_status_string(int status) {
  switch (status) {
    case AREAL_OK: return "ok";
    case AREAL_BAD_DTYPE: return "unsupported dtype (expected float32, float64, float16 or bfloat16)";
    case AREAL_BAD_SHAPE: return "invalid shape";
    case AREAL_CUDA_ERROR: return "CUDA kernel launch failed";
    default: return "unknown error";
  }
}

// ---- CPU (csrc/logprob/logprob_cpu.cpp, csrc/gae/gae_cpu.cpp); process rows [row_begin, row_end)
int areal_logprob_stats_cpu(const void* logits, int dtype, int64_t row_begin, int64_t row_end,
                            int64_t V, int64_t row_stride, const int64_t* labels,
                            int64_t vocab_start, double inv_temp, void* m, void* s, void* xlab,
                            void* u);
int areal_logprob_backward_cpu(const void* logits, int dtype, int64_t row_begin, int64_t row_end,
                               int64_t V, int64_t row_stride, const int64_t* labels,
                               int64_t vocab_start, double inv_temp, const void* lse,
                               const void* g_lp, const void* ex, const void* g_ent, void* grad,
                               int64_t grad_row_stride);
// the vector ISA the CPU logprob kernels run (0 generic/SSE2, 1 AVX2, 2 AVX-512); set_isa caps
// it at what the CPU supports (a negative value: back to the default) and returns the result
int areal_cpu_isa(void);
int areal_cpu_set_isa(int isa);
// sequences [seq_begin, seq_end); loss_mask / bootstrap may be NULL
int areal_gae_cpu(const float* rewards, const float* values, const int32_t* cu_seqlens,
                  int64_t seq_begin, int64_t seq_end, const float* bootstrap,
                  const uint8_t* loss_mask, double gamma, double lam, float* adv, float* ret);

// ---- CUDA (csrc/logprob/logprob_cuda.cu, csrc/gae/gae_cuda.cu); `stream` is a cudaStream_t
int areal_logprob_stats_cuda(const void* logits, int dtype, int64_t T, int64_t V,
                             int64_t row_stride, const int64_t* labels, int64_t vocab_start,
                             double inv_temp, void* m, void* s, void* xlab, void* u,
                             void* stream);
int areal_logprob_backward_cuda(const void* logits, int dtype, int64_t T, int64_t V,
                                int64_t row_stride, const int64_t* labels, int64_t vocab_start,
                                double inv_temp, const void* lse, const void* g_lp,
                                const void* ex, const void* g_ent, void* grad,
                                int64_t grad_row_stride, void* stream);
int areal_gae_cuda(const float* rewards, const float* values, const int32_t* cu_seqlens,
                   int64_t num_seqs, int64_t T, const float* bootstrap, const uint8_t* loss_mask,
                   double gamma, double lam, float* adv, float* ret, void* stream);

#ifdef __cplusplus
}
#endif
