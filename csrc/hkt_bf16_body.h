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
 * only where HKT_BF16_NATIVE (hkt_cpu.h); it runs only where the CPU has the
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
#if HKT_BF16_NATIVE
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
 * vector of each row holds the columns `last` selects (a narrower tail). */
static inline __attribute__((always_inline)) BF16_TARGET void bf16_tile(
    const int R, const int NV, const __mmask16 last, int64_t K2, const bf16 *restrict A, int64_t lda,
    const uint32_t *restrict B, int64_t ldb, float *restrict C, int64_t ldc, int accumulate) {
    __m512 c[8][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[r][v] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < K2; kk++) {
        __m512bh b[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            b[v] = (__m512bh)_mm512_maskz_loadu_epi32(v == NV - 1 ? last : 0xFFFF, B + kk * ldb + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair_at(A + r * lda + 2 * kk));
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
        }
    }
#pragma GCC unroll 8
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

/* C (M, N) [+]= A (M, 2 K2) @ B (2 K2, N): A bfloat16 rows lda apart (2 K2
 * readable entries each), B as pairs (K2, N) words, rows ldb apart; C float32.
 * 4 x 4 blocks (16 accumulators) over 64 columns, then 8 x 1 over 16. */
static BF16_TARGET void gemm_bf16(int64_t M, int64_t N, int64_t K2, const bf16 *A, int64_t lda, const uint32_t *B,
                                  int64_t ldb, float *C, int64_t ldc, int accumulate) {
    int64_t j = 0;
    for (; j + 64 <= N; j += 64) {
        int64_t i = 0;
        for (; i + 4 <= M; i += 4) bf16_tile(4, 4, 0xFFFF, K2, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
        for (; i < M; i++) bf16_tile(1, 4, 0xFFFF, K2, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
    }
    for (; j < N; j += 16) {
        const __mmask16 m = N - j >= 16 ? 0xFFFF : (__mmask16)((1u << (N - j)) - 1);
        int64_t i = 0;
        for (; i + 8 <= M; i += 8) bf16_tile(8, 1, m, K2, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
        for (; i < M; i++) bf16_tile(1, 1, m, K2, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, accumulate);
    }
}

/* Key rows [j0, j1) of every level as pairs along D: kp[l][dd * ld[l] + c -
 * base_col[l]] = (k_l[c][2dd], k_l[c][2dd + 1]) for the level's columns c. */
static void pack_keys_bf16(const hkt_params *p, int64_t b, int64_t h, int64_t j0, int64_t j1, float *const *kp,
                           const int64_t *ld, const int64_t *base_col) {
    const int64_t D2 = p->D / 2;
    for (int l = 0; l < p->L; l++) {
        span sp = level_span(l, 0, 1, j0, j1);
        const bf16 *kb = (const bf16 *)p->k[l] + b * p->k_stride[l][0] + kv_head(p, h) * p->k_stride[l][1];
        uint32_t *dst = (uint32_t *)kp[l] + sp.c0 - base_col[l];
        for (int64_t c = 0; c < sp.cl; c++) {
            const bf16 *row = kb + (sp.c0 + c) * p->k_stride[l][2];
            for (int64_t dd = 0; dd < D2; dd++) dst[dd * ld[l] + c] = pair_at(row + 2 * dd);
        }
    }
}

/* Value rows [j0, j1) (j0 even) interleaved in pairs: vp[jj * Dv + e] =
 * (v[j0 + 2jj][e], v[j0 + 2jj + 1][e]), the pair past an odd end zero-padded. */
static BF16_TARGET void pack_values_bf16(const hkt_params *p, const bf16 *vb, int64_t j0, int64_t j1, uint32_t *vp) {
    const int64_t Dv = p->Dv, vs = p->v_stride[2];
    for (int64_t j = j0; j < j1; j += 2) {
        const bf16 *lo = vb + j * vs, *hi = j + 1 < j1 ? lo + vs : NULL;
        uint32_t *dst = vp + (j - j0) / 2 * Dv;
        if (hi)
            for (int64_t e = 0; e < Dv; e++) dst[e] = (uint32_t)lo[e] | (uint32_t)hi[e] << 16;
        else
            for (int64_t e = 0; e < Dv; e++) dst[e] = lo[e];
    }
}

/* P (nq rows of nk float32, BK apart) rounded to bfloat16 (nearest even), rows
 * BK apart, zero-padded to an even length so the last pair is whole. */
static BF16_TARGET void round_p(const float *P, int64_t nq, int64_t nk, bf16 *out) {
    for (int64_t r = 0; r < nq; r++) {
        const float *src = P + r * BK;
        bf16 *dst = out + r * BK;
        for (int64_t c = 0; c < nk; c += 32) {
            const int64_t n = nk - c;
            const __mmask16 m0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
            const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
            const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, src + c + 16),
                                                   _mm512_maskz_loadu_ps(m0, src + c));
            /* whole pairs only: an odd n gets its zero partner */
            const int64_t keep = n >= 32 ? 32 : (n + 1) & ~(int64_t)1;
            _mm512_mask_storeu_epi16(dst + c, keep >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << keep) - 1),
                                     (__m512i)x);
        }
    }
}

/* forward_task (hkt_attention_body.h) with bfloat16 inputs. */
static BF16_TARGET void forward_task_bf16(const hkt_params *p, const ws_layout *ws, char *block, int64_t b, int64_t h,
                                          int64_t qt) {
    const int64_t T = p->T, S = p->S, Dv = p->Dv, D2 = p->D / 2;
    const int64_t i0 = qt * BQ, i1 = i0 + BQ < T ? i0 + BQ : T, nq = i1 - i0;
    float *base = (float *)(block + WS_HEADER);
    float *ready = base + ws->keys_ready;
    bf16 *pb = (bf16 *)(base + ws->p_bf16);
    float *ob = (float *)p->out + b * p->out_stride[0] + h * p->out_stride[1] + i0 * p->out_stride[2];
    const bf16 *vb = (const bf16 *)p->v + b * p->v_stride[0] + kv_head(p, h) * p->v_stride[1];
    float *kall[HKT_MAX_LEVELS]; /* holding 32-bit words: bfloat16 pairs */
    uint32_t *vall = (uint32_t *)(base + ws->values_all);
    int64_t kld[HKT_MAX_LEVELS], zero[HKT_MAX_LEVELS];
    start_task(p, ws, block, b, h, nq, ob, kall, kld, zero);
    const int64_t jend = p->causal ? (i1 < S ? i1 : S) : S;
    for (int64_t j0 = 0; j0 < jend; j0 += BK) {
        const int64_t j1 = j0 + BK < S ? j0 + BK : S, nk = j1 - j0;
        const uint32_t *kp[HKT_MAX_LEVELS], *vp;
        int64_t ld[HKT_MAX_LEVELS];
        if (ws->keys_cached) {
            if (!ready[j0 / BK]) {
                pack_keys_bf16(p, b, h, j0, j1, kall, kld, zero);
                pack_values_bf16(p, vb, j0, j1, vall + j0 / 2 * Dv);
                ready[j0 / BK] = 1;
            }
            for (int l = 0; l < p->L; l++) {
                kp[l] = (const uint32_t *)kall[l] + (j0 >> l);
                ld[l] = kld[l];
            }
            vp = vall + j0 / 2 * Dv;
        } else {
            float *buf[HKT_MAX_LEVELS];
            int64_t col0[HKT_MAX_LEVELS];
            key_tile_place(p, ws, base, j0, j1, buf, ld, col0);
            for (int l = 0; l < p->L; l++) kp[l] = (const uint32_t *)buf[l];
            pack_keys_bf16(p, b, h, j0, j1, buf, ld, col0);
            uint32_t *vt = (uint32_t *)(base + ws->value_tile);
            pack_values_bf16(p, vb, j0, j1, vt);
            vp = vt;
        }
        for (int l = 0; l < p->L; l++) {
            span sp = level_span(l, i0, i1, j0, j1);
            const bf16 *qb = (const bf16 *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1];
            gemm_bf16(sp.rl, sp.cl, D2, qb + sp.r0 * p->q_stride[l][2], p->q_stride[l][2], kp[l], ld[l],
                      base + ws->gram + ws->gram_off[l], sp.cl, 0);
        }
        tile_fold(p, ws, base, b, h, i0, i1, j0, j1);
        softmax_update(p, ws, base, b, h, i0, nq, j0, nk, ob);
        round_p(base + ws->scores, nq, nk, pb);
        gemm_bf16(nq, Dv, (nk + 1) / 2, pb, BK, vp, Dv, ob, p->out_stride[2], 1);
    }
    finish_rows(p, ws, base, b, h, i0, nq, ob);
}

void hkt_forward_bf16(const hkt_params *p) { run_forward(p, forward_task_bf16); }
#endif
