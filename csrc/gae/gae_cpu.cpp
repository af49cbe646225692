// CPU kernel: GAE over packed sequences as a per-sequence reverse scan (see areal_kernels.h and
// areal_mega/ops/gae.py).  Accumulates in double so 20k-token sequences at gamma*lambda = 0.95
// match a float64 reference; the caller parallelises over sequence ranges.
#include <cstdint>

#include "areal_kernels.h"

extern "C" int areal_gae_cpu(const float* rewards, const float* values, const int32_t* cu_seqlens,
                             int64_t seq_begin, int64_t seq_end, const float* bootstrap,
                             const uint8_t* loss_mask, double gamma, double lam, float* adv,
                             float* ret) {
  if (seq_end < seq_begin) return AREAL_BAD_SHAPE;
  const double gl = gamma * lam;
  for (int64_t b = seq_begin; b < seq_end; ++b) {
    const int64_t lo = cu_seqlens[b];
    const int64_t hi = cu_seqlens[b + 1];
    double next_v = bootstrap ? static_cast<double>(bootstrap[b]) : 0.0;
    double next_a = 0.0;
    if (loss_mask) {
      for (int64_t t = hi - 1; t >= lo; --t) {
        if (!loss_mask[t]) {
          adv[t] = 0.f;
          ret[t] = 0.f;
          continue;
        }
        const double v = values[t];
        const double a = rewards[t] + gamma * next_v - v + gl * next_a;
        adv[t] = static_cast<float>(a);
        ret[t] = static_cast<float>(a + v);
        next_v = v;
        next_a = a;
      }
    } else {
      for (int64_t t = hi - 1; t >= lo; --t) {
        const double v = values[t];
        const double a = rewards[t] + gamma * next_v - v + gl * next_a;
        adv[t] = static_cast<float>(a);
        ret[t] = static_cast<float>(a + v);
        next_v = v;
        next_a = a;
      }
    }
  }
  return AREAL_OK;
}
