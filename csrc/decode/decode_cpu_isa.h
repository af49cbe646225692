// The per-ISA builds of the decode-step kernels (decode_cpu_rows.inc).
#pragma once
#include <cstdint>

#define AREAL_DECLARE_DECODE(NS)                                                                \
  namespace NS {                                                                                \
  void rms_norm_rows(const float*, int64_t, const float*, float*, int64_t, int64_t, float,      \
                     int64_t, int64_t);                                                         \
  void attention_units(const float*, int64_t, const float*, const float*, int64_t, float*,      \
                       float*, int64_t, int64_t, const int64_t*, int64_t, int64_t, int64_t,     \
                       float, int64_t, float*, int64_t, float*, int64_t, int64_t);              \
  void sample_rows(const float*, int64_t, int64_t, const float*, const double*,                 \
                   const uint8_t*, int64_t*, float*, uint8_t*, int64_t, int64_t);               \
  int gemm_panel_width();                                                                       \
  void gemm_panels(const float*, int64_t, int64_t, int64_t, const float*, const float*, float*, \
                   int64_t, int64_t, int64_t);                                                  \
  }

AREAL_DECLARE_DECODE(areal_isa_avx512)
AREAL_DECLARE_DECODE(areal_isa_avx2)
AREAL_DECLARE_DECODE(areal_isa_generic)
