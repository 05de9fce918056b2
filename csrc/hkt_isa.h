/*
 * hkt_isa.h -- included first by the instruction-set builds of the CPU kernels
 * (hkt_cpu_{f32,f64}_{avx2,avx512}.c), which define HKT_ISA_AVX2 or
 * HKT_ISA_AVX512 before it: turns on that instruction set for the rest of the
 * translation unit and sets the vector width and name the kernels are built
 * with (hkt_cpu.h).  HKT_BUILD_THIS_ISA is 0 where GCC's x86-64 target pragma
 * is not available; the portable build then serves alone.
 */
#include "hkt.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(HKT_NO_ISA_BUILDS)
#define HKT_BUILD_THIS_ISA 1
#if defined(HKT_ISA_AVX512)
#pragma GCC target("avx512f")
#define HKT_ISA avx512
#define HKT_VEC_BYTES 64
#else
#pragma GCC target("avx2,fma")
#define HKT_ISA avx2
#define HKT_VEC_BYTES 32
#endif
#else
#define HKT_BUILD_THIS_ISA 0
#endif
