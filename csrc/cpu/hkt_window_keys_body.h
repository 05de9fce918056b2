/*
 * hkt_window_keys_body.h -- the windowed kernels' per-key mode (hkt_window.h:
 * a mask that varies with the query, or dropout), for one real type.
 * Included by hkt_window_body.h, with its structures, its units (seg_units)
 * and WIN_KEYS and WIN_GROUP defined.
 *
 * A unit's keys no longer share one probability: each key is scored at its
 * unit's score plus its mask entry and visited on its own, WIN_KEYS keys at a
 * time (their scores, exps and dropout draws made as vectors, then their
 * values summed in registers).  Level m >= 2's units are the same for the
 * queries of a level-(m-1) block, so groups of up to WIN_GROUP of them take
 * each chunk together: each key's values (and, in the backward, their
 * gradient) are read once for the group, not once per query.
 */

/* One query row's mask and dropout, for the kernels' per-key mode (a mask
 * that varies with the query, or dropout): the row's mask entries from key 0
 * on (a bool or a float row, or neither), and its dropout draws. */
typedef struct {
    const unsigned char *mb;
    const real *mf;
    int64_t ms;                 /* the mask row's stride along the keys */
    uint64_t sm, th, rowidx;    /* keep_entry's mixed seed and threshold; the index of the row's key 0 */
    real kf;                    /* what a kept entry is multiplied by */
    int drop;
} win_keyrow;

static win_keyrow win_key_row(const hkt_window_params *p, int64_t b, int64_t h, int64_t i) {
    win_keyrow kr;
    memset(&kr, 0, sizeof kr);
    const int64_t off = b * p->mask_stride[0] + h * p->mask_stride[1] + i * p->mask_stride[2];
    if (p->mask_kind == HKT_MASK_BOOL) kr.mb = (const unsigned char *)p->mask + off;
    else if (p->mask_kind == HKT_MASK_FLOAT) kr.mf = (const real *)p->mask + off;
    kr.ms = p->mask_stride[3];
    kr.drop = p->dropout_p > 0;
    kr.sm = mix64(p->seed);
    kr.th = keep_threshold(p->dropout_p);
    kr.kf = (real)keep_scale(p->dropout_p);
    kr.rowidx = (uint64_t)(((b * p->H + h) * p->T + i) * p->S);
    return kr;
}

/* a run's keys, [*j0, return): its units' keys, cut at S */
static inline int64_t win_run_keys(const hkt_window_params *p, const win_run *r, int64_t *j0) {
    *j0 = r->idx << r->lev;
    const int64_t j1 = (r->idx + r->n) << r->lev;
    return j1 < p->S ? j1 : p->S;
}

/* the unit scores of keys j0 .. j0 + n - 1 of run r into u: each key its
 * unit's score, filled a unit at a time */
static void win_unit_fill(const win_run *r, int64_t j0, int64_t n, real *u) {
    const int lev = r->lev;
    if (lev == 0) {
        memcpy(u, r->s + (j0 - r->idx), (size_t)n * sizeof(real));
        return;
    }
    for (int64_t t = 0; t < n;) {
        const int64_t c = (j0 + t) >> lev, end = ((c + 1) << lev) - j0 < n ? ((c + 1) << lev) - j0 : n;
        const real su = r->s[c - r->idx];
        for (; t < end; t++) u[t] = su;
    }
}

/* one query's scores of those keys into s: the unit scores u plus the float
 * mask's entries; -inf where the bool mask hides a key (even for a NaN score:
 * a hidden entry is out of its row) */
static void win_key_scores(const real *u, const win_keyrow *kr, int64_t j0, int64_t n, real *s) {
    if (kr->mb) {
        const unsigned char *mb = kr->mb + j0 * kr->ms;
        for (int64_t t = 0; t < n; t++) s[t] = mb[t * kr->ms] ? u[t] : -INFINITY;
    } else if (kr->mf) {
        const real *mf = kr->mf + j0 * kr->ms;
        for (int64_t t = 0; t < n; t++) s[t] = u[t] + mf[t * kr->ms];
    } else {
        memcpy(s, u, (size_t)n * sizeof(real));
    }
}

/* the dropout factors of keys j0 .. j0 + n - 1 into kk: kf where kept, 0 where dropped */
static void win_key_keeps(const win_keyrow *kr, int64_t j0, int64_t n, real *kk) {
    for (int64_t t = 0; t < n; t++) kk[t] = keep_entry(kr->sm, kr->th, kr->rowidx + (uint64_t)(j0 + t)) ? kr->kf : 0;
}

/* 16 reals as one GCC vector (one zmm of float32, two of float64), loaded
 * and stored unaligned */
typedef real win_lanes __attribute__((vector_size(16 * sizeof(real)), aligned(sizeof(real)), may_alias));

/* y += sum_k c[k] * x[k], rows of Dv, each element summed in k's order in a
 * register rather than through memory row after row; 64 elements at a time,
 * four independent chains of FMAs that overlap (one chain waits on the
 * FMA's latency at every k).  (GCC made scalar code of the plain loops.) */
static inline __attribute__((always_inline)) void win_axpy_rows(real *y, const real *c, const real *const *x, int64_t n, int64_t Dv) {
    typedef win_lanes lanes;
    int64_t d = 0;
    for (; d + 64 <= Dv; d += 64) {
        lanes a0 = *(const lanes *)(y + d), a1 = *(const lanes *)(y + d + 16), a2 = *(const lanes *)(y + d + 32),
              a3 = *(const lanes *)(y + d + 48);
        for (int64_t k = 0; k < n; k++) {
            const real ck = c[k], *xk = x[k] + d;
            a0 += ck * *(const lanes *)xk;
            a1 += ck * *(const lanes *)(xk + 16);
            a2 += ck * *(const lanes *)(xk + 32);
            a3 += ck * *(const lanes *)(xk + 48);
        }
        *(lanes *)(y + d) = a0;
        *(lanes *)(y + d + 16) = a1;
        *(lanes *)(y + d + 32) = a2;
        *(lanes *)(y + d + 48) = a3;
    }
    for (; d + 16 <= Dv; d += 16) {
        lanes a0 = *(const lanes *)(y + d);
        for (int64_t k = 0; k < n; k++) a0 += c[k] * *(const lanes *)(x[k] + d);
        *(lanes *)(y + d) = a0;
    }
    for (; d < Dv; d++) {
        real a = y[d];
        for (int64_t k = 0; k < n; k++) a += c[k] * x[k][d];
        y[d] = a;
    }
}

/* one query's chunk of keys in the per-key mode's partial: their scores s
 * taken in (a new max rescales what the query has summed, sum and O), their
 * exps (times their dropout factors) into e.  0 when the query has seen
 * nothing but hidden or NaN scores so far (e is not made), else 1, or 2 when
 * some of the chunk's keys are hidden. */
static int win_chunk_exps(const win_keyrow *kr, const real *s, real *e, real *kk, int64_t j0, int64_t n, real *mx,
                           real *sum, int *nan, real *O, int64_t Dv) {
    real cm = -INFINITY;
    int nn = 0, hid = 0;
#pragma omp simd reduction(max : cm) reduction(| : nn, hid)
    for (int64_t t = 0; t < n; t++) {
        nn |= s[t] != s[t];
        hid |= s[t] == -INFINITY;
        cm = s[t] > cm ? s[t] : cm;
    }
    *nan |= nn;
    if (cm > *mx) {
        const real a = *mx == -INFINITY ? 0 : exp_nonpos(*mx - cm);
        *sum *= a;
        for (int64_t d = 0; d < Dv; d++) O[d] *= a;
        *mx = cm;
    }
    if (*mx == -INFINITY) return 0;
    const real m = *mx;
    real se = 0;
#pragma omp simd reduction(+ : se)
    for (int64_t t = 0; t < n; t++) {
        e[t] = exp_nonpos(s[t] - m);
        se += e[t];
    }
    *sum += se;
    if (kr->drop) {
        win_key_keeps(kr, j0, n, kk);
        for (int64_t t = 0; t < n; t++) e[t] *= kk[t];
    }
    return 1 + hid;
}

/* the partials of level m's part (the current units) for queries i0 .. i0 + g
 * - 1 (g <= WIN_GROUP; more than one only where they share those units), in
 * the per-key mode: every key at its own score, the normaliser counting every
 * visible key, out only the kept ones.  Query q's into O + q * dvp, M[q] and
 * Z[q]; a NaN score makes Z NaN, which poisons the row when the partials
 * merge.  The keys come in chunks of WIN_KEYS, each key's values read once
 * for the whole group. */
static void win_partial_group(const hkt_window_params *p, win_work *wk, int64_t b, int64_t h, int64_t hk,
                               int64_t i0, int64_t g, real *O, real *M, real *Z) {
    const int64_t Dv = p->Dv, dvp = (Dv + 15) / 16 * 16;
    const real *V0 = win_vrow(p, p->vs, 0, b, hk, 0);
    win_keyrow kr[WIN_GROUP];
    real sum[WIN_GROUP];
    int nan[WIN_GROUP], live[WIN_GROUP];
    for (int64_t q = 0; q < g; q++) {
        kr[q] = win_key_row(p, b, h, i0 + q);
        M[q] = -INFINITY;
        sum[q] = 0;
        nan[q] = 0;
        memset(O + q * dvp, 0, (size_t)Dv * sizeof(real));
    }
    for (int x = 0; x < wk->nruns; x++) {
        int64_t J0;
        const int64_t J1 = win_run_keys(p, &wk->runs[x], &J0);
        for (int64_t j0 = J0; j0 < J1; j0 += WIN_KEYS) {
            const int64_t n = J1 - j0 < WIN_KEYS ? J1 - j0 : WIN_KEYS;
            real *u = wk->ks + WIN_GROUP * WIN_KEYS;
            win_unit_fill(&wk->runs[x], j0, n, u);
            for (int64_t q = 0; q < g; q++) {
                real *sq = wk->ks + q * WIN_KEYS;
                win_key_scores(u, &kr[q], j0, n, sq);
                live[q] = win_chunk_exps(&kr[q], sq, wk->ke + q * WIN_KEYS, wk->kk + q * WIN_KEYS, j0, n, &M[q],
                                          &sum[q], &nan[q], O + q * dvp, Dv);
            }
            for (int64_t q = 0; q < g; q++) { /* the chunk's values stay in cache for the group */
                if (!live[q]) continue;
                const real *sq = wk->ks + q * WIN_KEYS, *eq = wk->ke + q * WIN_KEYS;
                real c[WIN_KEYS];
                const real *rows[WIN_KEYS];
                int64_t k = 0;
                if (live[q] == 2) { /* only the visible keys: a hidden one's NaN value stays out */
                    for (int64_t t = 0; t < n; t++) {
                        c[k] = eq[t];
                        rows[k] = V0 + (j0 + t) * Dv;
                        k += sq[t] != -INFINITY;
                    }
                } else {
                    for (; k < n; k++) {
                        c[k] = eq[k];
                        rows[k] = V0 + (j0 + k) * Dv;
                    }
                }
                win_axpy_rows(O + q * dvp, c, rows, k, Dv);
            }
        }
    }
    for (int64_t q = 0; q < g; q++) {
        Z[q] = nan[q] ? NAN : sum[q];
        if (M[q] == -INFINITY && nan[q]) M[q] = 0;
    }
}

/* the per-key mode's group of queries for level m >= 2 that starts at i: how
 * many (a power of two, cut at T), 0 where i starts none */
static inline int64_t win_group_at(const hkt_window_params *p, int m, int64_t i) {
    const int gl = m - 1 < WIN_GROUP_LOG ? m - 1 : WIN_GROUP_LOG;
    if (i & (((int64_t)1 << gl) - 1)) return 0;
    return p->T - i < ((int64_t)1 << gl) ? p->T - i : (int64_t)1 << gl;
}

/* <a, b> as dot_axpy sums it (with AVX-512, the lanes' sums by a tree of
 * shuffles): the per-key backward's dot of every (query, key) pair */
static inline real win_dot_tree(const real *a, const real *b, int64_t n) {
    real g = 0;
    int64_t d = 0;
#if HKT_VEC_BYTES == 64 && REAL_IS_FLOAT
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    g = _mm512_reduce_add_ps(acc);
#elif HKT_VEC_BYTES == 64
    __m512d acc = _mm512_setzero_pd();
    for (; d + 8 <= n; d += 8) acc = _mm512_fmadd_pd(_mm512_loadu_pd(a + d), _mm512_loadu_pd(b + d), acc);
    g = _mm512_reduce_add_pd(acc);
#endif
    if (d == n) return g + 0; /* as in dot_axpy */
    return g + win_dot(a + d, b + d, n - d); /* the whole row, or AVX-512's tail (all in lane 0) */
}

/* the per-key backward of level m's part (the current units) for queries
 * i0 .. i0 + g - 1, grouped as partial_group groups them: each key's P =
 * exp(s - c) * pa at its own score (c the row's lse and pa 1, unless cpa
 * gives one query's (c, pa)), its dropout factor on <go, v_j> and on dv_j;
 * the unit's E gets its keys' score gradients, the float mask's gradient each
 * one.  A row that sees nothing (lse +inf) has none.  Each key's values and
 * their gradient are read once for the group. */
static void win_grads_group(const hkt_window_params *p, win_work *wk, int64_t b, int64_t h, int64_t hk,
                             int64_t i0, int64_t g, const real *cpa) {
    const int64_t Dv = p->Dv, row = (b * p->H + h) * p->T;
    const real *V0 = win_vrow(p, p->vs, 0, b, hk, 0);
    real *dV0 = (real *)win_vrow(p, (const void *const *)p->dvs, 0, b, hk, 0);
    const real *lse = (const real *)p->lse + row;
    win_keyrow kr[WIN_GROUP];
    real c[WIN_GROUP], pa[WIN_GROUP], Di[WIN_GROUP], *dm[WIN_GROUP];
    const real *go[WIN_GROUP];
    int64_t na = 0; /* the group's rows that see something */
    for (int64_t i = i0; i < i0 + g; i++) {
        if (lse[i] == INFINITY) continue;
        kr[na] = win_key_row(p, b, h, i);
        go[na] = (const real *)p->dout + (row + i) * Dv;
        const real *oi = (const real *)p->out + (row + i) * Dv;
        Di[na] = WIN_DI_PLAIN && cpa ? win_dot_plain(go[na], oi, Dv) : win_dot(go[na], oi, Dv); /* cpa: one query */
        c[na] = cpa ? cpa[0] : lse[i];
        pa[na] = cpa ? cpa[1] : 1;
        dm[na] = p->dmask ? (real *)p->dmask + (row + i) * p->S : NULL;
        na++;
    }
    const int drop = p->dropout_p > 0;
    for (int x = 0; na && x < wk->nruns; x++) {
        const win_run *r = &wk->runs[x];
        real *E = wk->EU[r->m] + r->ec;
        int64_t J0;
        const int64_t J1 = win_run_keys(p, r, &J0);
        for (int64_t j0 = J0; j0 < J1; j0 += WIN_KEYS) {
            const int64_t n = J1 - j0 < WIN_KEYS ? J1 - j0 : WIN_KEYS;
            real *u = wk->ks + WIN_GROUP * WIN_KEYS;
            win_unit_fill(r, j0, n, u);
            for (int64_t a = 0; a < na; a++) {
                real *sa = wk->ks + a * WIN_KEYS, *Pa = wk->ke + a * WIN_KEYS;
                win_key_scores(u, &kr[a], j0, n, sa);
                const real ca = c[a], paa = pa[a];
#pragma omp simd
                for (int64_t t = 0; t < n; t++) Pa[t] = exp_nonpos(sa[t] - ca) * paa;
                if (drop) win_key_keeps(&kr[a], j0, n, wk->kk + a * WIN_KEYS);
            }
            for (int64_t t = 0; t < n; t++) {
                const int64_t j = j0 + t;
                const real *vr = V0 + j * Dv;
                real coef[WIN_GROUP], es = 0;
                const real *rows[WIN_GROUP];
                int64_t k = 0, seen = 0;
                for (int64_t a = 0; a < na; a++) {
                    if (wk->ks[a * WIN_KEYS + t] == -INFINITY) continue; /* hidden: no probability, no gradient */
                    const real P = wk->ke[a * WIN_KEYS + t], kappa = drop ? wk->kk[a * WIN_KEYS + t] : 1;
                    const real gj = kappa != 0 ? win_dot_tree(go[a], vr, Dv) : 0;
                    const real dS = P * (kappa * gj - Di[a]);
                    es += dS;
                    seen = 1;
                    if (dm[a]) dm[a][j] = dS;
                    if (kappa != 0) {
                        coef[k] = P * kappa;
                        rows[k++] = go[a];
                    }
                }
                if (seen) E[(j >> r->lev) - r->idx] += es;
                win_axpy_rows(dV0 + j * Dv, coef, rows, k, Dv); /* dv_j += each row's P * kappa * dout */
            }
        }
    }
}

/* lse that large has lost log(sum) to rounding (a row of a float mask's
 * finfo.min): such a row's P comes from its max and sum, taken again */
#define WIN_LSE_EXACT ((real)(sizeof(real) == 4 ? 4096.0 : 2199023255552.0))

static inline int win_lse_exact(real li) { return li == INFINITY || (li > -WIN_LSE_EXACT && li < WIN_LSE_EXACT); }

/* the per-key backward of query i (its A current, its row seeing something)
 * for the levels no group took */
static void win_query_grads_keys(const hkt_window_params *p, win_work *wk, int64_t b, int64_t h, int64_t hk,
                                  int64_t i, real li) {
    real cpa[2] = {li, 1};
    if (!win_lse_exact(li)) {
        real mx = -INFINITY, sum = 0, Mm, Zm;
        for (int m = 0; m < p->L; m++) { /* the row's max and sum, merged over its levels' parts */
            win_seg_units(p, wk, m);
            win_partial_group(p, wk, b, h, hk, i, 1, wk->acc, &Mm, &Zm);
            if (Mm == -INFINITY) continue;
            if (Mm > mx) {
                sum = sum * exp_nonpos(mx - Mm) + Zm;
                mx = Mm;
            } else {
                sum += Zm * exp_nonpos(Mm - mx);
            }
        }
        cpa[0] = mx;
        cpa[1] = 1 / sum;
    }
    for (int m = 0; m < p->L; m++) {
        if (m >= 2 && wk->grouped[m]) continue;
        win_seg_units(p, wk, m);
        win_grads_group(p, wk, b, h, hk, i, 1, cpa);
    }
}
