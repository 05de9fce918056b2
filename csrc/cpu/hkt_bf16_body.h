/*
 * The bfloat16 forward on the CPU, computed natively: q, k and v stay bfloat16,
 * their products go through AVX512_BF16's vdpbf16ps (two bfloat16 products
 * added into a float32 lane per instruction, exact products, float32 sums), and
 * everything after the Gram blocks -- the fold of the levels, the masks, the
 * online softmax, the output and lse -- is the float32 kernel's own code.  P is
 * rounded to bfloat16 for P @ V (as flash-attention kernels do), while its row
 * sums are taken in float32 before the rounding.
 *
 * Not a header of declarations: included by hkt_cpu_f32.c after
 * hkt_attention_body.h (real = float), whose static helpers it calls.  Built
 * only into the AVX-512 set (HKT_BF16_HERE, hkt_cpu.h); it runs only where the CPU has the
 * instructions (hkt_cpu_has_bf16, checked by the binding).
 *
 * vdpbf16ps takes its operands as pairs along the reduction: C[i][n] +=
 * A[i][2kk] B[2kk][n] + A[i][2kk + 1] B[2kk + 1][n].  A row of A gives each
 * pair as one 32-bit word (broadcast); B is stored as pairs, word (kk, n) =
 * (B[2kk][n], B[2kk + 1][n]).  So the score's B (keys^T, (D, keys)) is the keys
 * as 32-bit words transposed, and P @ V's B is V with its rows interleaved two
 * by two.  Both are built once per (b, kv head) when they fit the key cache
 * (keys_all, values_all), else tile by tile.
 */
#if HKT_BF16_HERE
#include <immintrin.h>

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

typedef uint16_t bf16;

/* The pair x[0], x[1] as one 32-bit word (x[0] in the low half, as in memory). */
static inline __attribute__((always_inline)) uint32_t pair_at(const bf16 *x) {
    uint32_t u;
    memcpy(&u, x, sizeof u);
    return u;
}

/* An R x (NV vectors of 16) block of C [+]= A @ B over K2 pairs; the last
 * vector of each row holds the columns `last` selects (a narrower tail).
 * A's pair (r, kk) is the 32-bit word at A + r * ars + kk * aps bytes. */
static inline __attribute__((always_inline)) BF16_TARGET void bf16_tile(
    const int R, const int NV, const __mmask16 last, int64_t K2, const char *restrict A, int64_t ars, int64_t aps,
    const uint32_t *restrict B, int64_t ldb, float *restrict C, int64_t ldc, int accumulate) {
    __m512 c[12][4];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[r][v] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < K2; kk++) {
        __m512bh b[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            b[v] = (__m512bh)_mm512_maskz_loadu_epi32(v == NV - 1 ? last : 0xFFFF, B + kk * ldb + 16 * v);
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            uint32_t w;
            memcpy(&w, A + r * ars + kk * aps, sizeof w);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)w);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            float *out = C + r * ldc + 16 * v;
            const __mmask16 m = v == NV - 1 ? last : 0xFFFF;
            __m512 o = c[r][v];
            if (accumulate) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(m, out));
            _mm512_mask_storeu_ps(out, m, o);
        }
}

/* Rows [0, M) of one column block (NV vectors, the last `last`) in R-row
 * tiles, the rows left over in narrower ones (R a constant each). */
static inline __attribute__((always_inline)) BF16_TARGET void bf16_rows(
    const int R, const int NV, const __mmask16 last, int64_t M, int64_t K2, const char *A, int64_t ars, int64_t aps,
    const uint32_t *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t i = 0;
    for (; i + R <= M; i += R)
        bf16_tile(R, NV, last, K2, A + i * ars, ars, aps, B, ldb, C + i * ldc, ldc, accumulate);
    /* the rest, fewer than R rows, in pieces of 8, 4, 2 and 1 (those under R) */
#define BF16_REST(P)                                                                                         \
    if ((P) < R && M - i >= (P)) {                                                                           \
        bf16_tile(P, NV, last, K2, A + i * ars, ars, aps, B, ldb, C + i * ldc, ldc, accumulate);             \
        i += (P);                                                                                            \
    }
    BF16_REST(8)
    BF16_REST(4)
    BF16_REST(2)
    BF16_REST(1)
#undef BF16_REST
}

/* C (M, N) [+]= A (M, 2 K2) @ B (2 K2, N).  A's pair (i, kk) is the 32-bit word
 * at A + i * ars + kk * aps bytes: a bfloat16 row-major A (rows lda apart) has
 * ars = 2 lda, aps = 4; A^T of pairs packed along its rows (row_pairs) has
 * ars = 4, aps = 4 ld.  B as pairs (K2, N) words, rows ldb apart; C float32.
 * Every entry is one chain of vdpbf16ps over kk in order, whatever the tile,
 * so the tile shapes do not change a bit.  Tiles of 12 to 16 accumulators:
 * vdpbf16ps has a latency of about 6 cycles, and a core that issues two a
 * cycle needs 12 chains in flight to stay busy -- with 8 (the 8 x 1 tiles
 * this took over 16 and 32 columns before) the level-1 and -2 Gram blocks
 * (32 x 32 and 16 x 16) ran well below the rate of 64 x 64. */
static BF16_TARGET void gemm_dp(int64_t M, int64_t N, int64_t K2, const void *Av, int64_t ars, int64_t aps,
                                const uint32_t *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    const char *A = (const char *)Av;
    int64_t j = 0;
    for (; j + 64 <= N; j += 64) bf16_rows(4, 4, 0xFFFF, M, K2, A, ars, aps, B + j, ldb, C + j, ldc, accumulate);
    const int64_t rest = N - j;
    if (rest == 0) return;
    const __mmask16 last = rest % 16 ? (__mmask16)((1u << rest % 16) - 1) : 0xFFFF;
    if (rest > 48) bf16_rows(4, 4, last, M, K2, A, ars, aps, B + j, ldb, C + j, ldc, accumulate);
    else if (rest > 32) bf16_rows(4, 3, last, M, K2, A, ars, aps, B + j, ldb, C + j, ldc, accumulate);
    else if (rest > 16) bf16_rows(6, 2, last, M, K2, A, ars, aps, B + j, ldb, C + j, ldc, accumulate);
    else if (M > 24) bf16_rows(12, 1, last, M, K2, A, ars, aps, B + j, ldb, C + j, ldc, accumulate);
    else bf16_rows(8, 1, last, M, K2, A, ars, aps, B + j, ldb, C + j, ldc, accumulate); /* 16 rows: two 8s, not 12 + 4 */
}

#if HKT_AMX
/* ---- the same products on AMX tiles ----
 * TDPBF16PS takes A as 16 rows of kc <= 16 pairs (4 kc bytes each, rows any
 * stride apart: a bfloat16 row-major A as it is) and B as kc rows of pairs
 * (kk, n), 16 columns each: the pair layout above.  C is a 16 x 16 float32
 * tile.  The tiles are configured per thread (amx_ready): C in tmm0-3 (a 2 x 2
 * block of them), A in tmm4-5, B in tmm6-7, for steps of kc = 16 pairs, or of
 * all K2 pairs where K2 < 16 (the coarse levels' dq and dk: 8 pairs at level
 * 2), which costs a reconfiguration each way.  gemm_amx takes the
 * whole 16 x 16 blocks of C over reductions of whole steps; gemm_bf16 gives
 * the ragged edges to gemm_dp.  The sums are
 * formed in a different order than gemm_dp's, so the AMX path has bits of its
 * own -- fixed by the sizes, the same for any thread count. */
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

static AMX_TARGET void amx_ready(int kc) {
    /* hkt_amx_epoch when this thread last configured, and for which kc */
    static __thread uint64_t loaded = 0;
    static __thread int loaded_kc = 0;
    const uint64_t now = __atomic_load_n(&hkt_amx_epoch, __ATOMIC_RELAXED);
    if (loaded == now && loaded_kc == kc) return;
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t >= 6 ? kc : 16;                /* B: kc rows of pairs */
        c.colsb[t] = t == 4 || t == 5 ? 4 * kc : 64; /* A: kc pairs a row */
    }
    _tile_loadconfig(&c);
    loaded = now;
    loaded_kc = kc;
}

/* C's 16 x 16 blocks at (i, j), (i, j + 16) if two_j, (i + 16, j) if two_i
 * and (i + 16, j + 16) if both [+]= A @ B, A and C already offset to (i, j). */
static inline __attribute__((always_inline)) AMX_TARGET void amx_block(int two_i, int two_j, int64_t K2, int kc,
                                                                      const char *A, int64_t ars, const uint32_t *B,
                                                                      int64_t ldb, float *C, int64_t ldc, int acc) {
    const int64_t cs = ldc * 4, bs = ldb * 4;
    if (acc) {
        _tile_loadd(0, C, cs);
        if (two_j) _tile_loadd(1, C + 16, cs);
        if (two_i) _tile_loadd(2, C + 16 * ldc, cs);
        if (two_i && two_j) _tile_loadd(3, C + 16 * ldc + 16, cs);
    } else {
        _tile_zero(0);
        if (two_j) _tile_zero(1);
        if (two_i) _tile_zero(2);
        if (two_i && two_j) _tile_zero(3);
    }
    for (int64_t kk = 0; kk < K2; kk += kc) {
        _tile_loadd(4, A + kk * 4, ars);
        _tile_loadd(6, B + kk * ldb, bs);
        _tile_dpbf16ps(0, 4, 6);
        if (two_j) {
            _tile_loadd(7, B + kk * ldb + 16, bs);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_i) {
            _tile_loadd(5, A + 16 * ars + kk * 4, ars);
            _tile_dpbf16ps(2, 5, 6);
            if (two_j) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, C, cs);
    if (two_j) _tile_stored(1, C + 16, cs);
    if (two_i) _tile_stored(2, C + 16 * ldc, cs);
    if (two_i && two_j) _tile_stored(3, C + 16 * ldc + 16, cs);
}

/* gemm_dp's product over C's first M16 rows and N16 columns (multiples of 16),
 * K2 a multiple of kc (amx_kc), A row-major (pairs 4 bytes apart). */
static AMX_TARGET void gemm_amx(int64_t M16, int64_t N16, int64_t K2, int kc, const char *A, int64_t ars,
                                const uint32_t *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
    amx_ready(kc);
    for (int64_t j = 0; j < N16; j += 32) {
        const int two_j = j + 32 <= N16;
        int64_t i = 0;
        if (two_j)
            for (; i + 32 <= M16; i += 32) amx_block(1, 1, K2, kc, A + i * ars, ars, B + j, ldb, C + i * ldc + j, ldc, accumulate);
        else
            for (; i + 32 <= M16; i += 32) amx_block(1, 0, K2, kc, A + i * ars, ars, B + j, ldb, C + i * ldc + j, ldc, accumulate);
        if (i < M16) {
            if (two_j) amx_block(0, 1, K2, kc, A + i * ars, ars, B + j, ldb, C + i * ldc + j, ldc, accumulate);
            else amx_block(0, 0, K2, kc, A + i * ars, ars, B + j, ldb, C + i * ldc + j, ldc, accumulate);
        }
    }
}
#endif

/* The step gemm_amx takes a reduction of K2 pairs in: 16, or all of a shorter
 * one; 0 where neither fits (gemm_dp then). */
static inline int amx_kc(int64_t K2) { return K2 % 16 == 0 ? 16 : K2 < 16 ? (int)K2 : 0; }

/* gemm_dp's product, on AMX where ws->amx says so and the operands allow:
 * A row-major (aps 4) and a reduction amx_kc takes; the rows and columns past
 * the last whole 16 go to gemm_dp. */
static void gemm_bf16(const ws_layout *ws, int64_t M, int64_t N, int64_t K2, const void *A, int64_t ars, int64_t aps,
                      const uint32_t *B, int64_t ldb, float *C, int64_t ldc, int accumulate) {
#if HKT_AMX
    const int64_t M16 = M & ~(int64_t)15, N16 = N & ~(int64_t)15;
    if (ws->amx && aps == 4 && amx_kc(K2) && M16 > 0 && N16 > 0) {
        gemm_amx(M16, N16, K2, amx_kc(K2), (const char *)A, ars, B, ldb, C, ldc, accumulate);
        if (N16 < N) gemm_dp(M16, N - N16, K2, A, ars, aps, B + N16, ldb, C + N16, ldc, accumulate);
        if (M16 < M) gemm_dp(M - M16, N, K2, (const char *)A + M16 * ars, ars, aps, B, ldb, C + M16 * ldc, ldc, accumulate);
        return;
    }
#else
    (void)ws;
#endif
    gemm_dp(M, N, K2, A, ars, aps, B, ldb, C, ldc, accumulate);
}

/* Rows of src (n bfloat16 rows of w, w even, lds apart) as pairs along each
 * row, transposed: word (c2, r) of dst (rows ldd words apart) = (src[r][2 c2],
 * src[r][2 c2 + 1]).  A GEMM's B for the rows' matrix transposed (keys^T for
 * the scores, values^T for dP). */
static void col_pairs(const bf16 *src, int64_t lds, int64_t n, int64_t w, uint32_t *dst, int64_t ldd) {
    if (lds % 2 == 0 && w % 2 == 0) {
        /* rows of whole words: the float32 build's 16 x 16 register transpose,
         * which moves bits without touching them (loads, shuffles, stores),
         * faster than this scalar loop */
        transpose(n, w / 2, (const float *)(const void *)src, lds / 2, (float *)(void *)dst, ldd);
        return;
    }
    for (int64_t r = 0; r < n; r++)
        for (int64_t c2 = 0; c2 < w / 2; c2++) dst[c2 * ldd + r] = pair_at(src + r * lds + 2 * c2);
}

/* Rows of src (n bfloat16 rows of w, lds apart) interleaved two by two: word
 * (r2, c) of dst (rows ldd words apart) = (src[2 r2][c], src[2 r2 + 1][c]), the
 * partner past an odd n zero.  As a GEMM's B it is the rows' matrix (values
 * for P @ V, keys for dq, queries for dk, dO for dv). */
static BF16_TARGET void bf16_row_pairs(const bf16 *src, int64_t lds, int64_t n, int64_t w, uint32_t *dst,
                                       int64_t ldd) {
    for (int64_t r = 0; r < n; r += 2) {
        const bf16 *lo = src + r * lds, *hi = r + 1 < n ? lo + lds : NULL;
        uint32_t *d = dst + r / 2 * ldd;
        if (hi)
            for (int64_t c = 0; c < w; c++) d[c] = (uint32_t)lo[c] | (uint32_t)hi[c] << 16;
        else
            for (int64_t c = 0; c < w; c++) d[c] = lo[c];
    }
}

/* Key rows [j0, j1) of every level as pairs along D (col_pairs) into kp[l],
 * rows ld[l] words apart, level l's column c at c - base_col[l]. */
static void pack_keys_bf16(const hkt_params *p, int64_t b, int64_t h, int64_t j0, int64_t j1, float *const *kp,
                           const int64_t *ld, const int64_t *base_col) {
    for (int l = 0; l < p->L; l++) {
        span sp = level_span(l, 0, 1, j0, j1);
        const bf16 *kb = (const bf16 *)p->k[l] + b * p->k_stride[l][0] + kv_head(p, h) * p->k_stride[l][1];
        col_pairs(kb + sp.c0 * p->k_stride[l][2], p->k_stride[l][2], sp.cl, p->D,
                  (uint32_t *)kp[l] + sp.c0 - base_col[l], ld[l]);
    }
}

/* The Gram blocks q_l k_l^T of query tile [i0, i1) and key tile [j0, j1): the
 * query rows read as they are, the keys as pairs (kp[l], rows ld[l] apart, from
 * the tile's first column). */
static void grams_bf16(const hkt_params *p, const ws_layout *ws, float *base, int64_t b, int64_t h, int64_t i0,
                       int64_t i1, int64_t j0, int64_t j1, const uint32_t *const *kp, const int64_t *ld) {
    for (int l = 0; l < p->L; l++) {
        span sp = level_span(l, i0, i1, j0, j1);
        const bf16 *qb = (const bf16 *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1];
        gemm_bf16(ws, sp.rl, sp.cl, p->D / 2, qb + sp.r0 * p->q_stride[l][2], 2 * p->q_stride[l][2], 4, kp[l], ld[l],
                  base + ws->gram + ws->gram_off[l], sp.cl, 0);
    }
}

/* dst = alpha * src rounded to bfloat16 (nearest even): n rows of w floats
 * (lds apart) to n rows ldd bfloat16 apart, each zero-padded to an even length
 * so its last pair is whole. */
static BF16_TARGET void rows_to_bf16(const float *src, int64_t lds, int64_t n, int64_t w, float alpha, bf16 *dst,
                                     int64_t ldd) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t r = 0; r < n; r++) {
        const float *s = src + r * lds;
        bf16 *d = dst + r * ldd;
        for (int64_t c = 0; c < w; c += 32) {
            const int64_t m = w - c;
            const __mmask16 m0 = m >= 16 ? 0xFFFF : (__mmask16)((1u << m) - 1);
            const __mmask16 m1 = m >= 32 ? 0xFFFF : m > 16 ? (__mmask16)((1u << (m - 16)) - 1) : 0;
            const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m1, s + c + 16)),
                                                   _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m0, s + c)));
            /* whole pairs only: an odd w gets its zero partner */
            const int64_t keep = m >= 32 ? 32 : (m + 1) & ~(int64_t)1;
            _mm512_mask_storeu_epi16(d + c, keep >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << keep) - 1), (__m512i)x);
        }
    }
}

/* v's 32 bfloat16 words (x0's in words 0..15, x1's in 16..31, as
 * vcvtne2ps2bf16 leaves them) as the 16 pairs (x0[i], x1[i]), one 32-bit word
 * each. */
static inline __attribute__((always_inline)) BF16_TARGET __m512i interleave_pairs(__m512i v) {
    /* 16-bit word k of the interleave: x0's element k / 2 (k even, words 0..15 of
     * v) or x1's (k odd, words 16..31) */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, v);
}

/* bfloat16 of x0 and x1 (16 floats each, nearest even) as the 16 pairs
 * (x0[i], x1[i]), one 32-bit word each. */
static inline __attribute__((always_inline)) BF16_TARGET __m512i pair_words(__m512 x0, __m512 x1) {
    return interleave_pairs((__m512i)_mm512_cvtne2ps_pbh(x1, x0));
}

/* Rows of src (n rows of w floats, lds apart) times alpha, rounded, as pairs
 * along the rows: word (r2, c) of pairs (rows ldp words apart) = (src[2 r2][c],
 * src[2 r2 + 1][c]), the partner past an odd n zero.  As a GEMM's B it is the
 * rows' matrix; as its A (ars = 4, aps = 4 ldp) the transpose of that matrix.
 * Where rows is given, the same rounded rows row-major too (rows_to_bf16's
 * layout, ldr bfloat16 apart: dS_l's rows for dq beside its pairs for dk),
 * from the same products rounded by the same instruction, so the same bits,
 * with dS read and scaled once, not twice. */
static BF16_TARGET void rows_and_pairs(const float *src, int64_t lds, int64_t n, int64_t w, float alpha, bf16 *rows,
                                       int64_t ldr, uint32_t *pairs, int64_t ldp) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t r = 0; r < n; r += 2) {
        const float *s0 = src + r * lds, *s1 = r + 1 < n ? s0 + lds : NULL;
        uint32_t *d = pairs + r / 2 * ldp;
        for (int64_t c = 0; c < w; c += 16) {
            const int64_t left = w - c;
            const __mmask16 m = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __m512 x0 = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, s0 + c));
            const __m512 x1 = s1 ? _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, s1 + c)) : _mm512_setzero_ps();
            const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(x1, x0); /* x0's in words 0..15, x1's in 16..31 */
            if (rows) {
                /* rows_to_bf16 writes whole pairs: an odd w's zero partner too */
                const int64_t keep = left >= 16 ? 16 : (left + 1) & ~(int64_t)1;
                const __mmask16 mk = keep >= 16 ? 0xFFFF : (__mmask16)((1u << keep) - 1);
                bf16 *d0 = rows + r * ldr + c;
                _mm256_mask_storeu_epi16(d0, mk, _mm512_castsi512_si256(v));
                if (s1) _mm256_mask_storeu_epi16(d0 + ldr, mk, _mm512_extracti64x4_epi64(v, 1));
            }
            _mm512_mask_storeu_epi32(d + c, m, interleave_pairs(v));
        }
    }
}

/* rows_and_pairs' pairs alone (dst, rows ldd words apart) */
static BF16_TARGET void row_pairs(const float *src, int64_t lds, int64_t n, int64_t w, float alpha, uint32_t *dst,
                                  int64_t ldd) {
    rows_and_pairs(src, lds, n, w, alpha, NULL, 0, dst, ldd);
}

/* row_pairs' words transposed, in one pass: word (c, r2) of dst (rows ldd
 * words apart) = (src[2 r2][c], src[2 r2 + 1][c]) times alpha, rounded -- the
 * matrix's transpose as a row-major A with pairs along its rows, which AMX
 * needs.  16 x 16 blocks of words, transposed in registers. */
static BF16_TARGET void row_pairs_t(const float *src, int64_t lds, int64_t n, int64_t w, float alpha, uint32_t *dst,
                                    int64_t ldd) {
    const __m512 a = _mm512_set1_ps(alpha);
    const int64_t n2 = (n + 1) / 2;
    for (int64_t c0 = 0; c0 < w; c0 += 16) {
        const int64_t wc = w - c0 < 16 ? w - c0 : 16;
        const __mmask16 m = wc == 16 ? 0xFFFF : (__mmask16)((1u << wc) - 1);
        for (int64_t r0 = 0; r0 < n2; r0 += 16) {
            const int64_t nr = n2 - r0 < 16 ? n2 - r0 : 16;
            __m512i x[16];
            for (int i = 0; i < 16; i++) {
                const int64_t r = 2 * (r0 + i);
                if (i >= nr) {
                    x[i] = _mm512_setzero_si512();
                    continue;
                }
                const __m512 x0 = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, src + r * lds + c0));
                const __m512 x1 = r + 1 < n ? _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, src + (r + 1) * lds + c0))
                                            : _mm512_setzero_ps();
                x[i] = pair_words(x0, x1);
            }
            transpose16(x);
            const __mmask16 mr = nr == 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1);
            for (int64_t j = 0; j < wc; j++) _mm512_mask_storeu_epi32(dst + (c0 + j) * ldd + r0, mr, x[j]);
        }
    }
}

/* bfloat16 of 16 floats as torch's vectorised conversion (x86) rounds them:
 * to nearest, ties to even, on the bits -- subnormals kept, which
 * vcvtne2ps2bf16 flushes to zero -- and a NaN as 0xFFFF. */
static inline __attribute__((always_inline)) BF16_TARGET __m256i round_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF)));
}

/* n finished rows of w floats (lds apart) into n bfloat16 rows (ldd apart),
 * round_bf16's rounding: bf16_out's results. */
static BF16_TARGET void rows_out_bf16(const float *src, int64_t lds, int64_t n, int64_t w, bf16 *dst, int64_t ldd) {
    for (int64_t r = 0; r < n; r++) {
        const float *s = src + r * lds;
        bf16 *d = dst + r * ldd;
        for (int64_t c = 0; c < w; c += 16) {
            const __mmask16 m = w - c >= 16 ? 0xFFFF : (__mmask16)((1u << (w - c)) - 1);
            _mm256_mask_storeu_epi16(d + c, m, round_bf16(_mm512_maskz_loadu_ps(m, s + c)));
        }
    }
}

/* forward_task (hkt_attention_body.h) with bfloat16 inputs.  With bf16_out the
 * task's out rows are summed in its workspace (out_tile) and rounded once,
 * finished. */
static BF16_TARGET void forward_task_bf16(const hkt_params *p, const ws_layout *ws, char *block, int64_t b, int64_t h,
                                          int64_t qt) {
    const int64_t T = p->T, S = p->S, Dv = p->Dv;
    const int64_t i0 = qt * BQ, i1 = i0 + BQ < T ? i0 + BQ : T, nq = i1 - i0;
    float *base = (float *)(block + WS_HEADER);
    float *ready = base + ws->keys_ready;
    bf16 *pb = (bf16 *)(base + ws->p_bf16);
    const int64_t out_at = b * p->out_stride[0] + h * p->out_stride[1] + i0 * p->out_stride[2];
    float *ob = p->bf16_out ? base + ws->out_tile : (float *)p->out + out_at;
    const int64_t ldo = p->bf16_out ? Dv : p->out_stride[2];
    const bf16 *vb = (const bf16 *)p->v + b * p->v_stride[0] + kv_head(p, h) * p->v_stride[1];
    uint32_t *vall = (uint32_t *)(base + ws->values_all);
    const query_tile tile = {p, ws, base, b, h, i0, nq, ob, ldo};
    start_task(&tile, block);
    const int64_t jend = key_end(p, i1);
    for (int64_t j0 = first_key_tile(p, i0); j0 < jend; j0 += BK) {
        const int64_t j1 = j0 + BK < S ? j0 + BK : S, nk = j1 - j0;
        const uint32_t *kp[HKT_MAX_LEVELS], *vp;
        float *buf[HKT_MAX_LEVELS]; /* holding 32-bit words: bfloat16 pairs */
        int64_t ld[HKT_MAX_LEVELS], col0[HKT_MAX_LEVELS];
        if (ws->keys_cached) {
            cached_tile_place(p, ws, base, j0, j1, buf, ld, col0);
            if (!ready[j0 / BK]) {
                pack_keys_bf16(p, b, h, j0, j1, buf, ld, col0);
                bf16_row_pairs(vb + j0 * p->v_stride[2], p->v_stride[2], nk, Dv, vall + j0 / 2 * Dv, Dv);
                ready[j0 / BK] = 1;
            }
            vp = vall + j0 / 2 * Dv;
        } else {
            key_tile_place(p, ws, base, j0, j1, buf, ld, col0);
            pack_keys_bf16(p, b, h, j0, j1, buf, ld, col0);
            uint32_t *vt = (uint32_t *)(base + ws->value_tile);
            bf16_row_pairs(vb + j0 * p->v_stride[2], p->v_stride[2], nk, Dv, vt, Dv);
            vp = vt;
        }
        for (int l = 0; l < p->L; l++) kp[l] = (const uint32_t *)buf[l];
        grams_bf16(p, ws, base, b, h, i0, i1, j0, j1, kp, ld);
        tile_fold(p, ws, base, b, h, i0, i1, j0, j1);
        softmax_update(&tile, j0, nk);
        rows_to_bf16(base + ws->scores, BK, nq, nk, 1.0f, pb, BK);
        gemm_bf16(ws, nq, Dv, (nk + 1) / 2, pb, 2 * BK, 4, vp, Dv, ob, ldo, 1);
    }
    finish_rows(&tile);
    if (p->bf16_out) rows_out_bf16(ob, ldo, nq, Dv, (bf16 *)p->out + out_at, p->out_stride[2]);
}

void hkt_forward_bf16_avx512(const hkt_params *p) { run_forward(p, forward_task_bf16); }
/* ---- the backward with bfloat16 inputs ----
 * q, k, v, dO and out bfloat16; lse, the gradients and the float mask float32.
 * The float32 body's backward runs with these hooks in place of its gemm
 * calls: same operands, same accumulation into float32, P and dS rounded to
 * bfloat16 as the forward rounds P. */

/* Key tile [j0, j1) of every level as the scores' B (pairs along D, key_tile)
 * and dq's B (row pairs, key_pairs), and the values as dP's B (values_t). */
static void keys_bf16(const hkt_params *p, const ws_layout *ws, float *base, int64_t b, int64_t h, int64_t j0,
                      int64_t j1) {
    float *buf[HKT_MAX_LEVELS];
    int64_t ld[HKT_MAX_LEVELS], col0[HKT_MAX_LEVELS];
    key_tile_place(p, ws, base, j0, j1, buf, ld, col0);
    pack_keys_bf16(p, b, h, j0, j1, buf, ld, col0);
    const int64_t hk = kv_head(p, h);
    for (int l = 0; l < p->L; l++) {
        const bf16 *kb = (const bf16 *)p->k[l] + b * p->k_stride[l][0] + hk * p->k_stride[l][1];
        bf16_row_pairs(kb + col0[l] * p->k_stride[l][2], p->k_stride[l][2], ld[l], p->D,
                       (uint32_t *)(base + ws->key_pairs + ws->key_pairs_off[l]), p->D);
    }
    const bf16 *vb = (const bf16 *)p->v + b * p->v_stride[0] + hk * p->v_stride[1] + j0 * p->v_stride[2];
    col_pairs(vb, p->v_stride[2], j1 - j0, p->Dv, (uint32_t *)(base + ws->values_t), BK);
}

/* The pair's Gram blocks, from the key tile keys_bf16 packed. */
static void tile_grams_bf16(const hkt_params *p, const ws_layout *ws, float *base, int64_t b, int64_t h, int64_t i0,
                            int64_t i1, int64_t j0, int64_t j1) {
    const uint32_t *kp[HKT_MAX_LEVELS];
    int64_t ld[HKT_MAX_LEVELS];
    for (int l = 0; l < p->L; l++) {
        kp[l] = (const uint32_t *)(base + ws->key_tile + ws->key_tile_off[l]);
        ld[l] = level_span(l, 0, 1, j0, j1).cl;
    }
    grams_bf16(p, ws, base, b, h, i0, i1, j0, j1, kp, ld);
}

static const bf16 *dout_rows(const hkt_params *p, int64_t b, int64_t h, int64_t i0) {
    return (const bf16 *)p->dout + b * p->dout_stride[0] + h * p->dout_stride[1] + i0 * p->dout_stride[2];
}

/* dP (nq, BK) = dO V^T, the dO rows read as they are. */
static void dp_bf16(const hkt_params *p, const ws_layout *ws, float *base, int64_t b, int64_t h, int64_t i0,
                    int64_t nq, int64_t nk, float *dP) {
    gemm_bf16(ws, nq, nk, p->Dv / 2, dout_rows(p, b, h, i0), 2 * p->dout_stride[2], 4,
              (const uint32_t *)(base + ws->values_t), BK, dP, BK, 0);
}

/* C (M, N) += (alpha X)^T B: X float32 (n rows of M, ldx apart), rounded and
 * paired along its rows (the reduction).  gemm_dp reads row_pairs' words
 * transposed in place (pairs, BK words a row); AMX needs the transpose
 * row-major, which row_pairs_t writes (into pairs_t) in the same pass. */
static int rows_t_on_amx(const ws_layout *ws, int64_t M, int64_t N, int64_t n) {
    return ws->amx && amx_kc((n + 1) / 2) && M >= 16 && N >= 16;
}

/* paired: row_pairs' words are in pairs already (rows_and_pairs) */
static void gemm_rows_t(const ws_layout *ws, float *base, int64_t M, int64_t N, int64_t n, const float *X,
                        int64_t ldx, float alpha, uint32_t *pairs, const uint32_t *B, int64_t ldb, float *C,
                        int64_t ldc, int paired) {
    const int64_t K2 = (n + 1) / 2;
    if (rows_t_on_amx(ws, M, N, n)) {
        uint32_t *xt = (uint32_t *)(base + ws->pairs_t);
        row_pairs_t(X, ldx, n, M, alpha, xt, BQ / 2);
        gemm_bf16(ws, M, N, K2, xt, 4 * (BQ / 2), 4, B, ldb, C, ldc, 1);
    } else {
        if (!paired) row_pairs(X, ldx, n, M, alpha, pairs, BK);
        gemm_bf16(ws, M, N, K2, pairs, 4, 4 * BK, B, ldb, C, ldc, 1);
    }
}

/* dv rows [j0, j0 + nk) += Pv^T dO: Pv and dO as row pairs (pairs along the
 * queries, the reduction), Pv read transposed; dO's pairs already there when
 * packed (ROWS_PACKED). */
static void dv_bf16(const hkt_params *p, const ws_layout *ws, float *base, const float *Pv, int64_t b, int64_t h,
                    int64_t i0, int64_t nq, int64_t j0, int64_t nk, int packed) {
    uint32_t *pp = (uint32_t *)(base + ws->p_pairs), *dop = (uint32_t *)(base + ws->do_pairs);
    if (!packed) bf16_row_pairs(dout_rows(p, b, h, i0), p->dout_stride[2], nq, p->Dv, dop, p->Dv);
    float *dv = (float *)p->dv + b * p->dv_stride[0] + kv_head(p, h) * p->dv_stride[1] + j0 * p->dv_stride[2];
    gemm_rows_t(ws, base, nk, p->Dv, nq, Pv, BK, 1.0f, pp, dop, p->Dv, dv, p->dv_stride[2], 0);
}

/* dq_l rows [r0, r0 + rl) += wl dS_l k_l: dS_l (rl, cl) scaled and rounded,
 * k_l as row pairs (keys_bf16).  for_dk: dk_bf16 takes dS_l next, which then
 * finds its pairs made here where it reads pairs (returns 1 then). */
static int dq_bf16(const hkt_params *p, const ws_layout *ws, float *base, int l, const float *dsl, int64_t ldsl,
                   int64_t r0, int64_t rl, int64_t cl, float wl, int64_t b, int64_t h, int for_dk) {
    bf16 *ds = (bf16 *)(base + ws->ds_bf16);
    const int paired = for_dk && !rows_t_on_amx(ws, cl, p->D, rl);
    if (paired) rows_and_pairs(dsl, ldsl, rl, cl, wl, ds, BK, (uint32_t *)(base + ws->ds_pairs), BK);
    else rows_to_bf16(dsl, ldsl, rl, cl, wl, ds, BK);
    float *dq = (float *)p->dq[l] + b * p->dq_stride[l][0] + h * p->dq_stride[l][1] + r0 * p->dq_stride[l][2];
    gemm_bf16(ws, rl, p->D, (cl + 1) / 2, ds, 2 * BK, 4, (const uint32_t *)(base + ws->key_pairs + ws->key_pairs_off[l]),
              p->D, dq, p->dq_stride[l][2], 1);
    return paired;
}

/* dk_l rows [c0, c0 + cl) += wl dS_l^T q_l: dS_l and the query rows [r0, r0 +
 * rl) as row pairs (those already there when packed), dS_l read transposed. */
static void dk_bf16(const hkt_params *p, const ws_layout *ws, float *base, int l, const float *dsl, int64_t ldsl,
                    int64_t r0, int64_t rl, int64_t c0, int64_t cl, float wl, int64_t b, int64_t h, int packed,
                    int paired) {
    uint32_t *dsp = (uint32_t *)(base + ws->ds_pairs), *qp = (uint32_t *)(base + ws->q_pairs + ws->q_off[l]);
    const bf16 *q = (const bf16 *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1] + r0 * p->q_stride[l][2];
    if (!packed) bf16_row_pairs(q, p->q_stride[l][2], rl, p->D, qp, p->D);
    float *dk = (float *)p->dk[l] + b * p->dk_stride[l][0] + kv_head(p, h) * p->dk_stride[l][1] +
                c0 * p->dk_stride[l][2];
    gemm_rows_t(ws, base, cl, p->D, rl, dsl, ldsl, wl, dsp, qp, p->D, dk, p->dk_stride[l][2], paired);
}

static void grads_out_bf16(const hkt_params *dst, const hkt_params *acc, int64_t b, int64_t hk) {
    const int64_t group = dst->H / dst->H_kv;
    for (int l = 0; l < dst->L; l++) {
        const int64_t Tl = level_len(dst->T, l), Sl = level_len(dst->S, l);
        for (int64_t h = hk * group; h < (hk + 1) * group; h++)
            rows_out_bf16((const float *)acc->dq[l] + b * acc->dq_stride[l][0] + h * acc->dq_stride[l][1],
                          acc->dq_stride[l][2], Tl, dst->D,
                          (bf16 *)dst->dq[l] + b * dst->dq_stride[l][0] + h * dst->dq_stride[l][1],
                          dst->dq_stride[l][2]);
        rows_out_bf16((const float *)acc->dk[l] + b * acc->dk_stride[l][0] + hk * acc->dk_stride[l][1],
                      acc->dk_stride[l][2], Sl, dst->D,
                      (bf16 *)dst->dk[l] + b * dst->dk_stride[l][0] + hk * dst->dk_stride[l][1],
                      dst->dk_stride[l][2]);
    }
    rows_out_bf16((const float *)acc->dv + b * acc->dv_stride[0] + hk * acc->dv_stride[1], acc->dv_stride[2],
                  dst->S, dst->Dv, (bf16 *)dst->dv + b * dst->dv_stride[0] + hk * dst->dv_stride[1],
                  dst->dv_stride[2]);
}

static inline float bf16_value(bf16 x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* delta[i] = rowsum(dO * out) of (b, h)'s rows, summed in double (dot_exact). */
static void delta_bf16(const hkt_params *p, int64_t b, int64_t h, float *delta) {
    const bf16 *ob = (const bf16 *)p->out + b * p->out_stride[0] + h * p->out_stride[1];
    int64_t i = 0;
    /* eight rows at a time, each still one chain of double adds in e order (the
     * same bits): one row's chain waited on the add's latency at every element */
    for (; i + 8 <= p->T; i += 8) {
        const bf16 *o[8], *d[8];
        double acc[8];
        for (int k = 0; k < 8; k++) {
            o[k] = ob + (i + k) * p->out_stride[2];
            d[k] = dout_rows(p, b, h, i + k);
            acc[k] = 0;
        }
        for (int64_t e = 0; e < p->Dv; e++)
            for (int k = 0; k < 8; k++) acc[k] += (double)bf16_value(d[k][e]) * (double)bf16_value(o[k][e]);
        for (int k = 0; k < 8; k++) delta[i + k] = (float)acc[k];
    }
    for (; i < p->T; i++) {
        const bf16 *o = ob + i * p->out_stride[2], *d = dout_rows(p, b, h, i);
        double acc = 0;
        for (int64_t e = 0; e < p->Dv; e++) acc += (double)bf16_value(d[e]) * (double)bf16_value(o[e]);
        delta[i] = (float)acc;
    }
}
#endif
