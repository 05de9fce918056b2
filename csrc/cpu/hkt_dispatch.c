/*
 * The instruction-set dispatch of every CPU kernel family: one table per set
 * (hkt_cpu.h, hkt_isa_table), each holding per real type the entry points of
 * that set's builds (hkt_cpu_{f32,f64}*.c: dense attention, its backward,
 * decoding; hkt_window_{f32,f64}*.c: the windowed kernels), and the choice of
 * one set, made once per process (hkt_isa, hkt_cpu_kernels).
 */
#include "hkt_cpu.h"

#include <stdlib.h>
#include <string.h>

#define HKT_REAL_KERNELS(t, isa)                                                                             \
    {hkt_forward_##t##_##isa,          hkt_backward_##t##_##isa,        hkt_decode_##t##_##isa,              \
     hkt_window_forward_##t##_##isa,   hkt_window_backward_##t##_##isa, hkt_window_decode_##t##_##isa,       \
     hkt_window_thread_bytes_##t##_##isa, hkt_window_decode_thread_bytes_##t##_##isa}
#define HKT_ISA_TABLE(isa, label, bf16) {label, HKT_REAL_KERNELS(f32, isa), HKT_REAL_KERNELS(f64, isa), bf16}

static const hkt_isa_table isa_generic = HKT_ISA_TABLE(generic, "default", NULL);
#if HKT_ISA_BUILDS
static const hkt_isa_table isa_avx2 = HKT_ISA_TABLE(avx2, "avx2", NULL);
#if HKT_BF16_NATIVE
static const hkt_isa_table isa_avx512 = HKT_ISA_TABLE(avx512, "avx512f", hkt_forward_bf16_avx512);
#else
static const hkt_isa_table isa_avx512 = HKT_ISA_TABLE(avx512, "avx512f", NULL);
#endif
#endif

static const hkt_isa_table *pick_isa(void) {
#if HKT_ISA_BUILDS
    __builtin_cpu_init();
    const int has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int has512 = __builtin_cpu_supports("avx512f") && has2;
    const char *want = getenv("HKT_CPU_KERNELS"); /* for tests and benchmarks: a narrower set */
    if (want && strcmp(want, "default") == 0) return &isa_generic;
    if (want && strcmp(want, "avx2") == 0 && has2) return &isa_avx2;
    if (has512) return &isa_avx512;
    if (has2) return &isa_avx2;
#endif
    return &isa_generic;
}

const hkt_isa_table *hkt_isa(void) {
    /* every thread that races here stores the same pointer */
    static const hkt_isa_table *volatile chosen = NULL;
    const hkt_isa_table *t = chosen;
    if (!t) chosen = t = pick_isa();
    return t;
}

const char *hkt_cpu_kernels(void) { return hkt_isa()->name; }
