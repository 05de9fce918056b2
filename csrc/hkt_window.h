/*
 * hkt_window.h -- HKT attention with a window per level (docs/contract.md
 * section 1.11): level l sees key j from query i iff
 * |(i >> l) - (j >> l)| < W_l / 2^l, or always where the level has no window;
 * the score adds the terms of the levels that see (i, j); a key no level sees
 * is hidden.
 *
 * The kernels need the windows growing: W_l > W_{l-1} where both are given, and
 * no window above a level without one.  Then, for every query, the keys level
 * l sees contain those level l-1 sees, and a key that only levels >= m see has
 * the same score as every key of its level-m block (or, at the inner edge of
 * level m's part, of its level-(m-1) block): such keys share one probability,
 * and their part of out is that probability times the block's summed values.
 * A query thus visits O(W_0) single keys and O(W_m / 2^m) blocks per level
 * instead of S keys.
 *
 * Shapes (every array C-contiguous; Tl = ceil(T/2^l), Sl = ceil(S/2^l)):
 *   q[l]  (B, H, Tl, D)      k[l]  (B, H_kv, Sl, D)
 *   vs[l] (B, H_kv, Sl, Dv)  the values summed over level-l blocks: vs[0] = v,
 *                            row c of vs[l] the sum of v rows c*2^l .. c*2^l + 2^l - 1
 *                            (those below S); the caller forms them
 *   w     (H, L)             out (B, H, T, Dv)   lse (B, H, T)
 * H_kv divides H; query head h reads kv head h / (H / H_kv).
 *
 * Forward OVERWRITES out and lse (lse = +inf for a row with no visible key,
 * whose out is 0).  Backward OVERWRITES dq[l] (like q[l]), dk[l] (like k[l]),
 * dvs[l] (like vs[l]: the gradient of each block sum; the caller spreads
 * dvs[l] onto the 2^l value rows of each block) and dw (H, L).
 *
 * Soft-capping (section 1.12): with softcap = c > 0 a unit's combined score s
 * becomes c tanh(s / c) before a float mask is added; the keys that share s
 * share the capped score, so the sharing holds.  The backward takes each
 * unit's score gradient through the cap, d/ds = 1 - tanh(s / c)^2.
 *
 * Masks and dropout (section 1.11 of the contract).  A mask that does not
 * vary with the query, given as per-level counts (below), keeps the sharing:
 * a block's visible keys still share one probability.  A general mask
 * (mask_kind, as hkt.h's) or dropout (the entries hkt_dropout.h keeps, the
 * same as the other kernels keep for the same seed) varies inside a block:
 * the kernels then visit every key of a unit one by one, at its unit's score
 * (plus the float mask's entry), which costs O(T S Dv) like dense attention
 * but still no T x S buffer.
 *
 * Results are bitwise the same for any thread count: one task per (batch,
 * head) in the forward, per (batch, kv head) in the backward (its query heads
 * in index order), and dw summed over the batch in index order.  The kernels
 * never allocate: the workspace (hkt_window_workspace_bytes) comes from the
 * caller.  No Python header here.
 */
#ifndef HKT_WINDOW_H
#define HKT_WINDOW_H

#include <stddef.h>
#include <stdint.h>

#include "hkt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t B, H, H_kv, T, S, D, Dv;
    int L;
    int dtype;                             /* HKT_FLOAT32 or HKT_FLOAT64 */
    int is_causal;                         /* key j visible to query i only when j <= i */
    double scale;
    double softcap;                        /* 0: none; c > 0: a unit's score s is c tanh(s / c), before the mask */
    int64_t radius[HKT_MAX_LEVELS];        /* W_l / 2^l, in level-l blocks; 0: no window */
    const void *q[HKT_MAX_LEVELS];
    const void *k[HKT_MAX_LEVELS];
    const void *vs[HKT_MAX_LEVELS];
    const void *w;
    void *out, *lse;                       /* forward's outputs; backward's inputs */
    const void *dout;                      /* backward only */
    /* a mask (B, H, T, S), element strides (0 broadcasts): bool bytes (True: may attend) or `real` added to the
     * score; HKT_MASK_NONE for none */
    int mask_kind;
    const void *mask;
    int64_t mask_stride[4];
    double dropout_p;                      /* 0: none */
    uint64_t seed;
    /* a key-only bool mask instead (no mask_kind then): per level, (B, H_kv, Sl) `real` counts of each block's
     * visible keys, vs[l] then the visible keys' sums; NULL for none */
    const void *counts[HKT_MAX_LEVELS];
    /* backward, float mask only, or NULL: (B, H, T, S) C-contiguous, every entry's score gradient (0 where the
     * entry is hidden), OVERWRITTEN */
    void *dmask;
    void *dq[HKT_MAX_LEVELS];
    void *dk[HKT_MAX_LEVELS];
    void *dvs[HKT_MAX_LEVELS];
    void *dw;
    void *workspace;                       /* hkt_window_workspace_bytes, 64-byte aligned */
    int num_threads;                       /* >= 1 */
} hkt_window_params;

/* Bytes of workspace a call needs (all threads together); SIZE_MAX if that
 * does not fit a size_t. */
size_t hkt_window_workspace_bytes(const hkt_window_params *p, int backward);
void hkt_window_forward_cpu(const hkt_window_params *p);
void hkt_window_backward_cpu(const hkt_window_params *p);

/*
 * Decoding with windows: the causal rows of n new positions t0 .. t0 + n - 1
 * against a cache that already holds their keys and their values' block sums
 * (docs/contract.md section 1.11).  Position t reads the keys level l sees,
 * j >= start_l = ((t >> l) - radius_l + 1) * 2^l (0 without a window); the
 * starts cut [0, t] into runs in which the same levels see every key, and a
 * run whose finest seeing level is m is read as level-m blocks: each block a
 * unit (its score, its count of keys, its values' sum), a piece of a block at
 * a run's edge summed from the largest complete aligned blocks it is made of.
 * Per row: O(W_0 + sum_l (W_l - W_{l-1}) / 2^l + t / 2^(L-1)) units, not t + 1
 * keys.
 *
 * Shapes (every array C-contiguous; cap_l >= 1, the cache's level-l rows,
 * level-l block c in row c % cap_l: a ring that holds what the rows read, or
 * every block):
 *   q[l]  (B, H, n, D)          row i the level-l query of position t0 + i's block
 *   k[l]  (B, H_kv, cap_l, D)   the cache's level-l keys
 *   vs[l] (B, H_kv, cap_l, Dv)  vs[0] the values, vs[l] each complete level-l block's sum
 *   w     (H, L)                out (B, H, n, Dv), OVERWRITTEN
 * Each row is one task's; results are bitwise the same for any thread count.
 */
typedef struct {
    int64_t B, H, H_kv, n, t0, D, Dv;
    int64_t cap[HKT_MAX_LEVELS];
    int L;
    int dtype;                             /* HKT_FLOAT32 or HKT_FLOAT64 */
    double scale;
    double softcap;                        /* 0: none; c > 0: each score s is c tanh(s / c) */
    int64_t radius[HKT_MAX_LEVELS];        /* W_l / 2^l; 0: no window */
    const void *q[HKT_MAX_LEVELS];
    const void *k[HKT_MAX_LEVELS];
    const void *vs[HKT_MAX_LEVELS];
    const void *w;
    void *out;
    void *workspace;                       /* hkt_window_decode_workspace_bytes, 64-byte aligned */
    int num_threads;                       /* >= 1 */
} hkt_window_decode_params;

size_t hkt_window_decode_workspace_bytes(const hkt_window_decode_params *p);
void hkt_window_decode_cpu(const hkt_window_decode_params *p);

#ifdef __cplusplus
}
#endif

#endif
