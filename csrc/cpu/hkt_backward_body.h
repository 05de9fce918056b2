/*
 * HKT attention on the CPU: the backward for one real type, after the forward
 * (hkt_attention_body.h) and, in the float32 build, the bfloat16 kernels
 * (hkt_bf16_body.h), whose products it takes where the inputs are bfloat16.
 * Included by hkt_cpu_f32.c and hkt_cpu_f64.c after those; static, like them.
 *
 * The backward recomputes each tile's scores from the forward's log-sum-exp
 * (nothing of size T x S is stored), forms dS = P (dP - delta), and adds its
 * products into dq, dk and dv, and each level's share into dw.  It overwrites
 * every gradient it is given.
 */

/* The backward with bfloat16 inputs (p->dtype HKT_BFLOAT16), float32 build
 * only: hkt_bf16_body.h's hooks (keys_bf16, tile_grams_bf16, dp_bf16, dv_bf16,
 * dq_bf16, dk_bf16, delta_bf16, grads_out_bf16) each replace one gemm (or the
 * delta loop) below, reading the bfloat16 arrays themselves. */
#if REAL_IS_FLOAT && HKT_BF16_HERE
#define HKT_BF16_BACKWARD 1
#define BF16_INPUTS(p) ((p)->dtype == HKT_BFLOAT16)
#else
#define HKT_BF16_BACKWARD 0
#endif

/* A tile's scores and Gram blocks for the backward (tile_scores, keep_grams):
 * with bfloat16 inputs the Gram blocks are the bfloat16 products, then the
 * same fold. */
static void backward_tile_scores(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                 int64_t i0, int64_t i1, int64_t j0, int64_t j1, const real *const *kt,
                                 const int64_t *ktld) {
#if HKT_BF16_BACKWARD
    if (BF16_INPUTS(p)) {
        tile_grams_bf16(p, ws, base, b, h, i0, i1, j0, j1);
        tile_fold(p, ws, base, b, h, i0, i1, j0, j1);
        return;
    }
#endif
    tile_scores(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld, 1);
}

/* lse = m + log(sum) is kept per row in the real type: where |lse| is this
 * large its rounding step (2^-11 here) reaches into log(sum) -- a row whose
 * every key carries finfo.min from a padding mask has lse = m exactly, its
 * ties' shares lost -- so the backward refines it (refine_lse).  Rows below
 * keep their bits. */
#if REAL_IS_FLOAT
#define LSE_EXACT_BELOW 4096.0f
#else
#define LSE_EXACT_BELOW 2199023255552.0 /* 2^41 */
#endif
static inline int lse_is_coarse(real x) { return isfinite(x) && (x >= LSE_EXACT_BELOW || x <= -LSE_EXACT_BELOW); }

/* Each row's lse correction (refine_lse), in dw_partial after delta and the dw
 * partials: B * H * T reals (hkt_dw_partial_bytes). */
static inline real *lse_lo(const hkt_params *p) {
    const int64_t nkt = (p->S + BK - 1) / BK;
    return (real *)p->dw_partial + p->B * p->H * (p->T + (nkt > 0 ? nkt : 1) * p->L);
}

/* dS of one (query tile, key tile) pair, recomputed from the forward's lse:
 *
 * forward: S = sum_l scale w_l up(q_l k_l^T); P = softmax(S); out = Pdrop @ v
 * dP = dO v^T; dS = P * (dP * keep/(1-p) - delta), delta = rowsum(dO * out)
 *
 * Reads the tile's transposed keys kt/ktld and values (values_t, (Dv, BK)).
 * Leaves the tile's scores' Gram blocks in gram (for dw), P in scores, dS
 * (nq, BK, before the scale) in dscores and, with dropout, the dropped P in
 * pdrop; returns the P that weighed v (scores or pdrop). */
static const real *tile_dscores(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                int64_t i0, int64_t i1, int64_t j0, int64_t j1, const real *const *kt,
                                const int64_t *ktld) {
    const int64_t T = p->T, S = p->S, Dv = p->Dv, nq = i1 - i0, nk = j1 - j0;
    real *Sb = base + ws->scores, *dP = base + ws->dscores, *Vt = base + ws->values_t, *Pd = base + ws->pdrop;
    const real *delta = (const real *)p->dw_partial + (b * p->H + h) * T; /* shared (B, H, T) */
    const real *lse = (const real *)p->lse + (b * p->H + h) * T;
    const real *lo = lse_lo(p) + (b * p->H + h) * T;
    const int diag = diagonal_tile(p, i0, j0);
    backward_tile_scores(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld);
    /* A row whose lse or delta is not finite (NaN from a visible NaN score, +inf
     * lse for a row with nothing visible) must still give hidden entries dS = 0,
     * not 0 * NaN: remember which entries are hidden before the exp. */
    unsigned char odd_row[BQ], hidden[BQ][BK];
    for (int64_t r = 0; r < nq; r++) {
        real *srow = Sb + r * BK;
        odd_row[r] = !(isfinite(lse[i0 + r]) && isfinite(delta[i0 + r]));
        if (odd_row[r])
            for (int64_t c = 0; c < nk; c++) hidden[r][c] = srow[c] == -INFINITY;
        if (lo[i0 + r] != 0) { /* lse + lo: the row's exact log-sum-exp (refine_lse) */
            for (int64_t c = 0; c < nk; c++) srow[c] = (srow[c] - lse[i0 + r]) - lo[i0 + r];
            exp_shift(srow, nk, 0);
        } else {
            exp_shift(srow, nk, lse[i0 + r]); /* P */
        }
    }
    const real *dO = (const real *)p->dout + b * p->dout_stride[0] + h * p->dout_stride[1] + i0 * p->dout_stride[2];
    /* without dropout, dS = P (dP - delta) in dP's store where the tile takes it */
    const int fused = p->dropout_p == 0 && !diag && gemm_fused_takes(nk) && p->dtype != HKT_BFLOAT16;
#if HKT_BF16_BACKWARD
    if (BF16_INPUTS(p))
        dp_bf16(p, ws, base, b, h, i0, nq, nk, dP);
    else
#endif
    if (fused) {
        const tile_extra x = {Sb, BK, delta + i0, NULL, 0, 0};
        gemm_fused(EPI_DS, nq, nk, Dv, 1, dO, p->dout_stride[2], Vt, BK, dP, BK, &x);
    } else {
        gemm_diag(diag, DIAG_SCORES, nq, nk, Dv, 1, dO, p->dout_stride[2], Vt, BK, dP, BK, 0); /* dP = dO V^T */
    }
    const real *Pv = Sb; /* the P that weighed v: dropped or not */
    /* dS = P * (dP * keep / (1 - p) - delta), before the scale */
    if (p->dropout_p > 0) {
        const uint64_t sm = mix64(p->seed), th = keep_threshold(p->dropout_p);
        const real kf = (real)keep_scale(p->dropout_p);
        for (int64_t r = 0; r < nq; r++) {
            const uint64_t rowidx = (uint64_t)(((b * p->H + h) * T + i0 + r) * S + j0);
            const real di = delta[i0 + r];
            real *srow = Sb + r * BK, *dprow = dP + r * BK, *pdrow = Pd + r * BK;
            for (int64_t c = 0; c < nk; c++) {
                const real f = keep_entry(sm, th, rowidx + (uint64_t)c) ? kf : 0;
                pdrow[c] = srow[c] * f;
                dprow[c] = srow[c] * (dprow[c] * f - di);
            }
        }
        Pv = Pd;
    } else if (!fused) {
        for (int64_t r = 0; r < nq; r++) {
            const real di = delta[i0 + r];
            const real *srow = Sb + r * BK;
            real *dprow = dP + r * BK;
            for (int64_t c = 0; c < nk; c++) dprow[c] = srow[c] * (dprow[c] - di);
        }
    }
    for (int64_t r = 0; r < nq; r++)
        if (odd_row[r])
            for (int64_t c = 0; c < nk; c++)
                if (hidden[r][c]) dP[r * BK + c] = 0;
    if (diag) zero_unseen(nq, nk, dP, BK); /* dP was left out there */
    return Pv;
}

/* backward of one (query tile, key tile) pair: dS (tile_dscores), then
 *
 * dv = Pdrop^T dO; dq_l = scale w_l sum2^l(dS) k_l; dk_l = scale w_l sum2^l(dS)^T q_l;
 * dw_l = scale sum(sum2^l(dS) * q_l k_l^T)
 *
 * want_kv adds to dv, dk and dwacc (the key side), want_q to dq (the query side);
 * with neither it only leaves dS in dscores (for the mask's gradient).
 * kt/ktld are the key tile's transposed keys, values_t (Dv, BK) its transposed values.
 * All gradients accumulate: the caller orders the pairs. */
static void backward_pair(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                          int64_t i0, int64_t i1, int64_t j0, int64_t j1, const real *const *kt,
                          const int64_t *ktld, int want, real *dwacc) {
    const int64_t D = p->D, Dv = p->Dv, nq = i1 - i0, nk = j1 - j0;
    const int L = p->L;
    const real scale = (real)p->scale;
    real *dP = base + ws->dscores;
    const int64_t hk = kv_head(p, h);

    const real *Pv = tile_dscores(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld);
    const int diag = diagonal_tile(p, i0, j0);
    if (!(want & (WANT_KV | WANT_Q))) return; /* the mask's gradient: dS of the capped score, as it is */
    if (p->softcap > 0) {
        /* dS of the uncapped score, which q, k and w's gradients take: times the
         * cap's derivative.  A zero dS stays 0 (a hidden entry, whose score may be
         * NaN or never computed: what gemm_diag leaves out) */
        const real *cg = base + ws->capgrad;
        for (int64_t r = 0; r < nq; r++)
            for (int64_t c = 0; c < nk; c++) {
                real *ds = dP + r * BK + c;
                if (*ds != 0) *ds *= cg[r * BK + c];
            }
    }
    if (want & WANT_KV) {
#if HKT_BF16_BACKWARD
        if (BF16_INPUTS(p))
            dv_bf16(p, ws, base, Pv, b, h, i0, nq, j0, nk, want & ROWS_PACKED);
        else
#endif
            gemm_diag(diag, DIAG_KEYS, nk, Dv, nq, 1, Pv, BK,
                      (const real *)p->dout + b * p->dout_stride[0] + h * p->dout_stride[1] + i0 * p->dout_stride[2],
                      p->dout_stride[2],
                      (real *)p->dv + b * p->dv_stride[0] + hk * p->dv_stride[1] + j0 * p->dv_stride[2],
                      p->dv_stride[2], 1); /* dv += P^T dO */
    }
    /* per level: dS summed over 2^l blocks, level by level
     * from the one below; then that level's dq, or dk and dw */
    const real *dsl_prev = dP;
    int64_t ld_prev = BK, rl_prev = nq, cl_prev = nk;
    for (int l = 0; l < L; l++) {
        span sp = level_span(l, i0, i1, j0, j1);
        const real *dsl = dP;
        int64_t ldsl = BK;
        if (l > 0) {
            real *out = base + ws->dscores_coarse + ws->gram_off[l];
            for (int64_t a = 0; a < sp.rl; a++) {
                const real *r0 = dsl_prev + 2 * a * ld_prev;
                pairsum(r0, 2 * a + 1 < rl_prev ? r0 + ld_prev : NULL, cl_prev, out + a * sp.cl);
            }
            dsl = out;
            ldsl = sp.cl;
        }
        dsl_prev = dsl;
        ld_prev = ldsl;
        rl_prev = sp.rl;
        cl_prev = sp.cl;
        const real wl = level_factor(p->scale, weight(p, h, l));
#if HKT_BF16_BACKWARD
        int ds_paired = 0; /* dS_l's pairs for dk made with dq's rounding */
#endif
        if (want & WANT_Q) {
#if HKT_BF16_BACKWARD
            if (BF16_INPUTS(p))
                ds_paired = dq_bf16(p, ws, base, l, dsl, ldsl, sp.r0, sp.rl, sp.cl, wl, b, h, want & WANT_KV);
            else
#endif
            {
                const real *kb = (const real *)p->k[l] + b * p->k_stride[l][0] + hk * p->k_stride[l][1];
                const int64_t ldk = ws->pack_k ? D : p->k_stride[l][2];
                const real *krows = ws->pack_k ? base + ws->key_rows + ws->key_tile_off[l] : kb + sp.c0 * ldk;
                real *dq = (real *)p->dq[l] + b * p->dq_stride[l][0] + h * p->dq_stride[l][1];
                gemm_diag(diag && l == 0, DIAG_ROWS, sp.rl, D, sp.cl, wl, dsl, ldsl, krows, ldk,
                          dq + sp.r0 * p->dq_stride[l][2], p->dq_stride[l][2], 1);
            }
        }
        if (want & WANT_KV) {
            const real *G = base + ws->gram + ws->gram_off[l];
            /* summed lane-wise over the whole block, reduced once: a per-row dot
             * ended each row in a chain of VL dependent scalar adds; rows taken
             * in turn by four accumulators, whose chains overlap (one chain
             * waited on the FMA's latency) */
            vec acc[4] = {{0}, {0}, {0}, {0}};
            for (int64_t a = 0; a < sp.rl; a++)
                acc[a & 3] = dot_lanes(sp.cl, dsl + a * ldsl, G + a * sp.cl, acc[a & 3]);
            dwacc[l] += scale * lanes_total((acc[0] + acc[1]) + (acc[2] + acc[3]));
#if HKT_BF16_BACKWARD
            if (BF16_INPUTS(p))
                dk_bf16(p, ws, base, l, dsl, ldsl, sp.r0, sp.rl, sp.c0, sp.cl, wl, b, h, want & ROWS_PACKED,
                        ds_paired);
            else
#endif
            {
                const real *qb = (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1];
                real *dk = (real *)p->dk[l] + b * p->dk_stride[l][0] + hk * p->dk_stride[l][1];
                gemm_diag(diag && l == 0, DIAG_KEYS, sp.cl, D, sp.rl, wl, dsl, ldsl, qb + sp.r0 * p->q_stride[l][2],
                          p->q_stride[l][2], dk + sp.c0 * p->dk_stride[l][2], p->dk_stride[l][2], 1);
            }
        }
    }
}

/* Loads key tile j0 (transposed keys of every level, transposed values). */
static void backward_keys(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, int64_t j0,
                          int64_t j1, const real **kt, int64_t *ktld) {
#if HKT_BF16_BACKWARD
    if (BF16_INPUTS(p)) {
        keys_bf16(p, ws, base, b, h, j0, j1);
        return;
    }
#endif
    const real *vb = (const real *)p->v + b * p->v_stride[0] + kv_head(p, h) * p->v_stride[1];
    load_key_tile(p, ws, base, b, h, j0, j1, kt, ktld);
    transpose(j1 - j0, p->Dv, vb + j0 * p->v_stride[2], p->v_stride[2], base + ws->values_t, BK);
    if (ws->pack_k) /* dq's products read the tile's key rows once per query tile: packed once here */
        for (int l = 0; l < p->L; l++) {
            const span sp = level_span(l, 0, 1, j0, j1);
            const real *kb = (const real *)p->k[l] + b * p->k_stride[l][0] + kv_head(p, h) * p->k_stride[l][1];
            copy_rows(sp.cl, p->D, kb + sp.c0 * p->k_stride[l][2], p->k_stride[l][2],
                      base + ws->key_rows + ws->key_tile_off[l], p->D);
        }
}

/* ws with its key-tile regions (key_tile, values_t, key_rows, key_pairs) at
 * slot s of the BWD_KEY_TILES the backward holds; the pair's scratch regions
 * are shared by the slots. */
static inline ws_layout key_slot(const ws_layout *ws, int s) {
    ws_layout w = *ws;
    w.key_tile += s * ws->key_tile_step;
    w.values_t += s * ws->values_t_step;
    w.key_rows += s * ws->key_tile_step;
    w.key_pairs += s * ws->key_pairs_step;
    return w;
}

/* Key tiles [kt0, kt1) of kv head hk against every query tile that sees them,
 * for query heads [h0, h1) of one group, for the given sides; the key side's
 * dw partials go to dw_partial.  BWD_KEY_TILES key tiles are loaded at a time
 * (once for those heads), and each query tile is taken against all of them
 * before the next: (key tile block, query head, query tile, key tile) order.
 * Every gradient row still receives its additions in the order of the plain
 * (key tile, query head, query tile) walk -- a dq row from key tiles in
 * order, a dk or dv row from query heads, then query tiles, in order -- so
 * the same bits, whether the group's heads come in one call or one call each. */
static void backward_keys_range(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h0,
                                int64_t h1, int64_t kt0, int64_t kt1, int want) {
    const real *kt[BWD_KEY_TILES][HKT_MAX_LEVELS];
    int64_t ktld[BWD_KEY_TILES][HKT_MAX_LEVELS];
    ws_layout wk[BWD_KEY_TILES];
    int64_t kj0[BWD_KEY_TILES], kj1[BWD_KEY_TILES]; /* the held tiles' key ranges */
    real *dwacc = base + ws->dw_acc;
    const int64_t nkt = (p->S + BK - 1) / BK;
    /* one key tile at a time where a level's rows span tiles (L >= 8): its dq
     * and dk rows would take their additions in another order than the plain
     * walk's, which the two-pass schedule keeps */
    const int64_t held = ((int64_t)1 << (p->L - 1)) > BK ? 1 : BWD_KEY_TILES;
    for (int64_t t0 = kt0; t0 < kt1; t0 += held) {
        const int n = kt1 - t0 < held ? (int)(kt1 - t0) : (int)held;
        for (int s = 0; s < n; s++) {
            kj0[s] = (t0 + s) * BK;
            kj1[s] = kj0[s] + BK < p->S ? kj0[s] + BK : p->S;
            wk[s] = key_slot(ws, s);
            backward_keys(p, &wk[s], base, b, h0, kj0[s], kj1[s], kt[s], ktld[s]);
        }
        for (int64_t h = h0; h < h1; h++) {
            for (int x = 0; x < n * p->L; x++) dwacc[x] = 0;
            const int64_t iend = query_end(p, kj1[n - 1]);
            for (int64_t i0 = first_query_tile(p, kj0[0]); i0 < iend; i0 += BQ) {
                const int64_t i1 = i0 + BQ < p->T ? i0 + BQ : p->T;
                int packed = 0; /* the query tile's rows, as the first pair left them */
                for (int s = 0; s < n; s++) {
                    if (!pair_visible(p, i0, i1, kj0[s], kj1[s])) continue; /* causality or the band hide them */
                    backward_pair(p, &wk[s], base, b, h, i0, i1, kj0[s], kj1[s], kt[s], ktld[s], want | packed,
                                  dwacc + s * p->L);
                    packed = ROWS_PACKED;
                }
            }
            if (want & WANT_KV)
                for (int s = 0; s < n; s++) {
                    real *dwp = (real *)p->dw_partial + p->B * p->H * p->T + ((b * p->H + h) * nkt + t0 + s) * p->L;
                    for (int l = 0; l < p->L; l++) dwp[l] = dwacc[s * p->L + l];
                }
        }
    }
}

/* The one-pass schedule's task: every key tile of kv head (b, hk) against its
 * group's query heads, both sides.  Where ws packs rows (pack_rows in
 * hkt_attention.c), one query head at a time: its strided q, dO rows copied
 * into the workspace, dq summed there from zero (backward_prepare left the
 * array alone) and copied out at the end; the kernels see them through a copy
 * of the parameters whose (batch, head) strides are 0. */
static void backward_kv_head(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t hk) {
    const int64_t nkt = (p->S + BK - 1) / BK, group = p->H / p->H_kv, D = p->D;
    if (!(ws->pack_q || ws->pack_dq || ws->pack_do)) {
        backward_keys_range(p, ws, base, b, hk * group, (hk + 1) * group, 0, nkt, WANT_KV | WANT_Q);
        return;
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
        hkt_params pp = *p;
        for (int l = 0; l < p->L; l++) {
            const int64_t n = level_len(p->T, l);
            if (ws->pack_q) {
                real *qp = base + ws->q_packed + ws->pack_off[l];
                copy_rows(n, D, (const real *)p->q[l] + b * p->q_stride[l][0] + h * p->q_stride[l][1],
                          p->q_stride[l][2], qp, D);
                pp.q[l] = qp;
                pp.q_stride[l][0] = pp.q_stride[l][1] = 0;
                pp.q_stride[l][2] = D;
            }
            if (ws->pack_dq) {
                real *dqp = base + ws->dq_packed + ws->pack_off[l];
                memset(dqp, 0, sizeof(real) * (size_t)(n * D));
                pp.dq[l] = dqp;
                pp.dq_stride[l][0] = pp.dq_stride[l][1] = 0;
                pp.dq_stride[l][2] = D;
            }
        }
        if (ws->pack_do) {
            real *dop = base + ws->do_packed;
            copy_rows(p->T, p->Dv, (const real *)p->dout + b * p->dout_stride[0] + h * p->dout_stride[1],
                      p->dout_stride[2], dop, p->Dv);
            pp.dout = dop;
            pp.dout_stride[0] = pp.dout_stride[1] = 0;
            pp.dout_stride[2] = p->Dv;
        }
        backward_keys_range(&pp, ws, base, b, h, h + 1, 0, nkt, WANT_KV | WANT_Q);
        if (ws->pack_dq)
            for (int l = 0; l < p->L; l++)
                copy_rows(level_len(p->T, l), D, base + ws->dq_packed + ws->pack_off[l], D,
                          (real *)p->dq[l] + b * p->dq_stride[l][0] + h * p->dq_stride[l][1], p->dq_stride[l][2]);
    }
}

/* dq of query tiles [qt0, qt1) in the same key-major order as the one-pass
 * schedule, so both schedules add every gradient in the same order. */
static void backward_queries_range(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h,
                                   int64_t qt0, int64_t qt1) {
    const real *kt[HKT_MAX_LEVELS];
    int64_t ktld[HKT_MAX_LEVELS];
    const int64_t iend = qt1 * BQ < p->T ? qt1 * BQ : p->T;
    const int64_t jend = key_end(p, iend);
    for (int64_t j0 = first_key_tile(p, qt0 * BQ); j0 < jend; j0 += BK) {
        const int64_t j1 = j0 + BK < p->S ? j0 + BK : p->S;
        backward_keys(p, ws, base, b, h, j0, j1, kt, ktld);
        for (int64_t q = qt0; q < qt1; q++) {
            const int64_t i0 = q * BQ, i1 = i0 + BQ < p->T ? i0 + BQ : p->T;
            if (!pair_visible(p, i0, i1, j0, j1)) continue;
            backward_pair(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld, WANT_Q, NULL);
        }
    }
}

/* The float mask's gradient: dmask (dmask_shape; each dim 1 or full) is dS summed
 * over the dims where it is 1.  A task owns the dmask block (mb, mh, query tile
 * mqt, key tile mkt) — a whole dim where that dim is summed — and adds every
 * (b, h, query tile, key tile) pair that lands in it, in a fixed order: no races,
 * the same bits for any thread count.  Scores are recomputed for this (one more
 * pass over the pairs, paid only when the mask needs a gradient). */
static void backward_mask_task(const hkt_params *p, const ws_layout *ws, real *base, int64_t mb, int64_t mh,
                               int64_t mqt, int64_t mkt) {
    const int64_t *ms = p->dmask_shape;
    const int own_b = ms[0] == p->B, own_h = ms[1] == p->H, own_i = ms[2] == p->T, own_j = ms[3] == p->S;
    const int64_t nqt = (p->T + BQ - 1) / BQ, nkt = (p->S + BK - 1) / BK;
    const int64_t qt0 = own_i ? mqt : 0, qt1 = own_i ? mqt + 1 : nqt;
    const int64_t kt0 = own_j ? mkt : 0, kt1 = own_j ? mkt + 1 : nkt;
    real *dm = (real *)p->dmask + (mb * ms[1] + mh) * ms[2] * ms[3];
    const real *dS = base + ws->dscores;
    const real *kt[HKT_MAX_LEVELS];
    int64_t ktld[HKT_MAX_LEVELS];
    /* zero the block first: the backward overwrites */
    for (int64_t i = own_i ? qt0 * BQ : 0; i < (own_i ? (qt1 * BQ < p->T ? qt1 * BQ : p->T) : 1); i++)
        for (int64_t j = own_j ? kt0 * BK : 0; j < (own_j ? (kt1 * BK < p->S ? kt1 * BK : p->S) : 1); j++)
            dm[i * ms[3] + j] = 0;
    for (int64_t b = own_b ? mb : 0; b < (own_b ? mb + 1 : p->B); b++)
        for (int64_t h = own_h ? mh : 0; h < (own_h ? mh + 1 : p->H); h++)
            for (int64_t t = kt0; t < kt1; t++) {
                const int64_t j0 = t * BK, j1 = j0 + BK < p->S ? j0 + BK : p->S;
                backward_keys(p, ws, base, b, h, j0, j1, kt, ktld);
                for (int64_t q = qt0; q < qt1; q++) {
                    const int64_t i0 = q * BQ, i1 = i0 + BQ < p->T ? i0 + BQ : p->T;
                    if (!pair_visible(p, i0, i1, j0, j1)) continue;
                    backward_pair(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld, 0, NULL);
                    for (int64_t r = 0; r < i1 - i0; r++) {
                        const real *drow = dS + r * BK;
                        real *mrow = dm + (own_i ? i0 + r : 0) * ms[3];
                        if (own_j) {
                            for (int64_t c = 0; c < j1 - j0; c++) mrow[j0 + c] += drow[c];
                        } else {
                            real sum = 0;
                            for (int64_t c = 0; c < j1 - j0; c++) sum += drow[c];
                            mrow[0] += sum;
                        }
                    }
                }
            }
}

/* Whether query row i of (b, h) has an output gradient of zeros (bits, so
 * -0 too): its P then weighs nothing (dS = P (dP - delta) = 0, dv gets P 0),
 * so lse's precision does not matter there.  A padded position's row, where
 * the loss ignores it, is such a row in every layer. */
static int dout_row_zero(const hkt_params *p, int64_t b, int64_t h, int64_t i) {
    const int64_t at = b * p->dout_stride[0] + h * p->dout_stride[1] + i * p->dout_stride[2];
    if (p->dtype == HKT_BFLOAT16) { /* bfloat16 bits: zero but for the sign */
        const uint16_t *d = (const uint16_t *)p->dout + at;
        for (int64_t e = 0; e < p->Dv; e++)
            if (d[e] & 0x7FFF) return 0;
        return 1;
    }
    const real *d = (const real *)p->dout + at;
    for (int64_t e = 0; e < p->Dv; e++)
        if (d[e] != 0) return 0; /* NaN too */
    return 1;
}

/* lse's corrections (lse_lo below) of (b, h)'s rows: for each query tile
 * holding a row whose |lse| reaches LSE_EXACT_BELOW (and whose output gradient
 * is not all zeros: dout_row_zero), that row's max m and sum
 * of exp(score - m) over every key it sees, from the scores again (one more
 * pass over those tiles' keys, only for them), and lo = (m - lse) + log(sum):
 * lse + lo is m + log(sum) to about the real's precision, where lse alone had
 * lost log(sum) to its rounding.  Other rows keep lo = 0. */
static void refine_lse(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h, const real *lse,
                       real *lo) {
    const int64_t T = p->T, S = p->S;
    for (int64_t i0 = 0; i0 < T; i0 += BQ) {
        const int64_t i1 = i0 + BQ < T ? i0 + BQ : T, nq = i1 - i0;
        unsigned char want[BQ];
        int any = 0;
        double m[BQ], sum[BQ];
        for (int64_t r = 0; r < nq; r++) {
            want[r] = lse_is_coarse(lse[i0 + r]) && !dout_row_zero(p, b, h, i0 + r);
            any |= want[r];
            m[r] = -INFINITY;
            sum[r] = 0;
        }
        if (!any) continue;
        const int64_t jend = key_end(p, i1);
        for (int64_t j0 = first_key_tile(p, i0); j0 < jend; j0 += BK) {
            const int64_t j1 = j0 + BK < S ? j0 + BK : S;
            const real *kt[HKT_MAX_LEVELS];
            int64_t ktld[HKT_MAX_LEVELS];
            backward_keys(p, ws, base, b, h, j0, j1, kt, ktld);
            backward_tile_scores(p, ws, base, b, h, i0, i1, j0, j1, kt, ktld);
            for (int64_t r = 0; r < nq; r++) {
                if (!want[r]) continue;
                const real *srow = base + ws->scores + r * BK;
                const double mt = row_max(srow, j1 - j0); /* no NaN: the row's lse is finite */
                if (mt == -INFINITY) continue;
                if (mt > m[r]) {
                    sum[r] *= exp(m[r] - mt); /* 0 while m was -inf */
                    m[r] = mt;
                }
                for (int64_t c = 0; c < j1 - j0; c++) sum[r] += exp((double)srow[c] - m[r]);
            }
        }
        for (int64_t r = 0; r < nq; r++)
            if (want[r] && sum[r] > 0) lo[i0 + r] = (real)((m[r] - (double)lse[i0 + r]) + log(sum[r]));
    }
}

/* Zeroes query head (b, h)'s dq rows and, once per group (its first query
 * head), its kv head's dk and dv rows (the backward overwrites); fills
 * delta = rowsum(dO * out), the softmax backward's per-row term, and lse's
 * corrections (refine_lse; base: the thread's workspace). */
static void backward_prepare(const hkt_params *p, const ws_layout *ws, real *base, int64_t b, int64_t h) {
    const int64_t T = p->T, S = p->S, D = p->D, Dv = p->Dv, hk = kv_head(p, h);
    const int first_of_group = h % (p->H / p->H_kv) == 0;
    for (int l = 0; l < p->L; l++) {
        const int64_t Tl = level_len(T, l), Sl = level_len(S, l);
        real *dq = (real *)p->dq[l] + b * p->dq_stride[l][0] + h * p->dq_stride[l][1];
        real *dk = (real *)p->dk[l] + b * p->dk_stride[l][0] + hk * p->dk_stride[l][1];
        if (!ws->pack_dq) zero_rows(Tl, D, dq, p->dq_stride[l][2]); /* else summed in the workspace, then copied */
        if (first_of_group) zero_rows(Sl, D, dk, p->dk_stride[l][2]);
    }
    real *dvb = (real *)p->dv + b * p->dv_stride[0] + hk * p->dv_stride[1];
    if (first_of_group) zero_rows(S, Dv, dvb, p->dv_stride[2]);
    real *delta = (real *)p->dw_partial + (b * p->H + h) * T;
    const real *lse = (const real *)p->lse + (b * p->H + h) * T;
    real *lo = lse_lo(p) + (b * p->H + h) * T;
    int coarse = 0; /* refine_lse then leaves out rows whose dO is zero */
    for (int64_t i = 0; i < T; i++) {
        lo[i] = 0;
        coarse |= lse_is_coarse(lse[i]);
    }
    if (coarse) refine_lse(p, ws, base, b, h, lse, lo);
#if HKT_BF16_BACKWARD
    if (BF16_INPUTS(p)) {
        delta_bf16(p, b, h, delta);
        return;
    }
#endif
    const real *ob = (const real *)p->out + b * p->out_stride[0] + h * p->out_stride[1];
    const real *dob = (const real *)p->dout + b * p->dout_stride[0] + h * p->dout_stride[1];
    for (int64_t i = 0; i < T; i++) delta[i] = dot_exact(Dv, dob + i * p->dout_stride[2], ob + i * p->out_stride[2]);
}

/* Rounds (b, kv head hk)'s finished gradients -- dk and dv, and dq of its
 * group of query heads -- from their float32 sums (acc) into dst's bfloat16
 * arrays (bf16_out). */
static inline void grads_out(const hkt_params *dst, const hkt_params *acc, int64_t b, int64_t hk) {
#if HKT_BF16_BACKWARD
    grads_out_bf16(dst, acc, b, hk);
#else
    (void)dst, (void)acc, (void)b, (void)hk;
#endif
}

/* Thread tid's reals in the workspace: its block of wsb bytes, past the
 * per-thread state (WS_HEADER). */
static inline real *thread_reals(const hkt_params *p, size_t wsb, int tid) {
    return (real *)((char *)p->workspace + (size_t)tid * wsb + WS_HEADER);
}

/* Two schedules, bitwise equal results:
 *  - one task per (b, kv head), owning all the gradient rows of the kv head and
 *    of its group of query heads (no atomics): used when there are at least as
 *    many (b, kv head) as threads;
 *  - otherwise two passes: key chunks of one (b, kv head) write dk, dv and dw
 *    partials, query chunks of one (b, h) write dq.  A chunk spans 2^(L-1) rows
 *    (at least one 64-row tile), so no coarse-level row is shared between chunks;
 *    scores are recomputed in both passes, the price of using every thread.
 * dw is reduced from per-(b, h, key tile) partials in a fixed order. */
static void backward(const hkt_params *p) {
    const hkt_params *dst = NULL; /* bfloat16 gradients: where they go, p then holding their float32 sums */
#if HKT_BF16_BACKWARD
    hkt_params acc;
    if (BF16_INPUTS(p) && p->bf16_out) {
        hkt_grad_acc_params(p, &acc);
        dst = p;
        p = &acc;
    }
#endif
    const ws_layout ws = hkt_ws_layout(p, 1);
    const size_t wsb = hkt_workspace_bytes(p, 1);
    const int64_t nbh = p->B * p->H, nbk = p->B * p->H_kv, nkt = (p->S + BK - 1) / BK, nqt = (p->T + BQ - 1) / BQ;
    const int nt = num_threads(p);
    const int64_t span = ((int64_t)1 << (p->L - 1)) > BK ? ((int64_t)1 << (p->L - 1)) / BK : 1; /* tiles per chunk */
    const int64_t nkc = (nkt + span - 1) / span, nqc = (nqt + span - 1) / span;
    if (nbk >= nt) {
        PARALLEL_TASKS(nt, (dynamic, 1), nbk, t, tid, {
            /* the task alone reads its group's delta and writes its gradient rows:
             * zeroed here, they are in cache when the products add to them */
            const int64_t b = t / p->H_kv, hk = t % p->H_kv, group = p->H / p->H_kv;
            real *base = thread_reals(p, wsb, tid);
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) backward_prepare(p, &ws, base, b, h);
            backward_kv_head(p, &ws, base, b, hk);
            /* the task's gradient rows are final: rounded while they are in cache */
            if (dst) grads_out(dst, p, t / p->H_kv, t % p->H_kv);
        });
    } else {
        PARALLEL_TASKS(nt, (static), nbh, t, tid,
                       backward_prepare(p, &ws, thread_reals(p, wsb, tid), t / p->H, t % p->H););
        PARALLEL_TASKS(nt, (dynamic, 1), nbk * nkc, t, tid, {
            const int64_t bk = t / nkc, c = t % nkc;
            const int64_t group = p->H / p->H_kv, hk = bk % p->H_kv;
            backward_keys_range(p, &ws, thread_reals(p, wsb, tid), bk / p->H_kv, hk * group, (hk + 1) * group,
                                c * span, (c + 1) * span < nkt ? (c + 1) * span : nkt, WANT_KV);
        });
        PARALLEL_TASKS(nt, (dynamic, 1), nbh * nqc, t, tid, {
            const int64_t bh = t / nqc, c = nqc - 1 - t % nqc; /* causal: costlier chunks first */
            backward_queries_range(p, &ws, thread_reals(p, wsb, tid), bh / p->H, bh % p->H, c * span,
                                   (c + 1) * span < nqt ? (c + 1) * span : nqt);
        });
        if (dst) PARALLEL_TASKS(nt, (static), nbk, t, tid, grads_out(dst, p, t / p->H_kv, t % p->H_kv););
    }
    if (p->dmask) {
        const int64_t *ms = p->dmask_shape;
        const int64_t mqt = ms[2] == p->T ? nqt : 1, mkt = ms[3] == p->S ? nkt : 1;
        const int64_t ntask = ms[0] * ms[1] * mqt * mkt;
        PARALLEL_TASKS(nt, (dynamic, 1), ntask, t, tid,
                       backward_mask_task(p, &ws, thread_reals(p, wsb, tid), t / (mkt * mqt) / ms[1],
                                          t / (mkt * mqt) % ms[1], t / mkt % mqt, t % mkt););
    }
    /* dw[h, l] = sum over b and key tiles of the partials (and over h when w is shared) */
    real *dw = (real *)p->dw;
    const real *part = (const real *)p->dw_partial + nbh * p->T;
    const int64_t nw = p->w_per_head ? p->H * p->L : p->L;
    for (int64_t x = 0; x < nw; x++) dw[x] = 0;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->H; h++)
            for (int64_t t = 0; t < nkt; t++)
                for (int l = 0; l < p->L; l++)
                    dw[(p->w_per_head ? h * p->L : 0) + l] += part[((b * p->H + h) * nkt + t) * p->L + l];
}
