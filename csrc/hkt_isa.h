/*
 * hkt_isa.h -- included first by the instruction-set builds of the CPU kernels
 * (hkt_cpu_{f32,f64}_{avx2,avx512}.c), which define HKT_ISA_AVX2 or
 * HKT_ISA_AVX512 before it: turns that instruction set on for the rest of the
 * translation unit (hkt_cpu.h sets the vector width and names from the same
 * macros).  Where HKT_ISA_BUILDS is 0 the file builds nothing.
 */
#include "hkt_cpu.h"

#if HKT_ISA_BUILDS
#if defined(HKT_ISA_AVX512)
/* fma as well: AVX-512F alone fuses only zmm products (its EVEX forms of the
 * narrower ones need AVX512VL), so the GEMM's half- and quarter-width tiles
 * multiplied and added in two roundings, as no other tile did.  Every AVX-512
 * CPU has FMA (hkt_attention.c checks it all the same). */
#pragma GCC target("avx512f,fma")
#else
#pragma GCC target("avx2,fma")
#endif
#endif
