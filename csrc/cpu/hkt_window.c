/* The windowed kernels' type-free part (hkt_window.h): their workspace sizes
 * and entry points, which run the float32 or float64 kernels
 * (hkt_window_body.h, built by hkt_window_f32.c and hkt_window_f64.c) of the
 * instruction set every CPU kernel runs (hkt_dispatch.c). */
#include "hkt_cpu.h"

size_t hkt_window_workspace_bytes(const hkt_window_params *p, int backward) {
    const int f64 = p->dtype == HKT_FLOAT64;
    /* the same layout in every build */
    const size_t per = (hkt_kernels_of(p->dtype)->window_thread_bytes(p, backward) + 63) / 64 * 64;
    size_t total, part = 0;
    if (__builtin_mul_overflow(per, (size_t)(p->num_threads > 0 ? p->num_threads : 1), &total)) return SIZE_MAX;
    if (backward && (__builtin_mul_overflow((size_t)p->B * (size_t)p->H, (size_t)p->L * (f64 ? 8u : 4u), &part) ||
                     __builtin_add_overflow(total, part, &total)))
        return SIZE_MAX;
    return total;
}

void hkt_window_forward_cpu(const hkt_window_params *p) { hkt_kernels_of(p->dtype)->window_forward(p); }

void hkt_window_backward_cpu(const hkt_window_params *p) { hkt_kernels_of(p->dtype)->window_backward(p); }

size_t hkt_window_decode_workspace_bytes(const hkt_window_decode_params *p) {
    const size_t one = hkt_kernels_of(p->dtype)->window_decode_thread_bytes(p);
    size_t total;
    if (one > SIZE_MAX - 63 ||
        __builtin_mul_overflow((one + 63) / 64 * 64, (size_t)(p->num_threads > 0 ? p->num_threads : 1), &total))
        return SIZE_MAX;
    return total;
}

void hkt_window_decode_cpu(const hkt_window_decode_params *p) { hkt_kernels_of(p->dtype)->window_decode(p); }
