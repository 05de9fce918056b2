/*
 * hkt_window_body.h -- the windowed kernels of hkt_window.h for one real type.
 * Not a header of declarations: the kernels' body, included once by
 * hkt_window_f32.c and once by hkt_window_f64.c (and so per instruction set,
 * as the dense kernels' bodies are), each defining `real`, REAL_IS_FLOAT and
 * REAL_EXP / REAL_LOG / REAL_NEXTAFTER first.  Every function is static, named
 * win_*, the entry points win_forward, win_backward and win_decode; exps of
 * x <= 0 are hkt_real.h's exp_nonpos, in a form the compiler vectorises, and
 * soft caps its soft_cap.
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
 * With a soft cap c the units are scored U_m = c tanh(A_m / c) (a copy: A_m
 * still feeds the levels below), and the backward adds their gradients to EU_m,
 * taken through the cap into E_m when level m's block ends.  Without one U_m
 * is A_m and EU_m is E_m, the same arrays, so nothing else changes.
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

#include "hkt_cpu.h"
#include "hkt_dropout.h"
#include "hkt_real.h"
#include "hkt_window.h"

#include <string.h>
#if HKT_VEC_BYTES == 64
#include <immintrin.h> /* the AVX-512 build's lane sums */
#endif

#define WIN_TILE 16
/* the per-key mode's chunk of keys, scored and exponentiated together */
#define WIN_KEYS 128
/* the per-key mode's queries that take a level's shared units together: up to
 * 2^WIN_GROUP_LOG of one level-(m-1) block (one pass over the keys' values for
 * them all) */
#define WIN_GROUP_LOG 4
#define WIN_GROUP (1 << WIN_GROUP_LOG)

/* where level l's keys of query block a lie, in level-l blocks: the window
 * [lo, hi) unclipped (no window: all of them), and [base, end) clipped */
typedef struct {
    int64_t lo, hi, base, end;
} win_range;

static inline win_range win_level_range(const hkt_window_params *p, int l, int64_t a) {
    const int64_t Sl = p->S > 0 ? ((p->S - 1) >> l) + 1 : 0;
    win_range r;
    if (p->radius[l] == 0) {
        r.lo = 0;
        r.hi = Sl;
    } else {
        r.lo = a - p->radius[l] + 1;
        r.hi = a + p->radius[l];
    }
    r.base = r.lo > 0 ? r.lo : 0;
    if (r.base > Sl) r.base = Sl; /* a query block past the keys' end sees none: an empty range at Sl, so a
                                    * tile's union of ranges never reaches past the keys either */
    r.end = r.hi < Sl ? r.hi : Sl;
    if (p->is_causal && r.end > a + 1) r.end = a + 1;
    if (r.end < r.base) r.end = r.base;
    return r;
}

static inline int64_t win_blocks(int64_t n, int l) { return n > 0 ? ((n - 1) >> l) + 1 : 0; }

/* most level-l blocks a query block sees */
static int64_t win_level_cap(const hkt_window_params *p, int l) {
    const int64_t Sl = win_blocks(p->S, l);
    if (p->radius[l] == 0) return Sl;
    const int64_t n = 2 * p->radius[l] - 1;
    return n < Sl ? n : Sl;
}

/* n units side by side: their scores s[0 .. n) (in A[m], and their gradients
 * at the same places of E[m]), their summed values rows idx .. idx + n - 1 of
 * vs[lev], each of keys keys but the last, of last_keys (cut at S) */
typedef struct {
    const real *s;
    int64_t ec;             /* s's offset in A[m], E's alike */
    int64_t idx, n;
    real keys, last_keys;
    int lev, m;
} win_run;

/* a mask that varies with the query, or dropout: every key visited on its own */
static int win_per_key(const hkt_window_params *p) { return p->mask_kind != HKT_MASK_NONE || p->dropout_p > 0; }

/* one thread's workspace, carved from its slice */
typedef struct {
    real *G[HKT_MAX_LEVELS], *A[HKT_MAX_LEVELS], *E[HKT_MAX_LEVELS];
    win_range r[HKT_MAX_LEVELS];
    real *e, *acc;          /* a run's exps; a row accumulator (Dv) */
    win_run runs[8];       /* the current part's units, as runs */
    real *GT[HKT_MAX_LEVELS], *QT; /* per level: a tile's dot products (key-major); the tile's queries, transposed */
    int64_t tile[HKT_MAX_LEVELS], tile_base[HKT_MAX_LEVELS]; /* the tile's first query block (-1: none); first key */
    int nruns;
    real *O, *X;                        /* per level m, Dv each: a partial's weighted values; the backward's summed dout */
    /* per-key mode: per query of a group, a chunk of keys' scores, exps (or P) and dropout factors
     * (WIN_KEYS each); per level m and query of a group, a partial's weighted values, max and sum */
    real *ks, *ke, *kk, *QO, *QM, *QZ;
    int grouped[HKT_MAX_LEVELS];        /* backward, per-key mode: level m's units visited once per group */
    real M[HKT_MAX_LEVELS], Z[HKT_MAX_LEVELS]; /* per level: a partial's max and sum */
    real c[HKT_MAX_LEVELS], Y[HKT_MAX_LEVELS]; /* backward: a block's largest lse, its weighted sum of <dout, out> */
    int shared[HKT_MAX_LEVELS];         /* backward: level m's units visited once per level-(m-1) block */
    /* per level: the units' scores and where their gradients go (A and E, or with a soft cap their own) */
    real *U[HKT_MAX_LEVELS], *EU[HKT_MAX_LEVELS];
} win_work;

static size_t win_thread_bytes(const hkt_window_params *p, int backward) {
    size_t reals = 0, units = 0;
    for (int l = 0; l < p->L; l++) {
        const size_t n = (size_t)win_level_cap(p, l);
        reals += (backward ? 3 : 2) * ((n + 15) / 16 * 16) + WIN_TILE * (n + WIN_TILE);
        units += n + 2;
    }
    units = (units + 15) / 16 * 16;
    const size_t dv = ((size_t)p->Dv + 15) / 16 * 16;
    const size_t keyed = win_per_key(p) ? (WIN_GROUP + 1) * 3 * WIN_KEYS + WIN_GROUP * (size_t)p->L * (dv + 2) : 0;
    if (p->softcap > 0) /* U, and in the backward EU, of their own */
        for (int l = 0; l < p->L; l++) reals += (backward ? 2 : 1) * (((size_t)win_level_cap(p, l) + 15) / 16 * 16);
    return (reals + units + (1 + 2 * (size_t)p->L) * dv + WIN_TILE * (size_t)p->D + keyed) * sizeof(real) + 64;
}

static void win_carve(const hkt_window_params *p, int backward, char *mem, win_work *wk) {
    real *x = (real *)mem;
    size_t units = 0;
    for (int l = 0; l < p->L; l++) {
        const size_t n = ((size_t)win_level_cap(p, l) + 15) / 16 * 16;
        wk->G[l] = x;
        x += n;
        wk->A[l] = x;
        x += n;
        wk->E[l] = backward ? x : NULL;
        if (backward) x += n;
        wk->GT[l] = x;
        x += WIN_TILE * ((size_t)win_level_cap(p, l) + WIN_TILE);
        wk->tile[l] = -1;
        units += (size_t)win_level_cap(p, l) + 2;
    }
    units = (units + 15) / 16 * 16;
    wk->e = x;
    x += units;
    const size_t dv = ((size_t)p->Dv + 15) / 16 * 16;
    wk->acc = x;
    x += dv;
    wk->O = x;
    x += dv * (size_t)p->L;
    wk->X = x;
    x += dv * (size_t)p->L;
    wk->QT = x;
    x += WIN_TILE * (size_t)p->D;
    const size_t keys = win_per_key(p) ? (WIN_GROUP + 1) * WIN_KEYS : 0, slots = win_per_key(p) ? WIN_GROUP : 0;
    wk->ks = x;
    wk->ke = x + keys;
    wk->kk = x + 2 * keys;
    x += 3 * keys;
    wk->QO = x;
    x += slots * (size_t)p->L * dv;
    wk->QM = x;
    wk->QZ = x + slots * (size_t)p->L;
    x += 2 * slots * (size_t)p->L;
    /* after all the rest: without a cap the layout is the uncapped kernels' own */
    for (int l = 0; l < p->L; l++) {
        wk->U[l] = wk->A[l];
        wk->EU[l] = wk->E[l];
        if (p->softcap <= 0) continue;
        const size_t n = ((size_t)win_level_cap(p, l) + 15) / 16 * 16;
        wk->U[l] = x;
        x += n;
        if (backward) {
            wk->EU[l] = x;
            x += n;
        }
    }
}

/* <a, b> in a fixed order, whatever the compiler inlines or vectorises: one
 * partial sum per lane of a vector (VL_FULL of them: 16 floats with AVX-512, 8
 * with AVX2, 4 in the portable build), each a chain of madd over its lane's
 * entries; the entries past the last whole vector into lane 0, one by one;
 * then the lanes added in turn to 0.  That is how GCC built the
 * `omp simd reduction(+)` this replaces wherever it vectorised it (its lane
 * array, tail into lane 0); left to it, some inlined copies were not
 * vectorised and summed in plain order, other bits for the same call. */
static inline real win_dot(const real *a, const real *b, int64_t n) {
    vec acc = {0};
    int64_t d = 0;
    for (; d + VL_FULL <= n; d += VL_FULL) acc = vec_madd(vload(a + d), vload(b + d), acc);
    real lane[VL_FULL];
    vstore(lane, acc);
    for (; d < n; d++) lane[0] = madd(a[d], b[d], lane[0]);
    real s = 0;
    for (int k = 0; k < VL_FULL; k++) s += lane[k];
    return s;
}

/* <a, b> summed in plain order from 0, products fused as madd fuses them: the
 * order of the one-query per-key backward's <dout, out> in the float64 AVX2
 * and AVX-512 sets, where GCC had inlined that path and left its vectorisable
 * sum unvectorised (everywhere else it summed by lanes, as win_dot does).
 * Kept as it was so that those sets give the same bits as before. */
static inline real win_dot_plain(const real *a, const real *b, int64_t n) {
    real s = 0;
    for (int64_t d = 0; d < n; d++) s = madd(a[d], b[d], s);
    return 0 + s; /* as the reduction ended, an add to 0: -0 becomes +0 */
}
#define WIN_DI_PLAIN (!REAL_IS_FLOAT && HKT_VEC_BYTES >= 32)

/* scale * w as the other kernels form it: a product that rounds to 0 although
 * neither factor is 0 becomes the smallest subnormal of its sign */
static inline real win_factor(double scale, real w) {
    const real f = (real)scale * w;
    if (f == 0 && w != 0 && scale != 0) {
        const real tiny = REAL_NEXTAFTER((real)0, (real)1);
        return ((w > 0) == (scale > 0)) ? tiny : -tiny;
    }
    return f;
}

/* G and A of level l for query block a (batch b, head h, kv head hk).  G is
 * taken from a tile of WIN_TILE query blocks' dot products, made when a enters
 * it: with the tile's queries transposed, one key's products with all of them
 * are one vector of sums, each in the order of d, with no horizontal sum. */
static void win_level_scores(const hkt_window_params *p, win_work *wk, int l, int64_t b, int64_t h,
                              int64_t hk, int64_t a, real f) {
    const int64_t D = p->D, Tl = win_blocks(p->T, l), Sl = win_blocks(p->S, l);
    const win_range r = win_level_range(p, l, a);
    wk->r[l] = r;
    const real *qa = (const real *)p->q[l] + ((b * p->H + h) * Tl + a) * D;
    const real *kl = (const real *)p->k[l] + (b * p->H_kv + hk) * Sl * D;
    real *G = wk->G[l], *A = wk->A[l];
    const int64_t t0 = a & ~(int64_t)(WIN_TILE - 1);
    if (wk->tile[l] != t0) { /* the next WIN_TILE query blocks: their dot products with every key they see */
        const int64_t t1 = t0 + WIN_TILE < Tl ? t0 + WIN_TILE : Tl;
        const win_range lo = win_level_range(p, l, t0), hi = win_level_range(p, l, t1 - 1);
        real *QT = wk->QT, *GT = wk->GT[l];
        for (int64_t d = 0; d < D; d++)
            for (int64_t t = 0; t < WIN_TILE; t++) QT[d * WIN_TILE + t] = t0 + t < t1 ? qa[(t0 + t - a) * D + d] : 0;
        for (int64_t c = lo.base; c < hi.end; c++) {
            const real *kc = kl + c * D;
            real acc[WIN_TILE] = {0};
            for (int64_t d = 0; d < D; d++) {
                const real kd = kc[d];
#pragma omp simd
                for (int64_t t = 0; t < WIN_TILE; t++) acc[t] += QT[d * WIN_TILE + t] * kd;
            }
            memcpy(GT + (c - lo.base) * WIN_TILE, acc, sizeof acc);
        }
        wk->tile[l] = t0;
        wk->tile_base[l] = lo.base;
    }
    {
        const real *GT = wk->GT[l] + (r.base - wk->tile_base[l]) * WIN_TILE + (a - t0);
        for (int64_t c = r.base; c < r.end; c++) G[c - r.base] = GT[(c - r.base) * WIN_TILE];
    }
    if (l + 1 < p->L) {
        const real *Au = wk->A[l + 1];
        const int64_t bu = wk->r[l + 1].base;
        for (int64_t c = r.base; c < r.end; c++) A[c - r.base] = f * G[c - r.base] + Au[(c >> 1) - bu];
    } else {
        for (int64_t c = r.base; c < r.end; c++) A[c - r.base] = f * G[c - r.base];
    }
    if (p->softcap > 0) {
        const real cap = (real)p->softcap, *Al = wk->A[l];
        real *U = wk->U[l];
        memcpy(U, Al, (size_t)(r.end - r.base) * sizeof(real));
        soft_cap(U, r.end - r.base, cap, NULL); /* hkt_real.h's, the dense kernels' own */
        if (wk->EU[l] != wk->E[l]) memset(wk->EU[l], 0, (size_t)(r.end - r.base) * sizeof(real));
    }
    if (wk->E[l]) memset(wk->E[l], 0, (size_t)(r.end - r.base) * sizeof(real));
}

static inline void win_add_run(const hkt_window_params *p, win_work *wk, int lev, int64_t idx, int64_t n,
                                int m, int64_t ec) {
    if (n <= 0) return;
    win_run *r = &wk->runs[wk->nruns++];
    const int64_t full = (int64_t)1 << lev, tail = p->S - ((idx + n - 1) << lev);
    r->s = wk->U[m] + ec;
    r->ec = ec;
    r->idx = idx;
    r->n = n;
    r->keys = (real)full;
    r->last_keys = (real)(tail < full ? tail : full);
    r->lev = lev;
    r->m = m;
}

/* level m's units over its level-(m-1) blocks [x0, x1): the whole level-m
 * blocks in it as one run, a level-(m-1) block alone at either end as a run
 * of its own */
static void win_add_range(const hkt_window_params *p, win_work *wk, int m, int64_t x0, int64_t x1) {
    if (x0 >= x1) return;
    const int64_t base = wk->r[m].base;
    if (x0 & 1) {
        win_add_run(p, wk, m - 1, x0, 1, m, (x0 >> 1) - base);
        x0++;
    }
    const int64_t pairs = (x1 - x0) / 2;
    win_add_run(p, wk, m, x0 >> 1, pairs, m, (x0 >> 1) - base);
    x0 += 2 * pairs;
    if (x0 < x1) win_add_run(p, wk, m - 1, x0, 1, m, (x0 >> 1) - base);
}

/* the units of level m's part (m = 0: the single keys level 0 sees), once the
 * levels' A are current */
static void win_seg_units(const hkt_window_params *p, win_work *wk, int m) {
    wk->nruns = 0;
    if (m == 0) {
        const win_range r0 = wk->r[0];
        win_add_run(p, wk, 0, r0.base, r0.end - r0.base, 0, 0);
        return;
    }
    if (p->radius[m - 1] == 0) return; /* level m-1 sees every key: nothing is left for level m */
    const win_range rm = wk->r[m], rd = wk->r[m - 1];
    const int64_t Sd = win_blocks(p->S, m - 1);
    /* left of level m-1's window */
    int64_t x0 = 2 * rm.lo > 0 ? 2 * rm.lo : 0, x1 = rd.lo < Sd ? rd.lo : Sd;
    win_add_range(p, wk, m, x0, x1);
    if (!p->is_causal) { /* right of it: keys after query i */
        x0 = rd.hi > 0 ? rd.hi : 0;
        x1 = 2 * rm.hi < Sd ? 2 * rm.hi : Sd;
        win_add_range(p, wk, m, x0, x1);
    }
}

/* new block at level l for query i */
static inline int win_starts(int64_t i, int l) { return i == 0 || ((i - 1) >> l) != (i >> l); }
static inline int win_ends(const hkt_window_params *p, int64_t i, int l) {
    return i == p->T - 1 || ((i + 1) >> l) != (i >> l);
}

static inline const real *win_vrow(const hkt_window_params *p, const void *const *arr, int lev, int64_t b,
                                     int64_t hk, int64_t idx) {
    const int64_t Sl = win_blocks(p->S, lev);
    return (const real *)arr[lev] + ((b * p->H_kv + hk) * Sl + idx) * p->Dv;
}

/* the counts of visible keys of level lev's blocks from idx on (a key-only
 * mask), or NULL: every block has all its keys */
static inline const real *win_count_row(const hkt_window_params *p, int lev, int64_t b, int64_t hk, int64_t idx) {
    if (!p->counts[lev]) return NULL;
    return (const real *)p->counts[lev] + (b * p->H_kv + hk) * win_blocks(p->S, lev) + idx;
}

/* the partial softmax of the current units: max M, sum Z (each unit counted
 * for its keys, or for its visible ones), O = sum of exp(s - M) * its summed values */
static void win_partial(const hkt_window_params *p, win_work *wk, int64_t b, int64_t hk, real *O, real *M,
                         real *Z) {
    const int64_t Dv = p->Dv;
    real mx = -INFINITY;
    int nan = 0;
    for (int x = 0; x < wk->nruns; x++) {
        const win_run *r = &wk->runs[x];
        const real *cn = win_count_row(p, r->lev, b, hk, r->idx);
        for (int64_t u = 0; u < r->n; u++)
            if (!cn || cn[u] > 0) mx = r->s[u] > mx ? r->s[u] : mx;
    }
    memset(O, 0, (size_t)Dv * sizeof(real));
    if (mx == -INFINITY) { /* no unit, or none but hidden ones -- or NaN ones, which must reach the row */
        for (int x = 0; x < wk->nruns; x++) {
            const real *cn = win_count_row(p, wk->runs[x].lev, b, hk, wk->runs[x].idx);
            for (int64_t u = 0; u < wk->runs[x].n; u++)
                nan |= (!cn || cn[u] > 0) && wk->runs[x].s[u] != wk->runs[x].s[u];
        }
        *M = nan ? 0 : -INFINITY;
        *Z = nan ? NAN : 0;
        if (!nan) return;
        mx = 0;
    }
    real sum = 0, *e = wk->e;
    for (int x = 0; x < wk->nruns; x++) {
        const win_run *r = &wk->runs[x];
        const int64_t n = r->n;
        const real *cn = win_count_row(p, r->lev, b, hk, r->idx);
        real se = 0;
#pragma omp simd reduction(+ : se)
        for (int64_t u = 0; u < n; u++) {
            e[u] = exp_nonpos(r->s[u] - mx);
            se += e[u];
        }
        if (cn) { /* a block of no visible key weighs nothing, whatever its score */
            se = 0;
            for (int64_t u = 0; u < n; u++) {
                e[u] = cn[u] > 0 ? e[u] : 0;
                se += cn[u] * e[u];
            }
            sum += se;
        } else {
            sum += r->keys * se + (r->last_keys - r->keys) * e[n - 1];
        }
        const real *V = win_vrow(p, p->vs, r->lev, b, hk, r->idx);
        for (int64_t u = 0; u < n; u++) {
            const real eu = e[u];
            if (cn && cn[u] == 0) continue;
            const real *vr = V + u * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; d++) O[d] += eu * vr[d];
        }
    }
    *M = mx;
    *Z = sum;
}

#include "hkt_window_keys_body.h"

static void win_forward_head(const hkt_window_params *p, win_work *wk, int64_t b, int64_t h) {
    const int64_t hk = h / (p->H / p->H_kv), Dv = p->Dv;
    const real *w = (const real *)p->w + h * p->L;
    real f[HKT_MAX_LEVELS];
    for (int l = 0; l < p->L; l++) f[l] = win_factor(p->scale, w[l]);
    real *out = (real *)p->out + (b * p->H + h) * p->T * Dv;
    real *lse = (real *)p->lse + (b * p->H + h) * p->T;
    const int64_t dvp = (Dv + 15) / 16 * 16;
    const int per_key = win_per_key(p);
    for (int64_t i = 0; i < p->T; i++) {
        for (int l = p->L - 1; l >= 0; l--)
            if (win_starts(i, l)) win_level_scores(p, wk, l, b, h, hk, i >> l, f[l]);
        /* level m's part, shared by the queries of one level-(m-1) block; per key, by a group of them */
        for (int m = p->L - 1; m >= 0; m--)
            if (per_key && m >= 2) {
                const int64_t g = win_group_at(p, m, i);
                if (g) {
                    win_seg_units(p, wk, m);
                    win_partial_group(p, wk, b, h, hk, i, g, wk->QO + m * WIN_GROUP * dvp, wk->QM + m * WIN_GROUP,
                                       wk->QZ + m * WIN_GROUP);
                }
                const int64_t slot = i & (WIN_GROUP - 1) & ((((int64_t)1) << (m - 1)) - 1);
                wk->M[m] = wk->QM[m * WIN_GROUP + slot];
                wk->Z[m] = wk->QZ[m * WIN_GROUP + slot];
                memcpy(wk->O + m * dvp, wk->QO + (m * WIN_GROUP + slot) * dvp, (size_t)Dv * sizeof(real));
            } else if (m == 0 || per_key || win_starts(i, m - 1)) {
                win_seg_units(p, wk, m);
                if (per_key) win_partial_group(p, wk, b, h, hk, i, 1, wk->O + m * dvp, &wk->M[m], &wk->Z[m]);
                else win_partial(p, wk, b, hk, wk->O + m * dvp, &wk->M[m], &wk->Z[m]);
            }
        real mx = -INFINITY;
        for (int m = 0; m < p->L; m++) mx = wk->M[m] > mx ? wk->M[m] : mx;
        real *o = out + i * Dv;
        if (mx == -INFINITY) {
            if (Dv > 0) memset(o, 0, (size_t)Dv * sizeof(real)); /* Dv = 0: out may have no memory */
            lse[i] = INFINITY;
            continue;
        }
        real *acc = wk->acc, sum = 0;
        memset(acc, 0, (size_t)Dv * sizeof(real));
        for (int m = 0; m < p->L; m++) {
            if (wk->M[m] == -INFINITY) continue;
            const real e = exp_nonpos(wk->M[m] - mx);
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
static void win_flush(const hkt_window_params *p, win_work *wk, int l, int64_t b, int64_t h, int64_t hk,
                       int64_t a, real f, real *dwl) {
    const int64_t D = p->D, Tl = win_blocks(p->T, l), Sl = win_blocks(p->S, l);
    const win_range r = wk->r[l];
    if (p->softcap > 0) { /* the units' gradients, of capped scores, through the cap onto A's */
        const real inv = 1 / (real)p->softcap, *U = wk->U[l], *EU = wk->EU[l];
        real *El = wk->E[l];
        for (int64_t c = 0; c < r.end - r.base; c++) {
            if (EU[c] == 0) continue; /* no unit took this block: a NaN score's derivative stays out */
            const real t = U[c] * inv; /* tanh(A / cap), from the capped score rather than a second tanh */
            El[c] += EU[c] * (1 - t * t);
        }
    }
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

/* <go, vr>, and dvr += P * go, in one pass over the row.  With AVX-512 the
 * sum's lanes are added by a tree of shuffles: the compiler's reduction went
 * through memory one lane at a time, the backward's hottest loop. */
static inline real win_dot_axpy(const real *go, const real *vr, real *dvr, real P, int64_t Dv) {
    real g = 0;
    int64_t d = 0;
#if HKT_VEC_BYTES == 64 && REAL_IS_FLOAT
    __m512 acc = _mm512_setzero_ps();
    const __m512 Pv = _mm512_set1_ps(P);
    for (; d + 16 <= Dv; d += 16) {
        const __m512 gv = _mm512_loadu_ps(go + d);
        acc = _mm512_fmadd_ps(gv, _mm512_loadu_ps(vr + d), acc);
        _mm512_storeu_ps(dvr + d, _mm512_fmadd_ps(Pv, gv, _mm512_loadu_ps(dvr + d)));
    }
    g = _mm512_reduce_add_ps(acc);
#elif HKT_VEC_BYTES == 64
    __m512d acc = _mm512_setzero_pd();
    const __m512d Pv = _mm512_set1_pd(P);
    for (; d + 8 <= Dv; d += 8) {
        const __m512d gv = _mm512_loadu_pd(go + d);
        acc = _mm512_fmadd_pd(gv, _mm512_loadu_pd(vr + d), acc);
        _mm512_storeu_pd(dvr + d, _mm512_fmadd_pd(Pv, gv, _mm512_loadu_pd(dvr + d)));
    }
    g = _mm512_reduce_add_pd(acc);
#endif
    if (d == Dv) return g + 0; /* no tail: skip the vector reduction's epilogue, a sum of lanes through memory */
    /* the rest (the whole row without AVX-512) summed by lanes as win_dot sums */
    vec sums = {0};
    const vec Ps = P - (vec){0};
    for (; d + VL_FULL <= Dv; d += VL_FULL) {
        const vec gs = vload(go + d);
        sums = vec_madd(gs, vload(vr + d), sums);
        vstore(dvr + d, vec_madd(Ps, gs, vload(dvr + d)));
    }
    real lane[VL_FULL];
    vstore(lane, sums);
    for (; d < Dv; d++) {
        lane[0] = madd(go[d], vr[d], lane[0]);
        dvr[d] = madd(P, go[d], dvr[d]);
    }
    real t = 0;
    for (int k = 0; k < VL_FULL; k++) t += lane[k];
    return g + t;
}

/* the current units' gradients, given their probabilities' common factor:
 * P_u = exp(s_u - c) * (weight), go the summed output gradient (weighted like
 * P) and Dg its weighted sum of <dout, out> */
static void win_unit_grads(const hkt_window_params *p, win_work *wk, int64_t b, int64_t hk, real c,
                            const real *go, real Dg) {
    const int64_t Dv = p->Dv;
    real *P = wk->e;
    for (int x = 0; x < wk->nruns; x++) {
        const win_run *r = &wk->runs[x];
        const int64_t n = r->n;
#pragma omp simd
        for (int64_t u = 0; u < n; u++) P[u] = exp_nonpos(r->s[u] - c);
        const real *V = win_vrow(p, p->vs, r->lev, b, hk, r->idx);
        real *dV = (real *)win_vrow(p, (const void *const *)p->dvs, r->lev, b, hk, r->idx);
        real *E = wk->EU[r->m] + r->ec;
        const real kD = r->keys * Dg;
        const real *cn = win_count_row(p, r->lev, b, hk, r->idx);
        int hidden = 0;
        for (int64_t u = 0; u < n; u++) hidden |= r->s[u] == -INFINITY;
        if (cn || hidden) { /* a key-only mask's counts, or units a -inf score hides (even in a NaN row) */
            for (int64_t u = 0; u < n; u++) {
                if ((cn && cn[u] == 0) || r->s[u] == -INFINITY) continue; /* hidden: no P, no gradient */
                const real g = win_dot_axpy(go, V + u * Dv, dV + u * Dv, P[u], Dv);
                E[u] += P[u] * (g - (cn ? cn[u] : u == n - 1 ? r->last_keys : r->keys) * Dg);
            }
            continue;
        }
        for (int64_t u = 0; u < n; u++) {
            const real Pu = P[u];
            const real *vr = V + u * Dv;
            real *dvr = dV + u * Dv;
            const real g = win_dot_axpy(go, vr, dvr, Pu, Dv);
            E[u] += Pu * (g - (u == n - 1 ? r->last_keys * Dg : kD));
        }
    }
}

/* how far a block's rows' lse may spread for its queries to share the visit
 * of level m's units: exp(c - lse_i) stays far inside the real's range */
#define WIN_SPREAD ((real)(sizeof(real) == 4 ? 30 : 300))

static void win_backward_kv(const hkt_window_params *p, win_work *wk, int64_t b, int64_t hk, real *dw_part) {
    const int64_t D = p->D, Dv = p->Dv, group = p->H / p->H_kv, dvp = (Dv + 15) / 16 * 16;
    for (int l = 0; l < p->L; l++) {
        const int64_t Sl = win_blocks(p->S, l);
        if (Sl * D > 0) /* an empty array may have no memory at all (a NULL data pointer) */
            memset((real *)p->dk[l] + (b * p->H_kv + hk) * Sl * D, 0, (size_t)(Sl * D) * sizeof(real));
        if (Sl * Dv > 0)
            memset((real *)p->dvs[l] + (b * p->H_kv + hk) * Sl * Dv, 0, (size_t)(Sl * Dv) * sizeof(real));
    }
    const int per_key = win_per_key(p);
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        for (int l = 0; l < p->L; l++) wk->tile[l] = -1; /* the tiles hold another head's queries */
        if (p->dmask && p->T * p->S > 0)
            memset((real *)p->dmask + (b * p->H + h) * p->T * p->S, 0, (size_t)(p->T * p->S) * sizeof(real));
        const real *w = (const real *)p->w + h * p->L;
        real f[HKT_MAX_LEVELS], dwl[HKT_MAX_LEVELS];
        for (int l = 0; l < p->L; l++) {
            f[l] = win_factor(p->scale, w[l]);
            dwl[l] = 0;
        }
        const real *out = (const real *)p->out + (b * p->H + h) * p->T * Dv;
        const real *dout = (const real *)p->dout + (b * p->H + h) * p->T * Dv;
        const real *lse = (const real *)p->lse + (b * p->H + h) * p->T;
        for (int64_t i = 0; i < p->T; i++) {
            for (int l = p->L - 1; l >= 0; l--)
                if (win_starts(i, l)) win_level_scores(p, wk, l, b, h, hk, i >> l, f[l]);
            for (int m = 2; m < p->L; m++)
                if (win_starts(i, m - 1)) { /* a level-(m-1) block begins: can its queries share level m? */
                    const int64_t r0 = i, r1 = ((i >> (m - 1)) + 1) << (m - 1) < p->T ? ((i >> (m - 1)) + 1) << (m - 1)
                                                                                     : p->T;
                    real hi = -INFINITY, lo = INFINITY;
                    for (int64_t r = r0; r < r1; r++)
                        if (lse[r] != INFINITY) {
                            hi = lse[r] > hi ? lse[r] : hi;
                            lo = lse[r] < lo ? lse[r] : lo;
                        }
                    /* false for NaN too, and where a mask or dropout sets keys of a block apart */
                    wk->shared[m] = !per_key && (hi == -INFINITY || hi - lo <= WIN_SPREAD);
                    wk->c[m] = hi == -INFINITY ? 0 : hi;
                    wk->Y[m] = 0;
                    memset(wk->X + m * dvp, 0, (size_t)Dv * sizeof(real));
                }
            for (int m = 2; per_key && m < p->L; m++) { /* a group of queries sharing level m's units */
                const int64_t g = win_group_at(p, m, i);
                if (!g) continue;
                int exact = 1;
                for (int64_t r = i; r < i + g; r++) exact &= win_lse_exact(lse[r]);
                wk->grouped[m] = exact; /* else its rows visit them one by one, from their max and sum */
                if (exact) {
                    win_seg_units(p, wk, m);
                    win_grads_group(p, wk, b, h, hk, i, g, NULL);
                }
            }
            const real li = lse[i];
            if (li != INFINITY && per_key) {
                win_query_grads_keys(p, wk, b, h, hk, i, li);
            } else if (li != INFINITY) { /* a row that sees nothing has no gradient */
                const real *go = dout + i * Dv;
                const real Di = win_dot(go, out + i * Dv, Dv);
                for (int m = 0; m < p->L; m++) {
                    if (m >= 2 && wk->shared[m]) {
                        const real a = REAL_EXP(wk->c[m] - li);
                        real *X = wk->X + m * dvp;
#pragma omp simd
                        for (int64_t d = 0; d < Dv; d++) X[d] += a * go[d];
                        wk->Y[m] += a * Di;
                        continue;
                    }
                    win_seg_units(p, wk, m);
                    win_unit_grads(p, wk, b, hk, li, go, Di);
                }
            }
            for (int l = 0; l < p->L; l++)
                if (win_ends(p, i, l)) {
                    if (l + 1 >= 2 && l + 1 < p->L && wk->shared[l + 1]) { /* level l+1's shared units, once */
                        win_seg_units(p, wk, l + 1);
                        win_unit_grads(p, wk, b, hk, wk->c[l + 1], wk->X + (l + 1) * dvp, wk->Y[l + 1]);
                    }
                    win_flush(p, wk, l, b, h, hk, i >> l, f[l], &dwl[l]);
                }
        }
        for (int l = 0; l < p->L; l++) dw_part[(b * p->H + h) * p->L + l] = dwl[l];
    }
}

static void win_forward(const hkt_window_params *p) {
    const size_t per = (win_thread_bytes(p, 0) + 63) / 64 * 64;
    const int64_t tasks = p->B * p->H;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->num_threads) if (p->num_threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        win_work wk;
        win_carve(p, 0, (char *)p->workspace + per * (size_t)thread_id(), &wk);
        win_forward_head(p, &wk, t / p->H, t % p->H);
    }
}

static void win_backward(const hkt_window_params *p) {
    const size_t per = (win_thread_bytes(p, 1) + 63) / 64 * 64;
    real *dw_part = (real *)((char *)p->workspace + per * (size_t)p->num_threads);
    const int64_t tasks = p->B * p->H_kv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->num_threads) if (p->num_threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        win_work wk;
        win_carve(p, 1, (char *)p->workspace + per * (size_t)thread_id(), &wk);
        win_backward_kv(p, &wk, t / p->H_kv, t % p->H_kv, dw_part);
    }
    real *dw = (real *)p->dw;
    for (int64_t x = 0; x < p->H * p->L; x++) dw[x] = 0;
    for (int64_t b = 0; b < p->B; b++) /* over the batch in index order: the same bits for any thread count */
        for (int64_t x = 0; x < p->H * p->L; x++) dw[x] += dw_part[b * p->H * p->L + x];
}

#include "hkt_window_decode_body.h"

#undef WIN_SPREAD
#undef WIN_LSE_EXACT
#undef WIN_TILE
#undef WIN_KEYS
#undef WIN_GROUP
#undef WIN_GROUP_LOG
