/*
 * HKT decoding with a KV cache on the CPU (forward only), for one real type.
 *
 * Not a header of declarations: the kernel's body, included by hkt_cpu_f32.c and
 * hkt_cpu_f64.c after they define `real`, REAL_IS_FLOAT and REAL_EXP; every
 * function is static, the entry point is decode() at the end.  The type-free
 * part (how a call is cut into chunks, the workspace) is in hkt_decode.c.
 *
 * Tn new query rows per (b, h) against the cached keys 0 .. t of each row's
 * own position t = seqlens[b] + i (hkt.h, hkt_decode_params):
 *
 *   score[j] = scale * sum_l w[l] * <q[l][i], k_cache[l][j >> l]>,  j <= t
 *              (and t - j < W with a sliding window W > 0; keys before the
 *              band are never read, chunks wholly before it skipped)
 *              (then softcap * tanh(score / softcap) where softcap > 0)
 *   out[i]   = softmax(score) @ v_cache[0 .. t]
 *
 * One query row is a matrix-vector product per level, far too little work for
 * one thread at long S, so the keys are split into chunks of a fixed length
 * (split-K, as in flash-decoding): task (b, h, chunk) writes, for each new row,
 * its chunk's max score m, sum of exp(score - m) and unnormalised partial
 * output; the task that finishes a (b, h)'s last chunk combines its rows' chunks
 * in index order.  The chunk length depends on L and the lengths (hkt_decode_plan),
 * never on the thread count, and every partial is written by one task, so
 * results are bitwise the same for any num_threads.
 */
#include "hkt_cpu.h"
#include "hkt_real.h"

#include <math.h>
#include <string.h>

/* Lanes of a and b summed in pairs: the first half holds a's, the second b's. */
static inline __attribute__((always_inline)) vec pair_sums(vec a, vec b) {
    return veven(a, b) + vodd(a, b);
}

/* y[r] = <x, K[r]> for r < n, rows ld apart.  Four rows at a time share each
 * load of x, and their four accumulators are summed across lanes together
 * (two pairwise shuffle steps for all four, not a full reduction each): one
 * query row against many keys is a matrix-vector product, bound by the key
 * loads, and per-row horizontal sums would cost as much as the dot products. */
static inline __attribute__((always_inline)) void gemv(int64_t n, int64_t D, const real *restrict K,
                                                          int64_t ld, const real *restrict x, real *restrict y) {
    const int64_t Dvec = D - D % VL;
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) {
        const real *k0 = K + r * ld, *k1 = k0 + ld, *k2 = k1 + ld, *k3 = k2 + ld;
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t d = 0; d < Dvec; d += VL) {
            const vec xv = vload(x + d);
            a0 += vload(k0 + d) * xv;
            a1 += vload(k1 + d) * xv;
            a2 += vload(k2 + d) * xv;
            a3 += vload(k3 + d) * xv;
        }
        /* lanes [q P, (q+1) P) of part hold partial sums of row q, P = VL/4 ... */
        enum { P = VL >= 4 ? VL / 4 : 1 };
        real part[VL >= 4 ? VL : 4];
        if (VL >= 4) {
            const vec u = pair_sums(pair_sums(a0, a1), pair_sums(a2, a3));
            memcpy(part, &u, sizeof u);
        } else { /* ... or, with two lanes (16-byte doubles), one pair step sums a row */
            const vec u01 = pair_sums(a0, a1), u23 = pair_sums(a2, a3);
            memcpy(part, &u01, sizeof u01);
            memcpy(part + 2, &u23, sizeof u23);
        }
        for (int q = 0; q < 4; q++) {
            const real *kq = K + (r + q) * ld;
            real s = 0;
            for (int64_t e = 0; e < P; e++) s += part[q * P + e];
            for (int64_t d = Dvec; d < D; d++) s += kq[d] * x[d];
            y[r + q] = s;
        }
    }
    for (; r < n; r++) {
        const real *kr = K + r * ld;
        real s = 0;
        for (int64_t d = 0; d < D; d++) s += kr[d] * x[d];
        y[r] = s;
    }
}

/* s[0..j1-j0) = the scores of keys [j0, j1) for new row i of (b, h), in a
 * chunk of C keys starting at j0.  Each level's dots are taken once per block,
 * coarsest first, and folded down: E_l[x] = G_l[x] + E_{l+1}[x >> 1] (the
 * chunk's first block of level l < L-1 is even, see plan).  scale * w[l] goes
 * into the query, a D-vector, not into every score. */
static inline __attribute__((always_inline)) void chunk_scores(const hkt_decode_params *p, int64_t C,
                                                                  real *restrict scratch, int64_t b, int64_t h,
                                                                  int64_t hk, int64_t i, int64_t j0, int64_t j1) {
    const int64_t D = p->D;
    /* level 0's scores in s (C), then level l >= 1's dots at g + off[l], ceil(C / 2^l) of them */
    real *s = scratch, *g = scratch + C, *qs = scratch + 2 * C + p->L;
    int64_t off[HKT_MAX_LEVELS];
    off[0] = off[1] = 0;
    for (int l = 1; l + 1 < p->L; l++) off[l + 1] = off[l] + ((C - 1) >> l) + 1;
    const real *prev = NULL;
    for (int l = p->L - 1; l >= 0; l--) {
        const real wl = level_factor(p->scale, ((const real *)p->w)[h * p->w_stride[0] + l * p->w_stride[1]]);
        const real *q = (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1] + i * p->q_stride[l][2];
        for (int64_t d = 0; d < D; d++) qs[d] = wl * q[d];
        const int64_t c0 = j0 >> l, n = ((j1 - 1) >> l) + 1 - c0;
        const real *k = (const real *)p->k_cache[l] + b * p->k_cache_stride[l][0] + hk * p->k_cache_stride[l][1];
        real *e = l ? g + off[l] : s;
        gemv(n, D, k + c0 * p->k_cache_stride[l][2], p->k_cache_stride[l][2], qs, e);
        if (prev)
            for (int64_t x = 0; x < n; x++) e[x] += prev[x >> 1];
        prev = e;
    }
}

/* Task (b, h, chunk c): for each new row i that sees the chunk, its max score,
 * sum of exp(score - max) and unnormalised output, into slot (b, h, i, c). */
static void chunk_task(const hkt_decode_params *p, const hkt_decode_plan_t *pl, real *restrict scratch,
                       real *restrict part, int64_t b, int64_t h, int64_t c) {
    const int64_t C = pl->C, nch = pl->nch, Dv = p->Dv, hk = h / (p->H / p->H_kv), j0 = c * C;
    const real *vb = (const real *)p->v_cache + b * p->v_cache_stride[0] + hk * p->v_cache_stride[1];
    const int64_t ldv = p->v_cache_stride[2];
    for (int64_t i = 0; i < p->Tn; i++) {
        real *slot = part + (((b * p->H + h) * p->Tn + i) * nch + c) * (Dv + 2), *o = slot + 2;
        const int64_t t = p->seqlens[b] + i;
        slot[0] = -INFINITY;
        slot[1] = 0;
        if (j0 > t) continue; /* the chunk lies wholly after row i's position */
        const int64_t j1 = j0 + C < t + 1 ? j0 + C : t + 1;
        /* the sliding-window band: keys before t - W + 1 are hidden */
        const int64_t lo = p->sliding_window > 0 && t - p->sliding_window + 1 > j0 ? t - p->sliding_window + 1 : j0;
        if (lo >= j1) continue; /* the chunk lies wholly before the band */
        chunk_scores(p, C, scratch, b, h, hk, i, j0, j1);
        /* from the band's first key on: the fold needs the chunk's scores from j0 */
        real *s = scratch + (lo - j0);
        const int64_t n = j1 - lo;
        if (p->softcap > 0) soft_cap(s, n, (real)p->softcap, NULL); /* contract 1.12; no mask here */
        const real m = row_max(s, n);
        if (m == -INFINITY) continue; /* every score -inf: nothing to add */
        real sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t x = 0; x < n; x++) {
            s[x] = exp_nonpos(s[x] - m); /* m NaN or +inf: NaN, as the softmax is */
            sum += s[x];
        }
        slot[0] = m;
        slot[1] = sum;
        for (int64_t e = 0; e < Dv; e++) o[e] = 0;
        const real *v = vb + lo * ldv;
        int64_t x = 0;
        for (; x + 4 <= n; x += 4) {
            const real p0 = s[x], p1 = s[x + 1], p2 = s[x + 2], p3 = s[x + 3];
            const real *v0 = v + x * ldv, *v1 = v0 + ldv, *v2 = v1 + ldv, *v3 = v2 + ldv;
#pragma omp simd
            for (int64_t e = 0; e < Dv; e++) o[e] += (p0 * v0[e] + p1 * v1[e]) + (p2 * v2[e] + p3 * v3[e]);
        }
        for (; x < n; x++) {
            const real px = s[x], *vx = v + x * ldv;
#pragma omp simd
            for (int64_t e = 0; e < Dv; e++) o[e] += px * vx[e];
        }
    }
}

/* out row (b, h, i) from its chunks, in chunk order: rescaled to the largest
 * max.  A NaN max (a chunk of NaN and -inf scores) makes the row NaN; no chunk
 * with a score above -inf makes it zeros. */
static void combine_row(const hkt_decode_params *p, const hkt_decode_plan_t *pl, const real *part, int64_t b,
                            int64_t h, int64_t i) {
    const int64_t Dv = p->Dv, nch = pl->nch, nc = (p->seqlens[b] + i) / pl->C + 1;
    const real *slots = part + ((b * p->H + h) * p->Tn + i) * nch * (Dv + 2);
    real *out = (real *)p->out + b * p->out_stride[0] + h * p->out_stride[1] + i * p->out_stride[2];
    real M = -INFINITY;
    int nan = 0;
    for (int64_t c = 0; c < nc; c++) {
        const real m = slots[c * (Dv + 2)];
        nan |= m != m;
        M = m > M ? m : M;
    }
    for (int64_t e = 0; e < Dv; e++) out[e] = nan ? NAN : 0;
    if (nan || M == -INFINITY) return;
    real total = 0;
    for (int64_t c = 0; c < nc; c++) {
        const real *slot = slots + c * (Dv + 2);
        if (slot[0] == -INFINITY) continue;
        const real a = REAL_EXP(slot[0] - M); /* M +inf: NaN, as it should be */
        total += a * slot[1];
        for (int64_t e = 0; e < Dv; e++) out[e] += a * slot[2 + e];
    }
    const real inv = 1 / total;
    for (int64_t e = 0; e < Dv; e++) out[e] *= inv;
}

/* k_new / v_new into the caches, rows in order so that the last new position
 * of a coarse block wins. */
static void append_rows(const hkt_decode_params *p, int64_t b, int64_t hk) {
    for (int64_t i = 0; i < p->Tn; i++) {
        const int64_t t = p->seqlens[b] + i;
        for (int l = 0; l < p->L; l++) {
            const real *src = (const real *)p->k_new[l] + b * p->k_new_stride[l][0] + hk * p->k_new_stride[l][1] +
                              i * p->k_new_stride[l][2];
            real *dst = (real *)p->k_cache[l] + b * p->k_cache_stride[l][0] + hk * p->k_cache_stride[l][1] +
                        (t >> l) * p->k_cache_stride[l][2];
            memmove(dst, src, sizeof(real) * (size_t)p->D);
        }
        const real *src = (const real *)p->v_new + b * p->v_new_stride[0] + hk * p->v_new_stride[1] +
                          i * p->v_new_stride[2];
        real *dst = (real *)p->v_cache + b * p->v_cache_stride[0] + hk * p->v_cache_stride[1] +
                    t * p->v_cache_stride[2];
        memmove(dst, src, sizeof(real) * (size_t)p->Dv);
    }
}

/* One parallel loop, so one barrier: a thread the OS preempts (the machine may
 * be shared) stalls the call at every barrier.  The append, Tn rows per
 * (b, kv head), runs before it on the calling thread; a (b, h)'s rows are
 * combined by whichever task finishes its last chunk (the combine reads the
 * chunks in index order, so who runs it changes nothing). */
static void decode(const hkt_decode_params *p) {
    const hkt_decode_plan_t pl = hkt_decode_plan(p);
    const int64_t nch = pl.nch, nbh = p->B * p->H, ntask = nbh * nch;
    const int nt = p->num_threads > 0 ? p->num_threads : 1;
    int64_t *done = (int64_t *)(((uintptr_t)p->workspace + 63) & ~(uintptr_t)63);
    real *part = (real *)((char *)done + pl.partials);
    char *scratch0 = (char *)done + pl.scratch;
    if (p->v_new)
        for (int64_t t = 0; t < p->B * p->H_kv; t++) append_rows(p, t / p->H_kv, t % p->H_kv);
    for (int64_t x = 0; x < nbh; x++) done[x] = 0;
    /* a short cache is less work than waking the threads */
    const double work = (double)(nbh * p->Tn) * (double)pl.longest * (double)(p->D + p->Dv);
    const int team = nt > 1 && work > 65536.0 ? nt : 1;
    PARALLEL_TASKS(team, (dynamic, 1), ntask, t, tid, {
        const int64_t bh = t / nch, b = bh / p->H, h = bh % p->H;
        chunk_task(p, &pl, (real *)(scratch0 + (size_t)tid * pl.per_thread), part, b, h, t % nch);
        /* acquire-release: the last task sees every other task's partials */
        if (__atomic_add_fetch(&done[bh], 1, __ATOMIC_ACQ_REL) == nch)
            for (int64_t i = 0; i < p->Tn; i++) combine_row(p, &pl, part, b, h, i);
    });
}
