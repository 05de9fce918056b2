/* The CPU kernels in float32: the attention and decoding bodies with real = float,
 * and the bfloat16 forward, which computes in float32 and shares their helpers. */
#include <math.h>

typedef float real;
#define REAL_IS_FLOAT 1
#define REAL_LOG logf
#define REAL_EXP expf
#include "hkt_attention_body.h"
#include "hkt_decode_body.h"
#include "hkt_bf16_body.h"

void hkt_forward_f32(const hkt_params *p) { forward(p); }
void hkt_backward_f32(const hkt_params *p) { backward(p); }
void hkt_decode_f32(const hkt_decode_params *p) { decode(p); }
