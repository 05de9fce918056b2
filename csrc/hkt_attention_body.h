/*
 * HKT attention on the CPU: the products, the tiles and the forward for one
 * real type -- the first layer of the kernels' body.
 *
 * Not a header of declarations: the kernels' body, included once by
 * hkt_cpu_f32.c and once by hkt_cpu_f64.c, each defining `real`
 * (float, double), REAL_IS_FLOAT and REAL_LOG first.  Every function is static,
 * so both translation units use the same plain names.  The include order is
 * the layering: this file (products and tiles, then the forward, entry point
 * forward() at its end), then in the float32 build hkt_bf16_body.h (the
 * bfloat16 products and forward), then hkt_backward_body.h (the backward,
 * backward()), each using only what comes before it (hkt_cpu.h, hkt.h).
 *
 * Shapes (see hkt.h): q[l] (B, H, ceil(T/2^l), D), k[l] (B, H_kv, ceil(S/2^l), D),
 * v (B, H_kv, S, Dv), w (H, L) or (L,); out (B, H, T, Dv), lse (B, H, T).
 *
 * Flash-style: queries and keys are walked in BQ x BK tiles; a tile's score is
 * built from each level's small Gram block (computed once per 2^l x 2^l block,
 * the 1 + 1/4 + 1/16 ... cost) and consumed by an online softmax.  Nothing of
 * size T x S is ever stored; the forward keeps one log-sum-exp per row and the
 * backward recomputes the tile scores from it.  Each thread works in its own
 * workspace block, whose regions ws_layout (hkt_cpu.h) names.
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
    o = vshuffle1(vload(x->a + (r >> 1) * x->lda + (v & ~1) * (VLEN) / 2), v & 1 ? dup_hi : dup_lo)
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
        vstore(e + c, vec_madd(wl - (vec){0}, vload(g + c), vshuffle1(s, dup_lo)));
        vstore(e + c + VL, vec_madd(wl - (vec){0}, vload(g + c + VL), vshuffle1(s, dup_hi)));
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
        vstore(dst + c, vshuffle2(a, b, even) + vshuffle2(a, b, odd));
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

/* Transposes key rows [j0, j1) of every level into kt[l] (D, ld[l]) at column
 * offset (j0 >> l) - base_col[l]: the score GEMM's B operand, (D, keys). */
static void load_keys(const hkt_params *p, int64_t b, int64_t h, int64_t j0, int64_t j1, real *const *kt,
                      const int64_t *ld, const int64_t *base_col) {
    for (int l = 0; l < p->L; l++) {
        span sp = level_span(l, 0, 1, j0, j1);
        const real *kb = (const real *)p->k[l] + b * p->k_stride[l][0] + kv_head(p, h) * p->k_stride[l][1];
        transpose(sp.cl, p->D, kb + sp.c0 * p->k_stride[l][2], p->k_stride[l][2], kt[l] + sp.c0 - base_col[l], ld[l]);
    }
}

/* Where key tile [j0, j1) of each level goes in the workspace's key_tile
 * region: buf[l], row length ld[l] (the level's columns in the tile), first
 * column col0[l]. */
static void key_tile_place(const hkt_params *p, const ws_layout *ws, real *base, int64_t j0, int64_t j1, real **buf,
                           int64_t *ld, int64_t *col0) {
    for (int l = 0; l < p->L; l++) {
        span sp = level_span(l, 0, 1, j0, j1);
        buf[l] = base + ws->key_tile + ws->key_tile_off[l];
        ld[l] = sp.cl;
        col0[l] = sp.c0;
    }
}

/* Where key tile [j0, j1) of each level lies in the forward's key cache
 * (keys_all): as key_tile_place, but in the tile's own block of the cache.
 * Each tile's keys lie together, (D, cols_max(l)) a level, where they were
 * columns of one (D, S / 2^l) array: a score GEMM's B then read 64 rows
 * of 256 bytes, each in a page of its own, which the hardware prefetchers
 * do not follow; in the tile-major layout a GEMM's B is one run of memory,
 * which pays at long S. */
static void cached_tile_place(const hkt_params *p, const ws_layout *ws, real *base, int64_t j0, int64_t j1,
                              real **buf, int64_t *ld, int64_t *col0) {
    key_tile_place(p, ws, base, j0, j1, buf, ld, col0);
    for (int l = 0; l < p->L; l++)
        buf[l] = base + ws->keys_all + ws->keys_all_off[l] + j0 / BK * ws->key_t_rows * cols_max(l);
}

/* Transposes one key tile of every level into the workspace's kt region
 * (D, cl) each, and points kt[l] / ktld[l] at it. */
static void load_key_tile(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t j0,
                          int64_t j1, const real **kt, int64_t *ktld) {
    real *buf[HKT_MAX_LEVELS];
    int64_t col0[HKT_MAX_LEVELS];
    key_tile_place(p, ws, base, j0, j1, buf, ktld, col0);
    for (int l = 0; l < p->L; l++) kt[l] = buf[l];
    load_keys(p, b, h, j0, j1, buf, ktld, col0);
}

/* S (nq, BK) = scale * sum_l w[l] * upsample(G_l), with G_l = q[l] k[l]^T over the
 * tile (kept in the workspace for the backward's dw).  kt[l] points at the tile's
 * first transposed key column of level l, with leading dimension ktld[l].
 *
 * Coarse levels are folded from the coarsest down, E_l = scale w_l G_l + up2(E_{l+1}),
 * so each level costs one pass over its own grid; up2 duplicates rows and columns.
 * Tiles start at multiples of 64, so a level's first row and column inside a tile
 * are even whenever it has more than one: the parent of (a, c) is (a >> 1, c >> 1).
 * Then masking: invisible entries become -inf, a float mask is added. */
static void tile_fold(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                      int64_t i1, int64_t j0, int64_t j1);
static void fold_levels(const hkt_params *p, const ws_layout *ws, real *base, int64_t h, int64_t i0, int64_t i1,
                        int64_t j0, int64_t j1, int last);
static void tile_masks(const hkt_params *p, real *S, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0,
                       int64_t j1);

/* Level l's query rows from row r0 (the tile's first) of head (b, h), and
 * their row stride: the forward task's packed copy (ws->q_tile, filled at the
 * task's start) where the forward packs them, else the array itself. */
static inline const real *query_rows(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                     int l, int64_t r0, int64_t *ld) {
    if (ws->pack_q_tile) {
        *ld = p->D;
        return base + ws->q_tile + ws->pack_off[l];
    }
    *ld = p->q_stride[l][2];
    return (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1] + r0 * p->q_stride[l][2];
}

/* keep_grams: the backward, whose dw needs each level's Gram block; the forward
 * does not, and with one level its product goes straight into the scores,
 * scaled in the GEMM (alpha * sum, the same bits as the fold's w * G). */
static void tile_scores(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                        int64_t i1, int64_t j0, int64_t j1, const real *const *kt, const int64_t *ktld,
                        int keep_grams) {
    const int diag = diagonal_tile(p, i0, j0);
    if (!keep_grams && p->L == 1) {
        int64_t ld;
        const real *qr = query_rows(p, ws, base, b, h, 0, i0, &ld);
        /* what gemm_diag leaves out, the masks hide */
        gemm_diag(diag, DIAG_SCORES, i1 - i0, j1 - j0, p->D, level_factor(p->scale, weight(p, h, 0)),
                  qr, ld, kt[0], ktld[0], base + ws->scores, BK, 0);
        tile_masks(p, base + ws->scores, b, h, i0, i1, j0, j1);
        return;
    }
    /* level 0 with the fold in its store where it can (gemm_fused) */
    const int fused = !diag && gemm_fused_takes(j1 - j0);
    for (int l = fused; l < p->L; l++) {
        span sp = level_span(l, i0, i1, j0, j1);
        int64_t ld;
        const real *qr = query_rows(p, ws, base, b, h, l, sp.r0, &ld);
        real *G = base + ws->gram + ws->gram_off[l];
        gemm_diag(diag && l == 0, DIAG_SCORES, sp.rl, sp.cl, p->D, 1, qr, ld, kt[l], ktld[l], G, sp.cl, 0);
        if (diag && l == 0) zero_unseen(sp.rl, sp.cl, G, sp.cl);
    }
    if (!fused) {
        tile_fold(p, ws, base, b, h, i0, i1, j0, j1);
        return;
    }
    fold_levels(p, ws, base, h, i0, i1, j0, j1, 1);
    int64_t ld;
    const real *qr = query_rows(p, ws, base, b, h, 0, i0, &ld);
    const real w0 = level_factor(p->scale, weight(p, h, 0));
    /* E_1, the coarser levels folded (none with one level) */
    const real *E1 = p->L > 1 ? base + ws->folded + ws->gram_off[1] : NULL;
    const int64_t lde = p->L > 1 ? level_span(1, i0, i1, j0, j1).cl : 0;
    if (keep_grams) {
        const tile_extra x = {E1, lde, NULL, base + ws->scores, BK, w0};
        gemm_fused(E1 ? EPI_GRAM_SCORES : EPI_GRAM_SCORES0, i1 - i0, j1 - j0, p->D, 1, qr, ld, kt[0], ktld[0],
                   base + ws->gram, j1 - j0, &x);
    } else {
        const tile_extra x = {E1, lde, NULL, NULL, 0, 0};
        gemm_fused(EPI_UP, i1 - i0, j1 - j0, p->D, w0, qr, ld, kt[0], ktld[0], base + ws->scores, BK, &x);
    }
    tile_masks(p, base + ws->scores, b, h, i0, i1, j0, j1);
}

/* The tile's scores from its Gram blocks (in ws->gram, however they were
 * computed): the fold described above, then the masks. */
static void tile_fold(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                      int64_t i1, int64_t j0, int64_t j1) {
    fold_levels(p, ws, base, h, i0, i1, j0, j1, 0);
    tile_masks(p, base + ws->scores, b, h, i0, i1, j0, j1);
}

/* The fold from the coarsest level down to level last: E_last, in ws->folded
 * at gram_off[last] (row length: the level's columns in the tile), or for
 * last = 0 the tile's unmasked scores. */
static void fold_levels(const hkt_params *p, const ws_layout *ws, real *base, int64_t h, int64_t i0, int64_t i1,
                        int64_t j0, int64_t j1, int last) {
    const int L = p->L;
    real *S = base + ws->scores;
    const real *up = NULL; /* E_{l+1}, row length up_cl */
    int64_t up_cl = 0;
    for (int l = L - 1; l >= last; l--) {
        span sp = level_span(l, i0, i1, j0, j1);
        const real *G = base + ws->gram + ws->gram_off[l];
        real *E = l ? base + ws->folded + ws->gram_off[l] : S;
        const int64_t lde = l ? sp.cl : BK;
        const real wl = level_factor(p->scale, weight(p, h, l));
        for (int64_t a = 0; a < sp.rl; a++) {
            const real *g = G + a * sp.cl;
            real *e = E + a * lde;
            if (!up) {
                for (int64_t c = 0; c < sp.cl; c++) e[c] = wl * g[c];
                continue;
            }
            fold_row(g, up + (a >> 1) * up_cl, wl, sp.cl, e);
        }
        up = E;
        up_cl = sp.cl;
    }
}

/* Masking of the tile's scores S: invisible entries become -inf, a float mask is added. */
static void tile_masks(const hkt_params *p, real *S, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0,
                       int64_t j1) {
    const int64_t nq = i1 - i0, nk = j1 - j0;
    /* the float mask is added first, so hiding (causal, bool) wins over whatever
     * it holds: a NaN in a hidden entry of a float mask stays hidden */
    const int64_t ms3 = p->mask_stride[3];
    if (p->mask_kind == HKT_MASK_FLOAT)
        for (int64_t r = 0; r < nq; r++) {
            real *srow = S + r * BK;
            const real *m = (const real *)p->mask + b * p->mask_stride[0] + h * p->mask_stride[1] +
                            (i0 + r) * p->mask_stride[2] + j0 * ms3;
            for (int64_t c = 0; c < nk; c++) srow[c] += m[c * ms3];
        }
    if (p->causal && j1 - 1 > i0) {
        /* on the diagonal: key j > i is hidden */
        for (int64_t r = 0; r < nq; r++) {
            real *srow = S + r * BK;
            for (int64_t c = i0 + r - j0 + 1 > 0 ? i0 + r - j0 + 1 : 0; c < nk; c++) srow[c] = -INFINITY;
        }
    }
    if (p->mask_kind == HKT_MASK_BOOL)
        for (int64_t r = 0; r < nq; r++) {
            real *srow = S + r * BK;
            const unsigned char *m = (const unsigned char *)p->mask + b * p->mask_stride[0] + h * p->mask_stride[1] +
                                     (i0 + r) * p->mask_stride[2] + j0 * ms3;
            for (int64_t c = 0; c < nk; c++) srow[c] = m[c * ms3] ? srow[c] : -INFINITY;
        }
}

/* Per-thread state at the head of each workspace block. */
typedef struct {
    int64_t cached_bh;
} thread_state;

/* A forward task's start: forgets the thread's cached keys unless they are of
 * this task's (b, kv head) -- the query heads of one group, run one after
 * another, share them -- and zeroes the task's out rows (nq of them, from ob)
 * and its running max and sums. */
static void start_task(const hkt_params *p, const ws_layout *ws, char *block, int64_t b, int64_t h, int64_t nq,
                       real *ob, int64_t ldo) {
    thread_state *state = (thread_state *)block;
    real *base = (real *)(block + WS_HEADER);
    if (state->cached_bh != b * p->H_kv + kv_head(p, h)) {
        state->cached_bh = b * p->H_kv + kv_head(p, h);
        real *ready = base + ws->keys_ready;
        for (int64_t x = 0; x < (p->S + BK - 1) / BK; x++) ready[x] = 0;
    }
    real *m = base + ws->row_max, *lsum = base + ws->row_sums;
    for (int64_t r = 0; r < nq; r++) {
        m[r] = -INFINITY;
        vstore(lsum + r * VL, (vec){0});
        real *orow = ob + r * ldo;
        for (int64_t e = 0; e < p->Dv; e++) orow[e] = 0;
    }
}

/* exp_shift(x, n, m), returning row_lanes(x, n) of the result: one pass, the
 * same sums in the same order (lane-wise, a zero-padded tail last), so the same
 * bits as the two calls. */
static inline vec exp_shift_lanes(real *restrict x, int64_t n, real m) {
    if (m != m) {
        exp_shift(x, n, m);
        return row_lanes(x, n);
    }
    vec acc = {0};
    int64_t c = 0;
    for (; c + VL <= n; c += VL) {
        real *restrict xc = x + c;
#if HKT_EXPV
        /* x <= m, the max of the row's scores (or NaN): no clamps needed */
        const vec y = exp_nonpos_vec_le0(vload(xc) - m);
        vstore(xc, y);
        acc += y;
#else
#pragma GCC ivdep
        for (int64_t e = 0; e < VL; e++) xc[e] = exp_nonpos(xc[e] - m);
        acc += vload(xc);
#endif
    }
    if (c < n) {
        real tail[VL] = {0};
        for (int64_t e = 0; e < n - c; e++) tail[e] = x[c + e] = exp_nonpos(x[c + e] - m);
        acc += vload(tail);
    }
    return acc;
}

/* The online softmax's step for key tile [j0, j0 + nk): turns the tile's scores
 * into P (dropped out, with dropout) in place, rescales what the out rows hold
 * so far and updates each row's running max and lane sums.  The caller then
 * adds P @ V to the out rows.  In three passes over the rows (maxes, exps,
 * bookkeeping), so that the exps of consecutive rows, each a long chain of
 * dependent FMAs, have no branchy scalar code between them and overlap in the
 * core. */
static void softmax_update(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                           int64_t i0, int64_t nq, int64_t j0, int64_t nk, real *ob, int64_t ldo) {
    const int use_dropout = p->dropout_p > 0;
    const uint64_t sm = mix64(p->seed), th = keep_threshold(p->dropout_p);
    const real kf = (real)keep_scale(p->dropout_p);
    real *Sbuf = base + ws->scores, *m = base + ws->row_max, *lsum = base + ws->row_sums;
    real mnew[BQ];
    unsigned char seen[BQ]; /* the row sees a key in this tile */
    real maxes[BQ];
#if HKT_AVX512_F32
    for (int64_t r = 0; r < nq; r += 16) rows_max16(Sbuf + r * BK, BK, nq - r < 16 ? nq - r : 16, nk, maxes + r);
#else
    for (int64_t r = 0; r < nq; r++) maxes[r] = row_max(Sbuf + r * BK, nk);
#endif
    for (int64_t r = 0; r < nq; r++) {
        const real mx = maxes[r];
        seen[r] = mx != -INFINITY;
        /* NaN wins, so a NaN score poisons its row for good */
        mnew[r] = mx > m[r] || mx != mx ? mx : m[r];
    }
    for (int64_t r = 0; r < nq; r++) {
        real *srow = Sbuf + r * BK;
        if (!seen[r]) {
            for (int64_t c = 0; c < nk; c++) srow[c] = 0;
            continue;
        }
        /* an unchanged max (the common case after the first tiles) skips the
         * scalar exp: exp_nonpos(0) is exactly 1, so the same bits */
        const real alpha = m[r] == -INFINITY ? 0 : mnew[r] == m[r] ? 1 : exp_nonpos(m[r] - mnew[r]);
        vstore(lsum + r * VL, vload(lsum + r * VL) * alpha + exp_shift_lanes(srow, nk, mnew[r]));
        if (alpha != 1) {
            real *orow = ob + r * ldo;
            for (int64_t e = 0; e < p->Dv; e++) orow[e] *= alpha;
        }
        m[r] = mnew[r];
        if (use_dropout) {
            const uint64_t rowidx = (uint64_t)(((b * p->H + h) * p->T + i0 + r) * p->S + j0);
            for (int64_t c = 0; c < nk; c++) srow[c] = keep_entry(sm, th, rowidx + (uint64_t)c) ? srow[c] * kf : 0;
        }
    }
}

/* The out rows divided by their softmax sums, and each row's log-sum-exp. */
static void finish_rows(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                        int64_t nq, real *ob, int64_t ldo) {
    const int64_t Dv = p->Dv;
    const real *m = base + ws->row_max, *lsum = base + ws->row_sums;
    real *lse = (real *)p->lse + (b * p->H + h) * p->T + i0;
    for (int64_t r = 0; r < nq; r++) {
        real *orow = ob + r * ldo;
        const real total = lanes_total(vload(lsum + r * VL));
        if (total > 0) {
            const real inv = 1 / total;
            for (int64_t e = 0; e < Dv; e++) orow[e] *= inv;
            lse[r] = m[r] + REAL_LOG(total);
        } else if (total == 0) {
            /* no visible key: zeros, and +inf so the backward's P is exactly 0 */
            for (int64_t e = 0; e < Dv; e++) orow[e] = 0;
            lse[r] = INFINITY;
        } else {
            /* a visible NaN or +inf score: the softmax of the row is NaN */
            for (int64_t e = 0; e < Dv; e++) orow[e] = NAN;
            lse[r] = NAN;
        }
    }
}

/* forward: one task per (b, h, query tile); each task owns its out rows.  The
 * transposed keys of the current (b, h) stay in the thread's workspace, so each
 * key tile is transposed once per thread, not once per query tile. */
static void forward_task(const hkt_params *p, const ws_layout *ws, char *block, int64_t b, int64_t h,
                         int64_t qt) {
    const int64_t T = p->T, S = p->S, Dv = p->Dv;
    const int64_t i0 = qt * BQ, i1 = i0 + BQ < T ? i0 + BQ : T, nq = i1 - i0;
    real *base = (real *)(block + WS_HEADER);
    real *Sbuf = base + ws->scores, *ready = base + ws->keys_ready;
    real *ob = (real *)p->out + b * p->out_stride[0] + h * p->out_stride[1] + i0 * p->out_stride[2];
    const real *vb = (const real *)p->v + b * p->v_stride[0] + kv_head(p, h) * p->v_stride[1];
    start_task(p, ws, block, b, h, nq, ob, p->out_stride[2]);
    if (ws->pack_q_tile)
        for (int l = 0; l < p->L; l++) {
            const span sp = level_span(l, i0, i1, 0, 1);
            copy_rows(sp.rl, p->D, (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1] +
                      sp.r0 * p->q_stride[l][2], p->q_stride[l][2], base + ws->q_tile + ws->pack_off[l], p->D);
        }
    real *vpack = base + ws->values_packed;
    const int64_t jend = p->causal ? (i1 < S ? i1 : S) : S;
    for (int64_t j0 = 0; j0 < jend; j0 += BK) {
        const int64_t j1 = j0 + BK < S ? j0 + BK : S, nk = j1 - j0;
        real *kt[HKT_MAX_LEVELS];
        int64_t ktld[HKT_MAX_LEVELS], col0[HKT_MAX_LEVELS];
        if (ws->keys_cached) {
            cached_tile_place(p, ws, base, j0, j1, kt, ktld, col0);
            if (!ready[j0 / BK]) {
                load_keys(p, b, h, j0, j1, kt, ktld, col0);
                if (ws->pack_v) copy_rows(nk, Dv, vb + j0 * p->v_stride[2], p->v_stride[2], vpack + j0 * Dv, Dv);
                ready[j0 / BK] = 1;
            }
        } else {
            key_tile_place(p, ws, base, j0, j1, kt, ktld, col0);
            load_keys(p, b, h, j0, j1, kt, ktld, col0);
        }
        tile_scores(p, ws, base, b, h, i0, i1, j0, j1, (const real *const *)kt, ktld, 0);
        softmax_update(p, ws, base, b, h, i0, nq, j0, nk, ob, p->out_stride[2]);
        const int64_t ldv = ws->pack_v ? Dv : p->v_stride[2];
        gemm_diag(diagonal_tile(p, i0, j0), DIAG_ROWS, nq, Dv, nk, 1, Sbuf, BK, (ws->pack_v ? vpack : vb) + j0 * ldv,
                  ldv, ob, p->out_stride[2], 1);
    }
    finish_rows(p, ws, base, b, h, i0, nq, ob, p->out_stride[2]);
}

typedef void (*forward_task_fn)(const hkt_params *, const ws_layout *, char *, int64_t, int64_t, int64_t);

/* Task t of the forward, (b, h)-major, on the calling thread's workspace block. */
static inline void run_forward_task(const hkt_params *p, const ws_layout *ws, size_t wsb, forward_task_fn task,
                                    int64_t t, int tid) {
    const int64_t nqt = (p->T + BQ - 1) / BQ, bh = t / nqt, qt = nqt - 1 - t % nqt;
    task(p, ws, (char *)p->workspace + (size_t)tid * wsb, bh / p->H, bh % p->H, qt);
}

/* Runs task over every (b, h, query tile) (the bfloat16 forward brings its own). */
static void run_forward(const hkt_params *p, forward_task_fn task) {
    const ws_layout ws = hkt_ws_layout(p, 0);
    const size_t wsb = hkt_workspace_bytes(p, 0);
    const int64_t nqt = (p->T + BQ - 1) / BQ, nbh = p->B * p->H, ntask = nbh * nqt;
    const int nt = num_threads(p);
    for (int x = 0; x < nt; x++) ((thread_state *)((char *)p->workspace + (size_t)x * wsb))->cached_bh = -1;
    /* Tasks in (b, h)-major order.  With two (b, h) or more per thread, handed
     * out guided: a thread's first chunk is whole (b, h) in a row, so it
     * transposes their keys and packs their values alone, and the chunks
     * shrink to single tiles, which even out the threads' finish.  Tile by
     * tile, every thread came to every (b, h), and transposed and packed its
     * keys and values again.  With fewer (b, h), tile by tile: a guided first chunk
     * of one causal (b, h) would be its costliest half.  Within a (b, h) the
     * costlier causal tiles go first.  Who runs a tile changes no bits. */
    if (nbh >= 2 * (int64_t)nt)
        PARALLEL_TASKS(nt, (guided, 1), ntask, t, tid, run_forward_task(p, &ws, wsb, task, t, tid););
    else
        PARALLEL_TASKS(nt, (dynamic, 1), ntask, t, tid, run_forward_task(p, &ws, wsb, task, t, tid););
}

static void forward(const hkt_params *p) { run_forward(p, forward_task); }
