// The decode-step kernels built for generic (4 lanes); see decode_cpu_rows.inc.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "decode_cpu_isa.h"

#define AREAL_LANES 4
#define AREAL_ISA_NS areal_isa_generic
#include "decode_cpu_rows.inc"
