/*
 * HKT attention on the CPU: the scores and the forward for one real type -- the
 * second layer of the kernels' body, after hkt_products_body.h.
 *
 * Not a header of declarations: the kernels' body, included once by
 * hkt_cpu_f32.c and once by hkt_cpu_f64.c, each defining `real`
 * (float, double), REAL_IS_FLOAT and REAL_LOG first.  Every function is static,
 * so both translation units use the same plain names.  The include order is
 * the layering: hkt_products_body.h (products and tiles), this file (key
 * tiles, scores, the online softmax, the forward, entry point forward() at its
 * end), then in the float32 build hkt_bf16_body.h (the bfloat16 products and
 * forward), then hkt_backward_body.h (the backward, backward()), each using
 * only what comes before it (hkt_cpu.h, hkt.h).
 *
 * Shapes (see hkt.h): q[l] (B, H, ceil(T/2^l), D), k[l] (B, H_kv, ceil(S/2^l), D),
 * v (B, H_kv, S, Dv), w (H, L) or (L,); out (B, H, T, Dv), lse (B, H, T).
 *
 * Flash-style: queries and keys are walked in BQ x BK tiles; a tile's score is
 * built from each level's small Gram block (computed once per 2^l x 2^l block,
 * the 1 + 1/4 + 1/16 ... cost) and consumed by an online softmax.  Nothing of
 * size T x S is ever stored; the forward keeps one log-sum-exp per row and the
 * backward recomputes the tile scores from it.  Each thread works in its own
 * workspace block, whose regions ws_layout (hkt_cpu.h) names.
 */
#include "hkt_products_body.h"

/* Transposes key rows [j0, j1) of every level into kt[l] (D, ld[l]) at column
 * offset (j0 >> l) - base_col[l]: the score GEMM's B operand, (D, keys). */
static void load_keys(const hkt_params *p, int64_t b, int64_t h, int64_t j0, int64_t j1, real *const *kt,
                      const int64_t *ld, const int64_t *base_col) {
    for (int l = 0; l < p->L; l++) {
        span sp = level_span(l, 0, 1, j0, j1);
        const real *kb = (const real *)p->k[l] + b * p->k_stride[l][0] + kv_head(p, h) * p->k_stride[l][1];
        transpose(sp.cl, p->D, kb + sp.c0 * p->k_stride[l][2], p->k_stride[l][2], kt[l] + sp.c0 - base_col[l], ld[l]);
    }
}

/* Where key tile [j0, j1) of each level goes in the workspace's key_tile
 * region: buf[l], row length ld[l] (the level's columns in the tile), first
 * column col0[l]. */
static void key_tile_place(const hkt_params *p, const ws_layout *ws, real *base, int64_t j0, int64_t j1, real **buf,
                           int64_t *ld, int64_t *col0) {
    for (int l = 0; l < p->L; l++) {
        span sp = level_span(l, 0, 1, j0, j1);
        buf[l] = base + ws->key_tile + ws->key_tile_off[l];
        ld[l] = sp.cl;
        col0[l] = sp.c0;
    }
}

/* Where key tile [j0, j1) of each level lies in the forward's key cache
 * (keys_all): as key_tile_place, but in the tile's own block of the cache.
 * Each tile's keys lie together, (D, cols_max(l)) a level, where they were
 * columns of one (D, S / 2^l) array: a score GEMM's B then read 64 rows
 * of 256 bytes, each in a page of its own, which the hardware prefetchers
 * do not follow; in the tile-major layout a GEMM's B is one run of memory,
 * which pays at long S. */
static void cached_tile_place(const hkt_params *p, const ws_layout *ws, real *base, int64_t j0, int64_t j1,
                              real **buf, int64_t *ld, int64_t *col0) {
    key_tile_place(p, ws, base, j0, j1, buf, ld, col0);
    for (int l = 0; l < p->L; l++)
        buf[l] = base + ws->keys_all + ws->keys_all_off[l] + j0 / BK * ws->key_t_rows * cols_max(l);
}

/* Transposes one key tile of every level into the workspace's kt region
 * (D, cl) each, and points kt[l] / ktld[l] at it. */
static void load_key_tile(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t j0,
                          int64_t j1, const real **kt, int64_t *ktld) {
    real *buf[HKT_MAX_LEVELS];
    int64_t col0[HKT_MAX_LEVELS];
    key_tile_place(p, ws, base, j0, j1, buf, ktld, col0);
    for (int l = 0; l < p->L; l++) kt[l] = buf[l];
    load_keys(p, b, h, j0, j1, buf, ktld, col0);
}

/* S (nq, BK) = scale * sum_l w[l] * upsample(G_l), with G_l = q[l] k[l]^T over the
 * tile (kept in the workspace for the backward's dw).  kt[l] points at the tile's
 * first transposed key column of level l, with leading dimension ktld[l].
 *
 * Coarse levels are folded from the coarsest down, E_l = scale w_l G_l + up2(E_{l+1}),
 * so each level costs one pass over its own grid; up2 duplicates rows and columns.
 * Tiles start at multiples of 64, so a level's first row and column inside a tile
 * are even whenever it has more than one: the parent of (a, c) is (a >> 1, c >> 1).
 * Then the soft cap, if any, and masking: invisible entries become -inf, a float
 * mask is added. */
static void tile_fold(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                      int64_t i1, int64_t j0, int64_t j1);
static void fold_levels(const hkt_params *p, const ws_layout *ws, real *base, int64_t h, int64_t i0, int64_t i1,
                        int64_t j0, int64_t j1, int last);
static void tile_masks(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                       int64_t i1, int64_t j0, int64_t j1);

/* Level l's query rows from row r0 (the tile's first) of head (b, h), and
 * their row stride: the forward task's packed copy (ws->q_tile, filled at the
 * task's start) where the forward packs them, else the array itself. */
static inline const real *query_rows(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                     int l, int64_t r0, int64_t *ld) {
    if (ws->pack_q_tile) {
        *ld = p->D;
        return base + ws->q_tile + ws->pack_off[l];
    }
    *ld = p->q_stride[l][2];
    return (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1] + r0 * p->q_stride[l][2];
}

/* keep_grams: the backward, whose dw needs each level's Gram block; the forward
 * does not, and with one level its product goes straight into the scores,
 * scaled in the GEMM (alpha * sum, the same bits as the fold's w * G). */
static void tile_scores(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                        int64_t i1, int64_t j0, int64_t j1, const real *const *kt, const int64_t *ktld,
                        int keep_grams) {
    const int diag = diagonal_tile(p, i0, j0);
    if (!keep_grams && p->L == 1) {
        int64_t ld;
        const real *qr = query_rows(p, ws, base, b, h, 0, i0, &ld);
        /* what gemm_diag leaves out, the masks hide */
        gemm_diag(diag, DIAG_SCORES, i1 - i0, j1 - j0, p->D, level_factor(p->scale, weight(p, h, 0)),
                  qr, ld, kt[0], ktld[0], base + ws->scores, BK, 0);
        tile_masks(p, ws, base, b, h, i0, i1, j0, j1);
        return;
    }
    /* level 0 with the fold in its store where it can (gemm_fused) */
    const int fused = !diag && gemm_fused_takes(j1 - j0);
    for (int l = fused; l < p->L; l++) {
        span sp = level_span(l, i0, i1, j0, j1);
        int64_t ld;
        const real *qr = query_rows(p, ws, base, b, h, l, sp.r0, &ld);
        real *G = base + ws->gram + ws->gram_off[l];
        gemm_diag(diag && l == 0, DIAG_SCORES, sp.rl, sp.cl, p->D, 1, qr, ld, kt[l], ktld[l], G, sp.cl, 0);
        if (diag && l == 0) zero_unseen(sp.rl, sp.cl, G, sp.cl);
    }
    if (!fused) {
        tile_fold(p, ws, base, b, h, i0, i1, j0, j1);
        return;
    }
    fold_levels(p, ws, base, h, i0, i1, j0, j1, 1);
    int64_t ld;
    const real *qr = query_rows(p, ws, base, b, h, 0, i0, &ld);
    const real w0 = level_factor(p->scale, weight(p, h, 0));
    /* E_1, the coarser levels folded (none with one level) */
    const real *E1 = p->L > 1 ? base + ws->folded + ws->gram_off[1] : NULL;
    const int64_t lde = p->L > 1 ? level_span(1, i0, i1, j0, j1).cl : 0;
    if (keep_grams) {
        const tile_extra x = {E1, lde, NULL, base + ws->scores, BK, w0};
        gemm_fused(E1 ? EPI_GRAM_SCORES : EPI_GRAM_SCORES0, i1 - i0, j1 - j0, p->D, 1, qr, ld, kt[0], ktld[0],
                   base + ws->gram, j1 - j0, &x);
    } else {
        const tile_extra x = {E1, lde, NULL, NULL, 0, 0};
        gemm_fused(EPI_UP, i1 - i0, j1 - j0, p->D, w0, qr, ld, kt[0], ktld[0], base + ws->scores, BK, &x);
    }
    tile_masks(p, ws, base, b, h, i0, i1, j0, j1);
}

/* The tile's scores from its Gram blocks (in ws->gram, however they were
 * computed): the fold described above, then the masks. */
static void tile_fold(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                      int64_t i1, int64_t j0, int64_t j1) {
    fold_levels(p, ws, base, h, i0, i1, j0, j1, 0);
    tile_masks(p, ws, base, b, h, i0, i1, j0, j1);
}

/* The fold from the coarsest level down to level last: E_last, in ws->folded
 * at gram_off[last] (row length: the level's columns in the tile), or for
 * last = 0 the tile's unmasked scores. */
static void fold_levels(const hkt_params *p, const ws_layout *ws, real *base, int64_t h, int64_t i0, int64_t i1,
                        int64_t j0, int64_t j1, int last) {
    const int L = p->L;
    real *S = base + ws->scores;
    const real *up = NULL; /* E_{l+1}, row length up_cl */
    int64_t up_cl = 0;
    for (int l = L - 1; l >= last; l--) {
        span sp = level_span(l, i0, i1, j0, j1);
        const real *G = base + ws->gram + ws->gram_off[l];
        real *E = l ? base + ws->folded + ws->gram_off[l] : S;
        const int64_t lde = l ? sp.cl : BK;
        const real wl = level_factor(p->scale, weight(p, h, l));
        for (int64_t a = 0; a < sp.rl; a++) {
            const real *g = G + a * sp.cl;
            real *e = E + a * lde;
            if (!up) {
                for (int64_t c = 0; c < sp.cl; c++) e[c] = wl * g[c];
                continue;
            }
            fold_row(g, up + (a >> 1) * up_cl, wl, sp.cl, e);
        }
        up = E;
        up_cl = sp.cl;
    }
}

/* The tile's scores (ws->scores) soft-capped where p asks for it (the cap's
 * derivative kept in ws->capgrad where the backward has one), then masked:
 * invisible entries (causality, the sliding-window band, a bool mask) become
 * -inf, a float mask is added. */
static void tile_masks(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t i0,
                       int64_t i1, int64_t j0, int64_t j1) {
    const int64_t nq = i1 - i0, nk = j1 - j0;
    real *S = base + ws->scores;
    /* the cap comes before the mask (contract 1.12): a float mask is added to
     * the capped score.  Without a cap nothing here runs. */
    if (p->softcap > 0)
        for (int64_t r = 0; r < nq; r++)
            soft_cap(S + r * BK, nk, (real)p->softcap, ws->capgrad ? base + ws->capgrad + r * BK : NULL);
    /* the float mask is added first, so hiding (causal, bool) wins over whatever
     * it holds: a NaN in a hidden entry of a float mask stays hidden */
    const int64_t ms3 = p->mask_stride[3];
    if (p->mask_kind == HKT_MASK_FLOAT)
        for (int64_t r = 0; r < nq; r++) {
            real *srow = S + r * BK;
            const real *m = (const real *)p->mask + b * p->mask_stride[0] + h * p->mask_stride[1] +
                            (i0 + r) * p->mask_stride[2] + j0 * ms3;
            for (int64_t c = 0; c < nk; c++) srow[c] += m[c * ms3];
        }
    if (p->causal && j1 - 1 > i0) {
        /* on the diagonal: key j > i is hidden */
        for (int64_t r = 0; r < nq; r++) {
            real *srow = S + r * BK;
            for (int64_t c = i0 + r - j0 + 1 > 0 ? i0 + r - j0 + 1 : 0; c < nk; c++) srow[c] = -INFINITY;
        }
    }
    const int64_t W = p->sliding_window;
    if (W > 0 && (i1 - 1) - j0 >= W) /* the band's lower edge: key j <= i - W is hidden */
        for (int64_t r = 0; r < nq; r++) {
            const int64_t end = i0 + r - W + 1 - j0; /* columns before it are hidden */
            real *srow = S + r * BK;
            for (int64_t c = 0; c < (end < nk ? end : nk); c++) srow[c] = -INFINITY;
        }
    if (W > 0 && !p->causal && (j1 - 1) - i0 >= W) /* its upper edge: key j >= i + W is hidden */
        for (int64_t r = 0; r < nq; r++) {
            real *srow = S + r * BK;
            for (int64_t c = i0 + r + W - j0 > 0 ? i0 + r + W - j0 : 0; c < nk; c++) srow[c] = -INFINITY;
        }
    if (p->mask_kind == HKT_MASK_BOOL)
        for (int64_t r = 0; r < nq; r++) {
            real *srow = S + r * BK;
            const unsigned char *m = (const unsigned char *)p->mask + b * p->mask_stride[0] + h * p->mask_stride[1] +
                                     (i0 + r) * p->mask_stride[2] + j0 * ms3;
            for (int64_t c = 0; c < nk; c++) srow[c] = m[c * ms3] ? srow[c] : -INFINITY;
        }
}

/* Per-thread state at the head of each workspace block. */
typedef struct {
    int64_t cached_bh;
} thread_state;

/* A forward task's query tile, what start_task, softmax_update and
 * finish_rows share: rows [i0, i0 + nq) of head (b, h), the thread's workspace
 * (base: its numbers, after the thread_state header) and the rows' output
 * (ob, row stride ldo: the out array, or a bfloat16 task's float32 sums). */
typedef struct {
    const hkt_params *p;
    const ws_layout *ws;
    real *base;
    int64_t b, h, i0, nq;
    real *ob;
    int64_t ldo;
} query_tile;

/* A forward task's start: forgets the thread's cached keys unless they are of
 * this task's (b, kv head) -- the query heads of one group, run one after
 * another, share them -- and zeroes the task's out rows and its running max
 * and sums. */
static void start_task(const query_tile *qt, char *block) {
    const hkt_params *p = qt->p;
    const ws_layout *ws = qt->ws;
    const int64_t b = qt->b, h = qt->h, nq = qt->nq, ldo = qt->ldo;
    real *base = qt->base, *ob = qt->ob;
    thread_state *state = (thread_state *)block;
    if (state->cached_bh != b * p->H_kv + kv_head(p, h)) {
        state->cached_bh = b * p->H_kv + kv_head(p, h);
        real *ready = base + ws->keys_ready;
        for (int64_t x = 0; x < (p->S + BK - 1) / BK; x++) ready[x] = 0;
    }
    real *m = base + ws->row_max, *lsum = base + ws->row_sums;
    for (int64_t r = 0; r < nq; r++) {
        m[r] = -INFINITY;
        vstore(lsum + r * VL, (vec){0});
        real *orow = ob + r * ldo;
        for (int64_t e = 0; e < p->Dv; e++) orow[e] = 0;
    }
}

/* exp_shift(x, n, m), returning row_lanes(x, n) of the result: one pass, the
 * same sums in the same order (lane-wise, a zero-padded tail last), so the same
 * bits as the two calls. */
static inline vec exp_shift_lanes(real *restrict x, int64_t n, real m) {
    if (m != m) {
        exp_shift(x, n, m);
        return row_lanes(x, n);
    }
    vec acc = {0};
    int64_t c = 0;
    for (; c + VL <= n; c += VL) {
        real *restrict xc = x + c;
#if HKT_EXPV
        /* x <= m, the max of the row's scores (or NaN): no clamps needed */
        const vec y = exp_nonpos_vec_le0(vload(xc) - m);
        vstore(xc, y);
        acc += y;
#else
#pragma GCC ivdep
        for (int64_t e = 0; e < VL; e++) xc[e] = exp_nonpos(xc[e] - m);
        acc += vload(xc);
#endif
    }
    if (c < n) {
        real tail[VL] = {0};
        for (int64_t e = 0; e < n - c; e++) tail[e] = x[c + e] = exp_nonpos(x[c + e] - m);
        acc += vload(tail);
    }
    return acc;
}

/* The online softmax's step for key tile [j0, j0 + nk): turns the tile's scores
 * into P (dropped out, with dropout) in place, rescales what the out rows hold
 * so far and updates each row's running max and lane sums.  The caller then
 * adds P @ V to the out rows.  In three passes over the rows (maxes, exps,
 * bookkeeping), so that the exps of consecutive rows, each a long chain of
 * dependent FMAs, have no branchy scalar code between them and overlap in the
 * core. */
static void softmax_update(const query_tile *qt, int64_t j0, int64_t nk) {
    const hkt_params *p = qt->p;
    const ws_layout *ws = qt->ws;
    const int64_t b = qt->b, h = qt->h, i0 = qt->i0, nq = qt->nq, ldo = qt->ldo;
    real *base = qt->base, *ob = qt->ob;
    const int use_dropout = p->dropout_p > 0;
    const uint64_t sm = mix64(p->seed), th = keep_threshold(p->dropout_p);
    const real kf = (real)keep_scale(p->dropout_p);
    real *Sbuf = base + ws->scores, *m = base + ws->row_max, *lsum = base + ws->row_sums;
    real mnew[BQ];
    unsigned char seen[BQ]; /* the row sees a key in this tile */
    real maxes[BQ];
#if HKT_AVX512_F32
    for (int64_t r = 0; r < nq; r += 16) rows_max16(Sbuf + r * BK, BK, nq - r < 16 ? nq - r : 16, nk, maxes + r);
#else
    for (int64_t r = 0; r < nq; r++) maxes[r] = row_max(Sbuf + r * BK, nk);
#endif
    for (int64_t r = 0; r < nq; r++) {
        const real mx = maxes[r];
        seen[r] = mx != -INFINITY;
        /* NaN wins, so a NaN score poisons its row for good */
        mnew[r] = mx > m[r] || mx != mx ? mx : m[r];
    }
    for (int64_t r = 0; r < nq; r++) {
        real *srow = Sbuf + r * BK;
        if (!seen[r]) {
            for (int64_t c = 0; c < nk; c++) srow[c] = 0;
            continue;
        }
        /* an unchanged max (the common case after the first tiles) skips the
         * scalar exp: exp_nonpos(0) is exactly 1, so the same bits */
        const real alpha = m[r] == -INFINITY ? 0 : mnew[r] == m[r] ? 1 : exp_nonpos(m[r] - mnew[r]);
        vstore(lsum + r * VL, vload(lsum + r * VL) * alpha + exp_shift_lanes(srow, nk, mnew[r]));
        if (alpha != 1) {
            real *orow = ob + r * ldo;
            for (int64_t e = 0; e < p->Dv; e++) orow[e] *= alpha;
        }
        m[r] = mnew[r];
        if (use_dropout) {
            const uint64_t rowidx = (uint64_t)(((b * p->H + h) * p->T + i0 + r) * p->S + j0);
            for (int64_t c = 0; c < nk; c++) srow[c] = keep_entry(sm, th, rowidx + (uint64_t)c) ? srow[c] * kf : 0;
        }
    }
}

/* The out rows divided by their softmax sums, and each row's log-sum-exp. */
static void finish_rows(const query_tile *qt) {
    const hkt_params *p = qt->p;
    const ws_layout *ws = qt->ws;
    const int64_t b = qt->b, h = qt->h, i0 = qt->i0, nq = qt->nq, ldo = qt->ldo, Dv = p->Dv;
    real *base = qt->base, *ob = qt->ob;
    const real *m = base + ws->row_max, *lsum = base + ws->row_sums;
    real *lse = (real *)p->lse + (b * p->H + h) * p->T + i0;
    for (int64_t r = 0; r < nq; r++) {
        real *orow = ob + r * ldo;
        const real total = lanes_total(vload(lsum + r * VL));
        if (total > 0) {
            const real inv = 1 / total;
            for (int64_t e = 0; e < Dv; e++) orow[e] *= inv;
            lse[r] = m[r] + REAL_LOG(total);
        } else if (total == 0) {
            /* no visible key: zeros, and +inf so the backward's P is exactly 0 */
            for (int64_t e = 0; e < Dv; e++) orow[e] = 0;
            lse[r] = INFINITY;
        } else {
            /* a visible NaN or +inf score: the softmax of the row is NaN */
            for (int64_t e = 0; e < Dv; e++) orow[e] = NAN;
            lse[r] = NAN;
        }
    }
}

/* forward: one task per (b, h, query tile); each task owns its out rows.  The
 * transposed keys of the current (b, h) stay in the thread's workspace, so each
 * key tile is transposed once per thread, not once per query tile. */
static void forward_task(const hkt_params *p, const ws_layout *ws, char *block, int64_t b, int64_t h,
                         int64_t qt) {
    const int64_t T = p->T, S = p->S, Dv = p->Dv;
    const int64_t i0 = qt * BQ, i1 = i0 + BQ < T ? i0 + BQ : T, nq = i1 - i0;
    real *base = (real *)(block + WS_HEADER);
    real *Sbuf = base + ws->scores, *ready = base + ws->keys_ready;
    real *ob = (real *)p->out + b * p->out_stride[0] + h * p->out_stride[1] + i0 * p->out_stride[2];
    const real *vb = (const real *)p->v + b * p->v_stride[0] + kv_head(p, h) * p->v_stride[1];
    const query_tile tile = {p, ws, base, b, h, i0, nq, ob, p->out_stride[2]};
    start_task(&tile, block);
    if (ws->pack_q_tile)
        for (int l = 0; l < p->L; l++) {
            const span sp = level_span(l, i0, i1, 0, 1);
            copy_rows(sp.rl, p->D, (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1] +
                      sp.r0 * p->q_stride[l][2], p->q_stride[l][2], base + ws->q_tile + ws->pack_off[l], p->D);
        }
    real *vpack = base + ws->values_packed;
    const int64_t jend = key_end(p, i1);
    for (int64_t j0 = first_key_tile(p, i0); j0 < jend; j0 += BK) {
        const int64_t j1 = j0 + BK < S ? j0 + BK : S, nk = j1 - j0;
        real *kt[HKT_MAX_LEVELS];
        int64_t ktld[HKT_MAX_LEVELS], col0[HKT_MAX_LEVELS];
        if (ws->keys_cached) {
            cached_tile_place(p, ws, base, j0, j1, kt, ktld, col0);
            if (!ready[j0 / BK]) {
                load_keys(p, b, h, j0, j1, kt, ktld, col0);
                if (ws->pack_v) copy_rows(nk, Dv, vb + j0 * p->v_stride[2], p->v_stride[2], vpack + j0 * Dv, Dv);
                ready[j0 / BK] = 1;
            }
        } else {
            key_tile_place(p, ws, base, j0, j1, kt, ktld, col0);
            load_keys(p, b, h, j0, j1, kt, ktld, col0);
        }
        tile_scores(p, ws, base, b, h, i0, i1, j0, j1, (const real *const *)kt, ktld, 0);
        softmax_update(&tile, j0, nk);
        const int64_t ldv = ws->pack_v ? Dv : p->v_stride[2];
        gemm_diag(diagonal_tile(p, i0, j0), DIAG_ROWS, nq, Dv, nk, 1, Sbuf, BK, (ws->pack_v ? vpack : vb) + j0 * ldv,
                  ldv, ob, p->out_stride[2], 1);
    }
    finish_rows(&tile);
}

typedef void (*forward_task_fn)(const hkt_params *, const ws_layout *, char *, int64_t, int64_t, int64_t);

/* Task t of the forward, (b, h)-major, on the calling thread's workspace block. */
static inline void run_forward_task(const hkt_params *p, const ws_layout *ws, size_t wsb, forward_task_fn task,
                                    int64_t t, int tid) {
    const int64_t nqt = (p->T + BQ - 1) / BQ, bh = t / nqt, qt = nqt - 1 - t % nqt;
    task(p, ws, (char *)p->workspace + (size_t)tid * wsb, bh / p->H, bh % p->H, qt);
}

/* Runs task over every (b, h, query tile) (the bfloat16 forward brings its own). */
static void run_forward(const hkt_params *p, forward_task_fn task) {
    const ws_layout ws = hkt_ws_layout(p, 0);
    const size_t wsb = hkt_workspace_bytes(p, 0);
    const int64_t nqt = (p->T + BQ - 1) / BQ, nbh = p->B * p->H, ntask = nbh * nqt;
    const int nt = num_threads(p);
    for (int x = 0; x < nt; x++) ((thread_state *)((char *)p->workspace + (size_t)x * wsb))->cached_bh = -1;
    /* Tasks in (b, h)-major order.  With two (b, h) or more per thread, handed
     * out guided: a thread's first chunk is whole (b, h) in a row, so it
     * transposes their keys and packs their values alone, and the chunks
     * shrink to single tiles, which even out the threads' finish.  Tile by
     * tile, every thread came to every (b, h), and transposed and packed its
     * keys and values again.  With fewer (b, h), tile by tile: a guided first chunk
     * of one causal (b, h) would be its costliest half.  Within a (b, h) the
     * costlier causal tiles go first.  Who runs a tile changes no bits. */
    if (nbh >= 2 * (int64_t)nt)
        PARALLEL_TASKS(nt, (guided, 1), ntask, t, tid, run_forward_task(p, &ws, wsb, task, t, tid););
    else
        PARALLEL_TASKS(nt, (dynamic, 1), ntask, t, tid, run_forward_task(p, &ws, wsb, task, t, tid););
}

static void forward(const hkt_params *p) { run_forward(p, forward_task); }
