/* The windowed kernels (hkt_window_body.h) in float32, with real = float.  Built as
 * it is (the portable set) and by hkt_window_f32_avx2.c /
 * hkt_window_f32_avx512.c for their instruction sets, as hkt_cpu_f32.c is. */
#include "hkt_cpu.h"

#include <math.h>

typedef float real;
#define REAL_IS_FLOAT 1
#define REAL_EXP expf
#define REAL_LOG logf
#define REAL_NEXTAFTER nextafterf
#include "hkt_window_body.h"

void HKT_ISA_NAME(hkt_window_forward_f32)(const hkt_window_params *p) { win_forward(p); }
void HKT_ISA_NAME(hkt_window_backward_f32)(const hkt_window_params *p) { win_backward(p); }
void HKT_ISA_NAME(hkt_window_decode_f32)(const hkt_window_decode_params *p) { win_decode(p); }
size_t HKT_ISA_NAME(hkt_window_thread_bytes_f32)(const hkt_window_params *p, int backward) {
    return win_thread_bytes(p, backward);
}
size_t HKT_ISA_NAME(hkt_window_decode_thread_bytes_f32)(const hkt_window_decode_params *p) {
    return win_decode_thread_bytes(p);
}
