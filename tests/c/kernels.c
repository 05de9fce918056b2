/* Every CPU kernel family through hkt.h and hkt_window.h, with no Python: the
 * dense forward and backward (causal or not; no mask, a bool mask, a float
 * mask with its gradient, dropout; per-head and shared level weights; grouped
 * kv heads; a sliding-window band), the windowed forward, backward and decoding, packed sequences
 * both ways, decoding against a cache (with a band too), and the causal downsampling both ways,
 * each in float32 and float64, on fixed inputs of odd sizes.
 *
 *   kernels --write FILE   runs every case and writes its float64 results
 *   kernels --check FILE   runs every case and compares both dtypes with FILE
 *
 * A build for another machine (AArch64 under qemu: make test-aarch64) checks
 * against the results the host's build wrote; tests/kernels/test_c_kernels.py checks
 * the portable kernels against the host's instruction-set build.  Each named
 * result is one check: float64 within 1e-12, float32 within 1e-5, both
 * relative to 1 + |expected|; a NaN (what every output holds before its call)
 * fails, equal infinities (the lse of a row with no visible key) pass.  Ends
 * with one line, "N passed, N failed"; exits 1 on any failure. */
#include "hkt.h"
#include "hkt_window.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define THREADS 2

/* ---- inputs: the same doubles on every machine (integer arithmetic only) ---- */

static uint64_t rng_state;

static double uniform(void) { /* splitmix64, then 53 bits into [-1, 1) */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1p-52 - 1.0;
}

static void *xmalloc(size_t n) {
    void *p = aligned_alloc(64, (n + 63) / 64 * 64 + 64);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* n reals of the case's dtype, drawn in order (scaled by amp) */
static void *draw(int64_t n, int f64, double amp) {
    void *p = xmalloc((size_t)n * (f64 ? 8 : 4));
    for (int64_t i = 0; i < n; i++) {
        const double x = amp * uniform();
        if (f64) ((double *)p)[i] = x;
        else ((float *)p)[i] = (float)x;
    }
    return p;
}

/* an output of n reals, NaN until the kernel writes it */
static void *blank(int64_t n, int f64) {
    void *p = xmalloc((size_t)n * (f64 ? 8 : 4));
    for (int64_t i = 0; i < n; i++) {
        if (f64) ((double *)p)[i] = NAN;
        else ((float *)p)[i] = NAN;
    }
    return p;
}

static double at(const void *p, int64_t i, int f64) { return f64 ? ((const double *)p)[i] : ((const float *)p)[i]; }

static int64_t level_len(int64_t n, int l) { return n > 0 ? ((n - 1) >> l) + 1 : 0; }

/* strides (batch, head, row) of a C-contiguous (B, H, N, D) array */
static void strides4(int64_t s[3], int64_t H, int64_t N, int64_t D) {
    s[0] = H * N * D;
    s[1] = N * D;
    s[2] = D;
}

/* ---- results ---- */

typedef struct {
    char name[96];
    int f64;
    int64_t n;
    double *x;
} result;

static result results[512];
static int nresults;

static void keep(const char *name, const void *buf, int64_t n, int f64) {
    if (nresults == (int)(sizeof results / sizeof results[0])) {
        fprintf(stderr, "too many results\n");
        exit(2);
    }
    result *r = &results[nresults++];
    snprintf(r->name, sizeof r->name, "%s", name);
    r->f64 = f64;
    r->n = n;
    r->x = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) r->x[i] = at(buf, i, f64);
}

/* keep() under a printf-formed name */
static void keepf(const void *buf, int64_t n, int f64, const char *fmt, ...) {
    char name[96];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    keep(name, buf, n, f64);
}

/* ---- dense attention: forward, then backward from its out and lse ---- */

static void dense_case(const char *tag, int f64, int causal, int mask_kind, int w_per_head, double dropout,
                       int64_t band) {
    const int64_t B = 2, H = 4, H_kv = 2, D = 5, Dv = 7;
    const int64_t T = causal ? 77 : 70, S = causal ? 77 : 83;
    const int L = 3;
    hkt_params p;
    memset(&p, 0, sizeof p);
    p.B = B, p.H = H, p.H_kv = H_kv, p.T = T, p.S = S, p.D = D, p.Dv = Dv, p.L = L;
    p.dtype = f64 ? HKT_FLOAT64 : HKT_FLOAT32;
    int64_t nq[HKT_MAX_LEVELS], nk[HKT_MAX_LEVELS];
    for (int l = 0; l < L; l++) {
        nq[l] = B * H * level_len(T, l) * D;
        nk[l] = B * H_kv * level_len(S, l) * D;
        p.q[l] = draw(nq[l], f64, 1.0);
        strides4(p.q_stride[l], H, level_len(T, l), D);
        p.k[l] = draw(nk[l], f64, 1.0);
        strides4(p.k_stride[l], H_kv, level_len(S, l), D);
    }
    p.v = draw(B * H_kv * S * Dv, f64, 1.0);
    strides4(p.v_stride, H_kv, S, Dv);
    p.w_per_head = w_per_head;
    p.w = draw(w_per_head ? H * L : L, f64, 1.0);
    p.w_stride[0] = w_per_head ? L : 0;
    p.w_stride[1] = 1;
    p.mask_kind = mask_kind;
    if (mask_kind == HKT_MASK_BOOL) { /* (B, 1, T, S) broadcast over heads; query row 3 sees nothing */
        unsigned char *m = xmalloc((size_t)(B * T * S));
        for (int64_t i = 0; i < B * T * S; i++) m[i] = uniform() > -0.6 && (i / S) % T != 3;
        p.mask = m;
        p.mask_stride[0] = T * S, p.mask_stride[1] = 0, p.mask_stride[2] = S, p.mask_stride[3] = 1;
    } else if (mask_kind == HKT_MASK_FLOAT) { /* (B, H, T, S), a few entries -inf */
        void *m = draw(B * H * T * S, f64, 0.5);
        for (int64_t i = 0; i < B * H * T * S; i += 7) {
            if (f64) ((double *)m)[i] = -INFINITY;
            else ((float *)m)[i] = -INFINITY;
        }
        p.mask = m;
        p.mask_stride[0] = H * T * S, p.mask_stride[1] = T * S, p.mask_stride[2] = S, p.mask_stride[3] = 1;
    }
    p.causal = causal;
    p.sliding_window = band;
    p.scale = 1.0 / sqrt((double)D);
    p.dropout_p = dropout;
    p.seed = 12345;
    p.out = blank(B * H * T * Dv, f64);
    strides4(p.out_stride, H, T, Dv);
    p.lse = blank(B * H * T, f64);
    p.num_threads = THREADS;
    p.key_cache_bytes = -1;

    hkt_cpu_workspace plan = hkt_cpu_workspace_plan(&p, 0);
    char *mem = xmalloc(plan.total);
    hkt_cpu_workspace_place(&p, 0, &plan, mem);
    hkt_forward_cpu(&p);
    free(mem);
    keepf(p.out, B * H * T * Dv, f64, "dense%s/out", tag);
    keepf(p.lse, B * H * T, f64, "dense%s/lse", tag);

    p.dout = draw(B * H * T * Dv, f64, 1.0);
    strides4(p.dout_stride, H, T, Dv);
    for (int l = 0; l < L; l++) {
        p.dq[l] = blank(nq[l], f64);
        memcpy(p.dq_stride[l], p.q_stride[l], sizeof p.dq_stride[l]);
        p.dk[l] = blank(nk[l], f64);
        memcpy(p.dk_stride[l], p.k_stride[l], sizeof p.dk_stride[l]);
    }
    p.dv = blank(B * H_kv * S * Dv, f64);
    memcpy(p.dv_stride, p.v_stride, sizeof p.dv_stride);
    p.dw = blank(w_per_head ? H * L : L, f64);
    if (mask_kind == HKT_MASK_FLOAT) { /* summed over the batch */
        p.dmask_shape[0] = 1, p.dmask_shape[1] = H, p.dmask_shape[2] = T, p.dmask_shape[3] = S;
        p.dmask = blank(H * T * S, f64);
    }
    plan = hkt_cpu_workspace_plan(&p, 1);
    mem = xmalloc(plan.total);
    hkt_cpu_workspace_place(&p, 1, &plan, mem);
    hkt_backward_cpu(&p);
    free(mem);
    for (int l = 0; l < L; l++) {
        keepf(p.dq[l], nq[l], f64, "dense%s/dq%d", tag, l);
        keepf(p.dk[l], nk[l], f64, "dense%s/dk%d", tag, l);
    }
    keepf(p.dv, B * H_kv * S * Dv, f64, "dense%s/dv", tag);
    keepf(p.dw, w_per_head ? H * L : L, f64, "dense%s/dw", tag);
    if (p.dmask) {
        keepf(p.dmask, H * T * S, f64, "dense%s/dmask", tag);
    }
}

/* ---- packed sequences: forward, then backward ---- */

static void varlen_case(int f64, int causal) {
    const int64_t H = 2, H_kv = 1, D = 6, Dv = 5, nseq = 3;
    const int L = 3;
    static const int64_t cu_q[] = {0, 13, 14, 84}, cu_k_causal[] = {0, 13, 14, 84}, cu_k[] = {0, 9, 30, 95};
    const int64_t *ck = causal ? cu_k_causal : cu_k;
    hkt_varlen_params vp;
    memset(&vp, 0, sizeof vp);
    hkt_params *p = &vp.p;
    vp.nseq = nseq, vp.cu_q = cu_q, vp.cu_k = ck;
    const int64_t T = cu_q[nseq], S = ck[nseq];
    p->B = 1, p->H = H, p->H_kv = H_kv, p->T = T, p->S = S, p->D = D, p->Dv = Dv, p->L = L;
    p->dtype = f64 ? HKT_FLOAT64 : HKT_FLOAT32;
    int64_t nq[HKT_MAX_LEVELS], nk[HKT_MAX_LEVELS];
    for (int l = 0; l < L; l++) {
        nq[l] = hkt_varlen_level_rows(cu_q, nseq, l);
        nk[l] = hkt_varlen_level_rows(ck, nseq, l);
        p->q[l] = draw(nq[l] * H * D, f64, 1.0);
        p->q_stride[l][1] = D, p->q_stride[l][2] = H * D;
        p->k[l] = draw(nk[l] * H_kv * D, f64, 1.0);
        p->k_stride[l][1] = D, p->k_stride[l][2] = H_kv * D;
    }
    p->v = draw(S * H_kv * Dv, f64, 1.0);
    p->v_stride[1] = Dv, p->v_stride[2] = H_kv * Dv;
    p->w_per_head = 1;
    p->w = draw(H * L, f64, 1.0);
    p->w_stride[0] = L, p->w_stride[1] = 1;
    p->causal = causal;
    p->scale = 0.4;
    p->out = blank(T * H * Dv, f64);
    p->out_stride[1] = Dv, p->out_stride[2] = H * Dv;
    p->lse = blank(H * T, f64);
    p->num_threads = THREADS;
    p->key_cache_bytes = -1;
    char *mem = xmalloc(hkt_varlen_workspace_bytes(&vp, 0));
    p->workspace = mem;
    hkt_forward_varlen_cpu(&vp);
    free(mem);
    const char *tag = causal ? "causal" : "plain";
    keepf(p->out, T * H * Dv, f64, "varlen/%s/out", tag);
    keepf(p->lse, H * T, f64, "varlen/%s/lse", tag);

    p->dout = draw(T * H * Dv, f64, 1.0);
    p->dout_stride[1] = Dv, p->dout_stride[2] = H * Dv;
    for (int l = 0; l < L; l++) {
        p->dq[l] = blank(nq[l] * H * D, f64);
        memcpy(p->dq_stride[l], p->q_stride[l], sizeof p->dq_stride[l]);
        p->dk[l] = blank(nk[l] * H_kv * D, f64);
        memcpy(p->dk_stride[l], p->k_stride[l], sizeof p->dk_stride[l]);
    }
    p->dv = blank(S * H_kv * Dv, f64);
    memcpy(p->dv_stride, p->v_stride, sizeof p->dv_stride);
    p->dw = blank(H * L, f64);
    mem = xmalloc(hkt_varlen_workspace_bytes(&vp, 1));
    p->workspace = mem;
    hkt_backward_varlen_cpu(&vp);
    free(mem);
    for (int l = 0; l < L; l++) {
        keepf(p->dq[l], nq[l] * H * D, f64, "varlen/%s/dq%d", tag, l);
        keepf(p->dk[l], nk[l] * H_kv * D, f64, "varlen/%s/dk%d", tag, l);
    }
    keepf(p->dv, S * H_kv * Dv, f64, "varlen/%s/dv", tag);
    keepf(p->dw, H * L, f64, "varlen/%s/dw", tag);
}

/* ---- decoding: new positions appended to a cache, then attended ---- */

static void decode_case(const char *tag, int f64, int64_t band) {
    const int64_t B = 2, H = 4, H_kv = 2, Tn = 3, D = 5, Dv = 6, S_max = 40;
    const int L = 3;
    static const int64_t seqlens[] = {17, 30};
    hkt_decode_params p;
    memset(&p, 0, sizeof p);
    p.B = B, p.H = H, p.H_kv = H_kv, p.Tn = Tn, p.D = D, p.Dv = Dv, p.L = L;
    p.dtype = f64 ? HKT_FLOAT64 : HKT_FLOAT32;
    int64_t nk[HKT_MAX_LEVELS];
    for (int l = 0; l < L; l++) {
        p.q[l] = draw(B * H * Tn * D, f64, 1.0);
        strides4(p.q_stride[l], H, Tn, D);
        nk[l] = B * H_kv * level_len(S_max, l) * D;
        p.k_cache[l] = draw(nk[l], f64, 1.0);
        strides4(p.k_cache_stride[l], H_kv, level_len(S_max, l), D);
        p.k_new[l] = draw(B * H_kv * Tn * D, f64, 1.0);
        strides4(p.k_new_stride[l], H_kv, Tn, D);
    }
    p.v_cache = draw(B * H_kv * S_max * Dv, f64, 1.0);
    strides4(p.v_cache_stride, H_kv, S_max, Dv);
    p.v_new = draw(B * H_kv * Tn * Dv, f64, 1.0);
    strides4(p.v_new_stride, H_kv, Tn, Dv);
    p.w = draw(L, f64, 1.0);
    p.w_stride[0] = 0, p.w_stride[1] = 1;
    p.seqlens = seqlens;
    p.sliding_window = band;
    p.scale = 0.45;
    p.out = blank(B * H * Tn * Dv, f64);
    strides4(p.out_stride, H, Tn, Dv);
    p.num_threads = THREADS;
    char *mem = xmalloc(hkt_decode_workspace_bytes(&p));
    p.workspace = mem;
    hkt_decode_cpu(&p);
    free(mem);
    keepf(p.out, B * H * Tn * Dv, f64, "decode%s/out", tag);
    for (int l = 0; l < L; l++) {
        keepf(p.k_cache[l], nk[l], f64, "decode%s/k_cache%d", tag, l);
    }
    keepf(p.v_cache, B * H_kv * S_max * Dv, f64, "decode%s/v_cache", tag);
}

/* ---- causal downsampling: forward and backward ---- */

static void downsample_case(int f64) {
    const int64_t B = 2, n = 37, C = 5, K = 3, m = (n + 1) / 2;
    hkt_downsample_params p;
    memset(&p, 0, sizeof p);
    p.B = B, p.n = n, p.C = C, p.K = K;
    p.dtype = f64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p.x = draw(B * n * C, f64, 1.0);
    p.x_stride[0] = n * C, p.x_stride[1] = C;
    p.taps = draw(K * C, f64, 1.0);
    p.taps_stride = C;
    p.out = blank(B * m * C, f64);
    p.num_threads = THREADS;
    hkt_downsample_forward_cpu(&p);
    keep("downsample/out", p.out, B * m * C, f64);
    p.grad = draw(B * m * C, f64, 1.0);
    p.grad_stride[0] = m * C, p.grad_stride[1] = C;
    p.out = blank(B * n * C, f64);
    p.grad_taps = blank(K * C, f64);
    char *mem = xmalloc(hkt_downsample_workspace_bytes(&p));
    p.workspace = mem;
    hkt_downsample_backward_cpu(&p);
    free(mem);
    keep("downsample/grad_x", p.out, B * n * C, f64);
    keep("downsample/grad_taps", p.grad_taps, K * C, f64);
}

/* ---- windows: forward, backward, decoding ---- */

/* vs[l] of v (B, H_kv, S, Dv): row c the sum of v's rows of block c, in order */
static void *block_sums(const void *v, int64_t BH, int64_t S, int64_t Dv, int l, int f64) {
    const int64_t Sl = level_len(S, l);
    void *vs = xmalloc((size_t)(BH * Sl * Dv) * (f64 ? 8 : 4));
    for (int64_t bh = 0; bh < BH; bh++)
        for (int64_t c = 0; c < Sl; c++)
            for (int64_t d = 0; d < Dv; d++) {
                double sd = 0;
                float sf = 0;
                for (int64_t j = c << l; j < S && j < (c + 1) << l; j++) {
                    const double x = at(v, (bh * S + j) * Dv + d, f64);
                    sd += x;
                    sf += (float)x;
                }
                if (f64) ((double *)vs)[(bh * Sl + c) * Dv + d] = sd;
                else ((float *)vs)[(bh * Sl + c) * Dv + d] = sf;
            }
    return vs;
}

static void window_case(int f64, int causal, int bool_mask) {
    const int64_t B = 1, H = 2, H_kv = 1, T = 70, S = 70, D = 4, Dv = 5;
    const int L = 3;
    static const int64_t radius[] = {6, 5, 0}; /* W = 6, 10, none: growing */
    hkt_window_params p;
    memset(&p, 0, sizeof p);
    p.B = B, p.H = H, p.H_kv = H_kv, p.T = T, p.S = S, p.D = D, p.Dv = Dv, p.L = L;
    p.dtype = f64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p.is_causal = causal;
    p.scale = 0.5;
    memcpy(p.radius, radius, sizeof radius);
    int64_t nq[HKT_MAX_LEVELS], nk[HKT_MAX_LEVELS], nv[HKT_MAX_LEVELS];
    const void *v = draw(B * H_kv * S * Dv, f64, 1.0);
    for (int l = 0; l < L; l++) {
        nq[l] = B * H * level_len(T, l) * D;
        nk[l] = B * H_kv * level_len(S, l) * D;
        nv[l] = B * H_kv * level_len(S, l) * Dv;
        p.q[l] = draw(nq[l], f64, 1.0);
        p.k[l] = draw(nk[l], f64, 1.0);
        p.vs[l] = l == 0 ? v : block_sums(v, B * H_kv, S, Dv, l, f64);
    }
    p.w = draw(H * L, f64, 1.0);
    if (bool_mask) { /* (B, 1, T, S), broadcast over heads */
        unsigned char *m = xmalloc((size_t)(B * T * S));
        for (int64_t i = 0; i < B * T * S; i++) m[i] = uniform() > -0.7;
        p.mask_kind = HKT_MASK_BOOL;
        p.mask = m;
        p.mask_stride[0] = T * S, p.mask_stride[1] = 0, p.mask_stride[2] = S, p.mask_stride[3] = 1;
    }
    p.out = blank(B * H * T * Dv, f64);
    p.lse = blank(B * H * T, f64);
    p.num_threads = THREADS;
    char *mem = xmalloc(hkt_window_workspace_bytes(&p, 0));
    p.workspace = mem;
    hkt_window_forward_cpu(&p);
    free(mem);
    char tag[32];
    snprintf(tag, sizeof tag, "%s%s", causal ? "causal" : "plain", bool_mask ? "/bool" : "");
    keepf(p.out, B * H * T * Dv, f64, "window/%s/out", tag);
    keepf(p.lse, B * H * T, f64, "window/%s/lse", tag);

    p.dout = draw(B * H * T * Dv, f64, 1.0);
    for (int l = 0; l < L; l++) {
        p.dq[l] = blank(nq[l], f64);
        p.dk[l] = blank(nk[l], f64);
        p.dvs[l] = blank(nv[l], f64);
    }
    p.dw = blank(H * L, f64);
    mem = xmalloc(hkt_window_workspace_bytes(&p, 1));
    p.workspace = mem;
    hkt_window_backward_cpu(&p);
    free(mem);
    for (int l = 0; l < L; l++) {
        keepf(p.dq[l], nq[l], f64, "window/%s/dq%d", tag, l);
        keepf(p.dk[l], nk[l], f64, "window/%s/dk%d", tag, l);
        keepf(p.dvs[l], nv[l], f64, "window/%s/dvs%d", tag, l);
    }
    keepf(p.dw, H * L, f64, "window/%s/dw", tag);
}

static void window_decode_case(int f64) {
    const int64_t B = 1, H = 2, H_kv = 1, n = 3, t0 = 30, D = 4, Dv = 5, S = t0 + n;
    const int L = 3;
    static const int64_t radius[] = {6, 5, 0};
    hkt_window_decode_params p;
    memset(&p, 0, sizeof p);
    p.B = B, p.H = H, p.H_kv = H_kv, p.n = n, p.t0 = t0, p.D = D, p.Dv = Dv, p.L = L;
    p.dtype = f64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p.scale = 0.5;
    memcpy(p.radius, radius, sizeof radius);
    const void *v = draw(B * H_kv * S * Dv, f64, 1.0);
    for (int l = 0; l < L; l++) {
        p.cap[l] = level_len(S, l); /* every block */
        p.q[l] = draw(B * H * n * D, f64, 1.0);
        p.k[l] = draw(B * H_kv * p.cap[l] * D, f64, 1.0);
        p.vs[l] = l == 0 ? v : block_sums(v, B * H_kv, S, Dv, l, f64);
    }
    p.w = draw(H * L, f64, 1.0);
    p.out = blank(B * H * n * Dv, f64);
    p.num_threads = THREADS;
    char *mem = xmalloc(hkt_window_decode_workspace_bytes(&p));
    p.workspace = mem;
    hkt_window_decode_cpu(&p);
    free(mem);
    keep("window_decode/out", p.out, B * H * n * Dv, f64);
}

/* ---- every case, in one fixed order (the inputs are drawn in it) ---- */

static void run_all(int f64) {
    rng_state = 2024; /* both dtypes draw the same numbers */
    dense_case("/plain", f64, 0, HKT_MASK_NONE, 1, 0.0, 0);
    dense_case("/causal", f64, 1, HKT_MASK_NONE, 0, 0.0, 0);
    dense_case("/bool", f64, 0, HKT_MASK_BOOL, 1, 0.0, 0);
    dense_case("/causal_float", f64, 1, HKT_MASK_FLOAT, 1, 0.0, 0);
    dense_case("/dropout", f64, 1, HKT_MASK_NONE, 1, 0.25, 0);
    varlen_case(f64, 1);
    varlen_case(f64, 0);
    decode_case("", f64, 0);
    downsample_case(f64);
    window_case(f64, 1, 0);
    window_case(f64, 0, 0);
    window_case(f64, 1, 1);
    window_decode_case(f64);
    /* the sliding-window band, narrower than a tile (whole tiles skipped) and
     * not a multiple of 64: drawn last, so the cases above keep their inputs */
    dense_case("/band_bool", f64, 0, HKT_MASK_BOOL, 1, 0.0, 20);
    dense_case("/causal_band_float", f64, 1, HKT_MASK_FLOAT, 0, 0.25, 30);
    decode_case("/band", f64, 9);
}

/* ---- the results file: one "name count" line, then count hex floats ---- */

static void write_file(const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(2);
    }
    for (int r = 0; r < nresults; r++) {
        if (!results[r].f64) continue;
        fprintf(f, "%s %lld\n", results[r].name, (long long)results[r].n);
        for (int64_t i = 0; i < results[r].n; i++) fprintf(f, "%a\n", results[r].x[i]);
    }
    if (fclose(f)) {
        perror(path);
        exit(2);
    }
}

typedef struct {
    char name[96];
    int64_t n;
    double *x;
} expected;

static int read_file(const char *path, expected *e, int cap) {
    FILE *f = fopen(path, "r");
    if (!f) {
        perror(path);
        exit(2);
    }
    int ne = 0;
    char name[96];
    long long n;
    while (ne < cap && fscanf(f, "%95s %lld", name, &n) == 2) {
        snprintf(e[ne].name, sizeof e[ne].name, "%s", name);
        e[ne].n = n;
        e[ne].x = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
        char word[64];
        for (long long i = 0; i < n; i++) {
            if (fscanf(f, "%63s", word) != 1) {
                fprintf(stderr, "%s: %s cut short\n", path, name);
                exit(2);
            }
            e[ne].x[i] = strtod(word, NULL);
        }
        ne++;
    }
    fclose(f);
    return ne;
}

/* 1 when got matches want within tol relative to 1 + |want| (NaN never does) */
static int close_to(double got, double want, double tol) {
    if (isinf(want)) return got == want;
    return fabs(got - want) <= tol * (1 + fabs(want));
}

static int check_file(const char *path) {
    static expected e[512];
    const int ne = read_file(path, e, 512);
    int passed = 0, failed = 0;
    for (int r = 0; r < nresults; r++) {
        const result *res = &results[r];
        const double tol = res->f64 ? 1e-12 : 1e-5;
        const expected *want = NULL;
        for (int i = 0; i < ne && !want; i++)
            if (strcmp(e[i].name, res->name) == 0) want = &e[i];
        int ok = want && want->n == res->n;
        int64_t bad = -1;
        double worst = 0;
        for (int64_t i = 0; ok && i < res->n; i++) {
            if (!close_to(res->x[i], want->x[i], tol)) {
                ok = 0;
                bad = i;
            } else if (!isinf(want->x[i])) {
                const double err = fabs(res->x[i] - want->x[i]) / (1 + fabs(want->x[i]));
                worst = err > worst ? err : worst;
            }
        }
        if (ok) {
            passed++;
            printf("ok   %-32s %-7s %6lld values, largest error %.2g\n", res->name, res->f64 ? "float64" : "float32",
                   (long long)res->n, worst);
        } else {
            failed++;
            if (!want) printf("FAIL %s (%s): not in %s\n", res->name, res->f64 ? "float64" : "float32", path);
            else if (want->n != res->n) printf("FAIL %s: %lld values, %s has %lld\n", res->name,
                                               (long long)res->n, path, (long long)want->n);
            else printf("FAIL %s (%s): entry %lld is %.17g, expected %.17g\n", res->name,
                        res->f64 ? "float64" : "float32", (long long)bad, res->x[bad], want->x[bad]);
        }
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "--write") && strcmp(argv[1], "--check"))) {
        fprintf(stderr, "usage: %s --write FILE | --check FILE\n", argv[0]);
        return 2;
    }
    const int write = strcmp(argv[1], "--write") == 0;
    run_all(1);
    if (write) {
        write_file(argv[2]);
        printf("%d results written to %s (kernels: %s)\n", nresults, argv[2], hkt_cpu_kernels());
        return 0;
    }
    run_all(0);
    printf("kernels: %s\n", hkt_cpu_kernels());
    return check_file(argv[2]);
}
