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

// ---- CPU decode step of the rollout server (csrc/decode/decode_cpu.cpp), float32 only.
// RMSNorm of rows [row_begin, row_end): y = weight * (x / sqrt(mean(x^2) + eps)).
int areal_rms_norm_cpu(const float* x, int64_t x_row_stride, const float* weight, float* y,
                       int64_t y_row_stride, int64_t hidden, float eps, int64_t row_begin,
                       int64_t row_end);
// One query per row: unit u = b * kv_heads + h writes row b's new key / value of KV head h
// (k_new[b, h, :]) at column pos[b] of its cache ([rows, kv_heads, capacity, head_dim], row
// stride cache_row_stride), then computes softmax(q k^T * scale) v for its `groups` query
// heads (q[b, h * groups + g, :]) over columns [lo, pos[b]] (lo = pos[b] - window + 1 when
// window > 0, else 0) into out[b, h * groups + g, :]. scratch: pos[b] + 1 floats.
int areal_decode_attention_cpu(const float* q, int64_t q_row_stride, const float* k_new,
                               const float* v_new, int64_t new_row_stride, float* k_cache,
                               float* v_cache, int64_t cache_row_stride, int64_t capacity,
                               const int64_t* pos, int64_t kv_heads, int64_t groups,
                               int64_t head_dim, float scale, int64_t window, float* out,
                               int64_t out_row_stride, float* scratch, int64_t unit_begin,
                               int64_t unit_end);
// One token per row of x = logits[r, :] / temperature[r]: bad[r] = 1 when x has a NaN or
// +inf, or every value is -inf (token -1). Otherwise token[r] is the first argmax when
// greedy[r], else the first index whose cumulative sum of exp(x - max), in order, exceeds
// uniform[r] * sum (the inverse CDF at uniform[r] in [0, 1)); logprob[r] = x[token] - lse(x).
int areal_sample_rows_cpu(const float* logits, int64_t row_stride, int64_t V,
                          const float* temperature, const double* uniform,
                          const uint8_t* greedy, int64_t* token, float* logprob, uint8_t* bad,
                          int64_t row_begin, int64_t row_end);
// y = x w^T + bias for few rows x [M, K]: w packed in panels of NR output columns,
// [panels, K, NR] (NR = areal_gemm_panel_width_cpu(), which depends on the ISA in use; row n
// of w is column n % NR of panel n / NR, zeros past N); y is [M, panels * NR]; bias (null: none)
// has panels * NR values. Computes panels [panel_begin, panel_end).
int areal_gemm_panel_width_cpu(void);
int areal_gemm_panels_cpu(const float* x, int64_t x_row_stride, int64_t M, int64_t K,
                          const float* w_panels, const float* bias, float* y,
                          int64_t y_row_stride, int64_t panel_begin, int64_t panel_end);

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
