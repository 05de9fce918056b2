/*
 * HKT attention on the CPU: the products and the tiles for one real type -- the
 * first layer of the kernels' body: the GEMM micro-tiles and their fused
 * stores, the causal diagonal tile, transposes, the lane-wise row sums and
 * exps, the level spans of a tile, row copies.
 *
 * Not a header of declarations: the kernels' body, included at the top of
 * hkt_attention_body.h, which hkt_cpu_f32.c and hkt_cpu_f64.c (and their AVX2
 * and AVX-512 builds) include once each, defining `real` (float, double),
 * REAL_IS_FLOAT and REAL_LOG first.
 * Every function is static, so both translation units use the same plain
 * names.  The include order is the layering: this file, hkt_attention_body.h
 * (scores and the forward), in the float32 build hkt_bf16_body.h (the
 * bfloat16 products and forward), then hkt_backward_body.h (the backward),
 * each using only what comes before it (hkt_cpu.h, hkt.h).
 */
#include "hkt_cpu.h"
#include "hkt_dropout.h"
#include "hkt_real.h"

#include <math.h>
#include <string.h>


/* ---- GEMM: C (M, N) = [C +] alpha * op(A) @ B, row-major with leading dimensions;
 * op(A) = A (M, K) or, with trans_a, A^T where A is stored (K, M).  Register-blocked
 * R x (NV vectors) micro-tiles: 4 x 4 keeps 16 accumulators in zmm registers, and
 * 4 loads plus 4 broadcasts feed 16 FMAs.
 *
 * Each entry is stored as (C or -0) + alpha * sum, the product's one use, so
 * the builds with FMA round it once in every tile and the portable build twice
 * in every tile.  (With alpha * sum computed first and C added where
 * accumulating, GCC contracted it in some tiles and not in others, by how it
 * specialised each one.) */
/* What the fused products (gemm_fused below) read and write besides A, B and C,
 * from the micro-tile's first row and column on. */
typedef struct {
    const real *a;    /* E's parent row (EPI_UP), or P's rows (EPI_DS); NULL: none */
    int64_t lda;
    const real *rowv; /* EPI_DS: delta, one per row */
    real *c2;         /* EPI_GRAM_SCORES: the scores, C being the Gram block */
    int64_t ldc2;
    real alpha2;      /* EPI_GRAM_SCORES: the scores' factor */
} tile_extra;
#define DEFINE_TILE_OF(NAME, R, NV, AIDX, VT, VLEN) DEFINE_TILE_HOOKS(NAME, R, NV, AIDX, VT, VLEN, C_OR_ZERO, AS_IS)
/* the entry's first term: C where accumulating, else -0 */
#define C_OR_ZERO(o, p, r, v, VT, VLEN)                                                        \
    if (accumulate) memcpy(&o, p, sizeof(VT))
/* ... or the coarser level's folded scores E, upsampled: x->a points at the
 * parent row of the tile's first row, which is even */
#define UP_ROW(o, p, r, v, VT, VLEN)                                                           \
    o = vdup_half(vload(x->a + (r >> 1) * x->lda + (v & ~1) * (VLEN) / 2), v & 1)
/* what becomes of the entry o before it is stored: nothing, */
#define AS_IS(o, r, v, VT, VLEN)
/* dS = P (dP - delta), o being dP (tile_dscores' formula), */
#define TIMES_P_LESS_DELTA(o, r, v, VT, VLEN)                                                  \
    o = vload(x->a + r * x->lda + v * (VLEN)) * (o - x->rowv[r])
/* or o, a Gram block's entry, stored, and the scores' entry, E's entry (or
 * -0: ALSO_SCORES0) + alpha2 * sum, stored in x->c2, as the fold makes it of
 * o.  Two hooks, not one with a test: GCC multiplied first where the first
 * term came from either side of a branch, and rounded twice. */
#define ALSO_SCORES_OF(o, r, v, VT, VLEN, FIRST)                                               \
    do {                                                                                        \
        VT e = -(VT){0};                                                                        \
        FIRST(e, 0, r, v, VT, VLEN);                                                            \
        e = VT##_madd(x->alpha2 - (VT){0}, c[r][v], e);                                         \
        memcpy(x->c2 + r * x->ldc2 + v * (VLEN), &e, sizeof(VT));                               \
    } while (0)
#define MINUS_ZERO(o, p, r, v, VT, VLEN)
#define ALSO_SCORES(o, r, v, VT, VLEN) ALSO_SCORES_OF(o, r, v, VT, VLEN, UP_ROW)
#define ALSO_SCORES0(o, r, v, VT, VLEN) ALSO_SCORES_OF(o, r, v, VT, VLEN, MINUS_ZERO)
#define DEFINE_TILE_HOOKS(NAME, R, NV, AIDX, VT, VLEN, INIT, FINISH)                           \
    static inline __attribute__((always_inline)) void NAME(                                \
        int64_t K, real alpha, const real *restrict A, int64_t lda, const real *restrict B,    \
        int64_t ldb, real *restrict C, int64_t ldc, int accumulate, const tile_extra *x) {     \
        (void)accumulate, (void)x;                                                              \
        VT c[R][NV];                                                                            \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) c[r][v] = (VT){0};            \
        for (int64_t kk = 0; kk < K; kk++) {                                                    \
            VT b[NV];                                                                           \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++)                               \
                memcpy(&b[v], B + kk * ldb + v * (VLEN), sizeof(VT));                           \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                              \
                const real a = A[AIDX];                                                         \
                _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++)                           \
                    c[r][v] = VT##_madd(a - (VT){0}, b[v], c[r][v]);                                    \
            }                                                                                   \
        }                                                                                       \
        /* alpha read back from memory after the loop: held through it as a   \
         * broadcast vector, it took the 16th register AVX2's 6 x 2 tile needs, \
         * and GCC kept one B vector on the stack instead, which slowed the    \
         * transposed products */                                              \
        real al = alpha;                                                                        \
        __asm__("" : "+m"(al));                                                                 \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) {                             \
                real *p = C + r * ldc + v * (VLEN);                                             \
                VT o = -(VT){0}; /* -0 + x is x, +0 and -0 included */                          \
                INIT(o, p, r, v, VT, VLEN);                                                     \
                o = VT##_madd(al - (VT){0}, c[r][v], o);                                        \
                FINISH(o, r, v, VT, VLEN);                                                      \
                memcpy(p, &o, sizeof(VT));                                                      \
            }                                                                                   \
    }
#define DEFINE_TILE(NAME, R, NV, AIDX) DEFINE_TILE_OF(NAME, R, NV, AIDX, vec, VL)

/* Narrow columns (coarse levels of short sequences): half- and quarter-width
 * vectors (vech, vecq: hkt_real.h), so only what is left below a quarter
 * vector runs scalar. */
DEFINE_TILE_OF(tile_8xh, 8, 1, r * lda + kk, vech, VL / 2)
DEFINE_TILE_OF(tile_4xh, 4, 1, r * lda + kk, vech, VL / 2)
DEFINE_TILE_OF(tile_1xh, 1, 1, r * lda + kk, vech, VL / 2)
DEFINE_TILE_OF(tile_t8xh, 8, 1, kk * lda + r, vech, VL / 2)
DEFINE_TILE_OF(tile_t4xh, 4, 1, kk * lda + r, vech, VL / 2)
DEFINE_TILE_OF(tile_t1xh, 1, 1, kk * lda + r, vech, VL / 2)
#if HKT_QUARTER_TILES
DEFINE_TILE_OF(tile_8xq, 8, 1, r * lda + kk, vecq, VL / 4)
DEFINE_TILE_OF(tile_4xq, 4, 1, r * lda + kk, vecq, VL / 4)
DEFINE_TILE_OF(tile_1xq, 1, 1, r * lda + kk, vecq, VL / 4)
DEFINE_TILE_OF(tile_t8xq, 8, 1, kk * lda + r, vecq, VL / 4)
DEFINE_TILE_OF(tile_t4xq, 4, 1, kk * lda + r, vecq, VL / 4)
DEFINE_TILE_OF(tile_t1xq, 1, 1, kk * lda + r, vecq, VL / 4)
#endif

/* narrower column blocks (coarse levels, small Dv) take more rows, so every
 * block still keeps 16 (8) accumulators busy.  With AVX2's 16 vector registers
 * 16 accumulators would spill: 6 x 2 blocks keep 12 and leave room for the two
 * B vectors and the broadcast. */
#if HKT_VEC_BYTES == 64
#define WIDE_R 4
#define WIDE_NV 4
#define MID_R 8
#else
#define WIDE_R 6
#define WIDE_NV 2
#define MID_R 6
#endif
DEFINE_TILE(tile_wide, WIDE_R, WIDE_NV, r * lda + kk)
DEFINE_TILE(tile_4xwide, 4, WIDE_NV, r * lda + kk)
DEFINE_TILE(tile_1xwide, 1, WIDE_NV, r * lda + kk)
DEFINE_TILE(tile_mid, MID_R, 2, r * lda + kk)
DEFINE_TILE(tile_4x2, 4, 2, r * lda + kk)
DEFINE_TILE(tile_1x2, 1, 2, r * lda + kk)
DEFINE_TILE(tile_8x1, 8, 1, r * lda + kk)
DEFINE_TILE(tile_4x1, 4, 1, r * lda + kk)
DEFINE_TILE(tile_1x1, 1, 1, r * lda + kk)
DEFINE_TILE(tile_twide, WIDE_R, WIDE_NV, kk * lda + r)
DEFINE_TILE(tile_t4xwide, 4, WIDE_NV, kk * lda + r)
DEFINE_TILE(tile_t1xwide, 1, WIDE_NV, kk * lda + r)
DEFINE_TILE(tile_tmid, MID_R, 2, kk * lda + r)
DEFINE_TILE(tile_t4x2, 4, 2, kk * lda + r)
DEFINE_TILE(tile_t1x2, 1, 2, kk * lda + r)
DEFINE_TILE(tile_t8x1, 8, 1, kk * lda + r)
DEFINE_TILE(tile_t4x1, 4, 1, kk * lda + r)
DEFINE_TILE(tile_t1x1, 1, 1, kk * lda + r)

/* How many of a gemm's M rows go in R-row blocks; the rest go in 4-row blocks,
 * then single rows, whose few accumulators wait on the FMA's latency (2 chains
 * of a 1 x 2 tile: a quarter of the core's rate).  With AVX2's 6-row blocks a
 * 64-row tile left 4 such rows, 6% of the work at a quarter of the rate.
 * Where R is not a multiple of 4, 2 or 3 rows left over are taken with
 * the block before them as 8 or 9 rows.  Each entry is still one sum over kk in
 * order: the same bits whatever the blocks. */
static inline int64_t block_rows(int64_t M, int R) {
    const int64_t tail = M % R;
    return R % 4 && tail >= 2 && tail <= 3 && M >= R + tail ? M - R - tail : M - tail;
}

static void gemm(int trans_a, int64_t M, int64_t N, int64_t K, real alpha, const real *A,
                 int64_t lda, const real *B, int64_t ldb, real *C, int64_t ldc, int accumulate) {
    /* row i of op(A) starts at A + i * as, and op(A)[i][kk] = A[i * as + kk * ks] */
    const int64_t as = trans_a ? 1 : lda, ks = trans_a ? lda : 1;
    int64_t j = 0;
#define HKT_TILES(R, NV, TR, T4, T1, TTR, TT4, TT1)                                                      \
    for (; j + NV * VL <= N; j += NV * VL) {                                                             \
        int64_t i = 0;                                                                                   \
        const int64_t rows_main = block_rows(M, R);                                                      \
        if (trans_a) {                                                                                   \
            for (; i < rows_main; i += R) TTR(K, alpha, A + i, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate, NULL); \
            for (; i + 4 <= M; i += 4) TT4(K, alpha, A + i, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate, NULL); \
            for (; i < M; i++) TT1(K, alpha, A + i, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate, NULL);       \
        } else {                                                                                         \
            for (; i < rows_main; i += R) TR(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate, NULL); \
            for (; i + 4 <= M; i += 4) T4(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate, NULL); \
            for (; i < M; i++) T1(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate, NULL);       \
        }                                                                                                \
    }
    HKT_TILES(WIDE_R, WIDE_NV, tile_wide, tile_4xwide, tile_1xwide, tile_twide, tile_t4xwide, tile_t1xwide)
    HKT_TILES(MID_R, 2, tile_mid, tile_4x2, tile_1x2, tile_tmid, tile_t4x2, tile_t1x2)
    HKT_TILES(8, 1, tile_8x1, tile_4x1, tile_1x1, tile_t8x1, tile_t4x1, tile_t1x1)
#undef VL
#define VL (VL_FULL / 2)
    HKT_TILES(8, 1, tile_8xh, tile_4xh, tile_1xh, tile_t8xh, tile_t4xh, tile_t1xh)
#if HKT_QUARTER_TILES
#undef VL
#define VL (VL_FULL / 4)
    HKT_TILES(8, 1, tile_8xq, tile_4xq, tile_1xq, tile_t8xq, tile_t4xq, tile_t1xq)
#endif
#undef VL
#define VL VL_FULL
#undef HKT_TILES
    if (j < N) {
        for (int64_t i = 0; i < M; i++) {
            real *crow = C + i * ldc;
            for (int64_t n = j; n < N; n++) {
                real acc = 0; /* as the tiles round it (madd) */
                for (int64_t kk = 0; kk < K; kk++) acc = madd(A[i * as + kk * ks], B[kk * ldb + n], acc);
                crow[n] = madd(alpha, acc, accumulate ? crow[n] : -(real)0);
            }
        }
    }
}

/* Products whose store does the pass that would follow them over the tile
 * (gemm_fused), in wide tiles only: N a multiple of WIDE_NV vectors, A
 * row-major.  Each entry gets the operations, in the order, the pass gives it,
 * so the same bits, without storing the product and reading it back.
 *
 * EPI_UP, the forward's level-0 scores with the coarser levels' fold: C (M, N)
 * = up2(E) + alpha * A @ B, E = x.a the folded scores of level 1 (row length
 * x.lda; up2 repeats each of its rows and columns twice): fma(alpha, sum, E's
 * entry), as fold_row makes it of the Gram block's entry: the level-0 scores
 * are stored once, not stored and read back by the fold.
 *
 * EPI_GRAM_SCORES, the backward's level-0 scores, whose dw reads the Gram
 * block too: C = A @ B (alpha 1), and x.c2 = up2(E) + x.alpha2 * A @ B;
 * EPI_GRAM_SCORES0 the same with one level, x.c2 = x.alpha2 * A @ B.
 *
 * EPI_DS, the backward's dS: C = P (alpha A @ B - delta), P = x.a (row length
 * x.lda), delta = x.rowv, one per row: A @ B being dP = dO V^T. */
enum { EPI_UP, EPI_GRAM_SCORES, EPI_GRAM_SCORES0, EPI_DS };
/* the three row heights gemm_fused takes, wide, 4 and 1, of one kind */
#define DEFINE_WIDE_HOOKS(NAME, INIT, FINISH)                                                   \
    DEFINE_TILE_HOOKS(tile_wide_##NAME, WIDE_R, WIDE_NV, r * lda + kk, vec, VL, INIT, FINISH)   \
    DEFINE_TILE_HOOKS(tile_4xwide_##NAME, 4, WIDE_NV, r * lda + kk, vec, VL, INIT, FINISH)      \
    DEFINE_TILE_HOOKS(tile_1xwide_##NAME, 1, WIDE_NV, r * lda + kk, vec, VL, INIT, FINISH)
DEFINE_WIDE_HOOKS(up, UP_ROW, AS_IS)
DEFINE_WIDE_HOOKS(gs, C_OR_ZERO, ALSO_SCORES)
DEFINE_WIDE_HOOKS(gs0, C_OR_ZERO, ALSO_SCORES0)
DEFINE_WIDE_HOOKS(ds, C_OR_ZERO, TIMES_P_LESS_DELTA)
static inline int gemm_fused_takes(int64_t N) { return N % (WIDE_NV * VL) == 0; }
/* x as the micro-tile at row i, column j sees it: up2's E from row i's parent */
static inline tile_extra extra_at(const tile_extra *x, int64_t i, int64_t j, int up) {
    tile_extra y = *x;
    if (y.a) y.a += up ? (i >> 1) * y.lda + j / 2 : i * y.lda + j;
    if (y.rowv) y.rowv += i;
    if (y.c2) y.c2 += i * y.ldc2 + j;
    return y;
}
static void gemm_fused(int kind, int64_t M, int64_t N, int64_t K, real alpha, const real *A, int64_t lda,
                       const real *B, int64_t ldb, real *C, int64_t ldc, const tile_extra *x) {
    /* every block of rows but a last single one starts at an even row, the
     * first of a pair with one parent (WIDE_R and 4 are even) */
    const int64_t rows_main = block_rows(M, WIDE_R);
    const int up = kind != EPI_DS;
#define HKT_FUSED(NAME)                                                                              \
    for (int64_t j = 0; j < N; j += WIDE_NV * VL) {                                                         \
        int64_t i = 0;                                                                                      \
        for (; i < rows_main; i += WIDE_R) {                                                                \
            const tile_extra y = extra_at(x, i, j, up);                                                     \
            tile_wide_##NAME(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, 0, &y);          \
        }                                                                                                   \
        for (; i + 4 <= M; i += 4) {                                                                        \
            const tile_extra y = extra_at(x, i, j, up);                                                     \
            tile_4xwide_##NAME(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, 0, &y);        \
        }                                                                                                   \
        for (; i < M; i++) {                                                                                \
            const tile_extra y = extra_at(x, i, j, up);                                                     \
            tile_1xwide_##NAME(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, 0, &y);        \
        }                                                                                                   \
    }
    if (kind == EPI_UP)
        HKT_FUSED(up)
    else if (kind == EPI_GRAM_SCORES)
        HKT_FUSED(gs)
    else if (kind == EPI_GRAM_SCORES0)
        HKT_FUSED(gs0)
    else
        HKT_FUSED(ds)
#undef HKT_FUSED
}

/* ---- The causal diagonal tile.  Where a query tile's rows are its key tile's
 * columns (causal, i0 == j0), entry (r, c) is hidden for c > r: nearly half
 * the tile, which the plain products compute anyway (P and dS are
 * exactly 0 there).  gemm_diag takes level 0's products over such a tile in
 * blocks of DIAG rows of C, each over what its rows can see: 37.5% less of
 * the diagonal tiles' product work (at T=1024 a tenth of the causal pairs are
 * diagonal).  Each entry left out is either never read (hidden scores become
 * -inf) or a term 0 * x of a sum that starts at +0, which then never holds -0:
 * dropping such terms before or after the others leaves every sum's bits as
 * they were. */
#define DIAG 16
enum {
    DIAG_SCORES, /* C = scores (M queries, N keys): row block a, keys [0, a + DIAG) only */
    DIAG_ROWS,   /* op(A) = P or dS (M queries, K keys): row block a sums keys [0, a + DIAG) */
    DIAG_KEYS    /* op(A) = A^T, A = P or dS (K queries, M keys): key block a sums queries [a, K) */
};

static inline int diagonal_tile(const hkt_params *p, int64_t i0, int64_t j0) { return p->causal && i0 == j0; }
/* ---- Which (query tile, key tile) pairs hold a visible entry: causality
 * and the sliding-window band (hkt.h, sliding_window W) hide whole tiles,
 * which every loop over pairs skips (the band's work then grows as T * W).
 * A skipped pair's entries are all hidden, so it would add only zeros
 * (P = dS = 0): skipping it changes no bit of any sum. */
static inline int pair_visible(const hkt_params *p, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const int64_t W = p->sliding_window;
    if (p->causal && i1 - 1 < j0) return 0;
    if (W > 0 && (i0 - (j1 - 1) >= W || (!p->causal && j0 - (i1 - 1) >= W))) return 0;
    return 1;
}
/* The first key tile's start (a multiple of BK: key tiles are cached and
 * placed by j0 / BK) that query rows from i0 on may see. */
static inline int64_t first_key_tile(const hkt_params *p, int64_t i0) {
    const int64_t W = p->sliding_window;
    return W > 0 && i0 - W + 1 > 0 ? (i0 - W + 1) / BK * BK : 0;
}
/* The end of the keys that query rows before i1 may see. */
static inline int64_t key_end(const hkt_params *p, int64_t i1) {
    const int64_t W = p->sliding_window;
    int64_t end = p->causal ? i1 : W > 0 ? i1 - 1 + W : p->S; /* W <= 2^60: no overflow */
    return end < p->S ? end : p->S;
}
/* The same from the key side: the first query tile's start (a multiple of
 * BQ) that sees keys from j0 on, and the end of the queries that see keys
 * before j1. */
static inline int64_t first_query_tile(const hkt_params *p, int64_t j0) {
    const int64_t W = p->sliding_window;
    if (p->causal) return j0 / BQ * BQ;
    return W > 0 && j0 - W + 1 > 0 ? (j0 - W + 1) / BQ * BQ : 0;
}
static inline int64_t query_end(const hkt_params *p, int64_t j1) {
    const int64_t W = p->sliding_window;
    return W > 0 && j1 - 1 + W < p->T ? j1 - 1 + W : p->T;
}

/* gemm (transposed for DIAG_KEYS), in blocks where diag is set. */
static void gemm_diag(int diag, int kind, int64_t M, int64_t N, int64_t K, real alpha, const real *A, int64_t lda,
                      const real *B, int64_t ldb, real *C, int64_t ldc, int accumulate) {
    if (!diag) {
        gemm(kind == DIAG_KEYS, M, N, K, alpha, A, lda, B, ldb, C, ldc, accumulate);
        return;
    }
    for (int64_t a = 0; a < M; a += DIAG) {
        const int64_t m = a + DIAG < M ? DIAG : M - a, seen = a + DIAG;
        if (kind == DIAG_SCORES)
            gemm(0, m, seen < N ? seen : N, K, alpha, A + a * lda, lda, B, ldb, C + a * ldc, ldc, accumulate);
        else if (kind == DIAG_ROWS)
            gemm(0, m, N, seen < K ? seen : K, alpha, A + a * lda, lda, B, ldb, C + a * ldc, ldc, accumulate);
        else if (a < K)
            gemm(1, m, N, K - a, alpha, A + a * lda + a, lda, B + a * ldb, ldb, C + a * ldc, ldc, accumulate);
    }
}

/* Zeroes what gemm_diag(DIAG_SCORES) leaves out of an (M, N) block X: the
 * Gram block the fold and dw read, and dS, of which the mask's gradient and the
 * coarse levels' sums read every entry. */
static void zero_unseen(int64_t M, int64_t N, real *X, int64_t ldx) {
    for (int64_t r = 0; r < M; r++) {
        const int64_t seen = (r / DIAG + 1) * DIAG;
        for (int64_t c = seen; c < N; c++) X[r * ldx + c] = 0;
    }
}

/* e[c] = wl g[c] + up[c >> 1] for c < n: a row of the fold, the coarser level's
 * row upsampled in registers (see pairsum on why not through a stored row);
 * madd's rounding, which gemm_fused's EPI_UP gives the same entries */
static inline void fold_row(const real *restrict g, const real *restrict up, real wl, int64_t n, real *restrict e) {
    int64_t c = 0;
    for (; c + 2 * VL <= n; c += 2 * VL) {
        const vec s = vload(up + c / 2);
        vstore(e + c, vec_madd(wl - (vec){0}, vload(g + c), vdup_lo(s)));
        vstore(e + c + VL, vec_madd(wl - (vec){0}, vload(g + c + VL), vdup_hi(s)));
    }
    for (; c < n; c++) e[c] = madd(wl, g[c], up[c >> 1]);
}

/* dst[c] = src[2c] + src[2c + 1] (the last alone if n is odd): a row summed over
 * pairs; with src2, of the row src + src2 (added first, element by element), in
 * one pass: in a profile, the loads of a summed row stored just before were
 * the hottest instructions of the L=3 backward outside its products. */
static inline void pairsum(const real *restrict src, const real *restrict src2, int64_t n, real *restrict dst) {
    int64_t c = 0;
    for (; 2 * c + 2 * VL <= n; c += VL) {
        vec a = vload(src + 2 * c), b = vload(src + 2 * c + VL);
        if (src2) {
            a += vload(src2 + 2 * c);
            b += vload(src2 + 2 * c + VL);
        }
        vstore(dst + c, veven(a, b) + vodd(a, b));
    }
    for (; 2 * c < n; c++) {
        const real x0 = src2 ? src[2 * c] + src2[2 * c] : src[2 * c];
        const real x1 = 2 * c + 1 < n ? (src2 ? src[2 * c + 1] + src2[2 * c + 1] : src[2 * c + 1]) : 0;
        dst[c] = x0 + x1;
    }
}

#if HKT_AVX512_F32 /* the AVX-512 float32 build, whose intrinsics hkt_real.h includes */
/* The 16 x 16 block of 32-bit words in r[0..15] (row i in r[i]) transposed in
 * place: pairs of words, then of 64-bit pairs, then of 128-bit quarters swapped
 * across registers, then the quarters put in order.  (The bfloat16 kernels
 * transpose their pairs of words with it too.) */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4g + m] now holds, in quarter x, row 4x + (g's row group) ... column
     * group m of rows 4x..4x+3 for quarter x of g: swap quarters between g's */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* dst (cols, rows) = transpose of src (rows, cols) with leading dimensions, in
 * 16 x 16 blocks transposed in registers (edges masked).  The key caches and
 * the backward's values are transposed once per key tile and head, which weighs
 * most at short T, where a scalar loop's transposes are a fair part of a call. */
static inline void transpose(int64_t rows, int64_t cols, const real *src, int64_t lds, real *dst, int64_t ldd) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
        const int64_t wc = cols - c0 < 16 ? cols - c0 : 16;
        const __mmask16 m = (__mmask16)(wc == 16 ? 0xFFFF : (1u << wc) - 1);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
            __m512i x[16];
            for (int i = 0; i < 16; i++)
                x[i] = i < nr ? _mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + (r0 + i) * lds + c0))
                              : _mm512_setzero_si512();
            transpose16(x);
            const __mmask16 mr = (__mmask16)(nr == 16 ? 0xFFFF : (1u << nr) - 1);
            for (int64_t j = 0; j < wc; j++)
                _mm512_mask_storeu_ps(dst + (c0 + j) * ldd + r0, mr, _mm512_castsi512_ps(x[j]));
        }
    }
}

/* row_max of n <= 16 rows (w floats each, ld apart) into mx[0, n): each row's
 * lanes first (a NaN never replaces the running max: vmaxps returns its second
 * operand, the max, when either is NaN), then the 16 rows' lanes transposed and
 * reduced together.  The max of a set of non-NaN values is one of them whatever
 * the order (only a tie of -0 and +0 could pick another sign, which no use of
 * the max can see: exp(s - m), m == m', and lse = m + log(sum)), and a row with
 * nothing but -inf and NaN is NaN as in row_max.  One row at a time, each
 * ended in a horizontal reduction whose chain the next row waited behind, a
 * large part of softmax_update's time. */
static inline void rows_max16(const real *x, int64_t ld, int64_t n, int64_t w, real *mx) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const int64_t full = w / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (w - full)) - 1);
    __m512i v[16];
    for (int i = 0; i < 16; i++) {
        __m512 a = ninf;
        if (i < n) {
            const real *row = x + i * ld;
            for (int64_t c = 0; c < full; c += 16) a = _mm512_max_ps(_mm512_loadu_ps(row + c), a);
            if (tail) a = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, tail, row + full), a);
        }
        v[i] = _mm512_castps_si512(a);
    }
    transpose16(v);
    __m512 m = _mm512_castsi512_ps(v[0]);
    for (int j = 1; j < 16; j++) m = _mm512_max_ps(_mm512_castsi512_ps(v[j]), m);
    real out[16];
    _mm512_storeu_ps(out, m);
    /* a row with no finite max: row_max tells -inf from NaN */
    for (int64_t i = 0; i < n; i++) mx[i] = out[i] == -INFINITY ? row_max(x + i * ld, w) : out[i];
}
#else
/* dst (cols, rows) = transpose of src (rows, cols) with leading dimensions,
 * element by element */
static inline void transpose_scalar(int64_t rows, int64_t cols, const real *src, int64_t lds, real *dst,
                                    int64_t ldd) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}
#if HKT_AVX2_F32 /* the AVX2 float32 build, whose intrinsics hkt_real.h includes */
/* The 8 x 8 block of floats in r[0..7] (row i in r[i]) transposed in place:
 * pairs of floats interleaved, then pairs of pairs, then the 128-bit halves
 * swapped across registers. */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* transpose_scalar's result, whole 8 x 8 blocks through registers and the
 * ragged edges element by element: as the AVX-512 build's 16 x 16 blocks, for
 * the key caches and the backward's values, which weigh most at short T. */
static inline void transpose(int64_t rows, int64_t cols, const real *src, int64_t lds, real *dst, int64_t ldd) {
    const int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
    for (int64_t c0 = 0; c0 < c8; c0 += 8)
        for (int64_t r0 = 0; r0 < r8; r0 += 8) {
            __m256 x[8];
            for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_ps(src + (r0 + i) * lds + c0);
            transpose8(x);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + (c0 + j) * ldd + r0, x[j]);
        }
    if (r8 < rows) transpose_scalar(rows - r8, c8, src + r8 * lds, lds, dst + r8, ldd);
    if (c8 < cols) transpose_scalar(rows, cols - c8, src + c8, lds, dst + c8 * ldd, ldd);
}
#else
#define transpose transpose_scalar
#endif
#endif


/* x[c] = exp(x[c] - m).  With m NaN (a row holding a visible NaN or +inf score)
 * every entry is NaN except hidden ones (-inf), which stay exactly 0: a hidden
 * key contributes nothing, even to a NaN row. */
static inline void exp_shift(real *restrict x, int64_t n, real m) {
    if (m != m) {
        for (int64_t c = 0; c < n; c++) x[c] = x[c] == -INFINITY ? 0 : NAN;
        return;
    }
    int64_t c = 0;
#if HKT_EXPV
    for (; c + VL <= n; c += VL) vstore(x + c, exp_nonpos_vec(vload(x + c) - m));
#endif
    for (; c < n; c++) x[c] = exp_nonpos(x[c] - m);
}


/* x[0..n) added lane-wise into one vector (x[c] to lane c % VL): a row sum
 * kept in lanes, reduced once per row at the end (lanes_total), in an order
 * fixed by the vector width alone: bitwise the same results for any thread
 * count (the AVX2 and AVX-512 builds, of different widths, differ in rounding). */
static inline vec row_lanes(const real *restrict x, int64_t n) {
    vec acc = {0};
    int64_t c = 0;
    for (; c + VL <= n; c += VL) acc += vload(x + c);
    if (c < n) {
        real tail[VL] = {0};
        memcpy(tail, x + c, sizeof(real) * (size_t)(n - c));
        acc += vload(tail);
    }
    return acc;
}

/* acc + x[c] * y[c] lane-wise over c < n (x[c] y[c] to lane c % VL), the tail
 * zero-padded: a dot product kept in lanes, for lanes_total to reduce. */
static inline vec dot_lanes(int64_t n, const real *restrict x, const real *restrict y, vec acc) {
    int64_t c = 0;
    for (; c + VL <= n; c += VL) acc += vload(x + c) * vload(y + c);
    if (c < n) {
        real tx[VL] = {0}, ty[VL] = {0};
        memcpy(tx, x + c, sizeof(real) * (size_t)(n - c));
        memcpy(ty, y + c, sizeof(real) * (size_t)(n - c));
        acc += vload(tx) * vload(ty);
    }
    return acc;
}

static inline real lanes_total(vec acc) {
    real part[VL];
    vstore(part, acc);
    for (int64_t width = VL / 2; width >= 1; width /= 2)
        for (int64_t e = 0; e < width; e++) part[e] += part[e + width];
    return part[0];
}

static inline real weight(const hkt_params *p, int64_t h, int l) {
    return ((const real *)p->w)[h * p->w_stride[0] + l * p->w_stride[1]];
}

/* Level-l rows [r0, r0 + rl) and cols [c0, c0 + cl) that tile [i0,i1) x [j0,j1) touches. */
typedef struct {
    int64_t r0, rl, c0, cl;
} span;

static inline span level_span(int l, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    span s;
    s.r0 = i0 >> l;
    s.rl = ((i1 - 1) >> l) + 1 - s.r0;
    s.c0 = j0 >> l;
    s.cl = ((j1 - 1) >> l) + 1 - s.c0;
    return s;
}

/* rows [0, n) of width d: dst (row stride ldd) = src (row stride lds), in one
 * memcpy where both are dense (a call per row of 32 reals was a fair part of a
 * small call's backward, which copies and zeroes rows per head and level) */
static void copy_rows(int64_t n, int64_t d, const real *src, int64_t lds, real *dst, int64_t ldd) {
    if (n > 0 && lds == d && ldd == d) {
        memcpy(dst, src, sizeof(real) * (size_t)(n * d));
        return;
    }
    for (int64_t r = 0; r < n; r++) memcpy(dst + r * ldd, src + r * lds, sizeof(real) * (size_t)d);
}

/* rows [0, n) of width d, row stride ld, set to zero (one memset where dense) */
static void zero_rows(int64_t n, int64_t d, real *x, int64_t ld) {
    if (n > 0 && ld == d) {
        memset(x, 0, sizeof(real) * (size_t)(n * d));
        return;
    }
    for (int64_t r = 0; r < n; r++) memset(x + r * ld, 0, sizeof(real) * (size_t)d);
}
