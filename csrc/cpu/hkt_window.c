/* The windowed kernels (hkt_window.h) in float32 and float64, each in the
 * portable build and (GCC and clang on x86-64) AVX2 and AVX-512 builds, picked as the
 * other CPU kernels are (hkt_cpu_kernels: the widest the CPU has, or the one
 * HKT_CPU_KERNELS names). */
#include "hkt_window.h"
#include "hkt_cpu.h"
#include "hkt_dropout.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

/* float32's vectorisable exp, exp_nonpos, from the other kernels' helpers
 * (which want `real` as a type: float here; the bodies below name their own) */
typedef float real;
#define REAL_IS_FLOAT 1
#include "hkt_real.h"
#undef REAL_IS_FLOAT

#if HKT_ISA_BUILDS
#include <immintrin.h> /* the AVX-512 bodies' lane sums */
#endif

/* The instruction set of the bodies between WIN_ISA_BEGIN_* and WIN_ISA_END:
 * GCC's target pragma, or clang's attribute on every function defined there
 * (clang has no target pragma).  WIN_AVX512 tells a body it is AVX-512's
 * (clang's attribute defines no __AVX512F__). */
#if defined(__clang__)
#define WIN_ISA_BEGIN_AVX2 _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
#define WIN_ISA_BEGIN_AVX512 \
    _Pragma("clang attribute push(__attribute__((target(\"avx512f,fma\"))), apply_to = function)")
#define WIN_ISA_END _Pragma("clang attribute pop")
#else
#define WIN_ISA_BEGIN_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define WIN_ISA_BEGIN_AVX512 _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,fma\")")
#define WIN_ISA_END _Pragma("GCC pop_options")
#endif
#define WIN_AVX512 0

#define WIN_F32 1
#define real float
#define REAL_EXP expf
#define REAL_LOG logf
#define REAL_NEXTAFTER nextafterf
#define REAL_EXP_NONPOS exp_nonpos
#define WFN(name) win_f32_generic_##name
#include "hkt_window_body.h"
#undef WFN
#if HKT_ISA_BUILDS
WIN_ISA_BEGIN_AVX2
#define WFN(name) win_f32_avx2_##name
#include "hkt_window_body.h"
#undef WFN
WIN_ISA_END
WIN_ISA_BEGIN_AVX512
#undef WIN_AVX512
#define WIN_AVX512 1
#define WFN(name) win_f32_avx512_##name
#include "hkt_window_body.h"
#undef WFN
#undef WIN_AVX512
#define WIN_AVX512 0
WIN_ISA_END
#endif
#undef real
#undef REAL_EXP
#undef REAL_LOG
#undef REAL_NEXTAFTER
#undef REAL_EXP_NONPOS

#undef WIN_F32
#define WIN_F32 0
#define real double
#define REAL_EXP exp
#define REAL_LOG log
#define REAL_NEXTAFTER nextafter
#define REAL_EXP_NONPOS exp
#define WFN(name) win_f64_generic_##name
#include "hkt_window_body.h"
#undef WFN
#if HKT_ISA_BUILDS
WIN_ISA_BEGIN_AVX2
#define WFN(name) win_f64_avx2_##name
#include "hkt_window_body.h"
#undef WFN
WIN_ISA_END
WIN_ISA_BEGIN_AVX512
#undef WIN_AVX512
#define WIN_AVX512 1
#define WFN(name) win_f64_avx512_##name
#include "hkt_window_body.h"
#undef WFN
#undef WIN_AVX512
#define WIN_AVX512 0
WIN_ISA_END
#endif
#undef real

#if HKT_ISA_BUILDS
/* 2: AVX-512, 1: AVX2, 0: portable -- the set the other kernels run */
static int win_isa(void) {
    const char *name = hkt_cpu_kernels();
    return strcmp(name, "avx512f") == 0 ? 2 : strcmp(name, "avx2") == 0 ? 1 : 0;
}
#endif

size_t hkt_window_workspace_bytes(const hkt_window_params *p, int backward) {
    const int f64 = p->dtype == HKT_FLOAT64;
    /* the same layout in every build */
    const size_t per =
        ((f64 ? win_f64_generic_thread_bytes(p, backward) : win_f32_generic_thread_bytes(p, backward)) + 63) / 64 * 64;
    size_t total, part = 0;
    if (__builtin_mul_overflow(per, (size_t)(p->num_threads > 0 ? p->num_threads : 1), &total)) return SIZE_MAX;
    if (backward && (__builtin_mul_overflow((size_t)p->B * (size_t)p->H, (size_t)p->L * (f64 ? 8u : 4u), &part) ||
                     __builtin_add_overflow(total, part, &total)))
        return SIZE_MAX;
    return total;
}

#if HKT_ISA_BUILDS
#define WIN_PICK(type, dir, p)                                                                               \
    do {                                                                                                     \
        const int isa = win_isa();                                                                           \
        if (isa == 2) win_##type##_avx512_##dir(p);                                                          \
        else if (isa == 1) win_##type##_avx2_##dir(p);                                                       \
        else win_##type##_generic_##dir(p);                                                                  \
    } while (0)
#else
#define WIN_PICK(type, dir, p) win_##type##_generic_##dir(p)
#endif

void hkt_window_forward_cpu(const hkt_window_params *p) {
    if (p->dtype == HKT_FLOAT64) WIN_PICK(f64, forward, p);
    else WIN_PICK(f32, forward, p);
}

void hkt_window_backward_cpu(const hkt_window_params *p) {
    if (p->dtype == HKT_FLOAT64) WIN_PICK(f64, backward, p);
    else WIN_PICK(f32, backward, p);
}

size_t hkt_window_decode_workspace_bytes(const hkt_window_decode_params *p) {
    const size_t one = p->dtype == HKT_FLOAT64 ? win_f64_generic_decode_thread_bytes(p)
                                               : win_f32_generic_decode_thread_bytes(p);
    size_t total;
    if (one > SIZE_MAX - 63 ||
        __builtin_mul_overflow((one + 63) / 64 * 64, (size_t)(p->num_threads > 0 ? p->num_threads : 1), &total))
        return SIZE_MAX;
    return total;
}

void hkt_window_decode_cpu(const hkt_window_decode_params *p) {
    if (p->dtype == HKT_FLOAT64) WIN_PICK(f64, decode, p);
    else WIN_PICK(f32, decode, p);
}
