/* The windowed kernels (hkt_window_body.h) in float64, with real = double.  Built as
 * it is (the portable set) and by hkt_window_f64_avx2.c /
 * hkt_window_f64_avx512.c for their instruction sets, as hkt_cpu_f64.c is. */
#include "hkt_cpu.h"

#include <math.h>

typedef double real;
#define REAL_IS_FLOAT 0
#define REAL_EXP exp
#define REAL_LOG log
#define REAL_NEXTAFTER nextafter
#include "hkt_window_body.h"

void HKT_ISA_NAME(hkt_window_forward_f64)(const hkt_window_params *p) { win_forward(p); }
void HKT_ISA_NAME(hkt_window_backward_f64)(const hkt_window_params *p) { win_backward(p); }
void HKT_ISA_NAME(hkt_window_decode_f64)(const hkt_window_decode_params *p) { win_decode(p); }
size_t HKT_ISA_NAME(hkt_window_thread_bytes_f64)(const hkt_window_params *p, int backward) {
    return win_thread_bytes(p, backward);
}
size_t HKT_ISA_NAME(hkt_window_decode_thread_bytes_f64)(const hkt_window_decode_params *p) {
    return win_decode_thread_bytes(p);
}
