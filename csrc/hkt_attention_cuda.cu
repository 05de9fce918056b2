/*
 * HKT attention on CUDA: forward and backward, float32 and float64, and
 * bfloat16 on tensor cores.
 *
 * Shapes (see hkt.h): q[l] (B, H, ceil(T/2^l), D), k[l] (B, H_kv, ceil(S/2^l), D),
 * v (B, H_kv, S, Dv), w (H, L) or (L,); out (B, H, T, Dv), lse (B, H, T).
 * Forward writes out and lse (+inf for a row with no visible key); backward
 * OVERWRITES dq[l], dk[l], dv, dw and, when not NULL, dmask.  Same contract,
 * field for field, as hkt_attention.c; every pointer in hkt_params is a device
 * pointer on p->device_id.
 *
 * bfloat16 goes to tc_forward_kernel and tc_backward_kernel, on tensor cores
 * (their comment, below).  The float32 and float64 kernels are written to be
 * plainly right rather than fast (the CPU file is the fast one):
 *
 *   forward   one warp per query row i; its 32 lanes take 32 keys at a time,
 *             each lane computes its key's full score, the warp runs the online
 *             softmax (max and sum by shuffles), and lane e owns out[i][e]
 *             (e = lane, lane + 32, ...).  Nothing of size T x S is stored.
 *   backward  every gradient row is owned by exactly one warp, so there are no
 *             atomics and the result does not depend on scheduling:
 *               delta  one warp per row: delta[i] = rowsum(dO * out)
 *               dq     one warp per block of G = 2^(L-1) query rows, which holds
 *                      every level's dq rows of that block (level blocks nest);
 *                      lanes over keys, P recomputed from lse
 *               dk, dv the same per block of G key rows, lanes over queries
 *               dw     per-(b, h, query block) partials, reduced in a fixed
 *                      order by one small kernel
 *               dmask  one thread per dmask entry, adding the dS of every
 *                      (b, h, i, j) broadcast onto it in a fixed order.
 *
 * Non-finite values (hkt.h): an entry whose score is -inf (hidden by the bool
 * mask, causality or a -inf float mask) gets P = 0 and dS = 0 exactly, whatever
 * its row's lse and delta hold, and adds nothing to dq, dk or dw even where its
 * q or k holds NaN; a visible NaN or +inf score makes its row's out and lse NaN.
 * Every branch a warp takes together depends only on values that are bitwise
 * the same in all its lanes (loop bounds, and the butterfly max and sum), so a
 * NaN in one lane cannot split the warp before a shuffle or __syncwarp.
 *
 * Unlike the CPU kernels and the tensor-core ones, the float32 and float64
 * kernels compute the score of every (i, j) from all L levels (T*S*D*L
 * multiply-adds, not the T*S*D*sum 4^-l of docs/contract.md section 1.6):
 * sharing a coarse level's product across its 2^l x 2^l block needs a tiled
 * kernel, which only the tensor-core ones are so far.
 *
 * Allocation: "kernels never allocate" (docs/contract.md section 3) holds
 * here too: nothing in this file allocates.  The backward's scratch (delta,
 * B*H*T reals, then the dw partials, B*H*ceil(T/G)*L reals, both O(B*H*T);
 * hkt_cuda_scratch_bytes in hkt.h) is device memory the caller passes in
 * p->dw_partial; hkt/_kernels.py takes it from torch's caching allocator.
 *
 * Streams: every kernel is launched on p->stream (hkt/_kernels.py passes
 * torch's current stream of the device), so it runs in stream order after the
 * work that produced its inputs there, and the work queued after it on that
 * stream sees its outputs, exactly as for a torch op.  The entry points neither
 * wait for the device nor synchronize it: they return once the kernels are
 * queued (so a CUDA graph can capture them), after checking each launch with
 * cudaGetLastError.  A fault inside a kernel surfaces later, at the next
 * synchronizing call, as for any asynchronous CUDA work.
 */
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

template <typename real>
__device__ static inline real dot(const real *x, const real *y, int64_t n) {
    real acc = 0;
    for (int64_t e = 0; e < n; e++) acc += x[e] * y[e];
    return acc;
}

/* The score of (i, j) as the CPU's tile_scores builds it: levels folded from the
 * coarsest down, s = scale w_0 g_0 + (scale w_1 g_1 + (...)), then the mask
 * (bool: invisible -> -inf; float: added), then causality.  g[l] = <q[l][i>>l], k[l][j>>l]>
 * is stored when g is not null (the backward's dw needs it). */
template <typename real>
__device__ static real score_of(const hkt_params &p, int64_t b, int64_t h, int64_t i, int64_t j, real *g) {
    real s = 0;
    for (int l = p.L - 1; l >= 0; l--) {
        const real *qr = (const real *)p.q[l] + b * p.q_stride[l][0] + h * p.q_stride[l][1] + (i >> l) * p.q_stride[l][2];
        const real *kr = (const real *)p.k[l] + b * p.k_stride[l][0] + kv_head(p, h) * p.k_stride[l][1] +
                         (j >> l) * p.k_stride[l][2];
        const real gl = dot(qr, kr, p.D);
        if (g) g[l] = gl;
        const real wl = hkt_level_factor(p.scale, weight<real>(p, h, l));
        s = l == p.L - 1 ? wl * gl : wl * gl + s;
    }
    /* float mask first, then hiding, so a NaN in a hidden entry of a float mask
     * stays hidden (as in the CPU kernels) */
    if (p.mask_kind != HKT_MASK_NONE) {
        const int64_t at = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] + j * p.mask_stride[3];
        if (p.mask_kind == HKT_MASK_BOOL) s = ((const unsigned char *)p.mask)[at] ? s : (real)-INFINITY;
        else s += ((const real *)p.mask)[at];
    }
    if (p.causal && j > i) s = -INFINITY;
    return s;
}

/* ---- forward: one warp per query row r = (b*H + h)*T + i ---- */
template <typename real>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) forward_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    __shared__ real pbuf[WARPS][32];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int64_t T = p.T, S = p.S, Dv = p.Dv;
    const bool use_dropout = p.dropout_p > 0;
    const real kf = (real)a.keep_scale;
    for (int64_t r = warp_index(); r < p.B * p.H * T; r += warp_count()) {
        const int64_t bh = r / T, i = r % T, b = bh / p.H, h = bh % p.H;
        real *orow = (real *)p.out + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
        const real *vb = (const real *)p.v + b * p.v_stride[0] + kv_head(p, h) * p.v_stride[1];
        for (int64_t e = lane; e < Dv; e += 32) orow[e] = 0;
        real m = -INFINITY, lsum = 0;
        bool nan_row = false;
        const int64_t jend = p.causal ? (i + 1 < S ? i + 1 : S) : S;
        for (int64_t j0 = 0; j0 < jend; j0 += 32) {
            const int64_t j = j0 + lane;
            const real s = j < jend ? score_of<real>(p, b, h, i, j, nullptr) : (real)-INFINITY;
            const real mx = warp_max(s); /* the same bits in every lane: the branches below are uniform */
            if (mx == -INFINITY) continue; /* nothing visible among these keys */
            if (!(mx < INFINITY)) {        /* a visible NaN or +inf score: the row's softmax is NaN */
                nan_row = true;
                break;
            }
            /* online softmax: rescale what out holds so far, then add these keys' P @ V;
             * hidden keys (s = -inf) get P = 0 exactly */
            const real mnew = mx > m ? mx : m;
            const real alpha = m == -INFINITY ? (real)0 : dev_exp(m - mnew);
            real pe = dev_exp(s - mnew);
            lsum = lsum * alpha + warp_sum(pe);
            m = mnew;
            if (use_dropout)
                pe = j < jend && keep_entry(a.seed_mixed, a.threshold, (uint64_t)(r * S + j)) ? pe * kf : (real)0;
            pbuf[wib][lane] = pe;
            __syncwarp();
            const int64_t nk = jend - j0 < 32 ? jend - j0 : 32;
            for (int64_t e = lane; e < Dv; e += 32) {
                real acc = 0;
                for (int64_t c = 0; c < nk; c++) acc += pbuf[wib][c] * vb[(j0 + c) * p.v_stride[2] + e];
                orow[e] = orow[e] * alpha + acc;
            }
            __syncwarp();
        }
        if (nan_row) {
            for (int64_t e = lane; e < Dv; e += 32) orow[e] = (real)NAN;
            if (lane == 0) ((real *)p.lse)[r] = (real)NAN;
        } else if (lsum > 0) {
            const real inv = 1 / lsum;
            for (int64_t e = lane; e < Dv; e += 32) orow[e] *= inv;
            if (lane == 0) ((real *)p.lse)[r] = m + dev_log(lsum);
        } else {
            /* no visible key: zeros, and +inf so the backward's P is exactly 0 */
            for (int64_t e = lane; e < Dv; e += 32) orow[e] = 0;
            if (lane == 0) ((real *)p.lse)[r] = INFINITY;
        }
    }
}

/* ---- backward ----
 * forward: S = sum_l scale w_l up(q_l k_l^T); P = softmax(S); out = Pdrop @ v
 * backward: dv = Pdrop^T dO; dP = dO v^T; dS = P (dP keep/(1-p) - rowsum(dO * out))
 *           dq_l = scale w_l sum2^l(dS) k_l; dk_l = scale w_l sum2^l(dS)^T q_l;
 *           dw_l = scale sum(sum2^l(dS) * q_l k_l^T); dmask = dS summed over broadcast dims
 * (dS before the scale, as in the CPU file). */

/* delta[r] = <dO[r], out[r]>, one warp per row */
template <typename real>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) delta_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    const int lane = threadIdx.x & 31;
    for (int64_t r = warp_index(); r < p.B * p.H * p.T; r += warp_count()) {
        const int64_t bh = r / p.T, i = r % p.T, b = bh / p.H, h = bh % p.H;
        const real *dorow = (const real *)p.dout + b * p.dout_stride[0] + h * p.dout_stride[1] + i * p.dout_stride[2];
        const real *orow = (const real *)p.out + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2];
        real acc = 0;
        for (int64_t e = lane; e < p.Dv; e += 32) acc += dorow[e] * orow[e];
        acc = warp_sum(acc);
        if (lane == 0) ((real *)a.delta)[r] = acc;
    }
}

/* dS (before the scale) of (i, j), and its dropped P in *pdrop, recomputed from
 * the forward's lse.  A hidden entry (score -inf) gives exactly 0 for both,
 * even where lse or delta of its row is NaN or +inf (0 * NaN would be NaN). */
template <typename real>
__device__ static inline real ds_of(const cuda_args &a, int64_t b, int64_t h, int64_t i, int64_t j, real *g,
                                    real *pdrop) {
    const hkt_params &p = a.p;
    const int64_t r = (b * p.H + h) * p.T + i;
    const real s = score_of<real>(p, b, h, i, j, g);
    if (s == -INFINITY) {
        *pdrop = 0;
        return 0;
    }
    const real P = dev_exp(s - ((const real *)p.lse)[r]);
    const real *dorow = (const real *)p.dout + b * p.dout_stride[0] + h * p.dout_stride[1] + i * p.dout_stride[2];
    const real *vrow = (const real *)p.v + b * p.v_stride[0] + kv_head(p, h) * p.v_stride[1] + j * p.v_stride[2];
    const real dp = dot(dorow, vrow, p.Dv);
    real f = 1;
    if (p.dropout_p > 0) {
        f = keep_entry(a.seed_mixed, a.threshold, (uint64_t)(r * p.S + j)) ? (real)a.keep_scale : (real)0;
    }
    *pdrop = P * f;
    return P * (dp * f - ((const real *)a.delta)[r]);
}

/* dq, dk and dw add dS times a q, k or Gram entry only where dS != 0, and
 * scale w_l times a sum only where the sum != 0.  That skips exactly the
 * hidden entries' zeros (whose q, k or w may be NaN: hidden entries add
 * nothing to anything, not 0 * NaN) and changes no other result: a visible
 * entry whose q[l] or k[l] row or w is not finite has a NaN or +inf score, so
 * its row's lse and its dS are NaN, never 0, and a finite term with a zero
 * factor adds 0.  dv adds every P dO, as the CPU file does (NaN in dout may
 * reach dv through hidden entries, which hkt.h leaves open). */

/* dq of every level for the query rows [i_lo, i_hi) of one (b, h), and that
 * block's dw partial: one warp per (b, h, block of G rows). */
template <typename real>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) dq_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    __shared__ real dsbuf[WARPS][32];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int L = p.L;
    const int64_t T = p.T, S = p.S, D = p.D;
    const real scale = (real)p.scale;
    real g[HKT_MAX_LEVELS], dwacc[HKT_MAX_LEVELS];
    for (int64_t task = warp_index(); task < p.B * p.H * a.nqb; task += warp_count()) {
        const int64_t bh = task / a.nqb, blk = task % a.nqb, b = bh / p.H, h = bh % p.H;
        const int64_t i_lo = blk * a.G, i_hi = i_lo + a.G < T ? i_lo + a.G : T;
        for (int l = 0; l < L; l++) {
            real *dq = (real *)p.dq[l] + b * p.dq_stride[l][0] + h * p.dq_stride[l][1];
            for (int64_t row = i_lo >> l; row <= (i_hi - 1) >> l; row++)
                for (int64_t d = lane; d < D; d += 32) dq[row * p.dq_stride[l][2] + d] = 0;
            dwacc[l] = 0;
        }
        for (int64_t i = i_lo; i < i_hi; i++) {
            const int64_t jend = p.causal ? (i + 1 < S ? i + 1 : S) : S;
            for (int64_t j0 = 0; j0 < jend; j0 += 32) {
                const int64_t j = j0 + lane;
                real ds = 0, pdrop;
                if (j < jend) {
                    ds = ds_of<real>(a, b, h, i, j, g, &pdrop);
                    if (ds != 0)
                        for (int l = 0; l < L; l++) dwacc[l] += ds * g[l];
                }
                dsbuf[wib][lane] = ds;
                __syncwarp();
                const int64_t nk = jend - j0 < 32 ? jend - j0 : 32;
                for (int l = 0; l < L; l++) {
                    const real wl = hkt_level_factor(p.scale, weight<real>(p, h, l));
                    const real *kb = (const real *)p.k[l] + b * p.k_stride[l][0] + kv_head(p, h) * p.k_stride[l][1];
                    real *dqrow = (real *)p.dq[l] + b * p.dq_stride[l][0] + h * p.dq_stride[l][1] +
                                  (i >> l) * p.dq_stride[l][2];
                    for (int64_t d = lane; d < D; d += 32) {
                        real acc = 0;
                        for (int64_t c = 0; c < nk; c++) {
                            const real x = dsbuf[wib][c];
                            if (x != 0) acc += x * kb[((j0 + c) >> l) * p.k_stride[l][2] + d];
                        }
                        if (acc != 0) dqrow[d] += wl * acc;
                    }
                }
                __syncwarp();
            }
        }
        for (int l = 0; l < L; l++) {
            const real x = warp_sum(dwacc[l]);
            if (lane == 0) ((real *)a.dw_part)[task * L + l] = scale * x;
        }
    }
}

/* dk of every level and dv for the key rows [j_lo, j_hi) of one (b, kv head):
 * one warp per (b, kv head, block of G keys), lanes over queries; the query
 * heads of the kv head's group are added one after another, in order. */
template <typename real>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) dkv_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    __shared__ real dsbuf[WARPS][32], pdbuf[WARPS][32];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int L = p.L;
    const int64_t T = p.T, S = p.S, D = p.D, Dv = p.Dv;
    const int64_t group = p.H / p.H_kv;
    for (int64_t task = warp_index(); task < p.B * p.H_kv * a.nkb; task += warp_count()) {
        const int64_t bk = task / a.nkb, blk = task % a.nkb, b = bk / p.H_kv, hk = bk % p.H_kv;
        const int64_t j_lo = blk * a.G, j_hi = j_lo + a.G < S ? j_lo + a.G : S;
        real *dvb = (real *)p.dv + b * p.dv_stride[0] + hk * p.dv_stride[1];
        for (int l = 0; l < L; l++) {
            real *dk = (real *)p.dk[l] + b * p.dk_stride[l][0] + hk * p.dk_stride[l][1];
            for (int64_t row = j_lo >> l; row <= (j_hi - 1) >> l; row++)
                for (int64_t d = lane; d < D; d += 32) dk[row * p.dk_stride[l][2] + d] = 0;
        }
        for (int64_t j = j_lo; j < j_hi; j++)
            for (int64_t e = lane; e < Dv; e += 32) dvb[j * p.dv_stride[2] + e] = 0;
        /* keys in order, and for each key the group's query heads in order */
        for (int64_t jh = 0; jh < (j_hi - j_lo) * group; jh++) {
            const int64_t j = j_lo + jh / group, h = hk * group + jh % group;
            const real *dob = (const real *)p.dout + b * p.dout_stride[0] + h * p.dout_stride[1];
            /* causal: only queries i >= j see key j */
            for (int64_t i0 = p.causal ? j : 0; i0 < T; i0 += 32) {
                const int64_t i = i0 + lane;
                real ds = 0, pdrop = 0;
                if (i < T) ds = ds_of<real>(a, b, h, i, j, (real *)nullptr, &pdrop);
                dsbuf[wib][lane] = ds;
                pdbuf[wib][lane] = pdrop;
                __syncwarp();
                const int64_t nq = T - i0 < 32 ? T - i0 : 32;
                real *dvrow = dvb + j * p.dv_stride[2];
                for (int64_t e = lane; e < Dv; e += 32) {
                    real acc = 0;
                    for (int64_t c = 0; c < nq; c++) acc += pdbuf[wib][c] * dob[(i0 + c) * p.dout_stride[2] + e];
                    dvrow[e] += acc;
                }
                for (int l = 0; l < L; l++) {
                    const real wl = hkt_level_factor(p.scale, weight<real>(p, h, l));
                    const real *qb = (const real *)p.q[l] + b * p.q_stride[l][0] + h * p.q_stride[l][1];
                    real *dkrow = (real *)p.dk[l] + b * p.dk_stride[l][0] + hk * p.dk_stride[l][1] +
                                  (j >> l) * p.dk_stride[l][2];
                    for (int64_t d = lane; d < D; d += 32) {
                        real acc = 0;
                        for (int64_t c = 0; c < nq; c++) {
                            const real x = dsbuf[wib][c];
                            if (x != 0) acc += x * qb[((i0 + c) >> l) * p.q_stride[l][2] + d];
                        }
                        if (acc != 0) dkrow[d] += wl * acc;
                    }
                }
                __syncwarp();
            }
        }
    }
}

/* dw[h, l] = sum over b and query blocks of dw_part (and over h when w is
 * shared), in a fixed order: one thread per dw entry. */
template <typename real>
__global__ void dw_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    const int64_t L = p.L, nw = p.w_per_head ? p.H * L : L;
    const real *part = (const real *)a.dw_part;
    for (int64_t x = threadIdx.x; x < nw; x += blockDim.x) {
        const int64_t l = x % L, h0 = p.w_per_head ? x / L : 0, h1 = p.w_per_head ? h0 + 1 : p.H;
        real acc = 0;
        for (int64_t b = 0; b < p.B; b++)
            for (int64_t h = h0; h < h1; h++)
                for (int64_t blk = 0; blk < a.nqb; blk++) acc += part[((b * p.H + h) * a.nqb + blk) * L + l];
        ((real *)p.dw)[x] = acc;
    }
}

/* dmask (C-contiguous, shape dmask_shape, each dim 1 or the full B, H, T, S) =
 * dS summed over the dims where dmask_shape is 1 and the full size is not: one
 * thread per dmask entry, adding its (b, h, i, j) in that order.  Hidden
 * entries add nothing (causally hidden ones are not even visited). */
template <typename real>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) dmask_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    const int64_t *ms = p.dmask_shape;
    const int64_t full[4] = {p.B, p.H, p.T, p.S}, n = ms[0] * ms[1] * ms[2] * ms[3];
    for (int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; x < n; x += (int64_t)gridDim.x * blockDim.x) {
        int64_t lo[4], hi[4], rest = x;
        for (int d = 3; d >= 0; d--) {
            const int64_t at = rest % ms[d];
            rest /= ms[d];
            const bool summed = ms[d] != full[d];
            lo[d] = summed ? 0 : at;
            hi[d] = summed ? full[d] : at + 1;
        }
        real acc = 0, pdrop;
        for (int64_t b = lo[0]; b < hi[0]; b++)
            for (int64_t h = lo[1]; h < hi[1]; h++)
                for (int64_t i = lo[2]; i < hi[2]; i++) {
                    const int64_t jend = p.causal && i + 1 < hi[3] ? i + 1 : hi[3];
                    for (int64_t j = lo[3]; j < jend; j++) acc += ds_of<real>(a, b, h, i, j, (real *)nullptr, &pdrop);
                }
        ((real *)p.dmask)[x] = acc;
    }
}

/* ---- tensor cores: bfloat16 q, k, v; float32 accumulation ----
 *
 * FlashAttention-2 with HKT's levels.  A block of 4 warps owns 64 "rows" (each
 * warp 16, TC_BM) and walks the "columns" in tiles of 32 (TC_BN).  Forward and
 * the dq kernel: rows are queries, columns keys; the dv and dk kernels: rows
 * are keys, columns queries (their scores are S transposed, which HKT builds
 * the same way with q and k swapped).  Per column tile:
 *   1. the block copies the tile's columns of every level (and the value rows
 *      the kernel needs) to shared memory;
 *   2. the coarse levels' Gram blocks, (64 >> l) x (32 >> l) for l >= 1, are
 *      computed once each (mma tiles of 16 x 8, shared out among the warps)
 *      into shared float32: l >= 1 costs 4^-l of level 0, the 1.3125x of
 *      docs/contract.md section 1.6 at L = 3;
 *   3. each warp multiplies its level-0 scores, 16 x 32, and adds to each
 *      entry (r, c) the coarse ones, w_l G_l[r >> l][c >> l], folded coarsest
 *      first like the CPU's tile_fold; then the mask and causality.
 * Forward: online softmax in float32 (row max and sum over the 4 lanes that
 * share a row), P rounded to bfloat16 in registers: the score accumulator's
 * fragment layout is the P.V product's A fragment layout, so P never goes
 * through memory; P.V into the float32 output accumulator.  The row sums are
 * taken before P's rounding (as on the CPU).
 * Backward: P = exp(S - lse), dP = dO V^T (dq) or V dO^T (dk/dv), dS = P (dP -
 * delta) in float32; dV += P dO and the level-0 gradient += (scale w_0 dS) x
 * (the other side's level-0 rows) on tensor cores, dS and P rounded to
 * bfloat16 on the way in; each coarse level's dS block sums (by shuffles
 * within the warp: its 16 rows hold whole blocks) times scale w_l go through
 * shared memory into the coarse gradient rows, which each warp owns (float32,
 * in shared memory until the block is done); dw from the dq kernel's Grams.
 * Every gradient row belongs to one block, which writes it once: no atomics,
 * bitwise the same run to run.  delta = rowsum(dO * out) is the dq kernel's,
 * in double, into the scratch, where the dk kernel (queued after it) reads it.
 *
 * Fragments are those of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for
 * mma.m16n8k16 with floating point type"); with g = lane / 4, t = lane % 4,
 * each 32-bit register holding two consecutive elements, the lower in the low
 * half:
 *   A (16 x 16, row major): a0 (g, 2t), a1 (g + 8, 2t), a2 (g, 2t + 8), a3 (g + 8, 2t + 8)
 *   B (16 x 8, by column):  b0 (2t, g), b1 (2t + 8, g)   [rows k, k + 1 of column g]
 *   C (16 x 8, float32):    c0, c1 (g, 2t), (g, 2t + 1); c2, c3 (g + 8, 2t), (g + 8, 2t + 1)
 * tests/test_cuda.py emulates the instruction from that description.
 *
 * Non-finite values follow hkt.h: a hidden entry's P and dS are exactly 0; a
 * visible NaN or +inf score makes the row NaN (NaN propagates through the max,
 * the exponentials and the sums); a row with no visible key gives 0 and lse
 * +inf.  The only branches are on loop bounds and on values the whole block
 * shares, so a NaN cannot split a warp.  Products take whole tiles, so a NaN
 * in a hidden entry's v, q or k reaches the tile's other results through
 * 0 * NaN (hkt.h allows it; the CPU kernels do the same). */
#define TC_BM 64
#define TC_BN 32
#define TC_WARPS 4
#define TC_THREADS (32 * TC_WARPS)
/* shared rows of level l >= 1 (padded to whole mma tiles): the block's rows in
 * 16-row tiles, the tile's columns in 8-row tiles; with TC_BM = 64, TC_BN = 32
 * and at most 4 levels, a block's (tile's) rows of level l start at a multiple
 * of 2^l, so row r's coarse row is r >> l */
__host__ __device__ constexpr int tc_qrows(int l) { return (TC_BM >> l) > 16 ? (TC_BM >> l) : 16; }
__host__ __device__ constexpr int tc_krows(int l) { return (TC_BN >> l) > 8 ? (TC_BN >> l) : 8; }
/* offsets as loops, not recursion: a recursive tc_koff was compiled as a real
 * call (with a stack frame) wherever l is not a constant */
__host__ __device__ constexpr int tc_qoff(int l) {
    int o = 0;
    for (int m = 1; m < l; m++) o += tc_qrows(m);
    return o;
}
__host__ __device__ constexpr int tc_koff(int l) {
    int o = 0;
    for (int m = 0; m < l; m++) o += tc_krows(m);
    return o;
}
__host__ __device__ constexpr int tc_goff(int l) {
    int o = 0;
    for (int m = 1; m < l; m++) o += tc_qrows(m) * tc_krows(m);
    return o;
}
static_assert(HKT_TC_LMAX <= 4, "coarse rows r >> l need blocks and tiles aligned to 2^(L-1)");

/* compile-time bounds on D and Dv, so the fragment arrays stay in registers */
template <int DMAX, int DVMAX, int MODE = 0>
struct tc_cfg {
    static constexpr int KS = DMAX / 16; /* k-steps of 16 over D */
    static constexpr int NV = DVMAX / 8; /* n-tiles of 8 over Dv */
    static constexpr int ND = DMAX / 8;  /* n-tiles of 8 over D */
    static constexpr int ROW = DMAX + 8;   /* halves per shared row: +16 bytes, so the 8 rows a */
    static constexpr int VROW = DVMAX + 8; /* fragment load reads fall in different banks */
    /* forward: the level-0 query fragments stay in registers across the key
     * tiles when Dv <= 64; beside the 64 output accumulators of Dv up to 128
     * they spill (ptxas -v, sm_80), so there they are read again per tile */
    static constexpr bool QREG = DVMAX <= 64;
    /* backward: 0 the dq kernel, 1 the dv kernel, 2 the dk kernel.  dv and dk
     * come from two kernels that each recompute the scores: with both
     * accumulators (64 floats a lane) in one, ptxas spilled */
    static constexpr bool DKV = MODE != 0;  /* rows are keys */
    static constexpr bool DV = MODE == 1;   /* dv */
    static constexpr bool GRAD = MODE != 1; /* dS, and the rows' own gradients: dq[l] or dk[l] */
};

/* what every tensor-core kernel keeps in shared memory to build a tile's scores */
template <typename C>
struct tc_scores_smem {
    uint16_t rc[tc_qoff(HKT_TC_LMAX)][C::ROW]; /* the block's rows of levels 1 .. L-1 */
    uint16_t ct[tc_koff(HKT_TC_LMAX)][C::ROW]; /* the tile's columns, level 0 then 1 .. L-1 */
    float gram[tc_goff(HKT_TC_LMAX)];          /* G_l, l >= 1, row major (tc_qrows x tc_krows) */
};

template <typename C>
struct alignas(16) tc_forward_smem {
    tc_scores_smem<C> sc;
    uint16_t vt[C::NV * 8][TC_BN + 8]; /* the tile's v, transposed: vt[e][j] */
};

template <typename C>
struct alignas(16) tc_backward_smem {
    tc_scores_smem<C> sc;
    uint16_t cv[TC_BN][C::VROW];             /* the tile's value rows: v (dq) or dO (dk/dv) */
    float dgs[tc_goff(HKT_TC_LMAX)];         /* the tile's dS summed over each coarse block, times scale w_l */
    float acc[tc_qoff(HKT_TC_LMAX)][C::KS * 16]; /* the block's coarse gradient rows, l >= 1 */
    float colstat[2][TC_BN];                 /* dk/dv: the tile's queries' lse and delta */
    float rowstat[2][TC_BM];                 /* dq: the block's queries' lse and delta */
    float dwp[TC_WARPS][HKT_TC_LMAX];        /* dq: each warp's share of dw */
};

/* float -> bfloat16 bits, rounded to nearest even; NaN stays NaN */
__device__ static inline uint32_t tc_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ static inline float tc_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}
__device__ static inline uint32_t tc_pack(float lo, float hi) { return tc_bf16(lo) | (tc_bf16(hi) << 16); }
/* The A fragment of keys (columns) 16 ks .. 16 ks + 15 of a score-shaped
 * accumulator s (16 rows x TC_BN, C layout), times scale, rounded to bfloat16:
 * two C n-tiles side by side are one A fragment, so P or dS go from one
 * product into the next without leaving the registers. */
__device__ static inline void tc_c_to_a(uint32_t f[4], const float (*s)[4], int ks, float scale) {
    f[0] = tc_pack(scale * s[2 * ks][0], scale * s[2 * ks][1]);
    f[1] = tc_pack(scale * s[2 * ks][2], scale * s[2 * ks][3]);
    f[2] = tc_pack(scale * s[2 * ks + 1][0], scale * s[2 * ks + 1][1]);
    f[3] = tc_pack(scale * s[2 * ks + 1][2], scale * s[2 * ks + 1][3]);
}
/* two consecutive halves of shared memory (4-byte aligned: even index, even row length) */
__device__ static inline uint32_t tc_ld(const uint16_t *x) {
#if defined(HKT_CUDA_EMULATION)
    uint32_t u;
    memcpy(&u, x, 4);
    return u;
#else
    return *(const uint32_t *)x; /* one 32-bit load (memcpy from a uint16_t pointer may make two) */
#endif
}
/* two halves one row apart: a B fragment register read down a column */
__device__ static inline uint32_t tc_ld_col(const uint16_t *x, int ld) { return (uint32_t)x[0] | ((uint32_t)x[ld] << 16); }

/* d += a b, one warp: a 16 x 16 bfloat16, b 16 x 8 bfloat16, d 16 x 8 float32 */
__device__ static inline void tc_mma(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(HKT_CUDA_EMULATION)
    emu_mma_m16n8k16_bf16(d, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
    __trap(); /* the host refuses GPUs before sm_80 */
#endif
}

/* 16 bytes (8 bfloat16) from src (or zeros, src NULL) to dst, both 16-byte
 * aligned: one 128-bit load and store on the GPU */
__device__ static inline void tc_copy16(void *dst, const void *src) {
#if defined(HKT_CUDA_EMULATION)
    if (src) memcpy(dst, src, 16);
    else memset(dst, 0, 16);
#else
    *(uint4 *)dst = src ? *(const uint4 *)src : make_uint4(0, 0, 0, 0);
#endif
}
/* Whether rows of a bfloat16 array starting at x, rs apart, D long, can be
 * read 16 bytes at a time (the whole block decides alike). */
__device__ static inline bool tc_vec_rows(const uint16_t *x, int64_t rs, int D) {
    return D % 8 == 0 && rs % 8 == 0 && ((uintptr_t)x & 15) == 0;
}

/* rows [r0, r0 + n) of a (b, head) slice of a bfloat16 array (D columns), to
 * shared rows dst[0 .. rows); rows past n are zeros.  16 bytes a thread where
 * the rows allow (C::ROW keeps shared rows 16-byte aligned), else 2. */
template <int ROW>
__device__ static void tc_load_rows(uint16_t (*dst)[ROW], int rows, const void *src, const int64_t *stride,
                                    int64_t b, int64_t h, int64_t r0, int64_t n, int D) {
    static_assert(ROW % 8 == 0, "shared rows are 16-byte aligned");
    const uint16_t *base = (const uint16_t *)src + b * stride[0] + h * stride[1] + r0 * stride[2];
    if (tc_vec_rows(base, stride[2], D)) {
        const int per = D / 8;
        for (int x = threadIdx.x; x < rows * per; x += TC_THREADS) {
            const int r = x / per, e = x % per * 8;
            tc_copy16(&dst[r][e], r < n ? base + r * stride[2] + e : nullptr);
        }
        return;
    }
    for (int x = threadIdx.x; x < rows * D; x += TC_THREADS) {
        const int r = x / D, e = x % D;
        dst[r][e] = r < n ? base[r * stride[2] + e] : (uint16_t)0;
    }
}

/* Rows r and r + 8 of a bfloat16 (rows, D) slice with row stride rs, from
 * column 2t on (NULL past the end, n rows): what a lane reads of A fragments.
 * Taken once per task, so the loops index two pointers by constants (a row
 * address per fragment load, hoisted out of the tile loop, made ptxas spill). */
struct tc_rowpair {
    const uint16_t *r0, *r1;
};
__device__ static inline tc_rowpair tc_rows(const uint16_t *x, int64_t rs, int64_t r, int64_t n, int t) {
    return {r < n ? x + r * rs + 2 * t : nullptr, r + 8 < n ? x + (r + 8) * rs + 2 * t : nullptr};
}
/* the A fragment of columns c + 2t, c + 2t + 1, c + 2t + 8, c + 2t + 9 of the
 * pair (rows past the end are zeros; element by element: a row stride may be
 * odd, so pairs need not be aligned) */
__device__ static inline void tc_a_frag(uint32_t f[4], const tc_rowpair &rp, int c) {
    f[0] = rp.r0 ? (uint32_t)rp.r0[c] | ((uint32_t)rp.r0[c + 1] << 16) : 0u;
    f[1] = rp.r1 ? (uint32_t)rp.r1[c] | ((uint32_t)rp.r1[c + 1] << 16) : 0u;
    f[2] = rp.r0 ? (uint32_t)rp.r0[c + 8] | ((uint32_t)rp.r0[c + 9] << 16) : 0u;
    f[3] = rp.r1 ? (uint32_t)rp.r1[c + 8] | ((uint32_t)rp.r1[c + 9] << 16) : 0u;
}

/* Levels l0 .. L-1 of the (b, h) slice of x[l] (n rows at level 0) for the
 * SPAN level-0 rows from r0 on: level l's rows r0 >> l on, into dst at that
 * level's offset, padded with zero rows to whole mma tiles.  SPAN = TC_BM: a
 * block's rows (sm.rc, levels 1 ..); TC_BN: a tile's columns (sm.ct, levels 0 ..). */
template <typename C, int SPAN>
__device__ static void tc_load_levels(uint16_t (*dst)[C::ROW], const hkt_params &p, int l0, const void *const *x,
                                      const int64_t (*stride)[3], int64_t b, int64_t h, int64_t r0, int64_t n) {
    for (int l = l0; l < p.L; l++) {
        const int64_t nl = (n + ((int64_t)1 << l) - 1) >> l, s0 = r0 >> l;
        const int64_t cnt = nl - s0 < (SPAN >> l) ? nl - s0 : (SPAN >> l);
        const int rows = SPAN == TC_BM ? tc_qrows(l) : l ? tc_krows(l) : TC_BN;
        tc_load_rows<C::ROW>(dst + (SPAN == TC_BM ? tc_qoff(l) : tc_koff(l)), rows, x[l], stride[l], b, h, s0, cnt,
                             (int)p.D);
    }
}
/* the block's coarse rows (levels 1 .. L-1) into sm.rc */
template <typename C>
__device__ static void tc_load_block(tc_scores_smem<C> &sm, const hkt_params &p, const void *const *rows,
                                     const int64_t (*stride)[3], int64_t b, int64_t h, int64_t r0, int64_t nrows) {
    tc_load_levels<C, TC_BM>(sm.rc, p, 1, rows, stride, b, h, r0, nrows);
}
/* the tile's columns of every level into sm.ct */
template <typename C>
__device__ static void tc_load_tile(tc_scores_smem<C> &sm, const hkt_params &p, const void *const *cols,
                                    const int64_t (*stride)[3], int64_t b, int64_t h, int64_t c0, int64_t ncols) {
    tc_load_levels<C, TC_BN>(sm.ct, p, 0, cols, stride, b, h, c0, ncols);
}

/* the coarse Gram blocks, one 16 x 8 mma tile per warp in turn */
template <typename C>
__device__ static void tc_grams(tc_scores_smem<C> &sm, int L, int nks, int warp, int g, int t) {
    int tile = 0;
    for (int l = 1; l < L; l++)
        for (int mt = 0; mt < tc_qrows(l) / 16; mt++)
            for (int nt = 0; nt < tc_krows(l) / 8; nt++, tile++) {
                if (tile % TC_WARPS != warp) continue;
                const uint16_t(*qr)[C::ROW] = sm.rc + tc_qoff(l) + 16 * mt;
                const uint16_t(*kr)[C::ROW] = sm.ct + tc_koff(l) + 8 * nt;
                float c[4] = {0.f, 0.f, 0.f, 0.f};
                for (int kk = 0; kk < nks; kk++) {
                    const int e = 16 * kk + 2 * t;
                    const uint32_t af[4] = {tc_ld(&qr[g][e]), tc_ld(&qr[g + 8][e]), tc_ld(&qr[g][e + 8]),
                                            tc_ld(&qr[g + 8][e + 8])};
                    const uint32_t bf[2] = {tc_ld(&kr[g][e]), tc_ld(&kr[g][e + 8])};
                    tc_mma(c, af, bf);
                }
                float *gr = sm.gram + tc_goff(l);
                const int cols = tc_krows(l), r = 16 * mt + g, cc = 8 * nt + 2 * t;
                gr[r * cols + cc] = c[0];
                gr[r * cols + cc + 1] = c[1];
                gr[(r + 8) * cols + cc] = c[2];
                gr[(r + 8) * cols + cc + 1] = c[3];
            }
}

/* s = this warp's level-0 products, 16 rows x the tile's 32 columns: A from
 * the fragments qf (QREG) or read from the rows rp */
template <typename C, bool QREG>
__device__ __forceinline__ void tc_level0(float s[TC_BN / 8][4], const tc_scores_smem<C> &sm,
                                          const uint32_t (*qf)[4], const tc_rowpair &rp, int nks, int g, int t) {
#pragma unroll
    for (int j = 0; j < TC_BN / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < C::KS; kk++) {
        if (kk < nks) {
            const int e = 16 * kk + 2 * t;
            uint32_t qt[4];
            if (!QREG) tc_a_frag(qt, rp, 16 * kk);
#pragma unroll
            for (int j = 0; j < TC_BN / 8; j++) {
                const uint32_t bf[2] = {tc_ld(&sm.ct[8 * j + g][e]), tc_ld(&sm.ct[8 * j + g][e + 8])};
                tc_mma(s[j], QREG ? qf[QREG ? kk : 0] : qt, bf);
            }
        }
    }
}

/* s += the coarse levels, folded coarsest first: s = w_0 s + (w_1 G_1 + (...)).
 * Entry (r, c) reads G_l[r >> l][c >> l]: this lane's entries are rows r_lo
 * (+ 8) and columns 2t (+ 1) + 8n, and for l <= 3 both steps are multiples of
 * 2^l while 2t + 1 >> l = 2t >> l, so each level's reads are one base address
 * plus constants. */
template <typename C>
__device__ __forceinline__ void tc_fold(float s[TC_BN / 8][4], const tc_scores_smem<C> &sm, const float *wl, int L,
                                        int r_lo, int t) {
    const float *gb[HKT_TC_LMAX];
#pragma unroll
    for (int l = 1; l < HKT_TC_LMAX; l++) gb[l] = sm.gram + tc_goff(l) + (r_lo >> l) * tc_krows(l) + ((2 * t) >> l);
#pragma unroll
    for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            float acc = 0.f;
#pragma unroll
            for (int l = HKT_TC_LMAX - 1; l >= 1; l--)
                if (l < L) {
                    const float gl = gb[l][(x & 2 ? 8 >> l : 0) * tc_krows(l) + ((8 * n) >> l)];
                    acc = l == L - 1 ? wl[l] * gl : wl[l] * gl + acc;
                }
            s[n][x] = L == 1 ? wl[0] * s[n][x] : wl[0] * s[n][x] + acc;
        }
}

/* The mask (float first, then hiding, as score_of), causality and the bounds
 * on the tile's scores: entry (r, c) is (i, j) = (row0 + r, col0 + c), or
 * (col0 + c, row0 + r) when TR (rows are keys); nrows, ncols: T and S, or S and T */
template <bool TR>
__device__ __forceinline__ void tc_hide(float s[TC_BN / 8][4], const hkt_params &p, int64_t b, int64_t h, int64_t row0,
                                        int64_t col0, int r_lo, int t, int64_t nrows, int64_t ncols) {
    if (p.mask_kind != HKT_MASK_NONE) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int64_t r = row0 + r_lo + 8 * hr;
            if (r >= nrows) continue;
            const int64_t at = b * p.mask_stride[0] + h * p.mask_stride[1] + r * p.mask_stride[TR ? 3 : 2];
#pragma unroll
            for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    const int64_t c = col0 + 8 * n + 2 * t + u;
                    if (c >= ncols) continue;
                    float &sc = s[n][2 * hr + u];
                    const int64_t x = at + c * p.mask_stride[TR ? 2 : 3];
                    if (p.mask_kind == HKT_MASK_BOOL) sc = ((const unsigned char *)p.mask)[x] ? sc : -INFINITY;
                    else sc += ((const float *)p.mask)[x];
                }
        }
    }
    /* rows and columns past the end (a row past the end must not reach the
     * coarse block sums of the backward), and causally hidden entries: j > i */
    const int lim = (int)(ncols - col0 < TC_BN ? ncols - col0 : TC_BN);
    const int64_t rlim = nrows - row0, diag = row0 - col0;
#pragma unroll
    for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int rr = r_lo + (x & 2 ? 8 : 0), cc = 8 * n + 2 * t + (x & 1);
            /* j - i = cc - rr - diag (rows queries) or rr + diag - cc (rows keys) */
            const bool later = TR ? rr + diag > cc : cc - rr > diag;
            if (cc >= lim || rr >= rlim || (p.causal && later)) s[n][x] = -INFINITY;
        }
}

template <typename C>
__global__ void __launch_bounds__(TC_THREADS, 2) tc_forward_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    __shared__ tc_forward_smem<C> sm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int L = p.L;
    const int64_t T = p.T, S = p.S;
    const int D = (int)p.D, Dv = (int)p.Dv, nks = D / 16; /* at most HKT_TC_DMAX */
    const int64_t nqt = (T + TC_BM - 1) / TC_BM;
    float wl[HKT_TC_LMAX];
    for (int64_t task = blockIdx.x; task < p.B * p.H * nqt; task += gridDim.x) {
        const int64_t bh = task / nqt, i0 = task % nqt * TC_BM, b = bh / p.H, h = bh % p.H, hk = kv_head(p, h);
#pragma unroll
        for (int l = 0; l < HKT_TC_LMAX; l++) wl[l] = l < L ? hkt_level_factor(p.scale, weight<float>(p, h, l)) : 0.f;
        __syncthreads(); /* the previous task's reads of shared memory are done */
        tc_load_block(sm.sc, p, p.q, p.q_stride, b, h, i0, T);
        /* this warp's level-0 query rows as A fragments, for every 16 of D */
        const uint16_t *qb = (const uint16_t *)p.q[0] + b * p.q_stride[0][0] + h * p.q_stride[0][1];
        const int64_t q_row = i0 + warp * 16 + g;
        const tc_rowpair qrows = tc_rows(qb, p.q_stride[0][2], q_row, T, t);
        uint32_t qf[C::QREG ? C::KS : 1][4];
        if (C::QREG) {
#pragma unroll
            for (int kk = 0; kk < C::KS; kk++)
                if (kk < nks) tc_a_frag(qf[C::QREG ? kk : 0], qrows, 16 * kk);
        }
        float o[C::NV][4];
#pragma unroll
        for (int n = 0; n < C::NV; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
        float m[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.f, 0.f};
        const int64_t jend = p.causal ? (i0 + TC_BM < S ? i0 + TC_BM : S) : S;
        for (int64_t j0 = 0; j0 < jend; j0 += TC_BN) {
            /* 1. keys of every level, and v transposed */
            __syncthreads();
            tc_load_tile(sm.sc, p, p.k, p.k_stride, b, hk, j0, S);
            {
                const uint16_t *vb = (const uint16_t *)p.v + b * p.v_stride[0] + hk * p.v_stride[1];
                for (int x = threadIdx.x; x < TC_BN * Dv; x += TC_THREADS) {
                    const int r = x / Dv, e = x % Dv;
                    sm.vt[e][r] = j0 + r < S ? vb[(j0 + r) * p.v_stride[2] + e] : (uint16_t)0;
                }
            }
            __syncthreads();
            /* 2. the coarse Gram blocks */
            tc_grams(sm.sc, L, nks, warp, g, t);
            __syncthreads();
            /* 3. level-0 scores of this warp's 16 rows and the tile's 32 keys, the fold, the mask */
            float s[TC_BN / 8][4];
            tc_level0<C, C::QREG>(s, sm.sc, qf, qrows, nks, g, t);
            const int r_lo = warp * 16 + g;
            tc_fold(s, sm.sc, wl, L, r_lo, t);
            tc_hide<false>(s, p, b, h, i0, j0, r_lo, t, T, S);
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
                for (int x = 0; x < 4; x++) mx[x >> 1] = max_or_nan(mx[x >> 1], s[n][x]);
            /* 4. online softmax, each row's statistics shared by the 4 lanes t of its g */
            float scale_o[2];
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                mx[hr] = max_or_nan(mx[hr], __shfl_xor_sync(FULL, mx[hr], 1));
                mx[hr] = max_or_nan(mx[hr], __shfl_xor_sync(FULL, mx[hr], 2));
                const float mnew = max_or_nan(m[hr], mx[hr]);
                /* no visible key yet: subtract 0, so exp(-inf) = 0 */
                const float ref = mnew == -INFINITY ? 0.f : mnew;
                scale_o[hr] = dev_exp(m[hr] - ref);
                m[hr] = mnew;
                float rs = 0.f;
#pragma unroll
                for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
                    for (int x = 2 * hr; x < 2 * hr + 2; x++) {
                        s[n][x] = dev_exp(s[n][x] - ref);
                        rs += s[n][x];
                    }
                lsum[hr] = lsum[hr] * scale_o[hr] + rs;
            }
#pragma unroll
            for (int n = 0; n < C::NV; n++) {
                o[n][0] *= scale_o[0];
                o[n][1] *= scale_o[0];
                o[n][2] *= scale_o[1];
                o[n][3] *= scale_o[1];
            }
            /* 5. o += P V, 16 keys at a time: P's A fragment is two score n-tiles */
#pragma unroll
            for (int ks = 0; ks < TC_BN / 16; ks++) {
                uint32_t pf[4];
                tc_c_to_a(pf, s, ks, 1.f);
                const int e = 16 * ks + 2 * t;
#pragma unroll
                for (int n = 0; n < C::NV; n++) {
                    if (8 * n < Dv) {
                        const uint32_t bf[2] = {tc_ld(&sm.vt[8 * n + g][e]), tc_ld(&sm.vt[8 * n + g][e + 8])};
                        tc_mma(o[n], pf, bf);
                    }
                }
            }
        }
        /* the row sums over the 4 lanes of each row (the same bits in all four) */
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            lsum[hr] += __shfl_xor_sync(FULL, lsum[hr], 1);
            lsum[hr] += __shfl_xor_sync(FULL, lsum[hr], 2);
        }
        float *ob = (float *)p.out + b * p.out_stride[0] + h * p.out_stride[1];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int64_t i = q_row + 8 * hr;
            if (i >= T) continue;
            /* lsum == 0: no visible key (zeros, lse +inf); NaN stays NaN */
            const float inv = lsum[hr] == 0.f ? 0.f : 1.f / lsum[hr];
#pragma unroll
            for (int n = 0; n < C::NV; n++)
                for (int u = 0; u < 2; u++) {
                    const int64_t e = 8 * n + 2 * t + u;
                    if (e < Dv) ob[i * p.out_stride[2] + e] = o[n][2 * hr + u] * inv;
                }
            if (t == 0)
                ((float *)p.lse)[bh * T + i] = lsum[hr] == 0.f ? INFINITY : m[hr] + dev_log(lsum[hr]);
        }
    }
}

/* The backward, C::DKV false: dq[l], delta and the dw partials per block of 64
 * queries of (b, h); C::DKV: dv (C::DV) or dk[l] (C::GRAD) per block of 64
 * keys of (b, kv head), its query heads in order.  D and Dv multiples of 16 up
 * to 64. */
template <typename C>
__global__ void __launch_bounds__(TC_THREADS, 2) tc_backward_kernel(const __grid_constant__ cuda_args a) {
    constexpr bool DKV = C::DKV, DV = C::DV, GRAD = C::GRAD;
    const hkt_params &p = a.p;
    __shared__ tc_backward_smem<C> sm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int L = p.L, D = (int)p.D, Dv = (int)p.Dv, nks = D / 16, nvs = Dv / 16;
    const int64_t T = p.T, S = p.S, group = p.H / p.H_kv;
    const int64_t nrows = DKV ? S : T, ncols = DKV ? T : S;
    const int64_t nblk = (nrows + TC_BM - 1) / TC_BM, heads = DKV ? p.H_kv : p.H;
    float *const delta = (float *)a.delta;
    const int r_lo = warp * 16 + g;
    float wl[HKT_TC_LMAX];
    for (int64_t task = blockIdx.x; task < p.B * heads * nblk; task += gridDim.x) {
        const int64_t bh = task / nblk, blk = task % nblk, r0 = blk * TC_BM, b = bh / heads, hx = bh % heads;
        const int64_t row = r0 + r_lo; /* this lane's rows: row, row + 8 */
        __syncthreads(); /* the previous task's reads of shared memory are done */
        /* the block's coarse rows (q_l of h, or k_l of the kv head), and its coarse gradient rows zeroed */
        if (DKV) tc_load_block(sm.sc, p, p.k, p.k_stride, b, hx, r0, nrows);
        else tc_load_block(sm.sc, p, p.q, p.q_stride, b, hx, r0, nrows);
        for (int x = threadIdx.x; x < tc_qoff(HKT_TC_LMAX) * C::KS * 16; x += TC_THREADS)
            sm.acc[x / (C::KS * 16)][x % (C::KS * 16)] = 0.f;
        if (!DKV) { /* the block's lse, and delta = rowsum(dO * out) in double (into the scratch too) */
            const uint16_t *dob = (const uint16_t *)p.dout + b * p.dout_stride[0] + hx * p.dout_stride[1];
            const uint16_t *ob = (const uint16_t *)p.out + b * p.out_stride[0] + hx * p.out_stride[1];
            for (int r = threadIdx.x; r < TC_BM; r += TC_THREADS) {
                const int64_t i = r0 + r;
                double acc = 0;
                if (i < T)
                    for (int e = 0; e < Dv; e++)
                        acc += (double)tc_f32(dob[i * p.dout_stride[2] + e]) * tc_f32(ob[i * p.out_stride[2] + e]);
                sm.rowstat[0][r] = i < T ? ((const float *)p.lse)[bh * T + i] : 0.f;
                sm.rowstat[1][r] = (float)acc;
                if (i < T) delta[bh * T + i] = (float)acc;
            }
        }
        __syncthreads();
        float acc0[C::ND][4], accv[DV ? C::NV : 1][4], dwl[HKT_TC_LMAX];
#pragma unroll
        for (int n = 0; n < C::ND; n++) acc0[n][0] = acc0[n][1] = acc0[n][2] = acc0[n][3] = 0.f;
#pragma unroll
        for (int n = 0; n < (DV ? C::NV : 1); n++) accv[n][0] = accv[n][1] = accv[n][2] = accv[n][3] = 0.f;
#pragma unroll
        for (int l = 0; l < HKT_TC_LMAX; l++) dwl[l] = 0.f;
        /* the rows' level-0 array and value array (q[0] and dout of h, or k[0] and v of the kv head) */
        const uint16_t *r_x = DKV ? (const uint16_t *)p.k[0] + b * p.k_stride[0][0] + hx * p.k_stride[0][1]
                                  : (const uint16_t *)p.q[0] + b * p.q_stride[0][0] + hx * p.q_stride[0][1];
        const int64_t r_xs = DKV ? p.k_stride[0][2] : p.q_stride[0][2];
        const uint16_t *r_v = DKV ? (const uint16_t *)p.v + b * p.v_stride[0] + hx * p.v_stride[1]
                                  : (const uint16_t *)p.dout + b * p.dout_stride[0] + hx * p.dout_stride[1];
        const int64_t r_vs = DKV ? p.v_stride[2] : p.dout_stride[2];
        const tc_rowpair xrows = tc_rows(r_x, r_xs, row, nrows, t), vrows = tc_rows(r_v, r_vs, row, nrows, t);
        /* causal: keys j <= i; the dq block's keys end at its last query, the
         * dk/dv block's queries start at the tile holding its first key */
        const int64_t c_lo = DKV && p.causal ? r0 / TC_BN * TC_BN : 0;
        const int64_t c_hi = !DKV && p.causal ? (r0 + TC_BM < S ? r0 + TC_BM : S) : ncols;
        const int64_t ntile = (c_hi - c_lo + TC_BN - 1) / TC_BN;
        /* one loop over (query head of the group, column tile): dk/dv sums a kv
         * head's query heads in order (a nested head loop made ptxas spill) */
        for (int64_t it = 0; it < (DKV ? group : 1) * ntile; it++) {
            const int64_t hh = it / ntile, c0 = c_lo + it % ntile * TC_BN;
            const int64_t h = DKV ? hx * group + hh : hx, hk = DKV ? hx : kv_head(p, h);
#pragma unroll
            for (int l = 0; l < HKT_TC_LMAX; l++) wl[l] = l < L ? hkt_level_factor(p.scale, weight<float>(p, h, l)) : 0.f;
            __syncthreads();
            /* 1. the tile's columns of every level, its value rows (v, or dO), and (dk/dv) its queries' lse and delta */
            if (DKV) {
                tc_load_tile(sm.sc, p, p.q, p.q_stride, b, h, c0, ncols);
                tc_load_rows<C::VROW>(sm.cv, TC_BN, p.dout, p.dout_stride, b, h, c0,
                                      ncols - c0 < TC_BN ? ncols - c0 : TC_BN, Dv);
                for (int c = threadIdx.x; c < TC_BN; c += TC_THREADS) {
                    const int64_t i = c0 + c, at = (b * p.H + h) * T + i;
                    sm.colstat[0][c] = i < T ? ((const float *)p.lse)[at] : 0.f;
                    if (!DV) sm.colstat[1][c] = i < T ? delta[at] : 0.f; /* only dS needs delta */
                }
            } else {
                tc_load_tile(sm.sc, p, p.k, p.k_stride, b, hk, c0, ncols);
                tc_load_rows<C::VROW>(sm.cv, TC_BN, p.v, p.v_stride, b, hk, c0,
                                      ncols - c0 < TC_BN ? ncols - c0 : TC_BN, Dv);
            }
            __syncthreads();
            /* 2. the coarse Gram blocks; 3. the scores */
            tc_grams(sm.sc, L, nks, warp, g, t);
            __syncthreads();
            float s[TC_BN / 8][4], g0[DKV ? 1 : TC_BN / 8][4];
            tc_level0<C, false>(s, sm.sc, nullptr, xrows, nks, g, t);
            if (!DKV) {
#pragma unroll
                for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
                    for (int x = 0; x < 4; x++) g0[DKV ? 0 : n][x] = s[n][x];
            }
            tc_fold(s, sm.sc, wl, L, r_lo, t);
            tc_hide<DKV>(s, p, b, h, r0, c0, r_lo, t, nrows, ncols);
            /* 4. dP: the rows' values against the tile's value rows */
            float dp[TC_BN / 8][4];
#pragma unroll
            for (int n = 0; n < TC_BN / 8; n++) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < C::NV / 2; kk++) {
                if (GRAD && kk < nvs) {
                    const int e = 16 * kk + 2 * t;
                    uint32_t af[4];
                    tc_a_frag(af, vrows, 16 * kk);
#pragma unroll
                    for (int n = 0; n < TC_BN / 8; n++) {
                        const uint32_t bf[2] = {tc_ld(&sm.cv[8 * n + g][e]), tc_ld(&sm.cv[8 * n + g][e + 8])};
                        tc_mma(dp[n], af, bf);
                    }
                }
            }
            /* 5. P (into s) and dS (into dp); a hidden entry's are exactly 0 */
            float rl[2] = {0.f, 0.f}, rd[2] = {0.f, 0.f};
            if (!DKV)
                for (int hr = 0; hr < 2; hr++) {
                    rl[hr] = sm.rowstat[0][r_lo + 8 * hr];
                    rd[hr] = sm.rowstat[1][r_lo + 8 * hr];
                }
#pragma unroll
            for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int cc = 8 * n + 2 * t + (x & 1);
                    const float lse = DKV ? sm.colstat[0][cc] : rl[x >> 1];
                    const float del = DV ? 0.f : DKV ? sm.colstat[1][cc] : rd[x >> 1];
                    const bool hidden = s[n][x] == -INFINITY;
                    const float pv = hidden ? 0.f : dev_exp(s[n][x] - lse);
                    const float ds = hidden || !GRAD ? 0.f : pv * (dp[n][x] - del);
                    if (!DKV) dwl[0] += hidden ? 0.f : g0[DKV ? 0 : n][x] * ds;
                    s[n][x] = pv;
                    dp[n][x] = ds;
                }
            /* 6. dV += P dO (the dv kernel), or the level-0 gradient += (scale w_0
             * dS) x the tile's level-0 rows, 16 columns at a time */
            if (DV) {
#pragma unroll
                for (int ks = 0; ks < TC_BN / 16; ks++) {
                    const int k0 = 16 * ks + 2 * t;
                    uint32_t pf[4];
                    tc_c_to_a(pf, s, ks, 1.f);
#pragma unroll
                    for (int n = 0; n < (DV ? C::NV : 1); n++) {
                        if (8 * n < Dv) {
                            const uint16_t *col = &sm.cv[k0][8 * n + g];
                            const uint32_t bf[2] = {tc_ld_col(col, C::VROW), tc_ld_col(col + 8 * C::VROW, C::VROW)};
                            tc_mma(accv[n], pf, bf);
                        }
                    }
                }
            }
#pragma unroll
            for (int ks = 0; ks < (GRAD ? TC_BN / 16 : 0); ks++) {
                const int k0 = 16 * ks + 2 * t;
                uint32_t df[4];
                tc_c_to_a(df, dp, ks, wl[0]);
#pragma unroll
                for (int n = 0; n < C::ND; n++) {
                    if (8 * n < D) {
                        const uint16_t *col = &sm.sc.ct[k0][8 * n + g];
                        const uint32_t bf[2] = {tc_ld_col(col, C::ROW), tc_ld_col(col + 8 * C::ROW, C::ROW)};
                        tc_mma(acc0[n], df, bf);
                    }
                }
            }
            /* 7. the coarse levels: dS summed over each 2^l x 2^l block by a
             * butterfly over the lanes that hold it (rows: lane bits 2-4, columns:
             * bits 0-1), the same bits in every lane of a block; one lane writes
             * scale w_l times it, and (dq) adds G_l times it to dw */
            if (GRAD && L > 1) {
                float v[TC_BN / 8][2];
#pragma unroll
                for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
                    for (int hr = 0; hr < 2; hr++) v[n][hr] = dp[n][2 * hr] + dp[n][2 * hr + 1];
#pragma unroll
                for (int l = 1; l < HKT_TC_LMAX; l++) {
                    if (l >= L) break; /* L is the same in every lane */
                    const int rowbit = 4 << (l - 1), colbit = l >= 2 ? 1 << (l - 2) : 0;
                    const bool writer = (g & ((1 << l) - 1)) == 0 && (t & ((1 << (l - 1)) - 1)) == 0;
#pragma unroll
                    for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
                        for (int hr = 0; hr < 2; hr++) {
                            if (colbit) v[n][hr] += __shfl_xor_sync(FULL, v[n][hr], colbit);
                            v[n][hr] += __shfl_xor_sync(FULL, v[n][hr], rowbit);
                            if (writer) {
                                const int ar = (r_lo + 8 * hr) >> l, ac = (8 * n + 2 * t) >> l;
                                const int at = tc_goff(l) + ar * tc_krows(l) + ac;
                                sm.dgs[at] = wl[l] * v[n][hr];
                                if (!DKV && v[n][hr] != 0.f) dwl[l] += sm.sc.gram[at] * v[n][hr];
                            }
                        }
                }
                __syncwarp();
                /* the warp's coarse gradient rows += (scale w_l dG_l) x the tile's
                 * level-l rows, lane d owning columns d and d + 32 */
                for (int l = 1; l < L; l++) {
                    const int a_lo = (warp * 16) >> l, a_hi = (warp * 16 + 16) >> l;
                    const int64_t cl = (ncols + ((int64_t)1 << l) - 1) >> l, cb = c0 >> l;
                    const int nc = (int)(cl - cb < (TC_BN >> l) ? cl - cb : (TC_BN >> l));
                    for (int ar = a_lo; ar < a_hi; ar++)
                        for (int d = lane; d < D; d += 32) {
                            float acc = sm.acc[tc_qoff(l) + ar][d];
                            for (int c = 0; c < nc; c++)
                                acc += sm.dgs[tc_goff(l) + ar * tc_krows(l) + c] *
                                       tc_f32(sm.sc.ct[tc_koff(l) + c][d]);
                            sm.acc[tc_qoff(l) + ar][d] = acc;
                        }
                }
                __syncwarp();
            }
        }
        /* write the block's gradient rows: level 0 (and dv) from the registers */
        {
            const int64_t *gs = DKV ? p.dk_stride[0] : p.dq_stride[0];
            float *gb = (float *)(DKV ? p.dk[0] : p.dq[0]) + b * gs[0] + hx * gs[1];
            float *vb = (float *)p.dv + b * p.dv_stride[0] + hx * p.dv_stride[1];
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int64_t r = row + 8 * hr;
                if (r >= nrows) continue;
#pragma unroll
                for (int n = 0; n < (GRAD ? C::ND : 0); n++)
                    for (int u = 0; u < 2; u++)
                        if (8 * n + 2 * t + u < D) gb[r * gs[2] + 8 * n + 2 * t + u] = acc0[n][2 * hr + u];
                if (DV) {
#pragma unroll
                    for (int n = 0; n < (DV ? C::NV : 1); n++)
                        for (int u = 0; u < 2; u++)
                            if (8 * n + 2 * t + u < Dv)
                                vb[r * p.dv_stride[2] + 8 * n + 2 * t + u] = accv[n][2 * hr + u];
                }
            }
        }
        /* the coarse rows this warp owns */
        for (int l = 1; l < (GRAD ? L : 1); l++) {
            const int64_t *gs = DKV ? p.dk_stride[l] : p.dq_stride[l];
            float *gb = (float *)(DKV ? p.dk[l] : p.dq[l]) + b * gs[0] + hx * gs[1];
            const int64_t rl = (nrows + ((int64_t)1 << l) - 1) >> l;
            for (int ar = (warp * 16) >> l; ar < (warp * 16 + 16) >> l; ar++) {
                const int64_t r = (r0 >> l) + ar;
                if (r >= rl) continue;
                for (int d = lane; d < D; d += 32) gb[r * gs[2] + d] = sm.acc[tc_qoff(l) + ar][d];
            }
        }
        if (!DKV) { /* this block's dw: lanes, then warps, in a fixed order */
#pragma unroll
            for (int l = 0; l < HKT_TC_LMAX; l++)
                for (int o = 16; o > 0; o >>= 1) dwl[l] += __shfl_xor_sync(FULL, dwl[l], o);
            if (lane == 0)
                for (int l = 0; l < HKT_TC_LMAX; l++) sm.dwp[warp][l] = dwl[l];
            __syncthreads();
            if (threadIdx.x < (unsigned)L) {
                float acc = 0.f;
                for (int w = 0; w < TC_WARPS; w++) acc += sm.dwp[w][threadIdx.x];
                ((float *)a.dw_part)[(bh * nblk + blk) * L + threadIdx.x] = (float)p.scale * acc;
            }
        }
    }
}

/* the tensor-core kernels, for D and Dv each up to 64 or up to 128 */
template <typename C>
static cudaError_t tc_forward_launch(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    const int64_t tasks = p.B * p.H * ((p.T + TC_BM - 1) / TC_BM);
    const unsigned grid = (unsigned)(tasks < MAX_BLOCKS ? tasks : MAX_BLOCKS);
    cudaStream_t stream = (cudaStream_t)p.stream;
    *what = "tensor-core forward kernel launch";
    if (tasks > 0) tc_forward_kernel<C><<<grid, TC_THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

template <typename C>
static cudaError_t tc_backward_launch(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    const int64_t tasks = C::DKV ? p.B * p.H_kv * ((p.S + TC_BM - 1) / TC_BM) : p.B * p.H * ((p.T + TC_BM - 1) / TC_BM);
    const unsigned grid = (unsigned)(tasks < MAX_BLOCKS ? tasks : MAX_BLOCKS);
    cudaStream_t stream = (cudaStream_t)p.stream;
    *what = !C::DKV ? "tensor-core dq kernel launch" : C::DV ? "tensor-core dv kernel launch"
                                                             : "tensor-core dk kernel launch";
    if (tasks > 0) tc_backward_kernel<C><<<grid, TC_THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

/* ---- host side ---- */
static unsigned blocks_for(int64_t warps) {
    const int64_t n = (warps + WARPS - 1) / WARPS;
    return (unsigned)(n < MAX_BLOCKS ? n : MAX_BLOCKS);
}

static cuda_args make_args(const hkt_params *p) {
    cuda_args a;
    memset(&a, 0, sizeof a);
    a.p = *p;
    a.seed_mixed = mix64(p->seed);
    a.threshold = keep_threshold(p->dropout_p);
    a.keep_scale = keep_scale(p->dropout_p);
    a.G = (int64_t)1 << (p->L - 1);
    a.nqb = (p->T + a.G - 1) / a.G;
    a.nkb = (p->S + a.G - 1) / a.G;
    return a;
}

template <typename real>
static cudaError_t forward_launch(const cuda_args &a, const char **what) {
    cudaStream_t stream = (cudaStream_t)a.p.stream;
    const int64_t rows = a.p.B * a.p.H * a.p.T;
    *what = "forward kernel launch";
    if (rows > 0) forward_kernel<real><<<blocks_for(rows), THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

template <typename real>
static cudaError_t backward_launch(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    cudaStream_t stream = (cudaStream_t)p.stream;
    const int64_t rows = p.B * p.H * p.T, qtasks = p.B * p.H * a.nqb, ktasks = p.B * p.H_kv * a.nkb;
    cudaError_t e;
    *what = "backward delta kernel launch";
    if (rows > 0) delta_kernel<real><<<blocks_for(rows), THREADS, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dq kernel launch";
    if (qtasks > 0) dq_kernel<real><<<blocks_for(qtasks), THREADS, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dk/dv kernel launch";
    if (ktasks > 0) dkv_kernel<real><<<blocks_for(ktasks), THREADS, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dw kernel launch";
    if ((p.w_per_head ? p.H : 1) * p.L > 0) dw_kernel<real><<<1, 256, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dmask kernel launch";
    const int64_t nmask = p.dmask ? p.dmask_shape[0] * p.dmask_shape[1] * p.dmask_shape[2] * p.dmask_shape[3] : 0;
    if (nmask > 0) dmask_kernel<real><<<blocks_for((nmask + 31) / 32), THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

/* The tensor-core kernels' own guard (the binding has named the argument
 * already): why, the limit p breaks, or NULL; then sm_80 or later. */
static cudaError_t tc_check(const hkt_params &p, const char *why, const char **what) {
    int major = 0;
    cudaError_t e;
    if ((*what = why) != NULL) return cudaErrorInvalidValue;
    *what = "cudaDeviceGetAttribute";
    if ((e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.device_id)) != cudaSuccess) return e;
    *what = "bfloat16 needs a GPU of compute capability 8.0 or later (tensor cores with bfloat16)";
    return major < 8 ? cudaErrorInvalidValue : cudaSuccess;
}

/* bfloat16 forward: the tensor-core kernel for D and Dv up to 64 or 128 */
static cudaError_t tc_forward(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    const cudaError_t e = tc_check(p, hkt_cuda_tc_refusal(&p), what);
    if (e != cudaSuccess) return e;
    if (p.D <= 64)
        return p.Dv <= 64 ? tc_forward_launch<tc_cfg<64, 64>>(a, what) : tc_forward_launch<tc_cfg<64, 128>>(a, what);
    return p.Dv <= 64 ? tc_forward_launch<tc_cfg<128, 64>>(a, what) : tc_forward_launch<tc_cfg<128, 128>>(a, what);
}

/* bfloat16 backward: dq (and delta, dw partials per block of 64 queries),
 * then dv, then dk, then dw summed by dw_kernel */
static cudaError_t tc_backward(cuda_args a, const char **what) {
    const hkt_params &p = a.p;
    cudaError_t e = tc_check(p, hkt_cuda_tc_backward_refusal(&p), what);
    if (e != cudaSuccess) return e;
    a.nqb = (p.T + TC_BM - 1) / TC_BM; /* dw partials per block of TC_BM queries (fewer than per G) */
    if ((e = tc_backward_launch<tc_cfg<HKT_TC_BWD_DMAX, HKT_TC_BWD_DMAX, 0>>(a, what)) != cudaSuccess) return e;
    if ((e = tc_backward_launch<tc_cfg<HKT_TC_BWD_DMAX, HKT_TC_BWD_DMAX, 1>>(a, what)) != cudaSuccess) return e;
    if ((e = tc_backward_launch<tc_cfg<HKT_TC_BWD_DMAX, HKT_TC_BWD_DMAX, 2>>(a, what)) != cudaSuccess) return e;
    cudaStream_t stream = (cudaStream_t)p.stream;
    *what = "backward dw kernel launch";
    if ((p.w_per_head ? p.H : 1) * p.L > 0) dw_kernel<float><<<1, 256, 0, stream>>>(a);
    return cudaGetLastError();
}

static int report(cudaError_t e, const char *what, char *err, size_t errlen) {
    if (e == cudaSuccess) return 0;
    if (err && errlen) snprintf(err, errlen, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return -1;
}

/* Selects p's device (the stream's); *prev gets the caller's device, restored
 * by leave_device.  Nothing waits here: stream order does that. */
static cudaError_t enter_device(const hkt_params *p, int *prev, const char **what) {
    cudaError_t e;
    *what = "cudaGetDevice";
    if ((e = cudaGetDevice(prev)) != cudaSuccess) return e;
    *what = "cudaSetDevice";
    return cudaSetDevice(p->device_id);
}

static void leave_device(int prev) {
    if (prev >= 0) cudaSetDevice(prev);
}

extern "C" int hkt_forward_cuda(const hkt_params *p, char *err, size_t errlen) {
    const char *what = "";
    int prev = -1;
    cudaError_t e = enter_device(p, &prev, &what);
    if (e == cudaSuccess) {
        const cuda_args a = make_args(p);
        if (p->dtype == HKT_BFLOAT16)
            e = tc_forward(a, &what);
        else
            e = p->dtype == HKT_FLOAT64 ? forward_launch<double>(a, &what) : forward_launch<float>(a, &what);
    }
    leave_device(prev);
    return report(e, what, err, errlen);
}

extern "C" int hkt_backward_cuda(const hkt_params *p, char *err, size_t errlen) {
    const char *what = "";
    int prev = -1;
    cudaError_t e = enter_device(p, &prev, &what);
    if (e == cudaSuccess) {
        cuda_args a = make_args(p);
        const size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
        /* the layout hkt_cuda_scratch_bytes counts: delta, then the dw partials */
        a.delta = p->dw_partial;
        a.dw_part = (char *)p->dw_partial + (size_t)(p->B * p->H * p->T) * elem;
        what = "backward scratch: dw_partial is NULL";
        if (p->dw_partial == NULL && hkt_cuda_scratch_bytes(p->B, p->H, p->T, p->L, elem) > 0)
            e = cudaErrorInvalidValue;
        else
            e = p->dtype == HKT_BFLOAT16 ? tc_backward(a, &what)
                : p->dtype == HKT_FLOAT64  ? backward_launch<double>(a, &what)
                                           : backward_launch<float>(a, &what);
    }
    leave_device(prev);
    return report(e, what, err, errlen);
}
