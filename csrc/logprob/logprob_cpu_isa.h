// The per-ISA builds of the vectorised logprob row kernels (logprob_cpu_rows.inc).
#pragma once
#include <cstdint>

enum areal_cpu_isa_code { AREAL_ISA_GENERIC = 0, AREAL_ISA_AVX2 = 1, AREAL_ISA_AVX512 = 2 };

#define AREAL_DECLARE_ROWS(NS)                                                                  \
  namespace NS {                                                                                \
  void stats_rows_f32(const void*, int64_t, int64_t, int64_t, int64_t, const int64_t*, int64_t, \
                      float, float*, float*, float*, float*);                                   \
  void stats_rows_bf16(const void*, int64_t, int64_t, int64_t, int64_t, const int64_t*, int64_t,\
                       float, float*, float*, float*, float*);                                  \
  void stats_rows_f16(const void*, int64_t, int64_t, int64_t, int64_t, const int64_t*, int64_t, \
                      float, float*, float*, float*, float*);                                   \
  void backward_rows_f32(const void*, int64_t, int64_t, int64_t, int64_t, const int64_t*,       \
                         int64_t, float, const float*, const float*, const float*,              \
                         const float*, void*, int64_t);                                         \
  void backward_rows_bf16(const void*, int64_t, int64_t, int64_t, int64_t, const int64_t*,      \
                          int64_t, float, const float*, const float*, const float*,             \
                          const float*, void*, int64_t);                                        \
  void backward_rows_f16(const void*, int64_t, int64_t, int64_t, int64_t, const int64_t*,       \
                         int64_t, float, const float*, const float*, const float*,              \
                         const float*, void*, int64_t);                                         \
  }

AREAL_DECLARE_ROWS(areal_isa_avx512)
AREAL_DECLARE_ROWS(areal_isa_avx2)
AREAL_DECLARE_ROWS(areal_isa_generic)
