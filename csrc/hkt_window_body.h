/*
 * hkt_window_body.h -- the windowed kernels of hkt_window.h for one real type.
 * Included by hkt_window.c once per type and instruction set, with `real`,
 * WFN(name) (the function's name for them), REAL_EXP / REAL_LOG and
 * REAL_EXP_NONPOS (exp of x <= 0, in a form the compiler vectorises) defined.
 *
 * Per (batch, head) the queries run in order.  For level l the keys it sees
 * from query block a = i >> l are the level-l blocks [base, end) (the window
 * around a, cut at 0, at Sl, and under causality at a itself); per level the
 * kernel keeps
 *   G[c] = <q[l][a], k[l][c]>             (shared by the 2^l queries of block a)
 *   A[c] = f_l G[c] + A_{l+1}[c >> 1]     (the score terms of levels >= l)
 * recomputed only when block a changes.  A query's units are then its single
 * keys of level 0 (score A_0[j]) and, per level m >= 1, the part level m sees
 * and level m-1 does not: whole level-m blocks and at most one level-(m-1)
 * block at each inner edge, all scored A_m[block].  A unit of n keys counts n
 * times in the softmax's normaliser and adds p * (its summed values) to out.
 * Level m's part depends on the query only through i >> (m-1): it is reduced
 * once per level-(m-1) block to a partial softmax (max, sum, weighted values)
 * that each query of the block merges with its own.
 *
 * The backward adds each unit's score gradient to E_m (indexed like A_m); when
 * a level-l query block ends, E_l gives dq[l][a], dk[l] and dw[l] through G's
 * bilinear form and is added to its parents in E_{l+1}, whose scores include
 * the level-l terms' parents.  For m >= 2 the level-m part is shared the same
 * way: with P[i, u] = exp(s_u - c) * exp(c - lse_i), its queries' output
 * gradients are summed, weighted by exp(c - lse_i), once per query, and the
 * units visited once per block (c the block's largest lse; where the rows'
 * lse spread too far for that product, SPREAD, each query visits them).
 */

/* where level l's keys of query block a lie, in level-l blocks: the window
 * [lo, hi) unclipped (no window: all of them), and [base, end) clipped */
typedef struct {
    int64_t lo, hi, base, end;
} WFN(range);

static inline WFN(range) WFN(level_range)(const hkt_window_params *p, int l, int64_t a) {
    const int64_t Sl = p->S > 0 ? ((p->S - 1) >> l) + 1 : 0;
    WFN(range) r;
    if (p->radius[l] == 0) {
        r.lo = 0;
        r.hi = Sl;
    } else {
        r.lo = a - p->radius[l] + 1;
        r.hi = a + p->radius[l];
    }
    r.base = r.lo > 0 ? r.lo : 0;
    r.end = r.hi < Sl ? r.hi : Sl;
    if (p->is_causal && r.end > a + 1) r.end = a + 1;
    if (r.end < r.base) r.end = r.base;
    return r;
}

static inline int64_t WFN(blocks)(int64_t n, int l) { return n > 0 ? ((n - 1) >> l) + 1 : 0; }

/* most level-l blocks a query block sees */
static int64_t WFN(level_cap)(const hkt_window_params *p, int l) {
    const int64_t Sl = WFN(blocks)(p->S, l);
    if (p->radius[l] == 0) return Sl;
    const int64_t n = 2 * p->radius[l] - 1;
    return n < Sl ? n : Sl;
}

/* one thread's workspace, carved from its slice */
typedef struct {
    real *G[HKT_MAX_LEVELS], *A[HKT_MAX_LEVELS], *E[HKT_MAX_LEVELS];
    WFN(range) r[HKT_MAX_LEVELS];
    real *us, *ucnt, *acc;  /* units' scores and key counts; a row accumulator (Dv) */
    int32_t *ulev, *um;     /* the level of a unit's summed values; the level of its score */
    int64_t *uidx, *uc;     /* its block in vs[ulev]; its score's index in A[um] (from base) */
    int64_t nu;
    real *O, *X;                        /* per level m, Dv each: a partial's weighted values; the backward's summed dout */
    real M[HKT_MAX_LEVELS], Z[HKT_MAX_LEVELS]; /* per level: a partial's max and sum */
    real c[HKT_MAX_LEVELS], Y[HKT_MAX_LEVELS]; /* backward: a block's largest lse, its weighted sum of <dout, out> */
    int shared[HKT_MAX_LEVELS];         /* backward: level m's units visited once per level-(m-1) block */
} WFN(work);

static size_t WFN(thread_bytes)(const hkt_window_params *p, int backward) {
    size_t reals = 0, units = 0;
    for (int l = 0; l < p->L; l++) {
        const size_t n = (size_t)WFN(level_cap)(p, l);
        reals += (backward ? 3 : 2) * ((n + 15) / 16 * 16);
        units += n + 2;
    }
    units = (units + 15) / 16 * 16;
    const size_t dv = ((size_t)p->Dv + 15) / 16 * 16;
    return (reals + 2 * units + (1 + 2 * (size_t)p->L) * dv) * sizeof(real) +
           units * (2 * sizeof(int32_t) + 2 * sizeof(int64_t)) + 64;
}

static void WFN(carve)(const hkt_window_params *p, int backward, char *mem, WFN(work) *wk) {
    real *x = (real *)mem;
    size_t units = 0;
    for (int l = 0; l < p->L; l++) {
        const size_t n = ((size_t)WFN(level_cap)(p, l) + 15) / 16 * 16;
        wk->G[l] = x;
        x += n;
        wk->A[l] = x;
        x += n;
        wk->E[l] = backward ? x : NULL;
        if (backward) x += n;
        units += (size_t)WFN(level_cap)(p, l) + 2;
    }
    units = (units + 15) / 16 * 16;
    wk->us = x;
    x += units;
    wk->ucnt = x;
    x += units;
    const size_t dv = ((size_t)p->Dv + 15) / 16 * 16;
    wk->acc = x;
    x += dv;
    wk->O = x;
    x += dv * (size_t)p->L;
    wk->X = x;
    x += dv * (size_t)p->L;
    int64_t *y = (int64_t *)x;
    wk->uidx = y;
    y += units;
    wk->uc = y;
    y += units;
    int32_t *z = (int32_t *)y;
    wk->ulev = z;
    z += units;
    wk->um = z;
}

static inline real WFN(dot)(const real *a, const real *b, int64_t n) {
    real s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* scale * w as the other kernels form it: a product that rounds to 0 although
 * neither factor is 0 becomes the smallest subnormal of its sign */
static inline real WFN(factor)(double scale, real w) {
    const real f = (real)scale * w;
    if (f == 0 && w != 0 && scale != 0) {
        const real tiny = REAL_NEXTAFTER((real)0, (real)1);
        return ((w > 0) == (scale > 0)) ? tiny : -tiny;
    }
    return f;
}

/* G and A of level l for query block a (batch b, head h, kv head hk) */
static void WFN(level_scores)(const hkt_window_params *p, WFN(work) *wk, int l, int64_t b, int64_t h,
                              int64_t hk, int64_t a, real f) {
    const int64_t D = p->D, Tl = WFN(blocks)(p->T, l), Sl = WFN(blocks)(p->S, l);
    const WFN(range) r = WFN(level_range)(p, l, a);
    wk->r[l] = r;
    const real *qa = (const real *)p->q[l] + ((b * p->H + h) * Tl + a) * D;
    const real *kl = (const real *)p->k[l] + (b * p->H_kv + hk) * Sl * D;
    real *G = wk->G[l], *A = wk->A[l];
    int64_t c = r.base;
    for (; c + 4 <= r.end; c += 4) { /* four keys at once: four independent sums in flight */
        const real *k0 = kl + c * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
        real s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < D; d++) {
            s0 += qa[d] * k0[d];
            s1 += qa[d] * k1[d];
            s2 += qa[d] * k2[d];
            s3 += qa[d] * k3[d];
        }
        G[c - r.base] = s0;
        G[c + 1 - r.base] = s1;
        G[c + 2 - r.base] = s2;
        G[c + 3 - r.base] = s3;
    }
    for (; c < r.end; c++) G[c - r.base] = WFN(dot)(qa, kl + c * D, D);
    if (l + 1 < p->L) {
        const real *Au = wk->A[l + 1];
        const int64_t bu = wk->r[l + 1].base;
        for (int64_t c = r.base; c < r.end; c++) A[c - r.base] = f * G[c - r.base] + Au[(c >> 1) - bu];
    } else {
        for (int64_t c = r.base; c < r.end; c++) A[c - r.base] = f * G[c - r.base];
    }
    if (wk->E[l]) memset(wk->E[l], 0, (size_t)(r.end - r.base) * sizeof(real));
}

static inline void WFN(add_unit)(WFN(work) *wk, real s, real cnt, int lev, int64_t idx, int m, int64_t c) {
    const int64_t u = wk->nu++;
    wk->us[u] = s;
    wk->ucnt[u] = cnt;
    wk->ulev[u] = lev;
    wk->uidx[u] = idx;
    wk->um[u] = m;
    wk->uc[u] = c;
}

/* level m's units over its level-(m-1) blocks [x0, x1): pairs of them that
 * make a whole level-m block become one unit of that block, a single one a
 * unit of its own */
static void WFN(add_range)(const hkt_window_params *p, WFN(work) *wk, int m, int64_t x0, int64_t x1) {
    const real *A = wk->A[m];
    const int64_t base = wk->r[m].base;
    while (x0 < x1) {
        const int64_t c = x0 >> 1;
        if (!(x0 & 1) && x0 + 1 < x1) {
            const int64_t n = p->S - (c << m);
            WFN(add_unit)(wk, A[c - base], (real)(n < ((int64_t)1 << m) ? n : ((int64_t)1 << m)), m, c, m,
                          c - base);
            x0 += 2;
        } else {
            const int64_t n = p->S - (x0 << (m - 1));
            const int64_t full = (int64_t)1 << (m - 1);
            WFN(add_unit)(wk, A[c - base], (real)(n < full ? n : full), m - 1, x0, m, c - base);
            x0 += 1;
        }
    }
}

/* the units of level m's part (m = 0: the single keys level 0 sees), once the
 * levels' A are current */
static void WFN(seg_units)(const hkt_window_params *p, WFN(work) *wk, int m) {
    wk->nu = 0;
    if (m == 0) {
        const WFN(range) r0 = wk->r[0];
        const real *A0 = wk->A[0];
        for (int64_t j = r0.base; j < r0.end; j++) WFN(add_unit)(wk, A0[j - r0.base], 1, 0, j, 0, j - r0.base);
        return;
    }
    if (p->radius[m - 1] == 0) return; /* level m-1 sees every key: nothing is left for level m */
    const WFN(range) rm = wk->r[m], rd = wk->r[m - 1];
    const int64_t Sd = WFN(blocks)(p->S, m - 1);
    /* left of level m-1's window */
    int64_t x0 = 2 * rm.lo > 0 ? 2 * rm.lo : 0, x1 = rd.lo < Sd ? rd.lo : Sd;
    WFN(add_range)(p, wk, m, x0, x1);
    if (!p->is_causal) { /* right of it: keys after query i */
        x0 = rd.hi > 0 ? rd.hi : 0;
        x1 = 2 * rm.hi < Sd ? 2 * rm.hi : Sd;
        WFN(add_range)(p, wk, m, x0, x1);
    }
}

/* new block at level l for query i */
static inline int WFN(starts)(int64_t i, int l) { return i == 0 || ((i - 1) >> l) != (i >> l); }
static inline int WFN(ends)(const hkt_window_params *p, int64_t i, int l) {
    return i == p->T - 1 || ((i + 1) >> l) != (i >> l);
}

static inline const real *WFN(vrow)(const hkt_window_params *p, const void *const *arr, int lev, int64_t b,
                                     int64_t hk, int64_t idx) {
    const int64_t Sl = WFN(blocks)(p->S, lev);
    return (const real *)arr[lev] + ((b * p->H_kv + hk) * Sl + idx) * p->Dv;
}

/* the partial softmax of the current units: max M, sum Z (each unit counted
 * for its keys), O = sum of exp(s - M) * its summed values */
static void WFN(partial)(const hkt_window_params *p, WFN(work) *wk, int64_t b, int64_t hk, real *O, real *M,
                         real *Z) {
    const int64_t nu = wk->nu, Dv = p->Dv;
    real mx = -INFINITY;
    for (int64_t u = 0; u < nu; u++) mx = wk->us[u] > mx ? wk->us[u] : mx;
    memset(O, 0, (size_t)Dv * sizeof(real));
    if (mx == -INFINITY) { /* no unit, or none but hidden ones -- or NaN ones, which must reach the row */
        int nan = 0;
        for (int64_t u = 0; u < nu; u++) nan |= wk->us[u] != wk->us[u];
        *M = nan ? 0 : -INFINITY;
        *Z = nan ? NAN : 0;
        if (!nan) return;
        mx = 0;
    }
    real sum = 0, *e_u = wk->us;
#pragma omp simd
    for (int64_t u = 0; u < nu; u++) e_u[u] = REAL_EXP_NONPOS(e_u[u] - mx);
    for (int64_t u = 0; u < nu; u++) {
        const real e = e_u[u];
        sum += wk->ucnt[u] * e;
        const real *vr = WFN(vrow)(p, p->vs, wk->ulev[u], b, hk, wk->uidx[u]);
#pragma omp simd
        for (int64_t d = 0; d < Dv; d++) O[d] += e * vr[d];
    }
    *M = mx;
    *Z = sum;
}

static void WFN(forward_head)(const hkt_window_params *p, WFN(work) *wk, int64_t b, int64_t h) {
    const int64_t hk = h / (p->H / p->H_kv), Dv = p->Dv;
    const real *w = (const real *)p->w + h * p->L;
    real f[HKT_MAX_LEVELS];
    for (int l = 0; l < p->L; l++) f[l] = WFN(factor)(p->scale, w[l]);
    real *out = (real *)p->out + (b * p->H + h) * p->T * Dv;
    real *lse = (real *)p->lse + (b * p->H + h) * p->T;
    const int64_t dvp = (Dv + 15) / 16 * 16;
    for (int64_t i = 0; i < p->T; i++) {
        for (int l = p->L - 1; l >= 0; l--)
            if (WFN(starts)(i, l)) WFN(level_scores)(p, wk, l, b, h, hk, i >> l, f[l]);
        /* level m's part, shared by the queries of one level-(m-1) block */
        for (int m = p->L - 1; m >= 0; m--)
            if (m == 0 || WFN(starts)(i, m - 1)) {
                WFN(seg_units)(p, wk, m);
                WFN(partial)(p, wk, b, hk, wk->O + m * dvp, &wk->M[m], &wk->Z[m]);
            }
        real mx = -INFINITY;
        for (int m = 0; m < p->L; m++) mx = wk->M[m] > mx ? wk->M[m] : mx;
        real *o = out + i * Dv;
        if (mx == -INFINITY) {
            memset(o, 0, (size_t)Dv * sizeof(real));
            lse[i] = INFINITY;
            continue;
        }
        real *acc = wk->acc, sum = 0;
        memset(acc, 0, (size_t)Dv * sizeof(real));
        for (int m = 0; m < p->L; m++) {
            if (wk->M[m] == -INFINITY) continue;
            const real e = REAL_EXP_NONPOS(wk->M[m] - mx);
            const real *Om = wk->O + m * dvp;
            sum += e * wk->Z[m];
#pragma omp simd
            for (int64_t d = 0; d < Dv; d++) acc[d] += e * Om[d];
        }
        const real inv = 1 / sum;
        for (int64_t d = 0; d < Dv; d++) o[d] = acc[d] * inv;
        lse[i] = mx + REAL_LOG(sum);
    }
}

/* the end of level l's query block a: its E gives dq, dk, dw and its parents' E */
static void WFN(flush)(const hkt_window_params *p, WFN(work) *wk, int l, int64_t b, int64_t h, int64_t hk,
                       int64_t a, real f, real *dwl) {
    const int64_t D = p->D, Tl = WFN(blocks)(p->T, l), Sl = WFN(blocks)(p->S, l);
    const WFN(range) r = wk->r[l];
    const real *E = wk->E[l], *G = wk->G[l];
    const real *qa = (const real *)p->q[l] + ((b * p->H + h) * Tl + a) * D;
    const real *kl = (const real *)p->k[l] + (b * p->H_kv + hk) * Sl * D;
    real *dqa = (real *)p->dq[l] + ((b * p->H + h) * Tl + a) * D;
    real *dkl = (real *)p->dk[l] + (b * p->H_kv + hk) * Sl * D;
    memset(dqa, 0, (size_t)D * sizeof(real));
    real dws = 0;
    for (int64_t c = r.base; c < r.end; c++) {
        const real e = E[c - r.base];
        if (e == 0) continue; /* a key block whose units had no gradient (hidden or underflowed) */
        const real fe = f * e;
        const real *kc = kl + c * D;
        real *dkc = dkl + c * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            dqa[d] += fe * kc[d];
            dkc[d] += fe * qa[d];
        }
        dws += e * G[c - r.base];
    }
    *dwl += (real)p->scale * dws;
    if (l + 1 < p->L) {
        real *Eu = wk->E[l + 1];
        const int64_t bu = wk->r[l + 1].base;
        for (int64_t c = r.base; c < r.end; c++) Eu[(c >> 1) - bu] += E[c - r.base];
    }
}

/* the current units' gradients, given their probabilities' common factor:
 * P_u = exp(s_u - c) * (weight), go the summed output gradient (weighted like
 * P) and Dg its weighted sum of <dout, out> */
static void WFN(unit_grads)(const hkt_window_params *p, WFN(work) *wk, int64_t b, int64_t hk, real c,
                            const real *go, real Dg) {
    const int64_t Dv = p->Dv;
    real *P_u = wk->us;
#pragma omp simd
    for (int64_t u = 0; u < wk->nu; u++) P_u[u] = REAL_EXP_NONPOS(P_u[u] - c);
    for (int64_t u = 0; u < wk->nu; u++) {
        const real P = P_u[u];
        const real *vr = WFN(vrow)(p, p->vs, wk->ulev[u], b, hk, wk->uidx[u]);
        real *dvr = (real *)WFN(vrow)(p, (const void *const *)p->dvs, wk->ulev[u], b, hk, wk->uidx[u]);
        real g = 0;
#pragma omp simd reduction(+ : g)
        for (int64_t d = 0; d < Dv; d++) {
            g += go[d] * vr[d];
            dvr[d] += P * go[d];
        }
        wk->E[wk->um[u]][wk->uc[u]] += P * (g - wk->ucnt[u] * Dg);
    }
}

/* how far a block's rows' lse may spread for its queries to share the visit
 * of level m's units: exp(c - lse_i) stays far inside the real's range */
#define WIN_SPREAD ((real)(sizeof(real) == 4 ? 30 : 300))

static void WFN(backward_kv)(const hkt_window_params *p, WFN(work) *wk, int64_t b, int64_t hk, real *dw_part) {
    const int64_t D = p->D, Dv = p->Dv, group = p->H / p->H_kv, dvp = (Dv + 15) / 16 * 16;
    for (int l = 0; l < p->L; l++) {
        const int64_t Sl = WFN(blocks)(p->S, l);
        memset((real *)p->dk[l] + (b * p->H_kv + hk) * Sl * D, 0, (size_t)(Sl * D) * sizeof(real));
        memset((real *)p->dvs[l] + (b * p->H_kv + hk) * Sl * Dv, 0, (size_t)(Sl * Dv) * sizeof(real));
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        const real *w = (const real *)p->w + h * p->L;
        real f[HKT_MAX_LEVELS], dwl[HKT_MAX_LEVELS];
        for (int l = 0; l < p->L; l++) {
            f[l] = WFN(factor)(p->scale, w[l]);
            dwl[l] = 0;
        }
        const real *out = (const real *)p->out + (b * p->H + h) * p->T * Dv;
        const real *dout = (const real *)p->dout + (b * p->H + h) * p->T * Dv;
        const real *lse = (const real *)p->lse + (b * p->H + h) * p->T;
        for (int64_t i = 0; i < p->T; i++) {
            for (int l = p->L - 1; l >= 0; l--)
                if (WFN(starts)(i, l)) WFN(level_scores)(p, wk, l, b, h, hk, i >> l, f[l]);
            for (int m = 2; m < p->L; m++)
                if (WFN(starts)(i, m - 1)) { /* a level-(m-1) block begins: can its queries share level m? */
                    const int64_t r0 = i, r1 = ((i >> (m - 1)) + 1) << (m - 1) < p->T ? ((i >> (m - 1)) + 1) << (m - 1)
                                                                                     : p->T;
                    real hi = -INFINITY, lo = INFINITY;
                    for (int64_t r = r0; r < r1; r++)
                        if (lse[r] != INFINITY) {
                            hi = lse[r] > hi ? lse[r] : hi;
                            lo = lse[r] < lo ? lse[r] : lo;
                        }
                    wk->shared[m] = hi == -INFINITY || hi - lo <= WIN_SPREAD; /* false for NaN too */
                    wk->c[m] = hi == -INFINITY ? 0 : hi;
                    wk->Y[m] = 0;
                    memset(wk->X + m * dvp, 0, (size_t)Dv * sizeof(real));
                }
            const real li = lse[i];
            if (li != INFINITY) { /* a row that sees nothing has no gradient */
                const real *go = dout + i * Dv;
                const real Di = WFN(dot)(go, out + i * Dv, Dv);
                for (int m = 0; m < p->L; m++) {
                    if (m >= 2 && wk->shared[m]) {
                        const real a = REAL_EXP(wk->c[m] - li);
                        real *X = wk->X + m * dvp;
#pragma omp simd
                        for (int64_t d = 0; d < Dv; d++) X[d] += a * go[d];
                        wk->Y[m] += a * Di;
                        continue;
                    }
                    WFN(seg_units)(p, wk, m);
                    WFN(unit_grads)(p, wk, b, hk, li, go, Di);
                }
            }
            for (int l = 0; l < p->L; l++)
                if (WFN(ends)(p, i, l)) {
                    if (l + 1 >= 2 && l + 1 < p->L && wk->shared[l + 1]) { /* level l+1's shared units, once */
                        WFN(seg_units)(p, wk, l + 1);
                        WFN(unit_grads)(p, wk, b, hk, wk->c[l + 1], wk->X + (l + 1) * dvp, wk->Y[l + 1]);
                    }
                    WFN(flush)(p, wk, l, b, h, hk, i >> l, f[l], &dwl[l]);
                }
        }
        for (int l = 0; l < p->L; l++) dw_part[(b * p->H + h) * p->L + l] = dwl[l];
    }
}

static void WFN(forward)(const hkt_window_params *p) {
    const size_t per = (WFN(thread_bytes)(p, 0) + 63) / 64 * 64;
    const int64_t tasks = p->B * p->H;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->num_threads) if (p->num_threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        WFN(work) wk;
        WFN(carve)(p, 0, (char *)p->workspace + per * (size_t)omp_get_thread_num(), &wk);
        WFN(forward_head)(p, &wk, t / p->H, t % p->H);
    }
}

static void WFN(backward)(const hkt_window_params *p) {
    const size_t per = (WFN(thread_bytes)(p, 1) + 63) / 64 * 64;
    real *dw_part = (real *)((char *)p->workspace + per * (size_t)p->num_threads);
    const int64_t tasks = p->B * p->H_kv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->num_threads) if (p->num_threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        WFN(work) wk;
        WFN(carve)(p, 1, (char *)p->workspace + per * (size_t)omp_get_thread_num(), &wk);
        WFN(backward_kv)(p, &wk, t / p->H_kv, t % p->H_kv, dw_part);
    }
    real *dw = (real *)p->dw;
    for (int64_t x = 0; x < p->H * p->L; x++) dw[x] = 0;
    for (int64_t b = 0; b < p->B; b++) /* over the batch in index order: the same bits for any thread count */
        for (int64_t x = 0; x < p->H * p->L; x++) dw[x] += dw_part[b * p->H * p->L + x];
}

#undef WIN_SPREAD
