/*
 * HKT attention on the CPU: the type-free part.  hkt.h's CPU entry points, the
 * per-thread workspace layout (hkt_cpu.h), the plan of a call's host memory
 * (hkt_cpu_workspace_plan), the CPU's features and settings the kernels ask
 * after, and the dispatch by dtype to the float32 and float64 kernels, which
 * are one body (hkt_attention_body.h, hkt_backward_body.h) compiled per type
 * (hkt_cpu_f32.c, hkt_cpu_f64.c) and per instruction set (hkt_dispatch.c).
 */
#define _GNU_SOURCE /* pthread_getattr_np */
#include "hkt_cpu.h"
#include "hkt_dropout.h"

#include <pthread.h>
#include <stdint.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if HKT_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* HKT_CPU_KERNELS's names: a narrower set than the CPU's best, or that best */
static int cpu_kernels_known(const char *want) {
    return strcmp(want, "default") == 0 || strcmp(want, "avx2") == 0 || strcmp(want, "avx512f") == 0;
}

int hkt_cpu_has_bf16(void) {
    if (!hkt_isa()->forward_bf16) return 0;
#if HKT_ISA_BUILDS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

/* AMX-TILE and AMX-BF16 (cpuid leaf 7: edx bits 24 and 22), and the kernel's
 * leave to use the tile data: Linux hands it out per process on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, 5.16 on); a kernel
 * that refuses it, or predates it, means no AMX.  Asked once; torch's oneDNN
 * makes the same request for its own AMX kernels. */
int hkt_cpu_has_amx(void) {
#if HKT_AMX
    static volatile int known = -1;
    if (known < 0) {
        unsigned a, b, c, d;
        int has = hkt_cpu_has_bf16() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1);
        if (has) has = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        known = has;
    }
    return known;
#else
    return 0;
#endif
}

uint64_t hkt_amx_epoch = 1;

/* HKT_BF16's values; BF16_UNSET also for an empty or unknown one (the import
 * warns of those, hkt_settings_problem) */
enum { BF16_UNSET, BF16_NATIVE, BF16_AVX512BF16, BF16_UPCAST };

static int read_bf16_setting(void) {
    const char *want = getenv("HKT_BF16");
    if (!want) return BF16_UNSET;
    if (strcmp(want, "native") == 0) return BF16_NATIVE;
    if (strcmp(want, "avx512bf16") == 0) return BF16_AVX512BF16;
    if (strcmp(want, "upcast") == 0) return BF16_UPCAST;
    return BF16_UNSET;
}

/* HKT_BF16, read once as HKT_CPU_KERNELS is: every call of a process takes the
 * same bfloat16 path, and a call reads no environment (every thread that races
 * here stores the same value) */
static int bf16_setting(void) {
    static volatile int known = -1;
    int k = known;
    if (k < 0) known = k = read_bf16_setting();
    return k;
}

/* The native kernels take their products on AMX tiles where the CPU has them,
 * unless HKT_BF16=avx512bf16 asks for vdpbf16ps (for tests and comparisons). */
int hkt_cpu_bf16_amx(void) { return hkt_cpu_has_amx() && bf16_setting() != BF16_AVX512BF16; }

/* The native bfloat16 kernels' vector products are vdpbf16ps: two products per
 * lane where an FMA does one.  They pay where the core issues vdpbf16ps as fast
 * as an FMA, as AMD's do: there the native kernels beat float32.  Intel's cores
 * with AVX512_BF16 issue it at half that rate, and there the vdpbf16ps kernels
 * are slower than upcasting to float32 -- but those cores have AMX, whose
 * tiles take the products far faster, and with them the native kernels win
 * again.  So: native on AMD, and on Intel where AMX is there to use.  Chosen
 * by the CPU, not by a timing probe, so that a machine always takes the same
 * path and its results are the same bits run to run. */
int hkt_cpu_bf16_preferred(void) {
    if (!hkt_cpu_has_bf16()) return 0;
    const int setting = bf16_setting();
    if (setting == BF16_NATIVE || setting == BF16_AVX512BF16) return 1;
    if (setting == BF16_UPCAST) return 0;
#if HKT_ISA_BUILDS
    __builtin_cpu_init();
    return !__builtin_cpu_is("intel") || hkt_cpu_has_amx();
#else
    return 1;
#endif
}

/* The first 40 bytes of an environment value for a message, printable ASCII
 * only (others as '?'): the message becomes a Python str, decoded as UTF-8,
 * which arbitrary bytes, or a character cut in two, would fail. */
static const char *printable(const char *value, char out[41]) {
    int i = 0;
    for (; i < 40 && value[i]; i++) out[i] = value[i] >= 0x20 && value[i] < 0x7f ? value[i] : '?';
    out[i] = 0;
    return out;
}

int hkt_settings_problem(char *buf, size_t n) {
    const char *kernels = getenv("HKT_CPU_KERNELS"), *bf16 = getenv("HKT_BF16");
    char shown[41];
    if (kernels && *kernels && !cpu_kernels_known(kernels)) {
        snprintf(buf, n, "HKT_CPU_KERNELS=%s is not one of default, avx2, avx512f; running the '%s' kernels",
                 printable(kernels, shown), hkt_cpu_kernels());
        return 1;
    }
    if (kernels && *kernels && strcmp(kernels, "default") != 0 && strcmp(kernels, hkt_cpu_kernels()) != 0) {
        snprintf(buf, n, "HKT_CPU_KERNELS=%s: this CPU (or build) cannot run them; running the '%s' kernels",
                 printable(kernels, shown), hkt_cpu_kernels());
        return 1;
    }
    if (bf16 && *bf16 && strcmp(bf16, "native") != 0 && strcmp(bf16, "avx512bf16") != 0 &&
        strcmp(bf16, "upcast") != 0) {
        snprintf(buf, n, "HKT_BF16=%s is not one of native, avx512bf16, upcast; bfloat16 runs %s",
                 printable(bf16, shown), hkt_cpu_bf16_preferred() ? "natively" : "in float32");
        return 1;
    }
    return 0;
}

/* The least stack of an OpenMP worker thread (OMP_STACKSIZE sets it), read
 * off one worker: SIZE_MAX where there is none or it cannot be read. */
static size_t worker_stack_bytes(void) {
    size_t least = SIZE_MAX;
#ifdef _OPENMP
#pragma omp parallel num_threads(2)
    if (omp_get_thread_num() != 0) {
        size_t size = SIZE_MAX;
#if defined(__APPLE__) /* no pthread_getattr_np there; its own call */
        size = pthread_get_stacksize_np(pthread_self());
#else
        pthread_attr_t a;
        if (pthread_getattr_np(pthread_self(), &a) == 0) {
            if (pthread_attr_getstacksize(&a, &size) != 0) size = SIZE_MAX;
            pthread_attr_destroy(&a);
        }
#endif
#pragma omp critical(hkt_worker_stack)
        if (size < least) least = size;
    }
#endif
    return least;
}

size_t hkt_worker_stack(void) {
    /* OpenMP fixes the workers' stack size when it starts: asked once (a race
     * here only asks twice, and both get the same answer) */
    static volatile size_t known = 0;
    size_t k = known;
    if (k == 0) known = k = worker_stack_bytes();
    return k;
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

/* The backward's one-pass schedule (one task per (b, kv head), taken when
 * there are at least as many as threads) walks every query row of a head once
 * per key tile: with rows strided (the (B, T, H, D) heads a module splits off
 * its projections, 1 to 3 KiB apart) that streaming is a visible part of the
 * backward, spread over q, dO and dq.  Copied into the
 * thread's workspace once per head, they stream as the contiguous layout does:
 * the same products on the same values, so the same bits.  Within
 * HKT_PACK_BYTES over all threads; float32 and float64 (bfloat16 reads its rows
 * as pairs, hkt_bf16_body.h). */
static void pack_rows(const hkt_params *p, ws_layout *w, int64_t *at, size_t elem) {
    const int nt = num_threads(p);
    if (p->dtype == HKT_BFLOAT16 || p->B * p->H_kv < nt) return;
    int64_t rows = 0;
    int strided_q = 0, strided_dq = 0;
    for (int l = 0; l < p->L; l++) {
        const int64_t n = level_len(p->T, l);
        w->pack_off[l] = rows;
        rows += round16(n * p->D);
        strided_q |= n > 1 && p->q_stride[l][2] != p->D;
        strided_dq |= n > 1 && p->dq_stride[l][2] != p->D;
    }
    const int strided_do = p->T > 1 && p->dout_stride[2] != p->Dv;
    const int64_t n_do = round16(p->T * p->Dv);
    const int64_t reals = (strided_q ? rows : 0) + (strided_dq ? rows : 0) + (strided_do ? n_do : 0);
    if (reals == 0 || (size_t)reals > HKT_PACK_BYTES / elem / (size_t)nt) return;
    w->pack_q = strided_q;
    w->pack_dq = strided_dq;
    w->pack_do = strided_do;
    if (strided_q) { w->q_packed = *at;  *at += rows; }
    if (strided_dq) { w->dq_packed = *at; *at += rows; }
    if (strided_do) { w->do_packed = *at; *at += n_do; }
}

/* The forward reads a task's query rows once per key tile and a value row
 * once per query tile: strided (a module's heads), they are packed too -- the
 * query rows per task, the value rows into the key cache's companion (when the
 * keys are cached and both fit its budget).  Same products, same bits. */
static void pack_forward_rows(const hkt_params *p, ws_layout *w, int64_t *at, size_t keys_all, size_t cache_reals) {
    if (p->dtype == HKT_BFLOAT16) return;
    int64_t rows = 0;
    for (int l = 0; l < p->L; l++) {
        w->pack_off[l] = rows;
        rows += round16(rows_max(l) * p->D);
        w->pack_q_tile |= level_len(p->T, l) > 1 && p->q_stride[l][2] != p->D;
    }
    if (w->pack_q_tile) { w->q_tile = *at; *at += rows; }
    const int64_t values = round16(p->S * p->Dv);
    w->pack_v = w->keys_cached && p->S > 1 && p->v_stride[2] != p->Dv && keys_all + (size_t)values <= cache_reals;
    if (w->pack_v) { w->values_packed = *at; *at += values; }
}

ws_layout hkt_ws_layout(const hkt_params *p, int backward) {
    ws_layout w;
    int64_t levels = 0, key_tile = 0, keys_all = 0, at = 0;
    memset(&w, 0, sizeof w);
    /* bfloat16 keys are held as pairs along D: (D / 2, cols) 32-bit words, which
     * take the room of (D / 2, cols) float32 reals */
    const int bf16 = p->dtype == HKT_BFLOAT16;
    const int64_t key_rows = bf16 ? (p->D + 1) / 2 : p->D;
    w.key_t_rows = key_rows;
    for (int l = 0; l < p->L; l++) {
        w.gram_off[l] = levels;
        w.key_tile_off[l] = key_tile;
        w.keys_all_off[l] = keys_all;
        levels += rows_max(l) * cols_max(l);
        key_tile += key_rows * cols_max(l);
        /* one block per key tile (see ws_layout) */
        keys_all += (p->S + BK - 1) / BK * key_rows * cols_max(l);
    }
    levels = round16(levels);
    const int64_t value_pairs = bf16 ? round16((p->S + BK - 1) / BK * (BK / 2) * p->Dv) : 0;
    keys_all += value_pairs; /* the bfloat16 forward caches the values as pairs too */
    /* Caching a (b, kv head)'s transposed keys costs D * S * 4/3 reals per thread;
     * past this budget the forward transposes each key tile where it uses it. */
    const size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    const size_t budget = p->key_cache_bytes < 0 ? HKT_KEY_CACHE_BYTES : (size_t)p->key_cache_bytes;
    /* divided, not multiplied: keys_all * elem may not fit in a size_t for huge S */
    const size_t cache_reals = budget / elem / (size_t)num_threads(p); /* per thread */
    w.keys_cached = (size_t)keys_all <= cache_reals;
    w.scores = at;    at += BQ * BK;
    w.gram = at;      at += levels;
    w.folded = at;    at += levels;
    /* the backward holds BWD_KEY_TILES key tiles at once, the forward one */
    const int64_t slots = backward ? BWD_KEY_TILES : 1;
    w.key_tile_step = round16(key_tile);
    w.key_tile = at;  at += slots * w.key_tile_step;
    if (backward) {
        w.dscores = at;        at += BQ * BK;
        w.pdrop = at;          at += BQ * BK;
        if (p->softcap > 0) { w.capgrad = at; at += BQ * BK; }
        w.dscores_coarse = at; at += levels;
        w.values_t_step = round16(p->Dv * BK);
        w.values_t = at;       at += slots * w.values_t_step;
        w.dw_acc = at;         at += round16(slots * p->L);
        pack_rows(p, &w, &at, elem);
        for (int l = 0; l < p->L && !bf16; l++) w.pack_k |= level_len(p->S, l) > 1 && p->k_stride[l][2] != p->D;
        if (w.pack_k) { w.key_rows = at; at += slots * w.key_tile_step; }
        if (bf16) {
            /* words and bfloat16 pairs take the room of one float32 each */
            int64_t kp = 0, qs = 0;
            for (int l = 0; l < p->L; l++) {
                w.key_pairs_off[l] = kp;
                w.q_off[l] = qs;
                kp += (cols_max(l) + 1) / 2 * p->D;
                qs += (rows_max(l) + 1) / 2 * p->D;
            }
            w.key_pairs_step = round16(kp);
            w.key_pairs = at; at += slots * w.key_pairs_step;
            w.q_pairs = at;   at += round16(qs);
            w.do_pairs = at;  at += round16(BQ / 2 * p->Dv);
            w.p_pairs = at;   at += BQ / 2 * BK;
            w.ds_bf16 = at;   at += BQ / 2 * BK;
            w.ds_pairs = at;  at += BQ / 2 * BK;
            w.pairs_t = at;   at += BQ / 2 * BK;
        }
    } else {
        w.keys_all = at;   at += w.keys_cached ? round16(keys_all) : 0;
        w.keys_ready = at; at += round16((p->S + BK - 1) / BK);
        w.row_max = at;    at += BQ;
        w.row_sums = at;   at += BQ * 16; /* one 64-byte vector of partial sums per row */
        pack_forward_rows(p, &w, &at, (size_t)keys_all, cache_reals);
        if (bf16) {
            w.values_all = w.keys_all + keys_all - value_pairs;
            w.value_tile = at; at += round16(BK / 2 * p->Dv);
            w.p_bf16 = at;     at += BQ * BK / 2;
            if (p->bf16_out) { w.out_tile = at; at += round16(BQ * p->Dv); }
        }
    }
    w.total = at;
    w.amx = bf16 && hkt_cpu_bf16_amx();
    return w;
}

size_t hkt_workspace_bytes(const hkt_params *p, int backward) {
    size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    return (size_t)hkt_ws_layout(p, backward).total * elem + WS_HEADER + 64 /* round up */;
}

size_t hkt_dw_partial_bytes(const hkt_params *p) {
    /* delta (B, H, T), then dw partials (B, H, key tiles, L), then lse's
     * corrections (B, H, T) (refine_lse in hkt_backward_body.h) */
    size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    int64_t nkt = (p->S + BK - 1) / BK;
    return (size_t)(p->B * p->H * (2 * p->T + (nkt > 0 ? nkt : 1) * p->L)) * elem;
}

/* The float32 sums of dq, dk and dv in grad_acc, one after another, each
 * C-contiguous: dq[0..L), dk[0..L), dv.  Returns their floats (-1 on overflow);
 * with acc, points acc's dq, dk and dv there. */
static int64_t grad_acc_layout(const hkt_params *p, hkt_params *acc) {
    int64_t at = 0, n;
    for (int side = 0; side < 2; side++)
        for (int l = 0; l < p->L; l++) {
            const int64_t heads = side ? p->H_kv : p->H, rows = level_len(side ? p->S : p->T, l);
            if (__builtin_mul_overflow(rows, p->D, &n) || __builtin_mul_overflow(n, heads, &n) ||
                __builtin_mul_overflow(n, p->B, &n))
                return -1;
            if (acc) {
                void **ptr = side ? &acc->dk[l] : &acc->dq[l];
                int64_t *st = side ? acc->dk_stride[l] : acc->dq_stride[l];
                *ptr = (float *)p->grad_acc + at;
                st[0] = heads * rows * p->D;
                st[1] = rows * p->D;
                st[2] = p->D;
            }
            if (__builtin_add_overflow(at, n, &at)) return -1;
        }
    if (__builtin_mul_overflow(p->S, p->Dv, &n) || __builtin_mul_overflow(n, p->H_kv, &n) ||
        __builtin_mul_overflow(n, p->B, &n))
        return -1;
    if (acc) {
        acc->dv = (float *)p->grad_acc + at;
        acc->dv_stride[0] = p->H_kv * p->S * p->Dv;
        acc->dv_stride[1] = p->S * p->Dv;
        acc->dv_stride[2] = p->Dv;
    }
    return __builtin_add_overflow(at, n, &at) ? -1 : at;
}

size_t hkt_grad_acc_bytes(const hkt_params *p) {
    if (!(p->dtype == HKT_BFLOAT16 && p->bf16_out)) return 0;
    const int64_t n = grad_acc_layout(p, NULL);
    size_t bytes;
    if (n < 0 || __builtin_mul_overflow((size_t)n, sizeof(float), &bytes)) return SIZE_MAX;
    return bytes;
}

void hkt_grad_acc_params(const hkt_params *p, hkt_params *acc) {
    *acc = *p;
    grad_acc_layout(p, acc);
}

hkt_cpu_workspace hkt_cpu_workspace_plan(const hkt_params *p, int backward) {
    hkt_cpu_workspace w = {0};
    w.per_thread = hkt_workspace_bytes(p, backward);
    if (!backward && p->lse == NULL &&
        (__builtin_mul_overflow((size_t)p->B * (size_t)p->H, (size_t)p->T, &w.lse) ||
         __builtin_mul_overflow(w.lse, p->dtype == HKT_FLOAT64 ? 8u : 4u, &w.lse)))
        w.lse = SIZE_MAX;
    w.partial = backward ? (hkt_dw_partial_bytes(p) + 63) / 64 * 64 : 0;
    w.acc = backward ? hkt_grad_acc_bytes(p) : 0;
    size_t total;
    w.extra = w.total = SIZE_MAX;
    if (__builtin_add_overflow(w.partial, w.acc, &w.extra) || __builtin_add_overflow(w.extra, w.lse, &w.extra)) {
        w.extra = SIZE_MAX;
        return w;
    }
    if (!__builtin_mul_overflow(w.per_thread, (size_t)p->num_threads, &total) &&
        !__builtin_add_overflow(total, w.extra, &total) && !__builtin_add_overflow(total, 64, &total))
        w.total = total;
    return w;
}

void hkt_cpu_workspace_place(hkt_params *p, int backward, const hkt_cpu_workspace *plan, char *mem) {
    char *after = mem + plan->per_thread * (size_t)p->num_threads;
    p->workspace = mem;
    p->dw_partial = backward ? after : NULL;
    p->grad_acc = plan->acc ? after + plan->partial : NULL;
    if (plan->lse) p->lse = after;
}

/* A call this small (multiply-adds of standard attention's forward, or its
 * backward's) runs on one thread: waking a second costs more than it saves.
 * T=16, B=1, H=4, D=32 is 0.13 M; the ListOps size (T=128, H=8, D=64, one
 * sequence) 34 M.  The results are the same bits on any thread count. */
#define HKT_PARALLEL_MIN_FLOPS 4e6

static const hkt_params *threads_for(const hkt_params *p, int backward, hkt_params *one) {
    if (p->num_threads <= 1) return p;
    const double flops = (backward ? 5.0 : 2.0) * (double)p->B * (double)p->H * (double)p->T * (double)p->S *
                         (double)(p->D + p->Dv);
    if (flops >= HKT_PARALLEL_MIN_FLOPS) return p;
    *one = *p;
    one->num_threads = 1;
    /* the workspace was laid out for num_threads blocks, back to back (and
     * dw_partial after them): one thread may cache keys, or pack rows (its
     * backward takes the one-pass schedule), that more would not, and its one
     * block must fit in the room of all of them */
    return hkt_workspace_bytes(one, backward) <= hkt_workspace_bytes(p, backward) * (size_t)p->num_threads ? one
                                                                                                            : p;
}

void hkt_forward_cpu(const hkt_params *p) {
    hkt_params one;
    p = threads_for(p, 0, &one);
    if (p->dtype == HKT_BFLOAT16) __atomic_add_fetch(&hkt_amx_epoch, 1, __ATOMIC_RELAXED); /* hkt_cpu.h */
    if (p->dtype == HKT_BFLOAT16) hkt_isa()->forward_bf16(p); /* the binding checked hkt_cpu_has_bf16 */
    else hkt_kernels_of(p->dtype)->forward(p);
}

void hkt_backward_cpu(const hkt_params *p) {
    hkt_params one;
    p = threads_for(p, 1, &one);
    /* the float32 body runs the bfloat16 backward too (hkt_bf16_body.h's hooks) */
    if (p->dtype == HKT_BFLOAT16) __atomic_add_fetch(&hkt_amx_epoch, 1, __ATOMIC_RELAXED);
    hkt_kernels_of(p->dtype)->backward(p);
}
