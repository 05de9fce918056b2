/*
 * HKT attention on CUDA: forward and backward, float32 and float64.
 *
 * Shapes (see hkt.h): q[l] (B, H, ceil(T/2^l), D), k[l] (B, H_kv, ceil(S/2^l), D),
 * v (B, H_kv, S, Dv), w (H, L) or (L,); out (B, H, T, Dv), lse (B, H, T).
 * Forward writes out and lse (+inf for a row with no visible key); backward
 * OVERWRITES dq[l], dk[l], dv, dw and, when not NULL, dmask.  Same contract,
 * field for field, as hkt_attention.c; every pointer in hkt_params is a device
 * pointer on p->device_id.
 *
 * Written to be plainly right rather than fast (the CPU file is the fast one):
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
 * Unlike the CPU kernels, the score of every (i, j) is computed from all L
 * levels (T*S*D*L multiply-adds, not the T*S*D*sum 4^-l of docs/contract.md
 * section 1.6): sharing a coarse level's product across its 2^l x 2^l block
 * would need a tiled kernel, which this file leaves for later.
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
    const real scale = (real)p.scale;
    real s = 0;
    for (int l = p.L - 1; l >= 0; l--) {
        const real *qr = (const real *)p.q[l] + b * p.q_stride[l][0] + h * p.q_stride[l][1] + (i >> l) * p.q_stride[l][2];
        const real *kr = (const real *)p.k[l] + b * p.k_stride[l][0] + kv_head(p, h) * p.k_stride[l][1] +
                         (j >> l) * p.k_stride[l][2];
        const real gl = dot(qr, kr, p.D);
        if (g) g[l] = gl;
        const real wl = scale * weight<real>(p, h, l);
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
                    const real wl = scale * weight<real>(p, h, l);
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
    const real scale = (real)p.scale;
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
                    const real wl = scale * weight<real>(p, h, l);
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
            e = p->dtype == HKT_FLOAT64 ? backward_launch<double>(a, &what) : backward_launch<float>(a, &what);
    }
    leave_device(prev);
    return report(e, what, err, errlen);
}
