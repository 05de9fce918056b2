/* The CPU kernels in float64: the attention and decoding bodies with real = double.
 * Built as it is (the portable set) and by hkt_cpu_f64_avx2.c /
 * hkt_cpu_f64_avx512.c for their instruction sets. */
#include <math.h>

typedef double real;
#define REAL_IS_FLOAT 0
#define REAL_LOG log
#define REAL_EXP exp
#include "hkt_attention_body.h"
#include "hkt_backward_body.h"
#include "hkt_decode_body.h"

void HKT_ISA_NAME(hkt_forward_f64)(const hkt_params *p) { forward(p); }
void HKT_ISA_NAME(hkt_backward_f64)(const hkt_params *p) { backward(p); }
void HKT_ISA_NAME(hkt_decode_f64)(const hkt_decode_params *p) { decode(p); }
