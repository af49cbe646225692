// The logprob row kernels built for generic (4 lanes); see logprob_cpu_rows.inc.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "areal_kernels.h"
#include "logprob_cpu_isa.h"

#define AREAL_LANES 4
#define AREAL_ISA_NS areal_isa_generic
#include "logprob_cpu_rows.inc"
