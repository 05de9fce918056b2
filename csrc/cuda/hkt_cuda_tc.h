/*
 * The bfloat16 CUDA kernels on tensor cores (CUDA C++; included by
 * hkt_attention_cuda.cu only): tc_forward_kernel and tc_backward_kernel (dq,
 * dk and dv), FlashAttention-2 with HKT's levels, as the comment below says.
 */
#ifndef HKT_CUDA_TC_H
#define HKT_CUDA_TC_H

#include "hkt_cuda_common.h"

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
 * tests/kernels/test_cuda.py emulates the instruction from that description.
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

/* One step of the forward's online softmax for a lane's two rows (r_lo and
 * r_lo + 8), each row's statistics shared by the 4 lanes t of its g: the new
 * running maximum m, the tile's scores s turned into exp(s - m), the running
 * sum lsum and the accumulator o rescaled to the new maximum. */
template <typename C>
__device__ __forceinline__ void tc_online_softmax(float (&s)[TC_BN / 8][4], float (&o)[C::NV][4], float (&m)[2],
                                                  float (&lsum)[2]) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
        for (int x = 0; x < 4; x++) mx[x >> 1] = max_or_nan(mx[x >> 1], s[n][x]);
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
            /* 4. online softmax: the tile's probabilities in s, o rescaled */
            tc_online_softmax<C>(s, o, m, lsum);
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

/* The backward's steps, each a device function of tc_backward_kernel below
 * (forced inline: one kernel's registers, as when they were written in it).
 * r_lo is the lane's first row in the block (its rows: r_lo and r_lo + 8),
 * g = lane / 4, t = lane % 4 as in the fragments above. */

/* At a block's start: its coarse rows (q_l of h, or k_l of the kv head), its
 * coarse gradient rows zeroed, and (dq) its queries' lse and delta =
 * rowsum(dO * out) in double, into the scratch too for the dk kernel. */
template <typename C>
__device__ __forceinline__ void tc_bwd_block(tc_backward_smem<C> &sm, const cuda_args &a, int64_t b, int64_t hx,
                                             int64_t bh, int64_t r0, int64_t nrows) {
    const hkt_params &p = a.p;
    const int64_t T = p.T;
    const int Dv = (int)p.Dv;
    if (C::DKV) tc_load_block(sm.sc, p, p.k, p.k_stride, b, hx, r0, nrows);
    else tc_load_block(sm.sc, p, p.q, p.q_stride, b, hx, r0, nrows);
    for (int x = threadIdx.x; x < tc_qoff(HKT_TC_LMAX) * C::KS * 16; x += TC_THREADS)
        sm.acc[x / (C::KS * 16)][x % (C::KS * 16)] = 0.f;
    if (!C::DKV) {
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
            if (i < T) ((float *)a.delta)[bh * T + i] = (float)acc;
        }
    }
}

/* 1. the tile's columns of every level, its value rows (v, or dO), and
 * (dk/dv) its queries' lse and delta */
template <typename C>
__device__ __forceinline__ void tc_bwd_tile(tc_backward_smem<C> &sm, const cuda_args &a, int64_t b, int64_t h,
                                            int64_t hk, int64_t c0, int64_t ncols) {
    const hkt_params &p = a.p;
    const int Dv = (int)p.Dv;
    if (C::DKV) {
        tc_load_tile(sm.sc, p, p.q, p.q_stride, b, h, c0, ncols);
        tc_load_rows<C::VROW>(sm.cv, TC_BN, p.dout, p.dout_stride, b, h, c0,
                              ncols - c0 < TC_BN ? ncols - c0 : TC_BN, Dv);
        for (int c = threadIdx.x; c < TC_BN; c += TC_THREADS) {
            const int64_t i = c0 + c, at = (b * p.H + h) * p.T + i;
            sm.colstat[0][c] = i < p.T ? ((const float *)p.lse)[at] : 0.f;
            if (!C::DV) sm.colstat[1][c] = i < p.T ? ((const float *)a.delta)[at] : 0.f; /* only dS needs delta */
        }
    } else {
        tc_load_tile(sm.sc, p, p.k, p.k_stride, b, hk, c0, ncols);
        tc_load_rows<C::VROW>(sm.cv, TC_BN, p.v, p.v_stride, b, hk, c0,
                              ncols - c0 < TC_BN ? ncols - c0 : TC_BN, Dv);
    }
}

/* 4. dP: the rows' values against the tile's value rows */
template <typename C>
__device__ __forceinline__ void tc_bwd_dp(float (&dp)[TC_BN / 8][4], const tc_backward_smem<C> &sm,
                                          const tc_rowpair &vrows, int nvs, int g, int t) {
#pragma unroll
    for (int n = 0; n < TC_BN / 8; n++) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < C::NV / 2; kk++) {
        if (C::GRAD && kk < nvs) {
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
}

/* 5. P (into s) and dS (into dp); a hidden entry's are exactly 0; (dq) level
 * 0's share of dw, from its Gram entries g0 */
template <typename C>
__device__ __forceinline__ void tc_bwd_p_ds(float (&s)[TC_BN / 8][4], float (&dp)[TC_BN / 8][4],
                                            const float (&g0)[C::DKV ? 1 : TC_BN / 8][4],
                                            const tc_backward_smem<C> &sm, float &dw0, int r_lo, int t) {
    float rl[2] = {0.f, 0.f}, rd[2] = {0.f, 0.f};
    if (!C::DKV)
        for (int hr = 0; hr < 2; hr++) {
            rl[hr] = sm.rowstat[0][r_lo + 8 * hr];
            rd[hr] = sm.rowstat[1][r_lo + 8 * hr];
        }
#pragma unroll
    for (int n = 0; n < TC_BN / 8; n++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int cc = 8 * n + 2 * t + (x & 1);
            const float lse = C::DKV ? sm.colstat[0][cc] : rl[x >> 1];
            const float del = C::DV ? 0.f : C::DKV ? sm.colstat[1][cc] : rd[x >> 1];
            const bool hidden = s[n][x] == -INFINITY;
            const float pv = hidden ? 0.f : dev_exp(s[n][x] - lse);
            const float ds = hidden || !C::GRAD ? 0.f : pv * (dp[n][x] - del);
            if (!C::DKV) dw0 += hidden ? 0.f : g0[C::DKV ? 0 : n][x] * ds;
            s[n][x] = pv;
            dp[n][x] = ds;
        }
}

/* 6. dV += P dO (the dv kernel), or the level-0 gradient += (scale w_0 dS) x
 * the tile's level-0 rows, 16 columns at a time */
template <typename C>
__device__ __forceinline__ void tc_bwd_level0(float (&acc0)[C::ND][4], float (&accv)[C::DV ? C::NV : 1][4],
                                              const float (&s)[TC_BN / 8][4], const float (&dp)[TC_BN / 8][4],
                                              const tc_backward_smem<C> &sm, float w0, int D, int Dv, int g, int t) {
    if (C::DV) {
#pragma unroll
        for (int ks = 0; ks < TC_BN / 16; ks++) {
            const int k0 = 16 * ks + 2 * t;
            uint32_t pf[4];
            tc_c_to_a(pf, s, ks, 1.f);
#pragma unroll
            for (int n = 0; n < (C::DV ? C::NV : 1); n++) {
                if (8 * n < Dv) {
                    const uint16_t *col = &sm.cv[k0][8 * n + g];
                    const uint32_t bf[2] = {tc_ld_col(col, C::VROW), tc_ld_col(col + 8 * C::VROW, C::VROW)};
                    tc_mma(accv[n], pf, bf);
                }
            }
        }
    }
#pragma unroll
    for (int ks = 0; ks < (C::GRAD ? TC_BN / 16 : 0); ks++) {
        const int k0 = 16 * ks + 2 * t;
        uint32_t df[4];
        tc_c_to_a(df, dp, ks, w0);
#pragma unroll
        for (int n = 0; n < C::ND; n++) {
            if (8 * n < D) {
                const uint16_t *col = &sm.sc.ct[k0][8 * n + g];
                const uint32_t bf[2] = {tc_ld_col(col, C::ROW), tc_ld_col(col + 8 * C::ROW, C::ROW)};
                tc_mma(acc0[n], df, bf);
            }
        }
    }
}

/* 7. the coarse levels: dS summed over each 2^l x 2^l block by a butterfly
 * over the lanes that hold it (rows: lane bits 2-4, columns: bits 0-1), the
 * same bits in every lane of a block; one lane writes scale w_l times it, and
 * (dq) adds G_l times it to dw; then the warp's coarse gradient rows +=
 * (scale w_l dG_l) x the tile's level-l rows, lane d owning columns d and
 * d + 32 */
template <typename C>
__device__ __forceinline__ void tc_bwd_coarse(tc_backward_smem<C> &sm, const float (&dp)[TC_BN / 8][4],
                                              const float *wl, float *dwl, int L, int D, int64_t c0, int64_t ncols,
                                              int r_lo, int warp, int lane, int g, int t) {
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
                    if (!C::DKV && v[n][hr] != 0.f) dwl[l] += sm.sc.gram[at] * v[n][hr];
                }
            }
    }
    __syncwarp();
    for (int l = 1; l < L; l++) {
        const int a_lo = (warp * 16) >> l, a_hi = (warp * 16 + 16) >> l;
        const int64_t cl = (ncols + ((int64_t)1 << l) - 1) >> l, cb = c0 >> l;
        const int nc = (int)(cl - cb < (TC_BN >> l) ? cl - cb : (TC_BN >> l));
        for (int ar = a_lo; ar < a_hi; ar++)
            for (int d = lane; d < D; d += 32) {
                float acc = sm.acc[tc_qoff(l) + ar][d];
                for (int c = 0; c < nc; c++)
                    acc += sm.dgs[tc_goff(l) + ar * tc_krows(l) + c] * tc_f32(sm.sc.ct[tc_koff(l) + c][d]);
                sm.acc[tc_qoff(l) + ar][d] = acc;
            }
    }
    __syncwarp();
}

/* At a block's end: its gradient rows, level 0 (and dv) from the registers,
 * the coarse ones this warp owns from shared memory; (dq) the block's dw
 * partial, summed over lanes, then warps, in a fixed order */
template <typename C>
__device__ __forceinline__ void tc_bwd_write(tc_backward_smem<C> &sm, const cuda_args &a,
                                             const float (&acc0)[C::ND][4],
                                             const float (&accv)[C::DV ? C::NV : 1][4], float *dwl, int64_t b,
                                             int64_t hx, int64_t task, int64_t row, int64_t r0, int64_t nrows,
                                             int warp, int lane, int t) {
    const hkt_params &p = a.p;
    const int L = p.L, D = (int)p.D, Dv = (int)p.Dv;
    {
        const int64_t *gs = C::DKV ? p.dk_stride[0] : p.dq_stride[0];
        float *gb = (float *)(C::DKV ? p.dk[0] : p.dq[0]) + b * gs[0] + hx * gs[1];
        float *vb = (float *)p.dv + b * p.dv_stride[0] + hx * p.dv_stride[1];
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int64_t r = row + 8 * hr;
            if (r >= nrows) continue;
#pragma unroll
            for (int n = 0; n < (C::GRAD ? C::ND : 0); n++)
                for (int u = 0; u < 2; u++)
                    if (8 * n + 2 * t + u < D) gb[r * gs[2] + 8 * n + 2 * t + u] = acc0[n][2 * hr + u];
            if (C::DV) {
#pragma unroll
                for (int n = 0; n < (C::DV ? C::NV : 1); n++)
                    for (int u = 0; u < 2; u++)
                        if (8 * n + 2 * t + u < Dv) vb[r * p.dv_stride[2] + 8 * n + 2 * t + u] = accv[n][2 * hr + u];
            }
        }
    }
    for (int l = 1; l < (C::GRAD ? L : 1); l++) {
        const int64_t *gs = C::DKV ? p.dk_stride[l] : p.dq_stride[l];
        float *gb = (float *)(C::DKV ? p.dk[l] : p.dq[l]) + b * gs[0] + hx * gs[1];
        const int64_t rl = (nrows + ((int64_t)1 << l) - 1) >> l;
        for (int ar = (warp * 16) >> l; ar < (warp * 16 + 16) >> l; ar++) {
            const int64_t r = (r0 >> l) + ar;
            if (r >= rl) continue;
            for (int d = lane; d < D; d += 32) gb[r * gs[2] + d] = sm.acc[tc_qoff(l) + ar][d];
        }
    }
    if (!C::DKV) {
#pragma unroll
        for (int l = 0; l < HKT_TC_LMAX; l++)
            for (int o = 16; o > 0; o >>= 1) dwl[l] += __shfl_xor_sync(FULL, dwl[l], o);
        if (lane == 0)
            for (int l = 0; l < HKT_TC_LMAX; l++) sm.dwp[warp][l] = dwl[l];
        __syncthreads();
        if (threadIdx.x < (unsigned)L) {
            float acc = 0.f;
            for (int w = 0; w < TC_WARPS; w++) acc += sm.dwp[w][threadIdx.x];
            ((float *)a.dw_part)[task * L + threadIdx.x] = (float)p.scale * acc;
        }
    }
}

/* The backward, C::DKV false: dq[l], delta and the dw partials per block of 64
 * queries of (b, h); C::DKV: dv (C::DV) or dk[l] (C::GRAD) per block of 64
 * keys of (b, kv head), its query heads in order.  D and Dv multiples of 16 up
 * to 64.  Per block: tc_bwd_block; per column tile, steps 1 to 7; then
 * tc_bwd_write. */
template <typename C>
__global__ void __launch_bounds__(TC_THREADS, 2) tc_backward_kernel(const __grid_constant__ cuda_args a) {
    constexpr bool DKV = C::DKV, DV = C::DV;
    const hkt_params &p = a.p;
    __shared__ tc_backward_smem<C> sm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int L = p.L, D = (int)p.D, Dv = (int)p.Dv, nks = D / 16, nvs = Dv / 16;
    const int64_t T = p.T, S = p.S, group = p.H / p.H_kv;
    const int64_t nrows = DKV ? S : T, ncols = DKV ? T : S;
    const int64_t nblk = (nrows + TC_BM - 1) / TC_BM, heads = DKV ? p.H_kv : p.H;
    const int r_lo = warp * 16 + g;
    float wl[HKT_TC_LMAX];
    for (int64_t task = blockIdx.x; task < p.B * heads * nblk; task += gridDim.x) {
        const int64_t bh = task / nblk, blk = task % nblk, r0 = blk * TC_BM, b = bh / heads, hx = bh % heads;
        const int64_t row = r0 + r_lo; /* this lane's rows: row, row + 8 */
        __syncthreads(); /* the previous task's reads of shared memory are done */
        tc_bwd_block(sm, a, b, hx, bh, r0, nrows);
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
            tc_bwd_tile(sm, a, b, h, hk, c0, ncols); /* 1. */
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
            float dp[TC_BN / 8][4];
            tc_bwd_dp(dp, sm, vrows, nvs, g, t);               /* 4. */
            tc_bwd_p_ds(s, dp, g0, sm, dwl[0], r_lo, t);       /* 5. */
            tc_bwd_level0(acc0, accv, s, dp, sm, wl[0], D, Dv, g, t); /* 6. */
            if (C::GRAD && L > 1) tc_bwd_coarse(sm, dp, wl, dwl, L, D, c0, ncols, r_lo, warp, lane, g, t); /* 7. */
        }
        tc_bwd_write(sm, a, acc0, accv, dwl, b, hx, task, row, r0, nrows, warp, lane, t);
    }
}
#endif
