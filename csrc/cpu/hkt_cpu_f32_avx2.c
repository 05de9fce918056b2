/* The float32 kernels built for AVX2 + FMA, 32-byte vectors (hkt_isa.h, hkt_cpu.h). */
#define HKT_ISA_AVX2 1
#include "hkt_isa.h"
#if HKT_ISA_BUILDS
#include "hkt_cpu_f32.c"
HKT_ISA_END
#endif
