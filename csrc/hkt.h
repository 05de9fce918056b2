/*
 * hkt.h -- Hierarchical Kernel Transformer attention kernels.
 *
 * Dimension letters: B batch, H heads, T queries, S keys, D query/key head dim,
 * Dv value head dim, L levels.  Level l holds Tl = ceil(T/2^l) queries and
 * Sl = ceil(S/2^l) keys:
 *
 *   q[l] (B, H, Tl, D)   k[l] (B, H_kv, Sl, D)   v (B, H_kv, S, Dv)   w (H, L) or (L,)
 *   score[i, j] = scale * sum_l w[l] * <q[l][i >> l], k[l][j >> l]>  (+ float mask)
 *   out = softmax(score over visible j) @ v       (B, H, T, Dv)
 *
 * Grouped-query attention: k and v may have H_kv heads, H a multiple of H_kv;
 * query head h reads kv head h / (H / H_kv), and dk, dv of a kv head are summed
 * over its H / H_kv query heads in a fixed order (no copies, no atomics).
 *
 * Every array is described by a pointer and element strides; the last (feature)
 * dimension must have stride 1.  The kernels never allocate: outputs and the
 * per-thread workspace (hkt_workspace_bytes) come from the caller.  They include
 * no Python header; the binding (csrc/binding/) is the only code that knows Python.
 *
 * Forward writes out and lse (log-sum-exp per query row, +inf for a row with no
 * visible key).  Backward OVERWRITES dq[l], dk[l], dv and dw (it does not
 * accumulate into what the caller passes), and dmask when it is not NULL.
 * The CPU backward recomputes P from lse, except in rows whose |lse| reaches
 * 2^12 (float32; 2^41 float64), where lse's rounding has eaten into log(sum)
 * (a padding row of finfo.min): it takes their max and sum from the scores
 * again first (dw_partial holds the corrections).
 *
 * Non-finite values.  An entry whose score is -inf (hidden by the bool mask or
 * causality, or by a -inf in the float mask) contributes nothing to anything:
 * its P and its dS are exactly 0, even in a row that holds NaN.  A visible score
 * that is NaN or +inf (from NaN/inf in q, k, w or the float mask) makes its
 * row's out and lse NaN, and the row's gradients NaN, as the softmax does in
 * plain arithmetic.  A row with no visible key gives out = 0 and lse = +inf.
 * A non-finite value that only hidden entries see (in a hidden key's k or v, in
 * q or dout of a row that sees nothing) may or may not reach other results: the
 * kernels multiply whole tiles, and 0 * NaN is NaN where a hidden entry shares a
 * tile with visible ones (CUDA's float32/float64 kernels skip such products,
 * its bfloat16 tensor-core kernels multiply whole tiles too; the plain
 * reference always makes them).
 *
 * The _cuda functions (built with HKT_WITH_CUDA, hkt_attention_cuda.cu) compute
 * the same thing with every pointer on CUDA device device_id, launched on the
 * CUDA stream `stream`; they ignore workspace and num_threads and allocate
 * nothing: the backward's device scratch comes in dw_partial
 * (hkt_cuda_scratch_bytes).
 */
#ifndef HKT_H
#define HKT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HKT_MAX_LEVELS 24
/* The CPU kernels' query and key tile (rows and columns of one score block). */
#define HKT_CPU_TILE 64

/* HKT_BFLOAT16 (the CPU, where hkt_cpu_has_bf16(); D even): q, k and v are
 * bfloat16, and in the backward dout and out too; every other real array -- w,
 * the float mask, lse, dw -- is float32, and so are the forward's out and the
 * backward's dq, dk and dv unless bf16_out says they are bfloat16.  The
 * backward needs Dv even as well. */
enum hkt_dtype { HKT_FLOAT32 = 0, HKT_FLOAT64 = 1, HKT_BFLOAT16 = 2 };
enum hkt_mask_kind { HKT_MASK_NONE = 0, HKT_MASK_BOOL = 1, HKT_MASK_FLOAT = 2 };

typedef struct {
    int64_t B, H, T, S, D, Dv;
    int64_t H_kv;              /* heads of k[l], v, dk[l], dv: H_kv >= 1 divides H (or both 0) */
    int L;
    int dtype;                 /* enum hkt_dtype, shared by every real array (but see HKT_BFLOAT16) */

    /* inputs: strides are (batch, head, row) in elements */
    const void *q[HKT_MAX_LEVELS];
    int64_t q_stride[HKT_MAX_LEVELS][3];
    const void *k[HKT_MAX_LEVELS];
    int64_t k_stride[HKT_MAX_LEVELS][3];
    const void *v;
    int64_t v_stride[3];
    const void *w;             /* w[h * w_stride[0] + l * w_stride[1]] */
    int64_t w_stride[2];
    int w_per_head;            /* 0: w has shape (L,), dw is summed over heads */

    /* mask (B, H, T, S) with any strides (0 broadcasts); bool masks are bytes */
    int mask_kind;             /* enum hkt_mask_kind */
    const void *mask;
    int64_t mask_stride[4];

    int causal;                /* key j visible to query i only if j <= i */
    /* > 0: the sliding-window band of width W = sliding_window: key j visible
     * to query i only if i - j < W (and, without causal, j - i < W), on top
     * of causal and the masks, for the combined score of every level.  i and
     * j are level-0 positions both counted from 0, as causal counts them when
     * T != S.  Key tiles outside the band are skipped, so the work grows as
     * T * W.  0: no band.  At most 2^60 (the binding's count limit). */
    int64_t sliding_window;
    double scale;
    double dropout_p;          /* 0 disables dropout */
    uint64_t seed;
    /* > 0: each combined score s becomes softcap * tanh(s / softcap) before the
     * mask is applied (docs/contract.md section 1.12); 0: no cap */
    double softcap;

    /* HKT_BFLOAT16 on the CPU only: 1 when the forward's out, or the
     * backward's dq, dk and dv, are bfloat16.  The kernels still sum in
     * float32 (the forward a query tile's rows in its workspace, the backward
     * every gradient in grad_acc) and round each finished row once, to nearest
     * even on the bits as torch's vectorised conversion does (subnormals kept,
     * a NaN as 0xFFFF): the same bits as float32 outputs rounded afterwards,
     * without that pass over memory. */
    int bf16_out;
    /* the backward with bf16_out: hkt_grad_acc_bytes of host memory, float32
     * sums of dq, dk and dv, from the caller */
    void *grad_acc;

    /* forward outputs / backward inputs */
    void *out;
    int64_t out_stride[3];
    void *lse;                 /* (B, H, T) contiguous */

    /* backward only */
    const void *dout;
    int64_t dout_stride[3];
    void *dq[HKT_MAX_LEVELS];
    int64_t dq_stride[HKT_MAX_LEVELS][3];
    void *dk[HKT_MAX_LEVELS];
    int64_t dk_stride[HKT_MAX_LEVELS][3];
    void *dv;
    int64_t dv_stride[3];
    void *dw;                  /* (H, L) or (L,), contiguous, like w */
    /* Float masks only, or NULL: the mask's gradient dS (the score's gradient,
     * before the scale), summed over every dimension d whose dmask_shape[d] is 1
     * while the full size (B, H, T, S)[d] is larger; C-contiguous, of shape
     * dmask_shape, each entry either 1 or the full size. */
    void *dmask;
    int64_t dmask_shape[4];
    /* workspace: delta and dw partials.  CPU: hkt_dw_partial_bytes of host
     * memory.  CUDA: hkt_cuda_scratch_bytes of device memory on device_id,
     * aligned to the real type (the caller allocates it, e.g. from torch's
     * caching allocator; the CUDA entry points never allocate). */
    void *dw_partial;

    /* workspace: num_threads blocks of hkt_workspace_bytes(p, backward) */
    void *workspace;
    int num_threads;
    /* forward: largest total bytes of per-thread transposed-key caches
     * (negative: the default, 64 MiB); past it keys are transposed per tile */
    int64_t key_cache_bytes;

    int device_id;             /* CUDA only: the device every array is on */
    /* CUDA only: the cudaStream_t every kernel is launched on (NULL: the legacy
     * default stream).  The entry points return once the kernels are queued,
     * without waiting for them. */
    void *stream;
} hkt_params;

/* Bytes of per-thread workspace the forward (backward = 0) or backward needs. */
size_t hkt_workspace_bytes(const hkt_params *p, int backward);
/* Bytes of dw_partial the backward needs: 2*B*H*T + B*H*ceil(S/64)*L reals. */
size_t hkt_dw_partial_bytes(const hkt_params *p);
/* Bytes of grad_acc the backward needs: float32 dq, dk and dv of every level
 * where bf16_out is set (B*(H*sum_l Tl + H_kv*sum_l Sl)*D + B*H_kv*S*Dv
 * floats), else 0; SIZE_MAX when that does not fit in a size_t. */
size_t hkt_grad_acc_bytes(const hkt_params *p);
/* A CPU call's host memory as one block (hkt_cpu_workspace_plan, in bytes):
 * num_threads workspace blocks of per_thread; then the backward's delta and
 * dw partials (partial, hkt_dw_partial_bytes rounded up to 64) and, with
 * bf16_out, the float32 sums of its gradients (acc, hkt_grad_acc_bytes); then,
 * for a forward whose lse is NULL, the (B, H, T) lse it writes (lse).  extra
 * is partial + acc + lse; total all of it with 64 bytes to spare, SIZE_MAX
 * when that does not fit in a size_t. */
typedef struct {
    size_t per_thread, partial, acc, lse, extra, total;
} hkt_cpu_workspace;
hkt_cpu_workspace hkt_cpu_workspace_plan(const hkt_params *p, int backward);
/* Points p's workspace, dw_partial, grad_acc and (where planned) lse into mem,
 * a block of plan->total bytes. */
void hkt_cpu_workspace_place(hkt_params *p, int backward, const hkt_cpu_workspace *plan, char *mem);
/* Bytes of device scratch (dw_partial) the CUDA backward needs (SIZE_MAX when
 * that does not fit in size_t): B*H*T reals (delta) then B*H*ceil(T/G)*L reals (dw
 * partials, G = 2^(L-1) query rows per dq task); a real is itemsize bytes (4
 * for float32, 8 for float64).  Defined for every build: callers size the
 * buffer before they know whether CUDA is there. */
static inline size_t hkt_cuda_scratch_bytes(int64_t B, int64_t H, int64_t T, int L, size_t itemsize) {
    if (B < 0 || H < 0 || T < 0 || L < 1 || L > HKT_MAX_LEVELS) return SIZE_MAX;
    const uint64_t G = (uint64_t)1 << (L - 1), nqb = ((uint64_t)T + G - 1) / G;
    uint64_t bh, ndelta, npart, total;
    if (__builtin_mul_overflow((uint64_t)B, (uint64_t)H, &bh) || __builtin_mul_overflow(bh, (uint64_t)T, &ndelta) ||
        __builtin_mul_overflow(bh, nqb, &npart) || __builtin_mul_overflow(npart, (uint64_t)L, &npart) ||
        __builtin_add_overflow(ndelta, npart, &total) || __builtin_mul_overflow(total, (uint64_t)itemsize, &total) ||
        total > (uint64_t)SIZE_MAX)
        return SIZE_MAX;
    return (size_t)total;
}

/* The CUDA tensor-core kernels (hkt_attention_cuda.cu), the only CUDA kernels
 * that take HKT_BFLOAT16: bfloat16 q, k and v (w, a float mask, out and lse
 * float32, as on the CPU), multiplied on tensor cores (sm_80 and later) with
 * float32 accumulation.  It has limits the float32/float64 kernels do not:
 * hkt_cuda_tc_refusal names the first one p breaks (NULL: p is fine); the
 * backward (hkt_cuda_tc_backward_refusal) has narrower ones. */
#define HKT_TC_DMAX 128     /* D a multiple of 16, Dv a multiple of 8, both at most this */
#define HKT_TC_LMAX 4       /* levels */
#define HKT_TC_BWD_DMAX 64  /* the backward: D and Dv multiples of 16, at most this */
#define HKT_STR_(x) #x
#define HKT_STR(x) HKT_STR_(x) /* a macro's value as a string, so a message cannot drift from it */
static inline const char *hkt_cuda_tc_refusal(const hkt_params *p) {
    if (p->D % 16 || p->D > HKT_TC_DMAX)
        return "q[0]: the CUDA bfloat16 forward needs D a multiple of 16 up to " HKT_STR(HKT_TC_DMAX);
    if (p->Dv % 8 || p->Dv > HKT_TC_DMAX)
        return "v: the CUDA bfloat16 forward needs Dv a multiple of 8 up to " HKT_STR(HKT_TC_DMAX);
    if (p->L > HKT_TC_LMAX) return "q: the CUDA bfloat16 forward takes at most " HKT_STR(HKT_TC_LMAX) " levels";
    if (p->dropout_p > 0) return "dropout_p: the CUDA bfloat16 forward has no dropout";
    return NULL;
}
/* The same for the backward (tensor cores too): the forward's limits, D and
 * Dv multiples of 16 up to HKT_TC_BWD_DMAX, and no float mask gradient (dmask). */
static inline const char *hkt_cuda_tc_backward_refusal(const hkt_params *p) {
    const char *why = hkt_cuda_tc_refusal(p);
    if (why) return why;
    if (p->D > HKT_TC_BWD_DMAX)
        return "q[0]: the CUDA bfloat16 backward needs D a multiple of 16 up to " HKT_STR(HKT_TC_BWD_DMAX);
    if (p->Dv % 16 || p->Dv > HKT_TC_BWD_DMAX)
        return "v: the CUDA bfloat16 backward needs Dv a multiple of 16 up to " HKT_STR(HKT_TC_BWD_DMAX);
    if (p->dmask) return "dmask: the CUDA bfloat16 backward has no float mask gradient";
    return NULL;
}

/* Threads OpenMP would use by default (1 without OpenMP). */
int hkt_default_threads(void);
/* The stack an OpenMP worker thread gets, in bytes (SIZE_MAX without OpenMP
 * or where it cannot be read); runs a parallel region of two threads the first
 * time.  The kernels' deepest frames (the backward's) take about 22 KiB (the
 * packed backward's 30, measured by painting the stack), so
 * workers with less than HKT_MIN_WORKER_STACK must not run them: a small
 * OMP_STACKSIZE would crash the process. */
size_t hkt_worker_stack(void);
#define HKT_MIN_WORKER_STACK ((size_t)64 << 10)
/* Which instruction-set build of the CPU kernels runs: "avx512f", "avx2" or
 * "default" (hkt_cpu.h, hkt_isa). */
const char *hkt_cpu_kernels(void);
/* 1 when this build and this CPU run the bfloat16 forward natively (dtype
 * HKT_BFLOAT16: AVX512_BF16 dot products, float32 accumulation). */
int hkt_cpu_has_bf16(void);
/* 1 when the native bfloat16 kernels can take their products on AMX tiles:
 * the CPU has AMX-BF16 and the OS lets this process use it. */
int hkt_cpu_has_amx(void);
/* 1 when they do: hkt_cpu_has_amx() unless HKT_BF16=avx512bf16. */
int hkt_cpu_bf16_amx(void);
/* 1 when bfloat16 should take those native kernels rather than be upcast to
 * float32: hkt_cpu_has_bf16() and a core that runs vdpbf16ps at the float32
 * FMA's rate (AMD's, not Intel's) or has AMX; the environment variable
 * HKT_BF16=native, avx512bf16 or upcast overrides (native only where
 * hkt_cpu_has_bf16()).  HKT_BF16 is read once, at the first of these calls,
 * as HKT_CPU_KERNELS is: a process keeps the path it started with. */
int hkt_cpu_bf16_preferred(void);
/* What is wrong with the settings above, for a warning: an HKT_CPU_KERNELS or
 * HKT_BF16 value that is not one of their names (a misspelling would
 * otherwise run other kernels unnoticed), or a kernel set this CPU cannot
 * run; written into buf (n bytes), or 0 when nothing is. */
int hkt_settings_problem(char *buf, size_t n);

void hkt_forward_cpu(const hkt_params *p);
void hkt_backward_cpu(const hkt_params *p);

/* Fills keep (B, H, T, S) bytes with the kernels' dropout decision (1 = kept;
 * hkt_dropout.h), for tests. */
void hkt_dropout_mask_cpu(unsigned char *keep, uint64_t seed, double p,
                          int64_t B, int64_t H, int64_t T, int64_t S);

#ifdef HKT_WITH_CUDA
/* Same contract as the _cpu pair, on device pointers, asynchronous: the kernels
 * are queued on p->stream, in stream order after whatever the caller queued
 * there before, and the call returns without waiting for them (nothing
 * synchronizes the device, so they can be captured into a CUDA graph).  Return
 * 0, or -1 with a message in err when a launch failed (a launch error, or an
 * earlier asynchronous error the runtime reports then). */
int hkt_forward_cuda(const hkt_params *p, char *err, size_t errlen);
int hkt_backward_cuda(const hkt_params *p, char *err, size_t errlen);
#endif

/* ---- Packed variable-length batches (hkt_varlen.c, CPU) ----
 *
 * nseq sequences packed along one row axis, as flash_attn_varlen_func packs
 * them: sequence s owns query rows [cu_q[s], cu_q[s+1]) and key rows
 * [cu_k[s], cu_k[s+1]) of level 0; T_s and S_s are those lengths.  Level l packs
 * each sequence's ceil(T_s / 2^l) (ceil(S_s / 2^l)) level-l rows one after
 * another, so its row offsets are the cumulative sums of those counts
 * (hkt_varlen_level_rows gives the totals).  Every level is built per sequence
 * (blocks start at the sequence's own start): sequence s is computed exactly as
 * the (1, H, T_s, D) problem alone, bitwise, and nothing crosses a boundary.
 *
 * vp->p describes the packed arrays (B, T, S, mask_kind, dropout_p, dmask and
 * dw_partial are ignored; no mask, no dropout):
 *   q[l] (Tl_total, H, D), k[l] (Sl_total, H_kv, D), v (S_total, H_kv, Dv),
 *   out and dout (T_total, H, Dv), dq[l] / dk[l] / dv like q[l] / k[l] / v:
 *   pointers at packed row 0, strides {unused, head, row};
 *   w, dw as for hkt_params; dw is summed over sequences in index order, so it
 *   is bitwise the same for any num_threads, like every other result;
 *   lse: H * T_total reals, sequence s's (H, T_s) block contiguous at H * cu_q[s];
 *   workspace: hkt_varlen_workspace_bytes(vp, backward) bytes from the caller.
 * Causal masking is per sequence (key j visible to query i when j <= i, both
 * counted from the sequence's start).  No sliding-window band: the binding
 * refuses sliding_window for packed calls, and p.sliding_window must be 0. */
typedef struct {
    hkt_params p;
    int64_t nseq;
    const int64_t *cu_q, *cu_k; /* nseq + 1 level-0 offsets each, 0 = cu[0] <= cu[1] <= ... */
} hkt_varlen_params;

/* Rows of level l over all sequences: sum over s of ceil((cu[s+1] - cu[s]) / 2^l). */
int64_t hkt_varlen_level_rows(const int64_t *cu, int64_t nseq, int l);
size_t hkt_varlen_workspace_bytes(const hkt_varlen_params *vp, int backward);
void hkt_forward_varlen_cpu(const hkt_varlen_params *vp);
void hkt_backward_varlen_cpu(const hkt_varlen_params *vp);

/* ---- decoding with a KV cache (hkt_decode.c): forward only, CPU ----
 *
 * Tn new positions per batch row b, t_i = seqlens[b] + i, against caches of
 * S_max positions (the caller checks seqlens[b] >= 0 and seqlens[b] + Tn <=
 * S_max, and that k_cache[l] has ceil(S_max / 2^l) rows or more):
 *
 *   q[l] (B, H, Tn, D)        the level-l query of position t_i (its block's)
 *   k_cache[l] (B, H_kv, >= ceil(S_max/2^l), D)    v_cache (B, H_kv, S_max, Dv)
 *   score[i, j] = scale * sum_l w[l] * <q[l][i], k_cache[l][j >> l]>,  j <= t_i
 *   out[i] = softmax(score[i, 0..t_i]) @ v_cache[0..t_i]       (B, H, Tn, Dv)
 *   (with sliding_window W > 0: over j in max(0, t_i - W + 1) .. t_i only)
 *
 * Query head h reads kv head h / (H / H_kv).  With v_new not NULL, first
 * k_new[l] (B, H_kv, Tn, D) and v_new (B, H_kv, Tn, Dv) are written into the
 * caches, row i at slot t_i >> l of level l (t_i of v_cache), i in order, so
 * the last new position of a coarse block wins; nothing else is written but out.
 * No key after t_i is read, so cache slots past seqlens[b] + Tn may hold
 * anything.  Non-finite values as in hkt_forward_cpu: a NaN or +inf score makes
 * its row NaN, NaN in v reaches the rows that see it, a row whose every score is
 * -inf gives zeros.  Bitwise the same for any num_threads. */
typedef struct {
    int64_t B, H, H_kv, Tn, D, Dv;
    int L;
    int dtype;                 /* enum hkt_dtype */
    /* strides (batch, head, row) in elements; the last dimension has stride 1 */
    const void *q[HKT_MAX_LEVELS];
    int64_t q_stride[HKT_MAX_LEVELS][3];
    void *k_cache[HKT_MAX_LEVELS];
    int64_t k_cache_stride[HKT_MAX_LEVELS][3];
    void *v_cache;
    int64_t v_cache_stride[3];
    const void *k_new[HKT_MAX_LEVELS]; /* with v_new: appended first; else unused */
    int64_t k_new_stride[HKT_MAX_LEVELS][3];
    const void *v_new;         /* NULL: nothing appended */
    int64_t v_new_stride[3];
    const void *w;             /* w[h * w_stride[0] + l * w_stride[1]]; w_stride[0] = 0 for (L,) */
    int64_t w_stride[2];
    const int64_t *seqlens;    /* B entries: positions in the cache before this call */
    double scale;
    double softcap;            /* > 0: scores capped as in hkt_params; 0: no cap */
    /* > 0: row i reads only keys t_i - W + 1 .. t_i (W = sliding_window, the
     * band of hkt_params); 0: every key 0 .. t_i */
    int64_t sliding_window;
    void *out;
    int64_t out_stride[3];
    void *workspace;           /* hkt_decode_workspace_bytes(p) bytes, any alignment */
    int num_threads;
} hkt_decode_params;

size_t hkt_decode_workspace_bytes(const hkt_decode_params *p);
void hkt_decode_cpu(const hkt_decode_params *p);

/* ---- causal downsampling (hkt_downsample.c): CPU, float32 / float64 ----
 *
 * The trainable depthwise downsampling that makes each coarse level's inputs
 * (hkt.modules.causal_downsample), stride 2, K taps per channel:
 *
 *   out[b, p, c] = sum_{r < K} taps[r, c] * x[b, 2p - r, c]   (x = 0 before row 0)
 *
 * x (B, n, C), out (B, m, C) with m = ceil(n / 2), taps (K, C).  The forward
 * sums r = 0, 1, ... in order, each product rounded, then added, a zero x
 * before row 0 multiplied like any other: the same bits as that torch
 * expression.  The backward OVERWRITES grad_x (B, n, C) (unless it is NULL) and
 * grad_taps (K, C) from grad (B, m, C), summing grad_taps over row chunks fixed
 * by the sizes (within 64 rows in the real type, across them in double, then
 * the chunks in order), so that it is bitwise the same for any num_threads.
 * NaN and inf propagate as in the expression (a NaN tap makes every output of
 * its channel NaN, the padding's zeros included). */
typedef struct {
    int64_t B, n, C, K;
    int dtype;                 /* HKT_FLOAT32 or HKT_FLOAT64, every array */
    const void *x;             /* x[b * x_stride[0] + i * x_stride[1] + c] */
    int64_t x_stride[2];
    const void *taps;          /* taps[r * taps_stride + c] */
    int64_t taps_stride;
    const void *grad;          /* backward: d out, grad[b * grad_stride[0] + p * grad_stride[1] + c] */
    int64_t grad_stride[2];
    void *out;                 /* forward: out (B, m, C); backward: grad_x (B, n, C) or NULL (not
                                * wanted); C-contiguous */
    void *grad_taps;           /* backward: (K, C), C-contiguous */
    void *workspace;           /* backward: hkt_downsample_workspace_bytes(p) bytes, 8-byte aligned */
    int num_threads;
} hkt_downsample_params;

size_t hkt_downsample_workspace_bytes(const hkt_downsample_params *p);
void hkt_downsample_forward_cpu(const hkt_downsample_params *p);
void hkt_downsample_backward_cpu(const hkt_downsample_params *p);

#ifdef __cplusplus
}
#endif

#endif
