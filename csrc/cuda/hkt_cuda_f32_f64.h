/*
 * The float32 and float64 CUDA kernels (CUDA C++; included by
 * hkt_attention_cuda.cu only), written to be plainly right rather than fast:
 * one warp per query row for the forward; delta, dq, dk/dv, dw and dmask
 * kernels for the backward, each gradient row owned by one warp (no atomics).
 * hkt_attention_cuda.cu's opening comment describes each.
 */
#ifndef HKT_CUDA_F32_F64_H
#define HKT_CUDA_F32_F64_H

#include "hkt_cuda_common.h"

/* for (l = FIRST; l != END; l += STEP) { ... } over up to LMAX levels, unrolled
 * wholly where LMAX <= HKT_TC_LMAX, so that the per-level arrays it indexes
 * (dq_kernel's) stay in registers, else not at all (an unroll's argument must
 * be a literal, not a template parameter's expression). */
#define LEVEL_LOOP(LMAX, l, FIRST, END, STEP, ...)                                  \
    if constexpr ((LMAX) <= HKT_TC_LMAX) {                                          \
        _Pragma("unroll") for (int l = (FIRST); l != (END); l += (STEP)) __VA_ARGS__   \
    } else {                                                                         \
        _Pragma("unroll 1") for (int l = (FIRST); l != (END); l += (STEP)) __VA_ARGS__ \
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
 * is stored when g is not null (the backward's dw needs it); levels l < LMAX
 * (p.L at most). */
template <typename real, int LMAX = HKT_MAX_LEVELS>
__device__ __forceinline__ real score_of(const hkt_params &p, int64_t b, int64_t h, int64_t i, int64_t j, real *g) {
    real s = 0;
    LEVEL_LOOP(LMAX, l, LMAX - 1, -1, -1, {
        if (l >= p.L) continue;
        const real *qr = (const real *)p.q[l] + b * p.q_stride[l][0] + h * p.q_stride[l][1] + (i >> l) * p.q_stride[l][2];
        const real *kr = (const real *)p.k[l] + b * p.k_stride[l][0] + kv_head(p, h) * p.k_stride[l][1] +
                         (j >> l) * p.k_stride[l][2];
        const real gl = dot(qr, kr, p.D);
        if (g) g[l] = gl;
        const real wl = hkt_level_factor(p.scale, weight<real>(p, h, l));
        s = l == p.L - 1 ? wl * gl : wl * gl + s;
    })
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
template <typename real, int LMAX = HKT_MAX_LEVELS>
__device__ __forceinline__ real ds_of(const cuda_args &a, int64_t b, int64_t h, int64_t i, int64_t j, real *g,
                                      real *pdrop) {
    const hkt_params &p = a.p;
    const int64_t r = (b * p.H + h) * p.T + i;
    const real s = score_of<real, LMAX>(p, b, h, i, j, g);
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
 * block's dw partial: one warp per (b, h, block of G rows).  Its per-level
 * arrays (the lane's Gram entries g and dw sums) hold LMAX >= L levels: with
 * LMAX = HKT_TC_LMAX (L <= 4, the launch's choice where it can) every loop
 * over them is unrolled and they stay in registers; L up to HKT_MAX_LEVELS
 * takes the other instance, whose arrays live in local memory. */
template <typename real, int LMAX>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) dq_kernel(const __grid_constant__ cuda_args a) {
    const hkt_params &p = a.p;
    __shared__ real dsbuf[WARPS][32];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int L = p.L;
    const int64_t T = p.T, S = p.S, D = p.D;
    const real scale = (real)p.scale;
    real g[LMAX], dwacc[LMAX];
    for (int64_t task = warp_index(); task < p.B * p.H * a.nqb; task += warp_count()) {
        const int64_t bh = task / a.nqb, blk = task % a.nqb, b = bh / p.H, h = bh % p.H;
        const int64_t i_lo = blk * a.G, i_hi = i_lo + a.G < T ? i_lo + a.G : T;
        for (int l = 0; l < L; l++) {
            real *dq = (real *)p.dq[l] + b * p.dq_stride[l][0] + h * p.dq_stride[l][1];
            for (int64_t row = i_lo >> l; row <= (i_hi - 1) >> l; row++)
                for (int64_t d = lane; d < D; d += 32) dq[row * p.dq_stride[l][2] + d] = 0;
        }
        LEVEL_LOOP(LMAX, l, 0, LMAX, 1, { dwacc[l] = 0; })
        for (int64_t i = i_lo; i < i_hi; i++) {
            const int64_t jend = p.causal ? (i + 1 < S ? i + 1 : S) : S;
            for (int64_t j0 = 0; j0 < jend; j0 += 32) {
                const int64_t j = j0 + lane;
                real ds = 0, pdrop;
                if (j < jend) {
                    ds = ds_of<real, LMAX>(a, b, h, i, j, g, &pdrop);
                    if (ds != 0) LEVEL_LOOP(LMAX, l, 0, LMAX, 1, {
                            if (l < L) dwacc[l] += ds * g[l];
                        })
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
        LEVEL_LOOP(LMAX, l, 0, LMAX, 1, {
            if (l >= L) break; /* L is the same in every lane */
            const real x = warp_sum(dwacc[l]);
            if (lane == 0) ((real *)a.dw_part)[task * L + l] = scale * x;
        })
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

#endif
