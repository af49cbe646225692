// CPU kernels for packed-token log-softmax statistics and their backward (see areal_kernels.h).
//
// One pass over each row, block by block (BLK values converted to float32 in an L1-resident
// buffer), with an online max / sum-exp merge across blocks: nothing of size [T, V] is ever
// allocated.  The inner loops use GCC vector extensions and a Cephes-style exp for x <= 0,
// and are compiled for x86-64-v4 / v3 / baseline with target_clones (runtime dispatch).
// float64 logits take a plain scalar path with double accumulation (used for gradcheck).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "areal_kernels.h"

namespace {

constexpr int W = 16;      // lanes per vector
constexpr int BLK = 2048;  // values per block (8 KiB of float32)

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

#if defined(AREAL_NO_CLONES)  // one ISA, chosen by -march (bench/kernels.py --isa builds this)
#define AREAL_CLONES
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define AREAL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define AREAL_CLONES
#endif
#define AREAL_INLINE inline __attribute__((always_inline))

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

AREAL_INLINE vf splat(float a) { return vf{} + a; }

// exp(x) for x <= 0, x may be -inf (-> 0).  Relative error ~2 ulp; results below 2^-126 are 0.
AREAL_INLINE vf exp_neg(vf x) {
  const vi under = x < -87.33654f;
  x = under ? splat(-87.33654f) : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const vf r2 = r * r;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  const vf res = p * (vf)bits;
  return under ? splat(0.0f) : res;
}

AREAL_INLINE float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

AREAL_INLINE float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

template <int DT>
AREAL_INLINE float load1(const void* p, int64_t i) {
  if constexpr (DT == AREAL_F32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (DT == AREAL_BF16) {
    uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  } else {
    return static_cast<float>(static_cast<const _Float16*>(p)[i]);
  }
}

template <int DT>
AREAL_INLINE void store1(void* p, int64_t i, float f) {
  if constexpr (DT == AREAL_F32) {
    static_cast<float*>(p)[i] = f;
  } else if constexpr (DT == AREAL_BF16) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    uint16_t h = (b & 0x7fffffffu) > 0x7f800000u
                     ? static_cast<uint16_t>((b >> 16) | 0x40u)                      // quiet NaN
                     : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);  // RNE
    static_cast<uint16_t*>(p)[i] = h;
  } else {
    static_cast<_Float16*>(p)[i] = static_cast<_Float16>(f);
  }
}

// Converts row[start, start+n) * inv_t to float32 in buf, padding with -inf to a multiple of W.
template <int DT>
AREAL_INLINE int load_block(const void* row, int64_t start, int n, float inv_t, float* buf) {
  const char* base = static_cast<const char*>(row);
  constexpr int esz = DT == AREAL_F32 ? 4 : 2;
  const void* src = base + start * esz;
  for (int i = 0; i < n; ++i) buf[i] = load1<DT>(src, i) * inv_t;
  const int padded = (n + W - 1) / W * W;
  for (int i = n; i < padded; ++i) buf[i] = kNegInf;
  return padded;
}

template <int DT>
AREAL_INLINE void stats_row(const void* row, int64_t V, int64_t label_local, float inv_t,
                            float* m_out, float* s_out, float* xl_out, float* u_out) {
  alignas(64) float buf[BLK];
  float m = kNegInf;
  vf vs = splat(0.f), vu = splat(0.f);
  const bool ent = u_out != nullptr;
  for (int64_t start = 0; start < V; start += BLK) {
    const int n = static_cast<int>(V - start < BLK ? V - start : BLK);
    const int padded = load_block<DT>(row, start, n, inv_t, buf);
    vf vmax = splat(kNegInf);
    for (int i = 0; i < padded; i += W) {
      vf x;
      std::memcpy(&x, buf + i, sizeof(vf));
      vmax = x > vmax ? x : vmax;
    }
    const float bm = hmax(vmax);
    if (!(bm > kNegInf)) continue;  // an all -inf block adds nothing (NaN poisons below)
    if (bm > m) {
      if (m > kNegInf) {
        const float c = std::exp(m - bm);
        vu = c * (vu + (m - bm) * vs);
        vs = c * vs;
      }
      m = bm;
    }
    for (int i = 0; i < padded; i += W) {
      vf x;
      std::memcpy(&x, buf + i, sizeof(vf));
      const vf d = x - m;
      const vf e = exp_neg(d);
      vs += e;
      if (ent) vu += e > 0.f ? e * d : splat(0.f);
    }
  }
  *m_out = m;
  *s_out = hsum(vs);
  if (ent) *u_out = hsum(vu);
  *xl_out = (label_local >= 0 && label_local < V) ? load1<DT>(row, label_local) * inv_t : 0.f;
}

template <int DT>
AREAL_INLINE void backward_row(const void* row, void* grow, int64_t V, int64_t label_local,
                               float inv_t, float lse, float g, float ge, float ex, bool ent) {
  alignas(64) float buf[BLK];
  constexpr int esz = DT == AREAL_F32 ? 4 : 2;
  for (int64_t start = 0; start < V; start += BLK) {
    const int n = static_cast<int>(V - start < BLK ? V - start : BLK);
    const int padded = load_block<DT>(row, start, n, inv_t, buf);
    for (int i = 0; i < padded; i += W) {
      vf x;
      std::memcpy(&x, buf + i, sizeof(vf));
      const vf p = exp_neg(x - lse);
      vf gr = -g * p;
      if (ent) gr -= ge * (p > 0.f ? p * (x - ex) : splat(0.f));
      gr *= inv_t;
      std::memcpy(buf + i, &gr, sizeof(vf));
    }
    void* dst = static_cast<char*>(grow) + start * esz;
    for (int i = 0; i < n; ++i) store1<DT>(dst, i, buf[i]);
  }
  if (label_local >= 0 && label_local < V) {  // exact value at the label, rounded once
    const float x = load1<DT>(row, label_local) * inv_t;
    const float p = std::exp(x - lse);
    float val = g * (1.f - p);
    if (ent && p > 0.f) val -= ge * p * (x - ex);
    store1<DT>(grow, label_local, val * inv_t);
  }
}

#define AREAL_DEFINE_ROWS(NAME, DT)                                                               \
  AREAL_CLONES void stats_rows_##NAME(const void* logits, int64_t r0, int64_t r1, int64_t V,      \
                                      int64_t stride, const int64_t* labels, int64_t vstart,      \
                                      float inv_t, float* M, float* S, float* XL, float* U) {     \
    constexpr int esz = DT == AREAL_F32 ? 4 : 2;                                                  \
    for (int64_t t = r0; t < r1; ++t) {                                                           \
      const void* row = static_cast<const char*>(logits) + t * stride * esz;                      \
      stats_row<DT>(row, V, labels[t] - vstart, inv_t, M + t, S + t, XL + t,                      \
                    U ? U + t : nullptr);                                                         \
    }                                                                                             \
  }                                                                                               \
  AREAL_CLONES void backward_rows_##NAME(const void* logits, int64_t r0, int64_t r1, int64_t V,   \
                                         int64_t stride, const int64_t* labels, int64_t vstart,   \
                                         float inv_t, const float* LSE, const float* G,           \
                                         const float* EX, const float* GE, void* grad,            \
                                         int64_t gstride) {                                       \
    constexpr int esz = DT == AREAL_F32 ? 4 : 2;                                                  \
    const bool ent = EX != nullptr && GE != nullptr;                                              \
    for (int64_t t = r0; t < r1; ++t) {                                                           \
      const void* row = static_cast<const char*>(logits) + t * stride * esz;                      \
      void* grow = static_cast<char*>(grad) + t * gstride * esz;                                  \
      backward_row<DT>(row, grow, V, labels[t] - vstart, inv_t, LSE[t], G[t],                     \
                       ent ? GE[t] : 0.f, ent ? EX[t] : 0.f, ent);                                \
    }                                                                                             \
  }

AREAL_DEFINE_ROWS(f32, AREAL_F32)
AREAL_DEFINE_ROWS(bf16, AREAL_BF16)
AREAL_DEFINE_ROWS(f16, AREAL_F16)

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
    case AREAL_F32: stats_rows_f32(logits, r0, r1, V, stride, labels, vstart, it, M, S, XL, U); break;
    case AREAL_BF16: stats_rows_bf16(logits, r0, r1, V, stride, labels, vstart, it, M, S, XL, U); break;
    case AREAL_F16: stats_rows_f16(logits, r0, r1, V, stride, labels, vstart, it, M, S, XL, U); break;
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
    case AREAL_F32: backward_rows_f32(logits, r0, r1, V, stride, labels, vstart, it, L, G, EX, GE, grad, gstride); break;
    case AREAL_BF16: backward_rows_bf16(logits, r0, r1, V, stride, labels, vstart, it, L, G, EX, GE, grad, gstride); break;
    case AREAL_F16: backward_rows_f16(logits, r0, r1, V, stride, labels, vstart, it, L, G, EX, GE, grad, gstride); break;
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
