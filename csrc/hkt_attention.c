/*
 * HKT attention on the CPU: forward and backward, float32 and float64.
 *
 * Shapes (see hkt.h): q[l] (B, H, ceil(T/2^l), D), k[l] (B, H, ceil(S/2^l), D),
 * v (B, H, S, Dv), w (H, L) or (L,); out (B, H, T, Dv), lse (B, H, T).
 *
 * Flash-style: queries and keys are walked in BQ x BK tiles; a tile's score is
 * built from each level's small Gram block (computed once per 2^l x 2^l block,
 * the 1 + 1/4 + 1/16 ... cost) and consumed by an online softmax.  Nothing of
 * size T x S is ever stored; the forward keeps one log-sum-exp per row and the
 * backward recomputes the tile scores from it.
 *
 * The file is a template: it includes itself once per real type (float, double)
 * so that both share one body; the block under "#ifndef HKT_REAL" is the common,
 * type-free part.
 */
#ifndef HKT_REAL

#include "hkt.h"
#include "hkt_dropout.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Tile sizes: powers of two, so a tile always holds whole 2^l blocks of every
 * level with 2^l <= 64 and lies inside one block of any coarser level. */
#define BQ HKT_CPU_TILE
#define BK HKT_CPU_TILE
#define HKT_KEY_CACHE_BYTES ((size_t)64 << 20)

/* Compile the hot loops for several ISAs and pick one at load time, so one
 * build runs anywhere and still uses AVX2/AVX-512 where present. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(HKT_NO_CLONES)
#define HKT_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HKT_HOT
#endif

const char *hkt_cpu_kernels(void) {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(HKT_NO_CLONES)
    /* the order target_clones' resolver tries them in */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "avx512f";
    if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
    return "default";
}

int hkt_default_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

void hkt_dropout_mask_cpu(unsigned char *keep, uint64_t seed, double p,
                          int64_t B, int64_t H, int64_t T, int64_t S) {
    uint64_t sm = mix64(seed), th = keep_threshold(p);
    int64_t n = B * H * T * S;
    for (int64_t x = 0; x < n; x++) keep[x] = (unsigned char)keep_entry(sm, th, (uint64_t)x);
}

/* ---- workspace layout, shared by both real types ---- */
static int64_t rows_max(int l) { return (BQ >> l) > 0 ? (BQ >> l) : 1; }
static int64_t cols_max(int l) { return (BK >> l) > 0 ? (BK >> l) : 1; }
static int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

typedef struct {
    /* offsets in reals, after the per-thread header */
    int64_t s, dp, g, e, dsl, pt, kt, ktall, ready, tmp, vt, dwacc, m, lsum, total;
    int64_t goff[HKT_MAX_LEVELS], ktoff[HKT_MAX_LEVELS], ktalloff[HKT_MAX_LEVELS];
    int keys_cached; /* forward: whole (b, h) of transposed keys kept per thread */
} ws_layout;

/* Row length of a level's transposed keys: padded so rows 4 KiB apart do not all
 * land in the same L1 set. */
static int64_t ktall_ld(const hkt_params *p, int l) {
    return round16(p->S > 0 ? ((p->S - 1) >> l) + 1 : 0) + 16;
}

static ws_layout layout(const hkt_params *p, int backward) {
    ws_layout w;
    int64_t g = 0, kt = 0, ktall = 0, at = 0;
    memset(&w, 0, sizeof w);
    for (int l = 0; l < p->L; l++) {
        w.goff[l] = g;
        w.ktoff[l] = kt;
        w.ktalloff[l] = ktall;
        g += rows_max(l) * cols_max(l);
        kt += p->D * cols_max(l);
        ktall += p->D * ktall_ld(p, l);
    }
    g = round16(g);
    /* Caching a (b, h)'s transposed keys costs D * S * 4/3 reals per thread; past
     * this budget the forward transposes each key tile where it uses it. */
    const size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    const size_t budget = p->key_cache_bytes < 0 ? HKT_KEY_CACHE_BYTES : (size_t)p->key_cache_bytes;
    /* divided, not multiplied: ktall * elem may not fit in a size_t for huge S */
    w.keys_cached = (size_t)ktall <= budget / elem / (size_t)(p->num_threads > 0 ? p->num_threads : 1);
    w.s = at;    at += BQ * BK;
    w.g = at;    at += g;
    w.e = at;    at += g;
    w.tmp = at;  at += BK > BQ ? BK : BQ;
    w.kt = at;   at += round16(kt);
    if (backward) {
        w.dp = at;    at += BQ * BK;
        w.pt = at;    at += BQ * BK;
        w.dsl = at;   at += g;
        w.vt = at;    at += round16(p->Dv * BK);
        w.dwacc = at; at += round16(p->L);
    } else {
        /* the transposed keys of one (b, h), all levels, and which tiles are in */
        w.ktall = at; at += w.keys_cached ? round16(ktall) : 0;
        w.ready = at; at += round16((p->S + BK - 1) / BK);
        w.m = at;     at += BQ;
        w.lsum = at;  at += BQ * 16; /* one 64-byte vector of partial sums per row */
    }
    w.total = at;
    return w;
}

size_t hkt_workspace_bytes(const hkt_params *p, int backward) {
    size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    return (size_t)layout(p, backward).total * elem + 64 /* header */ + 64 /* round up */;
}

size_t hkt_dw_partial_bytes(const hkt_params *p) {
    /* delta (B, H, T), then dw partials (B, H, key tiles, L) */
    size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    int64_t nkt = (p->S + BK - 1) / BK;
    return (size_t)(p->B * p->H * (p->T + (nkt > 0 ? nkt : 1) * p->L)) * elem;
}
static int num_threads(const hkt_params *p) {
    return p->num_threads > 0 ? p->num_threads : 1;
}

/* which side of the backward a pass computes */
enum { WANT_KV = 1, WANT_Q = 2 };

#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)

#define HKT_REAL float
#define HKT_IS_FLOAT 1
#define HKT_SUFFIX f32
#define HKT_EXP expf
#define HKT_LOG logf
#include "hkt_attention.c"
#undef HKT_REAL
#undef HKT_IS_FLOAT
#undef HKT_SUFFIX
#undef HKT_EXP
#undef HKT_LOG

#define HKT_REAL double
#define HKT_IS_FLOAT 0
#define HKT_SUFFIX f64
#define HKT_EXP exp
#define HKT_LOG log
#include "hkt_attention.c"
#undef HKT_REAL
#undef HKT_IS_FLOAT
#undef HKT_SUFFIX
#undef HKT_EXP
#undef HKT_LOG

void hkt_forward_cpu(const hkt_params *p) {
    if (p->dtype == HKT_FLOAT64) forward_f64(p);
    else forward_f32(p);
}

void hkt_backward_cpu(const hkt_params *p) {
    if (p->dtype == HKT_FLOAT64) backward_f64(p);
    else backward_f32(p);
}

#else /* ------------------------- per-type body ------------------------- */

#define real HKT_REAL
#define FN(name) CAT(name, HKT_SUFFIX)
/* One 64-byte vector: a zmm register with AVX-512, two ymm with AVX2. */
#define VL_FULL ((int64_t)(64 / sizeof(real)))
#define VL VL_FULL
typedef real CAT(vec, HKT_SUFFIX) __attribute__((vector_size(64)));
#define vec CAT(vec, HKT_SUFFIX)
#if HKT_IS_FLOAT
typedef int32_t CAT(ivec, HKT_SUFFIX) __attribute__((vector_size(64)));
static const CAT(ivec, HKT_SUFFIX) FN(dup_lo) = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const CAT(ivec, HKT_SUFFIX) FN(dup_hi) = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
static const CAT(ivec, HKT_SUFFIX) FN(even) = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const CAT(ivec, HKT_SUFFIX) FN(odd) = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
#else
typedef int64_t CAT(ivec, HKT_SUFFIX) __attribute__((vector_size(64)));
static const CAT(ivec, HKT_SUFFIX) FN(dup_lo) = {0, 0, 1, 1, 2, 2, 3, 3};
static const CAT(ivec, HKT_SUFFIX) FN(dup_hi) = {4, 4, 5, 5, 6, 6, 7, 7};
static const CAT(ivec, HKT_SUFFIX) FN(even) = {0, 2, 4, 6, 8, 10, 12, 14};
static const CAT(ivec, HKT_SUFFIX) FN(odd) = {1, 3, 5, 7, 9, 11, 13, 15};
#endif

static inline __attribute__((always_inline)) vec FN(vload)(const real *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void FN(vstore)(real *p, vec v) { memcpy(p, &v, sizeof v); }

static inline real FN(dot)(int64_t n, const real *restrict x, const real *restrict y) {
    real acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t e = 0; e < n; e++) acc += x[e] * y[e];
    return acc;
}

/* ---- GEMM: C (M, N) = [C +] alpha * op(A) @ B, row-major with leading dimensions;
 * op(A) = A (M, K) or, with trans_a, A^T where A is stored (K, M).  Register-blocked
 * R x (NV vectors) micro-tiles: 4 x 4 keeps 16 accumulators in zmm registers, and
 * 4 loads plus 4 broadcasts feed 16 FMAs. */
#define DEFINE_TILE_OF(NAME, R, NV, AIDX, VT, VLEN)                                            \
    static inline __attribute__((always_inline)) void FN(NAME)(                                \
        int64_t K, real alpha, const real *restrict A, int64_t lda, const real *restrict B,    \
        int64_t ldb, real *restrict C, int64_t ldc, int accumulate) {                          \
        VT c[R][NV];                                                                            \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) c[r][v] = (VT){0};            \
        for (int64_t kk = 0; kk < K; kk++) {                                                    \
            VT b[NV];                                                                           \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++)                               \
                memcpy(&b[v], B + kk * ldb + v * (VLEN), sizeof(VT));                           \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                              \
                const real a = A[AIDX];                                                         \
                _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) c[r][v] += a * b[v];      \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) {                             \
                real *p = C + r * ldc + v * (VLEN);                                             \
                VT o = alpha * c[r][v], old;                                                    \
                if (accumulate) {                                                               \
                    memcpy(&old, p, sizeof(VT));                                                \
                    o += old;                                                                   \
                }                                                                               \
                memcpy(p, &o, sizeof(VT));                                                      \
            }                                                                                   \
    }
#define DEFINE_TILE(NAME, R, NV, AIDX) DEFINE_TILE_OF(NAME, R, NV, AIDX, vec, VL)

/* Narrow columns (coarse levels of short sequences): 32- and 16-byte vectors, so
 * only what is left below 4 (2) reals runs scalar. */
typedef real CAT(vech, HKT_SUFFIX) __attribute__((vector_size(32)));
typedef real CAT(vecq, HKT_SUFFIX) __attribute__((vector_size(16)));
DEFINE_TILE_OF(tile_8xh, 8, 1, r * lda + kk, CAT(vech, HKT_SUFFIX), VL / 2)
DEFINE_TILE_OF(tile_1xh, 1, 1, r * lda + kk, CAT(vech, HKT_SUFFIX), VL / 2)
DEFINE_TILE_OF(tile_t8xh, 8, 1, kk * lda + r, CAT(vech, HKT_SUFFIX), VL / 2)
DEFINE_TILE_OF(tile_t1xh, 1, 1, kk * lda + r, CAT(vech, HKT_SUFFIX), VL / 2)
DEFINE_TILE_OF(tile_8xq, 8, 1, r * lda + kk, CAT(vecq, HKT_SUFFIX), VL / 4)
DEFINE_TILE_OF(tile_1xq, 1, 1, r * lda + kk, CAT(vecq, HKT_SUFFIX), VL / 4)
DEFINE_TILE_OF(tile_t8xq, 8, 1, kk * lda + r, CAT(vecq, HKT_SUFFIX), VL / 4)
DEFINE_TILE_OF(tile_t1xq, 1, 1, kk * lda + r, CAT(vecq, HKT_SUFFIX), VL / 4)

/* narrower column blocks (coarse levels, small Dv) take more rows, so every
 * block still keeps 16 (8) accumulators busy */
DEFINE_TILE(tile_4x4, 4, 4, r * lda + kk)
DEFINE_TILE(tile_1x4, 1, 4, r * lda + kk)
DEFINE_TILE(tile_8x2, 8, 2, r * lda + kk)
DEFINE_TILE(tile_1x2, 1, 2, r * lda + kk)
DEFINE_TILE(tile_8x1, 8, 1, r * lda + kk)
DEFINE_TILE(tile_1x1, 1, 1, r * lda + kk)
DEFINE_TILE(tile_t4x4, 4, 4, kk * lda + r)
DEFINE_TILE(tile_t1x4, 1, 4, kk * lda + r)
DEFINE_TILE(tile_t8x2, 8, 2, kk * lda + r)
DEFINE_TILE(tile_t1x2, 1, 2, kk * lda + r)
DEFINE_TILE(tile_t8x1, 8, 1, kk * lda + r)
DEFINE_TILE(tile_t1x1, 1, 1, kk * lda + r)

static HKT_HOT void FN(gemm)(int trans_a, int64_t M, int64_t N, int64_t K, real alpha, const real *A,
                             int64_t lda, const real *B, int64_t ldb, real *C, int64_t ldc, int accumulate) {
    /* row i of op(A) starts at A + i * as, and op(A)[i][kk] = A[i * as + kk * ks] */
    const int64_t as = trans_a ? 1 : lda, ks = trans_a ? lda : 1;
    int64_t j = 0;
#define HKT_TILES(R, NV, TR, T1, TTR, TT1)                                                               \
    for (; j + NV * VL <= N; j += NV * VL) {                                                             \
        int64_t i = 0;                                                                                   \
        if (trans_a) {                                                                                   \
            for (; i + R <= M; i += R) FN(TTR)(K, alpha, A + i, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate); \
            for (; i < M; i++) FN(TT1)(K, alpha, A + i, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);       \
        } else {                                                                                         \
            for (; i + R <= M; i += R) FN(TR)(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate); \
            for (; i < M; i++) FN(T1)(K, alpha, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);       \
        }                                                                                                \
    }
    HKT_TILES(4, 4, tile_4x4, tile_1x4, tile_t4x4, tile_t1x4)
    HKT_TILES(8, 2, tile_8x2, tile_1x2, tile_t8x2, tile_t1x2)
    HKT_TILES(8, 1, tile_8x1, tile_1x1, tile_t8x1, tile_t1x1)
#undef VL
#define VL (VL_FULL / 2)
    HKT_TILES(8, 1, tile_8xh, tile_1xh, tile_t8xh, tile_t1xh)
#undef VL
#define VL (VL_FULL / 4)
    HKT_TILES(8, 1, tile_8xq, tile_1xq, tile_t8xq, tile_t1xq)
#undef VL
#define VL VL_FULL
#undef HKT_TILES
    if (j < N) {
        for (int64_t i = 0; i < M; i++) {
            real *crow = C + i * ldc;
            for (int64_t n = j; n < N; n++) {
                real acc = 0;
                for (int64_t kk = 0; kk < K; kk++) acc += A[i * as + kk * ks] * B[kk * ldb + n];
                crow[n] = accumulate ? crow[n] + alpha * acc : alpha * acc;
            }
        }
    }
}

/* dst[c] = src[c >> 1] for c < n: a grid row upsampled by 2 */
static inline void FN(expand2)(const real *restrict src, int64_t n, real *restrict dst) {
    int64_t c = 0;
    for (; c + 2 * VL <= n; c += 2 * VL) {
        const vec s = FN(vload)(src + c / 2);
        FN(vstore)(dst + c, __builtin_shuffle(s, FN(dup_lo)));
        FN(vstore)(dst + c + VL, __builtin_shuffle(s, FN(dup_hi)));
    }
    for (; c < n; c++) dst[c] = src[c >> 1];
}

/* dst[c] = src[2c] + src[2c + 1] (the last alone if n is odd): a row summed over pairs */
static inline void FN(pairsum)(const real *restrict src, int64_t n, real *restrict dst) {
    int64_t c = 0;
    for (; 2 * c + 2 * VL <= n; c += VL) {
        const vec a = FN(vload)(src + 2 * c), b = FN(vload)(src + 2 * c + VL);
        FN(vstore)(dst + c, __builtin_shuffle(a, b, FN(even)) + __builtin_shuffle(a, b, FN(odd)));
    }
    for (; 2 * c < n; c++) dst[c] = src[2 * c] + (2 * c + 1 < n ? src[2 * c + 1] : 0);
}

/* dst (cols, rows) = transpose of src (rows, cols) with leading dimensions */
static inline void FN(transpose)(int64_t rows, int64_t cols, const real *src, int64_t lds, real *dst, int64_t ldd) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}

/* x[c] = exp(x[c] - m) for c < n; -inf gives exactly 0.  Arguments are <= 0 (m is
 * the row max, or the row's log-sum-exp in the backward). */
#if HKT_IS_FLOAT
static inline float FN(exp_nonpos)(float x) {
    /* Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial
     * (relative error ~2e-7): vectorises, unlike a libm call. */
    /* NaN takes the -87 branch here (no undefined float-to-int cast below) and
     * comes out as NaN at the end */
    const float xc = x >= -87.0f ? (x > 0.0f ? 0.0f : x) : -87.0f;
    const float t = xc * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : (x == x ? p * scale : x);
}
#else
static inline double FN(exp_nonpos)(double x) { return exp(x); }
#endif

/* x[c] = exp(x[c] - m).  With m NaN (a row holding a visible NaN or +inf score)
 * every entry is NaN except hidden ones (-inf), which stay exactly 0: a hidden
 * key contributes nothing, even to a NaN row. */
static inline void FN(exp_shift)(real *restrict x, int64_t n, real m) {
    if (m != m) {
        for (int64_t c = 0; c < n; c++) x[c] = x[c] == -INFINITY ? 0 : NAN;
        return;
    }
    for (int64_t c = 0; c < n; c++) x[c] = FN(exp_nonpos)(x[c] - m);
}

/* Largest of x[0..n), NaN possibly skipped; -inf when nothing is visible, or NaN
 * if then some entry is NaN (a NaN anywhere else reaches the row sum through the
 * exp, so only this case needs the extra look). */
static inline real FN(row_max)(const real *restrict x, int64_t n) {
    real mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < n; c++) mx = x[c] > mx ? x[c] : mx;
    if (mx == -INFINITY)
        for (int64_t c = 0; c < n; c++)
            if (x[c] != x[c]) return NAN;
    return mx;
}

/* x[0..n) added lane-wise into one 64-byte vector (x[c] to lane c % VL): a row
 * sum kept in lanes, reduced once per row at the end (lanes_total), in the same
 * order whatever ISA the clone runs on, so results stay bitwise equal across
 * machines. */
static inline vec FN(row_lanes)(const real *restrict x, int64_t n) {
    vec acc = {0};
    int64_t c = 0;
    for (; c + VL <= n; c += VL) acc += FN(vload)(x + c);
    if (c < n) {
        real tail[VL] = {0};
        memcpy(tail, x + c, sizeof(real) * (size_t)(n - c));
        acc += FN(vload)(tail);
    }
    return acc;
}

static inline real FN(lanes_total)(vec acc) {
    real part[VL];
    FN(vstore)(part, acc);
    for (int64_t width = VL / 2; width >= 1; width /= 2)
        for (int64_t e = 0; e < width; e++) part[e] += part[e + width];
    return part[0];
}

static inline real FN(weight)(const hkt_params *p, int64_t h, int l) {
    return ((const real *)p->w)[h * p->w_stride[0] + l * p->w_stride[1]];
}

/* Level-l rows [r0, r0 + rl) and cols [c0, c0 + cl) that tile [i0,i1) x [j0,j1) touches. */
typedef struct { int64_t r0, rl, c0, cl; } FN(span);

static inline FN(span) FN(level_span)(int l, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    FN(span) s;
    s.r0 = i0 >> l;
    s.rl = ((i1 - 1) >> l) + 1 - s.r0;
    s.c0 = j0 >> l;
    s.cl = ((j1 - 1) >> l) + 1 - s.c0;
    return s;
}

/* Transposes key rows [j0, j1) of every level into kt[l] (D, ld[l]) at column
 * offset (j0 >> l) - base_col[l]: the score GEMM's B operand, (D, keys). */
static void FN(load_keys)(const hkt_params *p, int64_t b, int64_t h, int64_t j0, int64_t j1,
                          real *const *kt, const int64_t *ld, const int64_t *base_col) {
    for (int l = 0; l < p->L; l++) {
        FN(span) sp = FN(level_span)(l, 0, 1, j0, j1);
        const real *kb = (const real *)p->k[l] + b * p->k_stride[l][0] + h * p->k_stride[l][1];
        FN(transpose)(sp.cl, p->D, kb + sp.c0 * p->k_stride[l][2], p->k_stride[l][2],
                      kt[l] + sp.c0 - base_col[l], ld[l]);
    }
}

/* Transposes one key tile of every level into the workspace's kt region
 * (D, cl) each, and points kt[l] / ktld[l] at it. */
static void FN(load_key_tile)(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                              int64_t j0, int64_t j1, const real **kt, int64_t *ktld) {
    real *buf[HKT_MAX_LEVELS];
    int64_t col0[HKT_MAX_LEVELS];
    for (int l = 0; l < p->L; l++) {
        FN(span) sp = FN(level_span)(l, 0, 1, j0, j1);
        buf[l] = base + ws->kt + ws->ktoff[l];
        ktld[l] = sp.cl;
        col0[l] = sp.c0;
        kt[l] = buf[l];
    }
    FN(load_keys)(p, b, h, j0, j1, buf, ktld, col0);
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
static HKT_HOT void FN(tile_scores)(const hkt_params *p, const ws_layout *ws, real *base,
                                    int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                                    const real *const *kt, const int64_t *ktld) {
    const int64_t D = p->D, nq = i1 - i0, nk = j1 - j0;
    const int L = p->L;
    real *S = base + ws->s, *tmp = base + ws->tmp;
    const real scale = (real)p->scale;
    for (int l = 0; l < L; l++) {
        FN(span) sp = FN(level_span)(l, i0, i1, j0, j1);
        const real *qb = (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1];
        FN(gemm)(0, sp.rl, sp.cl, D, 1, qb + sp.r0 * p->q_stride[l][2], p->q_stride[l][2], kt[l], ktld[l],
                 base + ws->g + ws->goff[l], sp.cl, 0);
    }
    const real *up = NULL; /* E_{l+1}, row length up_cl */
    int64_t up_cl = 0;
    for (int l = L - 1; l >= 0; l--) {
        FN(span) sp = FN(level_span)(l, i0, i1, j0, j1);
        const real *G = base + ws->g + ws->goff[l];
        real *E = l ? base + ws->e + ws->goff[l] : S;
        const int64_t lde = l ? sp.cl : BK;
        const real wl = scale * FN(weight)(p, h, l);
        for (int64_t a = 0; a < sp.rl; a++) {
            const real *g = G + a * sp.cl;
            real *e = E + a * lde;
            if (!up) {
                for (int64_t c = 0; c < sp.cl; c++) e[c] = wl * g[c];
                continue;
            }
            if (a % 2 == 0) FN(expand2)(up + (a >> 1) * up_cl, sp.cl, tmp);
            for (int64_t c = 0; c < sp.cl; c++) e[c] = wl * g[c] + tmp[c];
        }
        up = E;
        up_cl = sp.cl;
    }
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
typedef struct { int64_t cached_bh; } FN(thread_state);
#define WS_HEADER 64

/* forward: one task per (b, h, query tile); each task owns its out rows.  The
 * transposed keys of the current (b, h) stay in the thread's workspace, so each
 * key tile is transposed once per thread, not once per query tile. */
static HKT_HOT void FN(forward_task)(const hkt_params *p, const ws_layout *ws, char *block,
                                     int64_t b, int64_t h, int64_t qt) {
    const int64_t T = p->T, S = p->S, Dv = p->Dv;
    const int64_t i0 = qt * BQ, i1 = i0 + BQ < T ? i0 + BQ : T, nq = i1 - i0;
    const int use_dropout = p->dropout_p > 0;
    const uint64_t sm = mix64(p->seed), th = keep_threshold(p->dropout_p);
    const real kf = (real)keep_scale(p->dropout_p);
    FN(thread_state) *state = (FN(thread_state) *)block;
    real *base = (real *)(block + WS_HEADER);
    real *Sbuf = base + ws->s, *m = base + ws->m, *ready = base + ws->ready;
    real *lsum = base + ws->lsum; /* row r's partial sums: VL lanes at lsum + r * VL */
    real *ob = (real *)p->out + b * p->out_stride[0] + h * p->out_stride[1] + i0 * p->out_stride[2];
    const real *vb = (const real *)p->v + b * p->v_stride[0] + h * p->v_stride[1];
    real *ktall[HKT_MAX_LEVELS];
    int64_t ktld[HKT_MAX_LEVELS], zero[HKT_MAX_LEVELS];
    const real *kt[HKT_MAX_LEVELS];
    for (int l = 0; l < p->L; l++) {
        ktall[l] = base + ws->ktall + ws->ktalloff[l];
        ktld[l] = ktall_ld(p, l);
        zero[l] = 0;
    }
    const int64_t nkt = (S + BK - 1) / BK;
    if (state->cached_bh != b * p->H + h) {
        state->cached_bh = b * p->H + h;
        for (int64_t x = 0; x < nkt; x++) ready[x] = 0;
    }

    for (int64_t r = 0; r < nq; r++) {
        m[r] = -INFINITY;
        FN(vstore)(lsum + r * VL, (vec){0});
        real *orow = ob + r * p->out_stride[2];
        for (int64_t e = 0; e < Dv; e++) orow[e] = 0;
    }
    const int64_t jend = p->causal ? (i1 < S ? i1 : S) : S;
    for (int64_t j0 = 0; j0 < jend; j0 += BK) {
        const int64_t j1 = j0 + BK < S ? j0 + BK : S, nk = j1 - j0;
        if (ws->keys_cached) {
            if (!ready[j0 / BK]) {
                FN(load_keys)(p, b, h, j0, j1, ktall, ktld, zero);
                ready[j0 / BK] = 1;
            }
            for (int l = 0; l < p->L; l++) kt[l] = ktall[l] + (j0 >> l);
            FN(tile_scores)(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld);
        } else {
            int64_t tld[HKT_MAX_LEVELS];
            FN(load_key_tile)(p, ws, base, b, h, j0, j1, kt, tld);
            FN(tile_scores)(p, ws, base, b, h, i0, i1, j0, j1, kt, tld);
        }
        /* online softmax: rescale what out holds so far, then add this tile's P @ V */
        for (int64_t r = 0; r < nq; r++) {
            real *srow = Sbuf + r * BK;
            const real mx = FN(row_max)(srow, nk);
            if (mx == -INFINITY) { /* nothing visible in this tile */
                for (int64_t c = 0; c < nk; c++) srow[c] = 0;
                continue;
            }
            /* NaN wins, so a NaN score poisons its row for good */
            const real mnew = mx > m[r] || mx != mx ? mx : m[r];
            const real alpha = m[r] == -INFINITY ? 0 : FN(exp_nonpos)(m[r] - mnew);
            FN(exp_shift)(srow, nk, mnew);
            if (alpha != 1) {
                real *orow = ob + r * p->out_stride[2];
                for (int64_t e = 0; e < Dv; e++) orow[e] *= alpha;
            }
            FN(vstore)(lsum + r * VL, FN(vload)(lsum + r * VL) * alpha + FN(row_lanes)(srow, nk));
            m[r] = mnew;
            if (use_dropout) {
                const uint64_t rowidx = (uint64_t)(((b * p->H + h) * T + i0 + r) * S + j0);
                for (int64_t c = 0; c < nk; c++)
                    srow[c] = keep_entry(sm, th, rowidx + (uint64_t)c) ? srow[c] * kf : 0;
            }
        }
        FN(gemm)(0, nq, Dv, nk, 1, Sbuf, BK, vb + j0 * p->v_stride[2], p->v_stride[2], ob, p->out_stride[2], 1);
    }
    real *lse = (real *)p->lse + (b * p->H + h) * T + i0;
    for (int64_t r = 0; r < nq; r++) {
        real *orow = ob + r * p->out_stride[2];
        const real total = FN(lanes_total)(FN(vload)(lsum + r * VL));
        if (total > 0) {
            const real inv = 1 / total;
            for (int64_t e = 0; e < Dv; e++) orow[e] *= inv;
            lse[r] = m[r] + HKT_LOG(total);
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

static void FN(forward)(const hkt_params *p) {
    const ws_layout ws = layout(p, 0);
    const size_t wsb = hkt_workspace_bytes(p, 0);
    const int64_t nqt = (p->T + BQ - 1) / BQ, nbh = p->B * p->H, ntask = nbh * nqt;
    const int nt = num_threads(p);
    for (int x = 0; x < nt; x++) ((FN(thread_state) *)((char *)p->workspace + (size_t)x * wsb))->cached_bh = -1;
    /* (b, h)-major so a thread's cached keys stay useful; within a (b, h) the
     * costlier causal tiles further down go first. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t t = 0; t < ntask; t++) {
        const int64_t bh = t / nqt, qt = nqt - 1 - t % nqt;
        char *block = (char *)p->workspace + (size_t)thread_id() * wsb;
        FN(forward_task)(p, &ws, block, bh / p->H, bh % p->H, qt);
    }
}

/* backward of one (query tile, key tile) pair.
 *
 * forward: S = sum_l scale w_l up(q_l k_l^T); P = softmax(S); out = Pdrop @ v
 * backward: dv = Pdrop^T dO; dP = dO v^T; dS = P * (dP * keep/(1-p) - rowsum(dO * out))
 *           dq_l = scale w_l sum2^l(dS) k_l; dk_l = scale w_l sum2^l(dS)^T q_l;
 *           dw_l = scale sum(sum2^l(dS) * q_l k_l^T); dmask = dS
 *
 * Leaves dS (nq, BK) in the workspace's dp region.
 * want_kv adds to dv, dk and dwacc (the key side), want_q to dq (the query side);
 * with neither it only computes dS (for the mask's gradient);
 * kt/ktld are the key tile's transposed keys, Vt (Dv, BK) its transposed values.
 * All gradients accumulate: the caller orders the pairs. */

static HKT_HOT void FN(backward_pair)(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                      int64_t i0, int64_t i1, int64_t j0, int64_t j1, const real *const *kt,
                                      const int64_t *ktld, int want, real *dwacc) {
    const int64_t T = p->T, S = p->S, D = p->D, Dv = p->Dv, nq = i1 - i0, nk = j1 - j0;
    const int L = p->L;
    const real scale = (real)p->scale;
    real *Sb = base + ws->s, *dP = base + ws->dp, *Vt = base + ws->vt, *Pd = base + ws->pt, *tmp = base + ws->tmp;
    const real *delta = (const real *)p->dw_partial + (b * p->H + h) * T; /* shared (B, H, T) */
    const real *lse = (const real *)p->lse + (b * p->H + h) * T;
    const real *dorows = (const real *)p->dout + b * p->dout_stride[0] + h * p->dout_stride[1] + i0 * p->dout_stride[2];
    real *dvb = (real *)p->dv + b * p->dv_stride[0] + h * p->dv_stride[1];

    FN(tile_scores)(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld);
    /* A row whose lse or delta is not finite (NaN from a visible NaN score, +inf
     * lse for a row with nothing visible) must still give hidden entries dS = 0,
     * not 0 * NaN: remember which entries are hidden before the exp. */
    unsigned char odd_row[BQ], hidden[BQ][BK];
    for (int64_t r = 0; r < nq; r++) {
        real *srow = Sb + r * BK;
        odd_row[r] = !(isfinite(lse[i0 + r]) && isfinite(delta[i0 + r]));
        if (odd_row[r])
            for (int64_t c = 0; c < nk; c++) hidden[r][c] = srow[c] == -INFINITY;
        FN(exp_shift)(srow, nk, lse[i0 + r]);                                      /* P */
    }
    FN(gemm)(0, nq, nk, Dv, 1, dorows, p->dout_stride[2], Vt, BK, dP, BK, 0);     /* dP = dO V^T */
    const real *Pv = Sb; /* the P that weighed v: dropped or not */
    /* dS = P * (dP * keep / (1 - p) - delta), before the scale */
    if (p->dropout_p > 0) {
        const uint64_t sm = mix64(p->seed), th = keep_threshold(p->dropout_p);
        const real kf = (real)keep_scale(p->dropout_p);
        for (int64_t r = 0; r < nq; r++) {
            const uint64_t rowidx = (uint64_t)(((b * p->H + h) * T + i0 + r) * S + j0);
            const real di = delta[i0 + r];
            real *srow = Sb + r * BK, *dprow = dP + r * BK, *pdrow = Pd + r * BK;
            for (int64_t c = 0; c < nk; c++) {
                const real f = keep_entry(sm, th, rowidx + (uint64_t)c) ? kf : 0;
                pdrow[c] = srow[c] * f;
                dprow[c] = srow[c] * (dprow[c] * f - di);
            }
        }
        Pv = Pd;
    } else {
        for (int64_t r = 0; r < nq; r++) {
            const real di = delta[i0 + r];
            const real *srow = Sb + r * BK;
            real *dprow = dP + r * BK;
            for (int64_t c = 0; c < nk; c++) dprow[c] = srow[c] * (dprow[c] - di);
        }
    }
    for (int64_t r = 0; r < nq; r++)
        if (odd_row[r])
            for (int64_t c = 0; c < nk; c++)
                if (hidden[r][c]) dP[r * BK + c] = 0;
    if (!(want & (WANT_KV | WANT_Q))) return;
    if (want & WANT_KV)
        FN(gemm)(1, nk, Dv, nq, 1, Pv, BK, dorows, p->dout_stride[2], dvb + j0 * p->dv_stride[2],
                 p->dv_stride[2], 1);                                                  /* dv += P^T dO */
    /* per level: dS summed over 2^l blocks, level by level
     * from the one below; then that level's dq, or dk and dw */
    const real *dsl_prev = dP;
    int64_t ld_prev = BK, rl_prev = nq, cl_prev = nk;
    for (int l = 0; l < L; l++) {
        FN(span) sp = FN(level_span)(l, i0, i1, j0, j1);
        const real *dsl = dP;
        int64_t ldsl = BK;
        if (l > 0) {
            real *out = base + ws->dsl + ws->goff[l];
            for (int64_t a = 0; a < sp.rl; a++) {
                const real *r0 = dsl_prev + 2 * a * ld_prev;
                if (2 * a + 1 < rl_prev) {
                    const real *r1 = r0 + ld_prev;
                    for (int64_t c = 0; c < cl_prev; c++) tmp[c] = r0[c] + r1[c];
                    FN(pairsum)(tmp, cl_prev, out + a * sp.cl);
                } else {
                    FN(pairsum)(r0, cl_prev, out + a * sp.cl);
                }
            }
            dsl = out;
            ldsl = sp.cl;
        }
        dsl_prev = dsl;
        ld_prev = ldsl;
        rl_prev = sp.rl;
        cl_prev = sp.cl;
        const real wl = scale * FN(weight)(p, h, l);
        if (want & WANT_Q) {
            const real *kb = (const real *)p->k[l] + b * p->k_stride[l][0] + h * p->k_stride[l][1];
            real *dq = (real *)p->dq[l] + b * p->dq_stride[l][0] + h * p->dq_stride[l][1];
            FN(gemm)(0, sp.rl, D, sp.cl, wl, dsl, ldsl, kb + sp.c0 * p->k_stride[l][2], p->k_stride[l][2],
                     dq + sp.r0 * p->dq_stride[l][2], p->dq_stride[l][2], 1);
        }
        if (want & WANT_KV) {
            const real *G = base + ws->g + ws->goff[l];
            real dws = 0;
            for (int64_t a = 0; a < sp.rl; a++) dws += FN(dot)(sp.cl, dsl + a * ldsl, G + a * sp.cl);
            dwacc[l] += scale * dws;
            const real *qb = (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1];
            real *dk = (real *)p->dk[l] + b * p->dk_stride[l][0] + h * p->dk_stride[l][1];
            FN(gemm)(1, sp.cl, D, sp.rl, wl, dsl, ldsl, qb + sp.r0 * p->q_stride[l][2], p->q_stride[l][2],
                     dk + sp.c0 * p->dk_stride[l][2], p->dk_stride[l][2], 1);
        }
    }
}

/* Loads key tile j0 (transposed keys of every level, transposed values). */
static void FN(backward_keys)(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                              int64_t j0, int64_t j1, const real **kt, int64_t *ktld) {
    const real *vb = (const real *)p->v + b * p->v_stride[0] + h * p->v_stride[1];
    FN(load_key_tile)(p, ws, base, b, h, j0, j1, kt, ktld);
    FN(transpose)(j1 - j0, p->Dv, vb + j0 * p->v_stride[2], p->v_stride[2], base + ws->vt, BK);
}

/* Key tiles [kt0, kt1) against every query tile that sees them, in key-major
 * order, for the given sides; the key side's dw partials go to dw_partial. */
static void FN(backward_keys_range)(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                    int64_t kt0, int64_t kt1, int want) {
    const real *kt[HKT_MAX_LEVELS];
    int64_t ktld[HKT_MAX_LEVELS];
    real *dwacc = base + ws->dwacc;
    const int64_t nkt = (p->S + BK - 1) / BK;
    real *dwp = (real *)p->dw_partial + p->B * p->H * p->T + ((b * p->H + h) * nkt) * p->L;
    for (int64_t t = kt0; t < kt1; t++) {
        const int64_t j0 = t * BK, j1 = j0 + BK < p->S ? j0 + BK : p->S;
        FN(backward_keys)(p, ws, base, b, h, j0, j1, kt, ktld);
        for (int l = 0; l < p->L; l++) dwacc[l] = 0;
        /* causal: query tiles that end before j0 see none of these keys */
        for (int64_t i0 = p->causal ? (j0 / BQ) * BQ : 0; i0 < p->T; i0 += BQ)
            FN(backward_pair)(p, ws, base, b, h, i0, i0 + BQ < p->T ? i0 + BQ : p->T, j0, j1, kt, ktld, want, dwacc);
        if (want & WANT_KV)
            for (int l = 0; l < p->L; l++) dwp[t * p->L + l] = dwacc[l];
    }
}

/* dq of query tiles [qt0, qt1) in the same key-major order as the one-pass
 * schedule, so both schedules add every gradient in the same order. */
static void FN(backward_queries_range)(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                       int64_t qt0, int64_t qt1) {
    const real *kt[HKT_MAX_LEVELS];
    int64_t ktld[HKT_MAX_LEVELS];
    const int64_t iend = qt1 * BQ < p->T ? qt1 * BQ : p->T;
    const int64_t jend = p->causal ? (iend < p->S ? iend : p->S) : p->S;
    for (int64_t j0 = 0; j0 < jend; j0 += BK) {
        const int64_t j1 = j0 + BK < p->S ? j0 + BK : p->S;
        FN(backward_keys)(p, ws, base, b, h, j0, j1, kt, ktld);
        for (int64_t q = qt0; q < qt1; q++) {
            const int64_t i0 = q * BQ, i1 = i0 + BQ < p->T ? i0 + BQ : p->T;
            if (p->causal && i1 - 1 < j0) continue;
            FN(backward_pair)(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld, WANT_Q, NULL);
        }
    }
}

/* The float mask's gradient: dmask (dmask_shape; each dim 1 or full) is dS summed
 * over the dims where it is 1.  A task owns the dmask block (mb, mh, query tile
 * mqt, key tile mkt) — a whole dim where that dim is summed — and adds every
 * (b, h, query tile, key tile) pair that lands in it, in a fixed order: no races,
 * the same bits for any thread count.  Scores are recomputed for this (one more
 * pass over the pairs, paid only when the mask needs a gradient). */
static void FN(backward_mask_task)(const hkt_params *p, const ws_layout *ws, real *base, int64_t mb, int64_t mh,
                                   int64_t mqt, int64_t mkt) {
    const int64_t *ms = p->dmask_shape;
    const int own_b = ms[0] == p->B, own_h = ms[1] == p->H, own_i = ms[2] == p->T, own_j = ms[3] == p->S;
    const int64_t nqt = (p->T + BQ - 1) / BQ, nkt = (p->S + BK - 1) / BK;
    const int64_t qt0 = own_i ? mqt : 0, qt1 = own_i ? mqt + 1 : nqt;
    const int64_t kt0 = own_j ? mkt : 0, kt1 = own_j ? mkt + 1 : nkt;
    real *dm = (real *)p->dmask + (mb * ms[1] + mh) * ms[2] * ms[3];
    const real *dS = base + ws->dp;
    const real *kt[HKT_MAX_LEVELS];
    int64_t ktld[HKT_MAX_LEVELS];
    /* zero the block first: the backward overwrites */
    for (int64_t i = own_i ? qt0 * BQ : 0; i < (own_i ? (qt1 * BQ < p->T ? qt1 * BQ : p->T) : 1); i++)
        for (int64_t j = own_j ? kt0 * BK : 0; j < (own_j ? (kt1 * BK < p->S ? kt1 * BK : p->S) : 1); j++)
            dm[i * ms[3] + j] = 0;
    for (int64_t b = own_b ? mb : 0; b < (own_b ? mb + 1 : p->B); b++)
        for (int64_t h = own_h ? mh : 0; h < (own_h ? mh + 1 : p->H); h++)
            for (int64_t t = kt0; t < kt1; t++) {
                const int64_t j0 = t * BK, j1 = j0 + BK < p->S ? j0 + BK : p->S;
                FN(backward_keys)(p, ws, base, b, h, j0, j1, kt, ktld);
                for (int64_t q = qt0; q < qt1; q++) {
                    const int64_t i0 = q * BQ, i1 = i0 + BQ < p->T ? i0 + BQ : p->T;
                    if (p->causal && i1 - 1 < j0) continue;
                    FN(backward_pair)(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld, 0, NULL);
                    for (int64_t r = 0; r < i1 - i0; r++) {
                        const real *drow = dS + r * BK;
                        real *mrow = dm + (own_i ? i0 + r : 0) * ms[3];
                        if (own_j) {
                            for (int64_t c = 0; c < j1 - j0; c++) mrow[j0 + c] += drow[c];
                        } else {
                            real sum = 0;
                            for (int64_t c = 0; c < j1 - j0; c++) sum += drow[c];
                            mrow[0] += sum;
                        }
                    }
                }
            }
}

/* Zeroes (b, h)'s gradient rows (the backward overwrites) and fills
 * delta = rowsum(dO * out), the softmax backward's per-row term. */
static void FN(backward_prepare)(const hkt_params *p, int64_t b, int64_t h) {
    const int64_t T = p->T, S = p->S, D = p->D, Dv = p->Dv;
    for (int l = 0; l < p->L; l++) {
        const int64_t Tl = T > 0 ? ((T - 1) >> l) + 1 : 0, Sl = S > 0 ? ((S - 1) >> l) + 1 : 0;
        real *dq = (real *)p->dq[l] + b * p->dq_stride[l][0] + h * p->dq_stride[l][1];
        real *dk = (real *)p->dk[l] + b * p->dk_stride[l][0] + h * p->dk_stride[l][1];
        for (int64_t r = 0; r < Tl; r++) memset(dq + r * p->dq_stride[l][2], 0, sizeof(real) * D);
        for (int64_t c = 0; c < Sl; c++) memset(dk + c * p->dk_stride[l][2], 0, sizeof(real) * D);
    }
    real *dvb = (real *)p->dv + b * p->dv_stride[0] + h * p->dv_stride[1];
    for (int64_t j = 0; j < S; j++) memset(dvb + j * p->dv_stride[2], 0, sizeof(real) * Dv);
    const real *ob = (const real *)p->out + b * p->out_stride[0] + h * p->out_stride[1];
    const real *dob = (const real *)p->dout + b * p->dout_stride[0] + h * p->dout_stride[1];
    real *delta = (real *)p->dw_partial + (b * p->H + h) * T;
    for (int64_t i = 0; i < T; i++) delta[i] = FN(dot)(Dv, dob + i * p->dout_stride[2], ob + i * p->out_stride[2]);
}

/* Two schedules, bitwise equal results:
 *  - one task per (b, h), owning all its gradient rows (no atomics): used when
 *    there are at least as many (b, h) as threads;
 *  - otherwise two passes, each over chunks of one (b, h): key chunks write dk,
 *    dv and dw partials, query chunks write dq.  A chunk spans 2^(L-1) rows
 *    (at least one 64-row tile), so no coarse-level row is shared between chunks;
 *    scores are recomputed in both passes, the price of using every thread.
 * dw is reduced from per-(b, h, key tile) partials in a fixed order. */
static void FN(backward)(const hkt_params *p) {
    const ws_layout ws = layout(p, 1);
    const size_t wsb = hkt_workspace_bytes(p, 1);
    const int64_t nbh = p->B * p->H, nkt = (p->S + BK - 1) / BK, nqt = (p->T + BQ - 1) / BQ;
    const int nt = num_threads(p);
    const int64_t span = ((int64_t)1 << (p->L - 1)) > BK ? ((int64_t)1 << (p->L - 1)) / BK : 1; /* tiles per chunk */
    const int64_t nkc = (nkt + span - 1) / span, nqc = (nqt + span - 1) / span;
#define BASE ((real *)((char *)p->workspace + (size_t)thread_id() * wsb + WS_HEADER))
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t t = 0; t < nbh; t++) FN(backward_prepare)(p, t / p->H, t % p->H);
    if (nbh >= nt) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
        for (int64_t t = 0; t < nbh; t++)
            FN(backward_keys_range)(p, &ws, BASE, t / p->H, t % p->H, 0, nkt, WANT_KV | WANT_Q);
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
        for (int64_t t = 0; t < nbh * nkc; t++) {
            const int64_t bh = t / nkc, c = t % nkc;
            FN(backward_keys_range)(p, &ws, BASE, bh / p->H, bh % p->H, c * span,
                                    (c + 1) * span < nkt ? (c + 1) * span : nkt, WANT_KV);
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
        for (int64_t t = 0; t < nbh * nqc; t++) {
            const int64_t bh = t / nqc, c = nqc - 1 - t % nqc; /* causal: costlier chunks first */
            FN(backward_queries_range)(p, &ws, BASE, bh / p->H, bh % p->H, c * span,
                                       (c + 1) * span < nqt ? (c + 1) * span : nqt);
        }
    }
    if (p->dmask) {
        const int64_t *ms = p->dmask_shape;
        const int64_t mqt = ms[2] == p->T ? nqt : 1, mkt = ms[3] == p->S ? nkt : 1;
        const int64_t ntask = ms[0] * ms[1] * mqt * mkt;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
        for (int64_t t = 0; t < ntask; t++)
            FN(backward_mask_task)(p, &ws, BASE, t / (mkt * mqt) / ms[1], t / (mkt * mqt) % ms[1],
                                   t / mkt % mqt, t % mkt);
    }
#undef BASE
    /* dw[h, l] = sum over b and key tiles of the partials (and over h when w is shared) */
    real *dw = (real *)p->dw;
    const real *part = (const real *)p->dw_partial + nbh * p->T;
    const int64_t nw = p->w_per_head ? p->H * p->L : p->L;
    for (int64_t x = 0; x < nw; x++) dw[x] = 0;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->H; h++)
            for (int64_t t = 0; t < nkt; t++)
                for (int l = 0; l < p->L; l++)
                    dw[(p->w_per_head ? h * p->L : 0) + l] += part[((b * p->H + h) * nkt + t) * p->L + l];
}

#undef vec
#undef VL
#undef VL_FULL
#undef real
#undef FN
#endif
