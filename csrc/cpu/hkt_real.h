/*
 * hkt_real.h -- small helpers the CPU kernel bodies (hkt_products_body.h, hkt_attention_body.h,
 * hkt_backward_body.h, hkt_decode_body.h) share for one real type: the vector
 * types and their fused multiply-adds, loads and
 * stores, a dot product, the vectorisable exp of the softmax and the row max.
 * Like those bodies it needs `real` and REAL_IS_FLOAT defined first; a
 * translation unit includes it once (the guard), for its one real type.
 */
#ifndef HKT_REAL_H
#define HKT_REAL_H

#include "hkt_level.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* One vector of HKT_VEC_BYTES (hkt_cpu.h): as wide as the registers of the
 * instruction set the translation unit is built for -- a zmm with AVX-512, a
 * ymm with AVX2, an xmm (or a NEON q register) in the portable build.  A
 * vector wider than the registers has no machine mode and
 * lives in memory (GCC gives it BLKmode): 64-byte vectors built for AVX2 run
 * far slower than these. */
#define VL_FULL ((int64_t)(HKT_VEC_BYTES / sizeof(real)))
#define VL VL_FULL
typedef real vec __attribute__((vector_size(HKT_VEC_BYTES)));
/* The lanes the kernels pick, as index lists for every lane count of vec:
 * each half's lanes doubled (DUP_LO, DUP_HI), and the even and odd lanes of
 * two vectors side by side (EVEN, ODD). */
#if REAL_IS_FLOAT && HKT_VEC_BYTES == 64
#define HKT_LANES_DUP_LO 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7
#define HKT_LANES_DUP_HI 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15
#define HKT_LANES_EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HKT_LANES_ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
typedef int32_t ivec __attribute__((vector_size(64)));
#elif HKT_VEC_BYTES == 64 || (REAL_IS_FLOAT && HKT_VEC_BYTES == 32) /* 8 lanes: 64-byte doubles, 32-byte floats */
#define HKT_LANES_DUP_LO 0, 0, 1, 1, 2, 2, 3, 3
#define HKT_LANES_DUP_HI 4, 4, 5, 5, 6, 6, 7, 7
#define HKT_LANES_EVEN 0, 2, 4, 6, 8, 10, 12, 14
#define HKT_LANES_ODD 1, 3, 5, 7, 9, 11, 13, 15
#if REAL_IS_FLOAT
typedef int32_t ivec __attribute__((vector_size(32))); /* shuffle masks: integers as wide as the reals */
#else
typedef int64_t ivec __attribute__((vector_size(64)));
#endif
#elif HKT_VEC_BYTES == 32 || REAL_IS_FLOAT /* 4 lanes: 32-byte doubles, 16-byte floats */
#define HKT_LANES_DUP_LO 0, 0, 1, 1
#define HKT_LANES_DUP_HI 2, 2, 3, 3
#define HKT_LANES_EVEN 0, 2, 4, 6
#define HKT_LANES_ODD 1, 3, 5, 7
#if REAL_IS_FLOAT
typedef int32_t ivec __attribute__((vector_size(16)));
#else
typedef int64_t ivec __attribute__((vector_size(32)));
#endif
#else /* 16-byte doubles: 2 lanes */
#define HKT_LANES_DUP_LO 0, 0
#define HKT_LANES_DUP_HI 1, 1
#define HKT_LANES_EVEN 0, 2
#define HKT_LANES_ODD 1, 3
typedef int64_t ivec __attribute__((vector_size(16)));
#endif

/* Those lanes picked: GCC's __builtin_shuffle by a mask vector; clang has no
 * such shuffle (its __builtin_shufflevector takes the lanes as constants, as
 * GCC's does from GCC 12 on only), so there the same lists are its constants:
 * shuffle instructions either way, the same lanes.  vdup_half(a, hi): a's
 * high half doubled where hi is nonzero, else its low half. */
#if defined(__clang__)
#define vdup_lo(a) __builtin_shufflevector(a, a, HKT_LANES_DUP_LO)
#define vdup_hi(a) __builtin_shufflevector(a, a, HKT_LANES_DUP_HI)
#define veven(a, b) __builtin_shufflevector(a, b, HKT_LANES_EVEN)
#define vodd(a, b) __builtin_shufflevector(a, b, HKT_LANES_ODD)
static inline __attribute__((always_inline)) vec vdup_half(vec a, int hi) { return hi ? vdup_hi(a) : vdup_lo(a); }
#else
static const ivec dup_lo = {HKT_LANES_DUP_LO};
static const ivec dup_hi = {HKT_LANES_DUP_HI};
static const ivec even = {HKT_LANES_EVEN};
static const ivec odd = {HKT_LANES_ODD};
#define vdup_lo(a) __builtin_shuffle(a, dup_lo)
#define vdup_hi(a) __builtin_shuffle(a, dup_hi)
#define veven(a, b) __builtin_shuffle(a, b, even)
#define vodd(a, b) __builtin_shuffle(a, b, odd)
#define vdup_half(a, hi) __builtin_shuffle(a, (hi) ? dup_hi : dup_lo)
#endif

static inline __attribute__((always_inline)) vec vload(const real *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void vstore(real *p, vec v) { memcpy(p, &v, sizeof v); }

/* a * b + c rounded as GCC rounds the vector kernels' a * b + c: once where the
 * target has fused multiply-add (GCC contracts them there), twice where it has
 * not.  For scalar loops that must give the bits the vector tiles give: left to
 * GCC, such a loop was contracted in some copies of a function and, in others,
 * vectorised as products added one by one, unfused.  (__FP_FAST_FMA is not
 * defined under hkt_isa.h's target pragmas; __FMA__ is.) */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__FP_FAST_FMA)
#define HKT_FUSED_MADD 1
#endif
static inline real madd(real a, real b, real c) {
#if HKT_FUSED_MADD && REAL_IS_FLOAT
    return __builtin_fmaf(a, b, c);
#elif HKT_FUSED_MADD
    return __builtin_fma(a, b, c);
#else
    return a * b + c; /* no fused instruction to contract into */
#endif
}

/* The half- and quarter-width vectors of the narrow tiles (the coarse levels
 * of short sequences); a quarter of a 16-byte vector is narrower than a
 * double: none there. */
typedef real vech __attribute__((vector_size(HKT_VEC_BYTES / 2)));
#define HKT_QUARTER_TILES (HKT_VEC_BYTES >= 32 || REAL_IS_FLOAT)
#if HKT_QUARTER_TILES
typedef real vecq __attribute__((vector_size(HKT_VEC_BYTES / 4)));
#endif

/* madd lane by lane, for each vector type (vec_madd, vech_madd, vecq_madd):
 * a * b + c fused where the target has FMA, whatever the compiler contracts.
 * The tiles' products and the scalar leftovers (madd) must round alike, and
 * left to contraction they do only where GCC optimises (at -O0 it fuses
 * nothing).  The x86 intrinsics where the width has one; lane by lane where
 * not (the narrowest tiles); a * b + c where there is no fused instruction,
 * which no compiler contracts. */
#define HKT_MADD_LANES(VT)                                                                              \
    static inline __attribute__((always_inline)) VT VT##_madd(VT a, VT b, VT c) {                     \
        VT r;                                                                                           \
        for (int i = 0; i < (int)(sizeof(VT) / sizeof(real)); i++) r[i] = madd(a[i], b[i], c[i]);      \
        return r;                                                                                       \
    }
#define HKT_MADD_AS(VT, FN, MT)                                                                         \
    static inline __attribute__((always_inline)) VT VT##_madd(VT a, VT b, VT c) {                     \
        return (VT)FN((MT)a, (MT)b, (MT)c);                                                             \
    }
#define HKT_MADD_PLAIN(VT)                                                                              \
    static inline __attribute__((always_inline)) VT VT##_madd(VT a, VT b, VT c) { return a * b + c; }
#if HKT_FUSED_MADD && defined(__x86_64__)
#include <immintrin.h>
#if REAL_IS_FLOAT
#define HKT_MADD_64(VT) HKT_MADD_AS(VT, _mm512_fmadd_ps, __m512)
#define HKT_MADD_32(VT) HKT_MADD_AS(VT, _mm256_fmadd_ps, __m256)
#define HKT_MADD_16(VT) HKT_MADD_AS(VT, _mm_fmadd_ps, __m128)
#else
#define HKT_MADD_64(VT) HKT_MADD_AS(VT, _mm512_fmadd_pd, __m512d)
#define HKT_MADD_32(VT) HKT_MADD_AS(VT, _mm256_fmadd_pd, __m256d)
#define HKT_MADD_16(VT) HKT_MADD_AS(VT, _mm_fmadd_pd, __m128d)
#endif
#if HKT_VEC_BYTES == 64
HKT_MADD_64(vec)
HKT_MADD_32(vech)
HKT_MADD_16(vecq)
#elif HKT_VEC_BYTES == 32
HKT_MADD_32(vec)
HKT_MADD_16(vech)
HKT_MADD_LANES(vecq)
#else
HKT_MADD_16(vec)
HKT_MADD_LANES(vech)
#if HKT_QUARTER_TILES
HKT_MADD_LANES(vecq)
#endif
#endif
#elif HKT_FUSED_MADD
HKT_MADD_LANES(vec)
HKT_MADD_LANES(vech)
#if HKT_QUARTER_TILES
HKT_MADD_LANES(vecq)
#endif
#else
HKT_MADD_PLAIN(vec)
HKT_MADD_PLAIN(vech)
#if HKT_QUARTER_TILES
HKT_MADD_PLAIN(vecq)
#endif
#endif

/* <x, y> summed in double: the backward's delta = rowsum(dO * out), which dS =
 * P (dP - delta) subtracts from a number of about its size, so its rounding
 * error is magnified there; a double sum leaves one rounding, whatever the
 * vector width (the builds of different ISAs sum in different orders). */
static inline real dot_exact(int64_t n, const real *restrict x, const real *restrict y) {
    double acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t e = 0; e < n; e++) acc += (double)x[e] * (double)y[e];
    return (real)acc;
}

/* exp(x) for x <= 0 (the softmax's exp(score - max), or exp(score - lse) in the
 * backward); -inf gives exactly 0, NaN stays NaN. */
#if REAL_IS_FLOAT
/* Its constants, which its vector forms below share: the same numbers, the
 * same bits. */
#define EXP_MIN (-87.0f)             /* below: exp underflows, exactly 0 */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_ROUND 12582912.0f        /* 1.5 * 2^23 + n: rounds t to the nearest integer n */
#define EXP_LN2_HI 0.693359375f      /* ln 2 in two parts (Cody-Waite) */
#define EXP_LN2_LO (-2.12194440e-4f)
/* the polynomial's coefficients, highest degree first (Horner) */
static const float exp_coef[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};

static inline float exp_nonpos(float x) {
    /* Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial
     * (relative error ~2e-7): vectorises, unlike a libm call.  Written so that
     * each clamp is one max or min instruction and one compare serves both ends:
     * a NaN passes both clamps (a comparison with NaN is false) and poisons the
     * polynomial, so it needs no test of its own, and n's integer is read from
     * the rounding's bits (no float-to-int cast, undefined for NaN), in unsigned
     * arithmetic.  The same bits as a version with four compares and selects,
     * which the softmax spent a third of its exp on. */
    const int below = x < EXP_MIN; /* -inf too */
    const float lo = EXP_MIN > x ? EXP_MIN : x;
    const float xc = 0.0f < lo ? 0.0f : lo;
    /* madd where the vector forms fuse (their fmadd and fnmadd) */
    const float m = madd(xc, EXP_LOG2E, EXP_ROUND);
    const float n = m - EXP_ROUND;
    uint32_t mbits;
    memcpy(&mbits, &m, sizeof mbits);
    const float r = madd(-n, EXP_LN2_LO, madd(-n, EXP_LN2_HI, xc));
    float p = exp_coef[0];
#pragma GCC unroll 6
    for (int i = 1; i < 7; i++) p = madd(p, r, exp_coef[i]);
    const uint32_t bits = (mbits - 0x4B400000u + 127u) << 23; /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return below ? 0.0f : p * scale;
}

#if HKT_VEC_BYTES == 64 && HKT_ISA_BUILDS
#include <immintrin.h>
/* exp_nonpos on the 16 lanes of an AVX-512 vector, the same bits (checked on
 * 2^24 inputs: every float32 class, NaN and +-inf included): the same clamps,
 * reduction and polynomial as FMAs, but 2^n applied by vscalefps, which takes
 * n as the float it already is, and, zero-masked, gives the underflow's exact
 * 0 -- one instruction for the integer add, shift, multiply and select the
 * scalar form compiles to. */
#define HKT_AVX512_F32 1
/* its body: below, the lanes of x below EXP_MIN (zeroed); xc, x clamped to
 * [EXP_MIN, 0] or, where the caller knows that changes nothing, x itself */
static inline __attribute__((always_inline)) vec exp_lanes_avx512(__m512 x, __m512 xc) {
    const __m512 round = _mm512_set1_ps(EXP_ROUND);
    const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_LT_OQ);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(EXP_LOG2E), round), round);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), xc));
    __m512 q = _mm512_set1_ps(exp_coef[0]);
#pragma GCC unroll 6
    for (int i = 1; i < 7; i++) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(exp_coef[i]));
    return (vec)_mm512_maskz_scalef_ps((__mmask16)~below, q, n);
}
static inline __attribute__((always_inline)) vec exp_nonpos_vec(vec xv) {
    /* max and min return their second operand when one is NaN: a NaN passes */
    const __m512 x = (__m512)xv;
    return exp_lanes_avx512(x, _mm512_min_ps(_mm512_setzero_ps(), _mm512_max_ps(_mm512_set1_ps(EXP_MIN), x)));
}
/* exp_nonpos_vec without its clamps, for lanes that are <= 0 or NaN (the
 * forward's score - row max, the max of those very scores): the same bits.
 * Such a lane is unchanged by both clamps (min(0, x) = x, -0 included;
 * max(EXP_MIN, x) moves only lanes below EXP_MIN, whose result the mask zeroes
 * whatever the polynomial made of them, inf or NaN included), and a NaN passes
 * both.  Intel's cores issue the two clamps on the ports their FMAs use, so
 * leaving them out shortens the forward's softmax step there. */
static inline __attribute__((always_inline)) vec exp_nonpos_vec_le0(vec xv) {
    return exp_lanes_avx512((__m512)xv, (__m512)xv);
}
#elif HKT_VEC_BYTES == 32 && HKT_ISA_BUILDS
#include <immintrin.h>
/* exp_nonpos on the 8 lanes of an AVX2 vector, the same bits (the same
 * clamps, reduction and polynomial as FMAs, 2^n built from the rounding's bits
 * as the scalar form does).  GCC vectorises the scalar form too, but with two
 * byte blends for the selects and its constants spilled to the stack; this is
 * one and-not for the underflow's exact 0 and the constants in registers. */
#define HKT_AVX2_F32 1
/* its body, with below and xc as in exp_lanes_avx512 */
static inline __attribute__((always_inline)) vec exp_lanes_avx2(__m256 x, __m256 xc) {
    const __m256 round = _mm256_set1_ps(EXP_ROUND);
    /* all ones where x < EXP_MIN (-inf too) */
    const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_LT_OQ);
    const __m256 m = _mm256_fmadd_ps(xc, _mm256_set1_ps(EXP_LOG2E), round);
    const __m256 n = _mm256_sub_ps(m, round);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), xc));
    __m256 q = _mm256_set1_ps(exp_coef[0]);
#pragma GCC unroll 6
    for (int i = 1; i < 7; i++) q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(exp_coef[i]));
    /* 2^n: n's integer sits in m's low mantissa bits, offset by EXP_ROUND's */
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(m), _mm256_set1_epi32((int)(127u - 0x4B400000u))), 23);
    return (vec)_mm256_andnot_ps(below, _mm256_mul_ps(q, _mm256_castsi256_ps(bits)));
}
static inline __attribute__((always_inline)) vec exp_nonpos_vec(vec xv) {
    /* max and min return their second operand when one is NaN: a NaN passes */
    const __m256 x = (__m256)xv;
    return exp_lanes_avx2(x, _mm256_min_ps(_mm256_setzero_ps(), _mm256_max_ps(_mm256_set1_ps(EXP_MIN), x)));
}
/* without the clamps, as exp_nonpos_vec_le0 above (a lane below EXP_MIN gets
 * a garbage 2^n, then the and-not's 0) */
static inline __attribute__((always_inline)) vec exp_nonpos_vec_le0(vec xv) {
    return exp_lanes_avx2((__m256)xv, (__m256)xv);
}
#endif
#else
static inline double exp_nonpos(double x) { return exp(x); }
#endif
/* which intrinsics the build has (float32 only), and so whether it has a vector exp */
#ifndef HKT_AVX512_F32
#define HKT_AVX512_F32 0
#endif
#ifndef HKT_AVX2_F32
#define HKT_AVX2_F32 0
#endif
#define HKT_EXPV (HKT_AVX512_F32 || HKT_AVX2_F32)

/* scale * w_l, the factor a level's dot products are multiplied by, in this
 * real type: hkt_level.h's rule, which the CUDA kernels share (scale: the
 * caller's double, p->scale). */
static inline real level_factor(double scale, real w) {
#if REAL_IS_FLOAT
    return hkt_level_factor_f(scale, w);
#else
    return hkt_level_factor_d(scale, w);
#endif
}

/* Largest of x[0..n), NaN possibly skipped; -inf when nothing is visible, or NaN
 * if then some entry is NaN (a NaN anywhere else reaches the row sum through the
 * exp, so only this case needs the extra look). */
static inline real row_max(const real *restrict x, int64_t n) {
    real mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < n; c++) mx = x[c] > mx ? x[c] : mx;
    if (mx == -INFINITY)
        for (int64_t c = 0; c < n; c++)
            if (x[c] != x[c]) return NAN;
    return mx;
}

/* Soft-capping (docs/contract.md section 1.12): s[0..n) becomes c tanh(s / c),
 * and where grad is not NULL, grad[x] the cap's derivative 1 - tanh(s / c)^2,
 * which the backward multiplies into dS.  NaN stays NaN, and a huge |s| (an
 * infinity too) gives +-c without overflow.
 *
 * float32: libm's tanhf, one call per score, cost more than the rest of a
 * capped call together, so tanh is formed from exp_nonpos, which vectorises:
 * with a = |y|, e = exp(-2a) <= 1, tanh a = (1 - e) / (1 + e) and its
 * derivative 4e / (1 + e)^2 (no 1 - t^2 cancelling near 1); below a = 1/4,
 * where 1 - e would cancel, tanh's odd series to y^9 (truncation below 2e-8
 * relative).  A few ulp, as the softmax's own exp.  float64 keeps libm's tanh
 * (within an ulp): the reference-grade type. */
#if REAL_IS_FLOAT
static inline __attribute__((always_inline)) float cap_tanh(float y, float *deriv) {
    const float a = fabsf(y), y2 = y * y;
    const float e = exp_nonpos(-2.0f * a); /* NaN stays NaN; -inf gives 0 */
    const float big = (1.0f - e) / (1.0f + e);
    const float small =
        a * (1.0f + y2 * (-1.0f / 3 + y2 * (2.0f / 15 + y2 * (-17.0f / 315 + y2 * (62.0f / 2835)))));
    const int near0 = a < 0.25f;
    const float t = near0 ? small : big;
    *deriv = near0 ? 1.0f - t * t : 4.0f * e / ((1.0f + e) * (1.0f + e));
    return copysignf(t, y);
}
#endif

static inline void soft_cap(real *restrict s, int64_t n, real c, real *restrict grad) {
#if REAL_IS_FLOAT
    if (grad) {
#pragma omp simd
        for (int64_t x = 0; x < n; x++) s[x] = c * cap_tanh(s[x] / c, &grad[x]);
    } else {
#pragma omp simd
        for (int64_t x = 0; x < n; x++) {
            float d;
            s[x] = c * cap_tanh(s[x] / c, &d);
        }
    }
#else
    for (int64_t x = 0; x < n; x++) {
        const real t = tanh(s[x] / c);
        s[x] = c * t;
        if (grad) grad[x] = 1 - t * t;
    }
#endif
}

#endif
