// CPU kernels for packed-token log-softmax statistics and their backward (see areal_kernels.h):
// the entry points, the ISA dispatch and the float64 path.
//
// The float32 / bfloat16 / float16 rows run the vectorised kernels of logprob_cpu_rows.inc,
// built three times: AVX-512 (16 lanes), AVX2 + FMA (8 lanes) and SSE2 (4 lanes, any x86-64 or
// other CPU). The best one the CPU supports is used; AREAL_MEGA_KERNEL_ISA=avx512|avx2|generic
// asks for a lower one (bench/kernels.py --isa measures the AVX2 path on an AVX-512 machine),
// and areal_cpu_set_isa() changes it at run time (tests).
// float64 logits take a plain scalar path with double accumulation (used for gradcheck).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "areal_kernels.h"
#include "logprob_cpu_isa.h"

namespace {

int best_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return AREAL_ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AREAL_ISA_AVX2;
#endif
  return AREAL_ISA_GENERIC;
}

int isa_from_env() {
  const int best = best_isa();
  const char* want = std::getenv("AREAL_MEGA_KERNEL_ISA");
  if (want == nullptr || *want == 0) return best;
  int isa = best;
  if (std::strcmp(want, "generic") == 0) isa = AREAL_ISA_GENERIC;
  else if (std::strcmp(want, "avx2") == 0) isa = AREAL_ISA_AVX2;
  else if (std::strcmp(want, "avx512") == 0) isa = AREAL_ISA_AVX512;
  return isa < best ? isa : best;
}

int g_isa = -1;

int current_isa() {
  if (g_isa < 0) g_isa = isa_from_env();
  return g_isa;
}

#define AREAL_DISPATCH_ROWS(FN, ...)                                              \
  switch (current_isa()) {                                                        \
    case AREAL_ISA_AVX512: areal_isa_avx512::FN(__VA_ARGS__); break;              \
    case AREAL_ISA_AVX2: areal_isa_avx2::FN(__VA_ARGS__); break;                  \
    default: areal_isa_generic::FN(__VA_ARGS__); break;                           \
  }

// float64: scalar two-pass with double accumulation (precision path for gradcheck).
void stats_rows_f64(const double* logits, int64_t r0, int64_t r1, int64_t V, int64_t stride,
                    const int64_t* labels, int64_t vstart, double inv_t, double* M, double* S,
                    double* XL, double* U) {
  for (int64_t t = r0; t < r1; ++t) {
    const double* row = logits + t * stride;
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < V; ++v) m = row[v] * inv_t > m ? row[v] * inv_t : m;
    double s = 0.0, u = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      const double d = row[v] * inv_t - m;
      const double e = std::exp(d);
      s += e;
      if (e > 0.0) u += e * d;
    }
    const int64_t l = labels[t] - vstart;
    M[t] = m;
    S[t] = s;
    if (U) U[t] = u;
    XL[t] = (l >= 0 && l < V) ? row[l] * inv_t : 0.0;
  }
}

void backward_rows_f64(const double* logits, int64_t r0, int64_t r1, int64_t V, int64_t stride,
                       const int64_t* labels, int64_t vstart, double inv_t, const double* LSE,
                       const double* G, const double* EX, const double* GE, double* grad,
                       int64_t gstride) {
  const bool ent = EX != nullptr && GE != nullptr;
  for (int64_t t = r0; t < r1; ++t) {
    const double* row = logits + t * stride;
    double* grow = grad + t * gstride;
    const int64_t l = labels[t] - vstart;
    for (int64_t v = 0; v < V; ++v) {
      const double x = row[v] * inv_t;
      const double p = std::exp(x - LSE[t]);
      double val = G[t] * ((v == l ? 1.0 : 0.0) - p);
      if (ent && p > 0.0) val -= GE[t] * p * (x - EX[t]);
      grow[v] = val * inv_t;
    }
  }
}

}  // namespace

extern "C" {

int areal_cpu_isa(void) { return current_isa(); }

int areal_cpu_set_isa(int isa) {
  const int best = best_isa();
  if (isa < 0) isa = isa_from_env();
  g_isa = isa < best ? isa : best;
  return g_isa;
}

int areal_logprob_stats_cpu(const void* logits, int dtype, int64_t r0, int64_t r1, int64_t V,
                            int64_t stride, const int64_t* labels, int64_t vstart,
                            double inv_temp, void* m, void* s, void* xlab, void* u) {
  if (V <= 0 || r1 < r0) return AREAL_BAD_SHAPE;
  const float it = static_cast<float>(inv_temp);
  auto* M = static_cast<float*>(m);
  auto* S = static_cast<float*>(s);
  auto* XL = static_cast<float*>(xlab);
  auto* U = static_cast<float*>(u);
  switch (dtype) {
    case AREAL_F32: AREAL_DISPATCH_ROWS(stats_rows_f32, logits, r0, r1, V, stride, labels, vstart, it, M, S, XL, U); break;
    case AREAL_BF16: AREAL_DISPATCH_ROWS(stats_rows_bf16, logits, r0, r1, V, stride, labels, vstart, it, M, S, XL, U); break;
    case AREAL_F16: AREAL_DISPATCH_ROWS(stats_rows_f16, logits, r0, r1, V, stride, labels, vstart, it, M, S, XL, U); break;
    case AREAL_F64:
      stats_rows_f64(static_cast<const double*>(logits), r0, r1, V, stride, labels, vstart,
                     inv_temp, static_cast<double*>(m), static_cast<double*>(s),
                     static_cast<double*>(xlab), static_cast<double*>(u));
      break;
    default: return AREAL_BAD_DTYPE;
  }
  return AREAL_OK;
}

int areal_logprob_backward_cpu(const void* logits, int dtype, int64_t r0, int64_t r1, int64_t V,
                               int64_t stride, const int64_t* labels, int64_t vstart,
                               double inv_temp, const void* lse, const void* g_lp,
                               const void* ex, const void* g_ent, void* grad, int64_t gstride) {
  if (V <= 0 || r1 < r0) return AREAL_BAD_SHAPE;
  const float it = static_cast<float>(inv_temp);
  auto* L = static_cast<const float*>(lse);
  auto* G = static_cast<const float*>(g_lp);
  auto* EX = static_cast<const float*>(ex);
  auto* GE = static_cast<const float*>(g_ent);
  switch (dtype) {
    case AREAL_F32: AREAL_DISPATCH_ROWS(backward_rows_f32, logits, r0, r1, V, stride, labels, vstart, it, L, G, EX, GE, grad, gstride); break;
    case AREAL_BF16: AREAL_DISPATCH_ROWS(backward_rows_bf16, logits, r0, r1, V, stride, labels, vstart, it, L, G, EX, GE, grad, gstride); break;
    case AREAL_F16: AREAL_DISPATCH_ROWS(backward_rows_f16, logits, r0, r1, V, stride, labels, vstart, it, L, G, EX, GE, grad, gstride); break;
    case AREAL_F64:
      backward_rows_f64(static_cast<const double*>(logits), r0, r1, V, stride, labels, vstart,
                        inv_temp, static_cast<const double*>(lse),
                        static_cast<const double*>(g_lp), static_cast<const double*>(ex),
                        static_cast<const double*>(g_ent), static_cast<double*>(grad), gstride);
      break;
    default: return AREAL_BAD_DTYPE;
  }
  return AREAL_OK;
}

}  // extern "C"
