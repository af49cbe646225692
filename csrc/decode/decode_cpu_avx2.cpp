// The decode-step kernels built for avx2 (8 lanes); see decode_cpu_rows.inc.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "decode_cpu_isa.h"

#define AREAL_LANES 8
#define AREAL_ISA_NS areal_isa_avx2
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif
#include "decode_cpu_rows.inc"
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC pop_options
#endif
