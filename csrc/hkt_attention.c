/*
 * HKT attention on the CPU: the type-free part.  hkt.h's CPU entry points, the
 * per-thread workspace layout (hkt_cpu.h) and the dispatch to the float32 and
 * float64 kernels, which are one body (hkt_attention_body.h) compiled twice
 * (hkt_cpu_f32.c, hkt_cpu_f64.c).
 */
#include "hkt_cpu.h"
#include "hkt_dropout.h"

#include <string.h>

const char *hkt_cpu_kernels(void) {
#if HKT_CLONES
    /* the order target_clones' resolver tries them in */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "avx512f";
    if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
    return "default";
}

int hkt_cpu_has_bf16(void) {
#if HKT_BF16_NATIVE
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

int hkt_default_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

void hkt_dropout_mask_cpu(unsigned char *keep, uint64_t seed, double p,
                          int64_t B, int64_t H, int64_t T, int64_t S) {
    uint64_t sm = mix64(seed), th = keep_threshold(p);
    int64_t n = B * H * T * S;
    for (int64_t x = 0; x < n; x++) keep[x] = (unsigned char)keep_entry(sm, th, (uint64_t)x);
}

/* Padded so rows 4 KiB apart do not all land in the same L1 set. */
int64_t hkt_keys_all_ld(const hkt_params *p, int l) {
    return round16(level_len(p->S, l)) + 16;
}

ws_layout hkt_ws_layout(const hkt_params *p, int backward) {
    ws_layout w;
    int64_t levels = 0, key_tile = 0, keys_all = 0, at = 0;
    memset(&w, 0, sizeof w);
    /* bfloat16 keys are held as pairs along D: (D / 2, cols) 32-bit words, which
     * take the room of (D / 2, cols) float32 reals */
    const int bf16 = p->dtype == HKT_BFLOAT16;
    const int64_t key_rows = bf16 ? (p->D + 1) / 2 : p->D;
    for (int l = 0; l < p->L; l++) {
        w.gram_off[l] = levels;
        w.key_tile_off[l] = key_tile;
        w.keys_all_off[l] = keys_all;
        levels += rows_max(l) * cols_max(l);
        key_tile += key_rows * cols_max(l);
        keys_all += key_rows * hkt_keys_all_ld(p, l);
    }
    levels = round16(levels);
    const int64_t value_pairs = bf16 ? round16((p->S + BK - 1) / BK * (BK / 2) * p->Dv) : 0;
    keys_all += value_pairs; /* the bfloat16 forward caches the values as pairs too */
    /* Caching a (b, kv head)'s transposed keys costs D * S * 4/3 reals per thread;
     * past this budget the forward transposes each key tile where it uses it. */
    const size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    const size_t budget = p->key_cache_bytes < 0 ? HKT_KEY_CACHE_BYTES : (size_t)p->key_cache_bytes;
    /* divided, not multiplied: keys_all * elem may not fit in a size_t for huge S */
    w.keys_cached = (size_t)keys_all <= budget / elem / (size_t)num_threads(p);
    w.scores = at;    at += BQ * BK;
    w.gram = at;      at += levels;
    w.folded = at;    at += levels;
    w.row_tmp = at;   at += BK > BQ ? BK : BQ;
    w.key_tile = at;  at += round16(key_tile);
    if (backward) {
        w.dscores = at;        at += BQ * BK;
        w.pdrop = at;          at += BQ * BK;
        w.dscores_coarse = at; at += levels;
        w.values_t = at;       at += round16(p->Dv * BK);
        w.dw_acc = at;         at += round16(p->L);
        if (bf16) {
            /* words and bfloat16 pairs take the room of one float32 each */
            int64_t kp = 0, qs = 0;
            for (int l = 0; l < p->L; l++) {
                w.key_pairs_off[l] = kp;
                w.q_off[l] = qs;
                kp += (cols_max(l) + 1) / 2 * p->D;
                qs += (rows_max(l) + 1) / 2 * p->D;
            }
            w.key_pairs = at; at += round16(kp);
            w.q_pairs = at;   at += round16(qs);
            w.do_pairs = at;  at += round16(BQ / 2 * p->Dv);
            w.p_pairs = at;   at += BQ / 2 * BK;
            w.ds_bf16 = at;   at += BQ / 2 * BK;
            w.ds_pairs = at;  at += BQ / 2 * BK;
        }
    } else {
        w.keys_all = at;   at += w.keys_cached ? round16(keys_all) : 0;
        w.keys_ready = at; at += round16((p->S + BK - 1) / BK);
        w.row_max = at;    at += BQ;
        w.row_sums = at;   at += BQ * 16; /* one 64-byte vector of partial sums per row */
        if (bf16) {
            w.values_all = w.keys_all + keys_all - value_pairs;
            w.value_tile = at; at += round16(BK / 2 * p->Dv);
            w.p_bf16 = at;     at += BQ * BK / 2;
        }
    }
    w.total = at;
    return w;
}

size_t hkt_workspace_bytes(const hkt_params *p, int backward) {
    size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    return (size_t)hkt_ws_layout(p, backward).total * elem + WS_HEADER + 64 /* round up */;
}

size_t hkt_dw_partial_bytes(const hkt_params *p) {
    /* delta (B, H, T), then dw partials (B, H, key tiles, L) */
    size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    int64_t nkt = (p->S + BK - 1) / BK;
    return (size_t)(p->B * p->H * (p->T + (nkt > 0 ? nkt : 1) * p->L)) * elem;
}

void hkt_forward_cpu(const hkt_params *p) {
    if (p->dtype == HKT_FLOAT64) hkt_forward_f64(p);
#if HKT_BF16_NATIVE
    else if (p->dtype == HKT_BFLOAT16) hkt_forward_bf16(p);
#endif
    else hkt_forward_f32(p);
}

void hkt_backward_cpu(const hkt_params *p) {
    /* the float32 body runs the bfloat16 backward too (hkt_bf16_body.h's hooks) */
    if (p->dtype == HKT_FLOAT64) hkt_backward_f64(p);
    else hkt_backward_f32(p);
}
