/* The CPU kernels in float32: the attention and decoding bodies with real = float,
 * and (in the AVX-512 build) the bfloat16 kernels, which compute in float32 and
 * share their helpers.  Built as it is (the portable set) and by
 * hkt_cpu_f32_avx2.c / hkt_cpu_f32_avx512.c for their instruction sets. */
#include <math.h>

typedef float real;
#define REAL_IS_FLOAT 1
#define REAL_LOG logf
#define REAL_EXP expf
#include "hkt_attention_body.h"
#include "hkt_bf16_body.h"
#include "hkt_backward_body.h"
#include "hkt_decode_body.h"

void HKT_ISA_NAME(hkt_forward_f32)(const hkt_params *p) { forward(p); }
void HKT_ISA_NAME(hkt_backward_f32)(const hkt_params *p) { backward(p); }
void HKT_ISA_NAME(hkt_decode_f32)(const hkt_decode_params *p) { decode(p); }
