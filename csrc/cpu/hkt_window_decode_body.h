/*
 * hkt_window_decode_body.h -- decoding with windows (hkt_window.h,
 * hkt_window_decode_params) for one real type.  Included by
 * hkt_window_body.h, after the kernels' helpers (win_factor, win_dot_tree,
 * win_axpy_rows), with `real` defined.
 *
 * One row: position t's runs (the stretches of [0, t] that the same levels
 * see), each run's units (whole blocks of its finest seeing level m, and the
 * pieces at its edges), their scores (each seeing level's dots with the
 * blocks it holds, over the contiguous range of them the run covers, summed
 * in level order), then one softmax in which a unit counts its keys and adds
 * its values' sum (with a soft cap, of the unit's capped score).  Level-l
 * block c lies in row c % cap[l] of k[l] and vs[l].
 */

/* how many units a row of position t can have, at most: per level m, its
 * run's level-m blocks (its window's, or all of [0, t]), and two pieces per run */
static int64_t win_decode_units(const hkt_window_decode_params *p, int64_t t) {
    int64_t n = 2 * (p->L + 1);
    for (int m = 0; m < p->L; m++) {
        const int64_t all = (t >> m) + 1;
        n += p->radius[m] && p->radius[m] + 2 < all ? p->radius[m] + 2 : all;
    }
    return n;
}

/* the most units of the call's last row, in a multiple of 16 */
static size_t win_decode_slots(const hkt_window_decode_params *p) {
    return ((size_t)win_decode_units(p, p->t0 + p->n - 1 > 0 ? p->t0 + p->n - 1 : 0) + 15) / 16 * 16;
}

/* one thread's scratch: per unit its score, key count and values' row; a
 * level's dots over a run; the row's sum of values; the edge pieces' sums
 * (SIZE_MAX if that does not fit a size_t) */
static size_t win_decode_thread_bytes(const hkt_window_decode_params *p) {
    const size_t units = win_decode_slots(p), dv = ((size_t)p->Dv + 15) / 16 * 16;
    const size_t per_unit = 3 * sizeof(real) + sizeof(real *), fixed = (2 * (size_t)p->L + 3) * dv * sizeof(real) + 64;
    size_t total;
    if (__builtin_mul_overflow(units, per_unit, &total) || __builtin_add_overflow(total, fixed, &total))
        return SIZE_MAX;
    return total;
}

/* the values' sum of keys [a, b) into y (Dv): the largest complete aligned
 * blocks that tile the range, left to right */
static void win_range_sum(const hkt_window_decode_params *p, int64_t b0, int64_t hk, int64_t a, int64_t b, real *y) {
    const int64_t Dv = p->Dv;
    memset(y, 0, (size_t)Dv * sizeof(real));
    while (a < b) {
        int l = 0;
        while (l < p->L - 1 && a % ((int64_t)2 << l) == 0 && a + ((int64_t)2 << l) <= b) l++;
        const real *row = (const real *)p->vs[l] + ((b0 * p->H_kv + hk) * p->cap[l] + (a >> l) % p->cap[l]) * Dv;
        for (int64_t d = 0; d < Dv; d++) y[d] += row[d];
        a += (int64_t)1 << l;
    }
}

typedef struct {
    real *s, *cnt, *dots, *edge, *acc;
    const real **rows;
    int64_t nu, nedge;
} win_decode_row_work;

/* keys [lo, hi) as one unit (none where empty): their count and their values' sum */
static void win_decode_piece(const hkt_window_decode_params *p, win_decode_row_work *rw, int64_t b0, int64_t hk,
                              int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    real *y = rw->edge + rw->nedge++ * ((p->Dv + 15) / 16 * 16);
    win_range_sum(p, b0, hk, lo, hi, y);
    rw->cnt[rw->nu] = (real)(hi - lo);
    rw->rows[rw->nu++] = y;
}

/* run [a, b)'s units at level m (blocks, counts, rows of values), then their
 * scores: the dots of each seeing level l >= m, in level order */
static void win_decode_run(const hkt_window_decode_params *p, win_decode_row_work *rw, int64_t b0, int64_t hk,
                            const real *const *qv, const real *f, const int64_t *start, int64_t a, int64_t b) {
    int m = 0;
    while (start[m] > a) m++;
    const int64_t size = (int64_t)1 << m, first = (a + size - 1) >> m, last = b >> m, u0 = rw->nu;
    const real *vm = (const real *)p->vs[m] + (b0 * p->H_kv + hk) * p->cap[m] * p->Dv;
    const int64_t blk0 = a >> m; /* the first unit's block: a's (its piece's, or `first` where a is aligned) */
    /* the units: a piece where the run begins or ends inside a block, whole blocks between */
    if (first > last) {
        win_decode_piece(p, rw, b0, hk, a, b);
    } else {
        win_decode_piece(p, rw, b0, hk, a, first * size);
        for (int64_t c = first, row = first % p->cap[m]; c < last; c++, row = row + 1 < p->cap[m] ? row + 1 : 0) {
            rw->cnt[rw->nu] = (real)size;
            rw->rows[rw->nu++] = vm + row * p->Dv;
        }
        win_decode_piece(p, rw, b0, hk, last * size, b);
    }
    if (rw->nu == u0) return;
    for (int64_t u = u0; u < rw->nu; u++) rw->s[u] = 0;
    for (int l = m; l < p->L; l++) {
        if (start[l] > a) continue; /* level l does not see this run */
        const int sh = l - m;
        const int64_t lo = blk0 >> sh, hi = (blk0 + (rw->nu - u0) - 1) >> sh;
        const real *kl = (const real *)p->k[l] + (b0 * p->H_kv + hk) * p->cap[l] * p->D;
        for (int64_t c = lo, row = lo % p->cap[l]; c <= hi; c++, row = row + 1 < p->cap[l] ? row + 1 : 0)
            rw->dots[c - lo] = win_dot_tree(qv[l], kl + row * p->D, p->D);
        for (int64_t u = u0; u < rw->nu; u++) rw->s[u] += f[l] * rw->dots[((blk0 + (u - u0)) >> sh) - lo];
    }
}

static void win_decode_row(const hkt_window_decode_params *p, win_decode_row_work *rw, int64_t b0, int64_t h,
                            int64_t i) {
    const int64_t t = p->t0 + i, hk = h / (p->H / p->H_kv), Dv = p->Dv;
    const real *qv[HKT_MAX_LEVELS];
    real f[HKT_MAX_LEVELS];
    int64_t start[HKT_MAX_LEVELS], cuts[HKT_MAX_LEVELS + 1];
    int ncut = 0;
    for (int l = 0; l < p->L; l++) {
        qv[l] = (const real *)p->q[l] + ((b0 * p->H + h) * p->n + i) * p->D;
        f[l] = win_factor(p->scale, ((const real *)p->w)[h * p->L + l]);
        const int64_t s0 = ((t >> l) - p->radius[l] + 1) * ((int64_t)1 << l);
        start[l] = p->radius[l] == 0 || s0 < 0 ? 0 : s0;
        int dup = start[l] > t;
        for (int c = 0; c < ncut; c++) dup |= cuts[c] == start[l];
        if (!dup) cuts[ncut++] = start[l];
    }
    for (int c = 1; c < ncut; c++) /* ascending (a few entries) */
        for (int d = c; d > 0 && cuts[d - 1] > cuts[d]; d--) {
            const int64_t x = cuts[d];
            cuts[d] = cuts[d - 1];
            cuts[d - 1] = x;
        }
    cuts[ncut] = t + 1;
    rw->nu = rw->nedge = 0;
    for (int c = 0; c < ncut; c++) win_decode_run(p, rw, b0, hk, qv, f, start, cuts[c], cuts[c + 1]);
    if (p->softcap > 0) /* a unit's keys share its score, so its capped score too */
        soft_cap(rw->s, rw->nu, (real)p->softcap, NULL);
    real mx = -INFINITY;
    int nan = 0;
    for (int64_t u = 0; u < rw->nu; u++) {
        nan |= rw->s[u] != rw->s[u];
        mx = rw->s[u] > mx ? rw->s[u] : mx;
    }
    real *o = (real *)p->out + ((b0 * p->H + h) * p->n + i) * Dv;
    if (mx == -INFINITY && !nan) { /* nothing visible */
        if (Dv > 0) memset(o, 0, (size_t)Dv * sizeof(real));
        return;
    }
    real sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t u = 0; u < rw->nu; u++) {
        rw->s[u] = exp_nonpos(rw->s[u] - mx); /* NaN stays NaN, and poisons the row */
        sum += rw->cnt[u] * rw->s[u];
    }
    memset(rw->acc, 0, (size_t)Dv * sizeof(real));
    win_axpy_rows(rw->acc, rw->s, rw->rows, rw->nu, Dv);
    const real inv = 1 / sum;
    for (int64_t d = 0; d < Dv; d++) o[d] = rw->acc[d] * inv;
}

static void win_decode(const hkt_window_decode_params *p) {
    const size_t per = (win_decode_thread_bytes(p) + 63) / 64 * 64, units = win_decode_slots(p);
    const size_t dv = ((size_t)p->Dv + 15) / 16 * 16;
    const int64_t rows = p->B * p->H * p->n;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->num_threads) if (p->num_threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        real *x = (real *)((char *)p->workspace + per * (size_t)thread_id());
        win_decode_row_work rw;
        rw.s = x;
        rw.cnt = x + units;
        rw.dots = x + 2 * units;
        rw.acc = x + 3 * units;
        rw.edge = rw.acc + dv;
        rw.rows = (const real **)(rw.edge + (2 * (size_t)p->L + 2) * dv);
        win_decode_row(p, &rw, r / (p->H * p->n), (r / p->n) % p->H, r % p->n);
    }
}
