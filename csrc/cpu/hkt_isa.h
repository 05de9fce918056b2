/*
 * hkt_isa.h -- included first by the instruction-set builds of the CPU kernels
 * (hkt_{cpu,window}_{f32,f64}_{avx2,avx512}.c), which define HKT_ISA_AVX2 or
 * HKT_ISA_AVX512 before it: turns that instruction set on for the rest of the
 * translation unit (hkt_cpu.h sets the vector width and names from the same
 * macros).  Where HKT_ISA_BUILDS is 0 the file builds nothing.  The file
 * that includes it ends with HKT_ISA_END (clang's end of the instruction set).
 */
#include "hkt_cpu.h"

#if HKT_ISA_BUILDS && defined(__clang__)
/* clang has no target pragma: the same instruction sets as an attribute on
 * every function defined from here to HKT_ISA_END (which the including file
 * ends with).  The headers the bodies include come first, so that their own
 * functions keep their attributes.  The attribute defines no __FMA__, so the
 * fused madd (hkt_real.h) is asked for by name. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#define HKT_FUSED_MADD 1
#if defined(HKT_ISA_AVX512)
#pragma clang attribute push(__attribute__((target("avx512f,fma"))), apply_to = function)
#else
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#endif
#define HKT_ISA_END _Pragma("clang attribute pop")
#elif HKT_ISA_BUILDS
/* fma as well: AVX-512F alone fuses only zmm products (its EVEX forms of the
 * narrower ones need AVX512VL), so the GEMM's half- and quarter-width tiles
 * multiplied and added in two roundings, as no other tile did.  Every AVX-512
 * CPU has FMA (hkt_attention.c checks it all the same). */
#if defined(HKT_ISA_AVX512)
#pragma GCC target("avx512f,fma")
#else
#pragma GCC target("avx2,fma")
#endif
#endif
#ifndef HKT_ISA_END
#define HKT_ISA_END
#endif
