// CPU kernels of the rollout server's decode step (see areal_kernels.h): the entry points and
// their ISA dispatch, which follows the logprob kernels' (areal_cpu_isa(): the best the CPU
// has, capped by AREAL_MEGA_KERNEL_ISA or areal_cpu_set_isa()).
#include <cstdint>

#include "areal_kernels.h"
#include "decode_cpu_isa.h"

#define AREAL_DISPATCH_DECODE(FN, ...)                                            \
  switch (areal_cpu_isa()) {                                                      \
    case 2: areal_isa_avx512::FN(__VA_ARGS__); break;                             \
    case 1: areal_isa_avx2::FN(__VA_ARGS__); break;                               \
    default: areal_isa_generic::FN(__VA_ARGS__); break;                           \
  }

extern "C" {

int areal_rms_norm_cpu(const float* x, int64_t x_row_stride, const float* weight, float* y,
                       int64_t y_row_stride, int64_t hidden, float eps, int64_t row_begin,
                       int64_t row_end) {
  if (hidden <= 0 || row_end < row_begin) return AREAL_BAD_SHAPE;
  AREAL_DISPATCH_DECODE(rms_norm_rows, x, x_row_stride, weight, y, y_row_stride, hidden, eps,
                        row_begin, row_end);
  return AREAL_OK;
}

int areal_decode_attention_cpu(const float* q, int64_t q_row_stride, const float* k_new,
                               const float* v_new, int64_t new_row_stride, float* k_cache,
                               float* v_cache, int64_t cache_row_stride, int64_t capacity,
                               const int64_t* pos, int64_t kv_heads, int64_t groups,
                               int64_t head_dim, float scale, int64_t window, float* out,
                               int64_t out_row_stride, float* scratch, int64_t unit_begin,
                               int64_t unit_end) {
  if (kv_heads <= 0 || groups <= 0 || head_dim <= 0 || unit_end < unit_begin)
    return AREAL_BAD_SHAPE;
  for (int64_t u = unit_begin; u < unit_end; ++u) {
    const int64_t p = pos[u / kv_heads];
    if (p < 0 || p >= capacity) return AREAL_BAD_SHAPE;
  }
  AREAL_DISPATCH_DECODE(attention_units, q, q_row_stride, k_new, v_new, new_row_stride, k_cache,
                        v_cache, cache_row_stride, capacity, pos, kv_heads, groups, head_dim,
                        scale, window, out, out_row_stride, scratch, unit_begin, unit_end);
  return AREAL_OK;
}

int areal_sample_rows_cpu(const float* logits, int64_t row_stride, int64_t V,
                          const float* temperature, const double* uniform,
                          const uint8_t* greedy, int64_t* token, float* logprob, uint8_t* bad,
                          int64_t row_begin, int64_t row_end) {
  if (V <= 0 || row_end < row_begin) return AREAL_BAD_SHAPE;
  AREAL_DISPATCH_DECODE(sample_rows, logits, row_stride, V, temperature, uniform, greedy, token,
                        logprob, bad, row_begin, row_end);
  return AREAL_OK;
}

int areal_gemm_panel_width_cpu(void) {
  switch (areal_cpu_isa()) {
    case 2: return areal_isa_avx512::gemm_panel_width();
    case 1: return areal_isa_avx2::gemm_panel_width();
    default: return areal_isa_generic::gemm_panel_width();
  }
}

int areal_gemm_panels_cpu(const float* x, int64_t x_row_stride, int64_t M, int64_t K,
                          const float* w_panels, const float* bias, float* y,
                          int64_t y_row_stride, int64_t panel_begin, int64_t panel_end) {
  if (M < 0 || K <= 0 || panel_end < panel_begin) return AREAL_BAD_SHAPE;
  AREAL_DISPATCH_DECODE(gemm_panels, x, x_row_stride, M, K, w_panels, bias, y, y_row_stride,
                        panel_begin, panel_end);
  return AREAL_OK;
}

}  // extern "C"
