/* The float64 windowed kernels built for AVX-512, 64-byte vectors (hkt_isa.h, hkt_cpu.h). */
#define HKT_ISA_AVX512 1
#include "hkt_isa.h"
#if HKT_ISA_BUILDS
#include "hkt_window_f64.c"
HKT_ISA_END
#endif
