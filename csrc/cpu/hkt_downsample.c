/*
 * Causal downsampling on the CPU (hkt.h, hkt_downsample_params): the forward
 * and backward of hkt.modules.causal_downsample in one pass each.  In torch the
 * expression is a pad, K strided products and K - 1 sums, and its backward
 * twice as many full-size passes plus the reductions for the taps, a fair part
 * of a small model's training step.
 *
 * Memory-bound elementwise code: plain C the compiler vectorises for the
 * baseline ISA; no per-ISA builds.
 */
#include "hkt_cpu.h"

#include <string.h>

/* The forward's bits must be the torch expression's: each product rounded
 * before it is added.  GCC's default for GNU C (-ffp-contract=fast) would fuse
 * them into FMAs wherever the target has them. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* Below this many multiply-adds one thread does it all: waking others costs more. */
#define DS_SERIAL_WORK ((int64_t)1 << 17)

static int threads_for(const hkt_downsample_params *p, int64_t work) {
    return work < DS_SERIAL_WORK || p->num_threads < 1 ? 1 : p->num_threads;
}

#define DS_FORWARD(real, name)                                                                         \
    static void name(const hkt_downsample_params *p) {                                                 \
        const int64_t B = p->B, n = p->n, C = p->C, K = p->K, m = (n + 1) / 2;                         \
        const real *x = (const real *)p->x, *taps = (const real *)p->taps;                             \
        real *out = (real *)p->out;                                                                    \
        const int nt = threads_for(p, B * m * C * K);                                                  \
        PARALLEL_TASKS(nt, (static), B * m, row, tid, {                                                \
            const int64_t b = row / m, pp = row % m;                                                   \
            const real *xb = x + b * p->x_stride[0];                                                   \
            real *restrict o = out + row * C;                                                          \
            const real *restrict x0 = xb + 2 * pp * p->x_stride[1];                                    \
            for (int64_t c = 0; c < C; c++) o[c] = x0[c] * taps[c];                                    \
            for (int64_t r = 1; r < K; r++) {                                                          \
                const real *restrict t = taps + r * p->taps_stride;                                    \
                if (2 * pp - r >= 0) {                                                                 \
                    const real *restrict xr = xb + (2 * pp - r) * p->x_stride[1];                      \
                    for (int64_t c = 0; c < C; c++) o[c] = o[c] + xr[c] * t[c];                        \
                } else { /* the zero padding, multiplied: NaN taps give NaN, as in torch */            \
                    for (int64_t c = 0; c < C; c++) o[c] = o[c] + (real)0 * t[c];                      \
                }                                                                                      \
            }                                                                                          \
        });                                                                                            \
    }

/* The backward runs over the output rows of all batches, flattened (row = b * m
 * + p), in chunks: a chunk writes grad_x's rows 2p and 2p + 1 of its rows p,
 *
 *   grad_x[i] = sum over r of i's parity, ascending, with p = (i + r) / 2 < m,
 *               of taps[r] * grad[p],
 *
 * and sums its share of grad_taps[r] = sum over b, p of grad[p] * x[2p - r]
 * (x = 0 before row 0): in the real type over each DS_SUB rows, those sums in
 * double into the chunk's partial.  The partials are then added in chunk
 * order.  Chunks depend on the sizes only, never on the thread count, so every
 * result is bitwise the same for any num_threads. */
#define DS_SUB 64                      /* rows summed in the real type */
#define DS_MAX_CHUNKS 1024
#define DS_PARTIAL_BYTES ((int64_t)16 << 20) /* cap on the chunks' partials, all together */

static int64_t chunk_rows(const hkt_downsample_params *p) {
    const int64_t rows = p->B * ((p->n + 1) / 2), per = p->K * p->C * (int64_t)sizeof(double);
    int64_t most = DS_MAX_CHUNKS;
    if (per > 0 && DS_PARTIAL_BYTES / per < most) most = DS_PARTIAL_BYTES / per > 0 ? DS_PARTIAL_BYTES / per : 1;
    int64_t R = DS_SUB;
    if ((rows + R - 1) / R > most) R = (rows + most - 1) / most;
    return R;
}

static int64_t chunks_of(const hkt_downsample_params *p) {
    const int64_t rows = p->B * ((p->n + 1) / 2), R = chunk_rows(p);
    return rows > 0 ? (rows + R - 1) / R : 1;
}

#define DS_BACKWARD(real, name)                                                                        \
    static void name(const hkt_downsample_params *p) {                                                 \
        const int64_t B = p->B, n = p->n, C = p->C, K = p->K, m = (n + 1) / 2, KC = K * C;             \
        const int64_t R = chunk_rows(p), nch = chunks_of(p);                                           \
        const real *x = (const real *)p->x, *taps = (const real *)p->taps, *g = (const real *)p->grad; \
        real *gx = (real *)p->out, *gt = (real *)p->grad_taps;                                         \
        double *part = (double *)p->workspace; /* (nch, K, C) */                                       \
        real *sub0 = (real *)(part + nch * KC); /* per thread (K, C) */                                \
        const int nt = threads_for(p, B * n * C * K);                                                  \
        PARALLEL_TASKS(nt, (static), nch, ch, tid, {                                                   \
            real *sub = sub0 + tid * KC;                                                               \
            double *pc = part + ch * KC;                                                               \
            for (int64_t e = 0; e < KC; e++) pc[e] = 0;                                                \
            const int64_t q1 = (ch + 1) * R < B * m ? (ch + 1) * R : B * m;                            \
            for (int64_t q = ch * R; q < q1; q++) {                                                    \
                const int64_t b = q / m, pp = q % m;                                                   \
                const real *xb = x + b * p->x_stride[0], *gb = g + b * p->grad_stride[0];              \
                const real *restrict gp = gb + pp * p->grad_stride[1];                                 \
                for (int64_t i = 2 * pp; gx && i < 2 * pp + 2 && i < n; i++) {                         \
                    real *restrict o = gx + (b * n + i) * C;                                           \
                    int64_t r = i % 2;                                                                 \
                    if (r >= K || (i + r) / 2 >= m) {                                                  \
                        for (int64_t c = 0; c < C; c++) o[c] = 0;                                      \
                        continue;                                                                      \
                    }                                                                                  \
                    const real *restrict t0 = taps + r * p->taps_stride;                               \
                    const real *restrict g0 = gb + (i + r) / 2 * p->grad_stride[1];                    \
                    for (int64_t c = 0; c < C; c++) o[c] = t0[c] * g0[c];                              \
                    for (r += 2; r < K && (i + r) / 2 < m; r += 2) {                                   \
                        const real *restrict t = taps + r * p->taps_stride;                            \
                        const real *restrict gr = gb + (i + r) / 2 * p->grad_stride[1];                \
                        for (int64_t c = 0; c < C; c++) o[c] = o[c] + t[c] * gr[c];                    \
                    }                                                                                  \
                }                                                                                      \
                const int fresh = (q - ch * R) % DS_SUB == 0;                                          \
                for (int64_t r = 0; r < K; r++) {                                                      \
                    real *restrict a = sub + r * C;                                                    \
                    if (2 * pp - r >= 0) {                                                             \
                        const real *restrict xr = xb + (2 * pp - r) * p->x_stride[1];                  \
                        if (fresh) for (int64_t c = 0; c < C; c++) a[c] = gp[c] * xr[c];               \
                        else for (int64_t c = 0; c < C; c++) a[c] = a[c] + gp[c] * xr[c];              \
                    } else { /* the zero padding: inf or NaN in grad gives NaN, as in torch */         \
                        if (fresh) for (int64_t c = 0; c < C; c++) a[c] = gp[c] * (real)0;             \
                        else for (int64_t c = 0; c < C; c++) a[c] = a[c] + gp[c] * (real)0;            \
                    }                                                                                  \
                }                                                                                      \
                if ((q + 1 - ch * R) % DS_SUB == 0 || q + 1 == q1)                                     \
                    for (int64_t e = 0; e < KC; e++) pc[e] += (double)sub[e];                          \
            }                                                                                          \
        });                                                                                            \
        /* the chunks' partials, added in chunk order */                                               \
        PARALLEL_TASKS(nt, (static), KC, e, tid, {                                                     \
            double s = 0;                                                                              \
            for (int64_t ch = 0; ch < nch; ch++) s += part[ch * KC + e];                               \
            gt[e] = (real)s;                                                                           \
        });                                                                                            \
    }

DS_FORWARD(float, forward_f32)
DS_FORWARD(double, forward_f64)
DS_BACKWARD(float, backward_f32)
DS_BACKWARD(double, backward_f64)

size_t hkt_downsample_workspace_bytes(const hkt_downsample_params *p) {
    const size_t kc = (size_t)(p->K > 0 ? p->K : 0) * (size_t)(p->C > 0 ? p->C : 0);
    const size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    const size_t nt = (size_t)(p->num_threads > 1 ? p->num_threads : 1);
    return kc * ((size_t)chunks_of(p) * sizeof(double) + nt * elem);
}

void hkt_downsample_forward_cpu(const hkt_downsample_params *p) {
    if (p->dtype == HKT_FLOAT64) forward_f64(p);
    else forward_f32(p);
}

void hkt_downsample_backward_cpu(const hkt_downsample_params *p) {
    if (p->dtype == HKT_FLOAT64) backward_f64(p);
    else backward_f32(p);
}
