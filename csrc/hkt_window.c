/* The windowed kernels (hkt_window.h) in float32 and float64: hkt_window_body.h
 * once per type, and the entry points that pick one by p->dtype. */
#include "hkt_window.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

#define real float
#define WFN(name) win_f32_##name
#define REAL_EXP expf
#define REAL_LOG logf
#define REAL_NEXTAFTER nextafterf
#include "hkt_window_body.h"
#undef real
#undef WFN
#undef REAL_EXP
#undef REAL_LOG
#undef REAL_NEXTAFTER

#define real double
#define WFN(name) win_f64_##name
#define REAL_EXP exp
#define REAL_LOG log
#define REAL_NEXTAFTER nextafter
#include "hkt_window_body.h"
#undef real
#undef WFN
#undef REAL_EXP
#undef REAL_LOG
#undef REAL_NEXTAFTER

size_t hkt_window_workspace_bytes(const hkt_window_params *p, int backward) {
    const int f64 = p->dtype == HKT_FLOAT64;
    const size_t per = ((f64 ? win_f64_thread_bytes(p, backward) : win_f32_thread_bytes(p, backward)) + 63) / 64 * 64;
    size_t total, part = 0;
    if (__builtin_mul_overflow(per, (size_t)(p->num_threads > 0 ? p->num_threads : 1), &total)) return SIZE_MAX;
    if (backward && (__builtin_mul_overflow((size_t)p->B * (size_t)p->H, (size_t)p->L * (f64 ? 8u : 4u), &part) ||
                     __builtin_add_overflow(total, part, &total)))
        return SIZE_MAX;
    return total;
}

void hkt_window_forward_cpu(const hkt_window_params *p) {
    if (p->dtype == HKT_FLOAT64) win_f64_forward(p);
    else win_f32_forward(p);
}

void hkt_window_backward_cpu(const hkt_window_params *p) {
    if (p->dtype == HKT_FLOAT64) win_f64_backward(p);
    else win_f32_backward(p);
}
