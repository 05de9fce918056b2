/*
 * What the CUDA kernels share (CUDA C++; included by hkt_attention_cuda.cu
 * only, through hkt_cuda_f32_f64.h and hkt_cuda_tc.h): the launch shape,
 * the kernels' argument block, and the small device helpers -- exp and log
 * per type, the butterfly reductions, the kv head of a query head, a level's
 * weight.  hkt_attention_cuda.cu's opening comment gives the contract.
 */
#ifndef HKT_CUDA_COMMON_H
#define HKT_CUDA_COMMON_H

#include "hkt.h"
#include "hkt_dropout.h"
#include "hkt_level.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define WARPS 4               /* warps per block */
#define THREADS (32 * WARPS)
/* Blocks per SM that __launch_bounds__ asks room for: at most 65536 / (4 * 128)
 * = 128 registers a thread.  With no minimum, ptxas (CUDA 13) holds these
 * kernels to 64-72 registers and spills. */
#define MIN_BLOCKS 4
#define MAX_BLOCKS (1 << 16)  /* the kernels loop over tasks, so any count works */
#define FULL 0xffffffffu

/* Everything a kernel reads, passed by value (__grid_constant__: read in place,
 * not copied per thread). */
typedef struct {
    hkt_params p;
    uint64_t seed_mixed, threshold; /* dropout, as keep_entry wants them */
    double keep_scale;              /* dropout: a kept P is scaled by 1/(1-p) (0 for p >= 1) */
    void *delta;                    /* backward: (B, H, T) */
    void *dw_part;                  /* backward: (B, H, nqb, L) */
    int64_t G;                      /* rows (keys) per dq (dk) task: 2^(L-1) */
    int64_t nqb, nkb;               /* query / key blocks of G per (b, h) */
} cuda_args;

static_assert(sizeof(cuda_args) <= 4000, "kernel arguments must stay under 4 KiB");

/* dropout: hkt_dropout.h, shared with the CPU kernels */

/* ---- small device helpers ---- */
__device__ static inline float dev_exp(float x) { return expf(x); }
__device__ static inline double dev_exp(double x) { return exp(x); }
__device__ static inline float dev_log(float x) { return logf(x); }
__device__ static inline double dev_log(double x) { return log(x); }

/* Butterfly reductions: at each step both lanes of a pair combine the same two
 * values with an operation that gives the same bits in either order, so every
 * lane ends with the bitwise identical result and branches on it stay uniform.
 * (A sum of two NaNs may keep either payload on some hosts; no branch depends
 * on a sum that can be NaN.) */
template <typename real>
__device__ static inline real warp_sum(real x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
    return x;
}

/* max(x, y), NaN if either is: "y > x ? y : x" would keep a lane's own NaN
 * while its partner keeps the other value, and the lanes would disagree.  The
 * NaN is the canonical one, and "+ 0" turns a -0 result into +0, so
 * max(+0, -0) and max(-0, +0) give the same bits too. */
template <typename real>
__device__ static inline real max_or_nan(real x, real y) {
    return x != x || y != y ? (real)NAN : (y > x ? y : x) + (real)0;
}

template <typename real>
__device__ static inline real warp_max(real x) {
    for (int o = 16; o > 0; o >>= 1) x = max_or_nan(x, __shfl_xor_sync(FULL, x, o));
    return x;
}

__device__ static inline int64_t warp_index() { return ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ static inline int64_t warp_count() { return ((int64_t)gridDim.x * blockDim.x) >> 5; }

/* The kv head that query head h reads (grouped-query attention; H_kv == H: h). */
__device__ static inline int64_t kv_head(const hkt_params &p, int64_t h) { return h / (p.H / p.H_kv); }

template <typename real>
__device__ static inline real weight(const hkt_params &p, int64_t h, int l) {
    return ((const real *)p.w)[h * p.w_stride[0] + l * p.w_stride[1]];
}

#endif
