/*
 * hkt_cpu.h -- what the CPU kernel files share (private to csrc/cpu/, not installed).
 *
 * The CPU kernels are bodies written once for a type `real`
 * (hkt_products_body.h, hkt_attention_body.h, hkt_backward_body.h, hkt_decode_body.h, with
 * hkt_real.h's helpers; hkt_bf16_body.h for bfloat16 in float32's; the
 * windowed kernels' hkt_window_body.h) and compiled once per real type:
 * hkt_cpu_f32.c and hkt_cpu_f64.c (hkt_window_f32.c and hkt_window_f64.c)
 * each define `real` and include them, so their static functions have plain
 * names in each translation unit.  hkt_attention.c, hkt_decode.c and
 * hkt_window.c hold the type-free parts: the workspace layouts, hkt.h's and
 * hkt_window.h's entry points and the dispatch by dtype (hkt_kernels_of).
 */
#ifndef HKT_CPU_H
#define HKT_CPU_H

#include "hkt.h"
#include "hkt_window.h"

#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Tile sizes: powers of two, so a tile always holds whole 2^l blocks of every
 * level with 2^l <= 64 and lies inside one block of any coarser level. */
#define BQ HKT_CPU_TILE
#define BK HKT_CPU_TILE
/* Default cap on the forward's per-thread transposed-key caches, all threads together. */
#define HKT_KEY_CACHE_BYTES ((size_t)64 << 20)
/* Cap on the backward's per-thread packed copies of strided query-side rows
 * (ws_layout.pack_q and the like), all threads together. */
#define HKT_PACK_BYTES ((size_t)64 << 20)
/* Key tiles the backward holds at once (ws_layout's key slots): each query
 * tile's rows, read from beyond the L2 cache, serve that many key tiles before
 * the next is read.  At T=4096, L=3, one key tile per pass over a head's
 * query side (4.6 MB of q, dO and dq rows) ran the backward below its rate at
 * T=2048; two halve that traffic; four crowd the packed rows of a module's
 * heads (B=8 H=4 T=1024) out of L2. */
#define BWD_KEY_TILES 2
/* Bytes at the head of each thread's workspace block, before the reals: per-thread state. */
#define WS_HEADER 64

/* The kernels are built once per instruction set, each with vectors as wide
 * as its registers (HKT_VEC_BYTES), and hkt_dispatch.c picks one set when
 * first called (hkt_isa).  The per-type files (hkt_cpu_f32.c, hkt_cpu_f64.c,
 * hkt_window_f32.c, hkt_window_f64.c) are the portable build; their *_avx2.c
 * and *_avx512.c builds define HKT_ISA_AVX2 or HKT_ISA_AVX512 and include them
 * through hkt_isa.h, which turns the instruction set on.  (GCC's target_clones, used before, builds one
 * source per ISA but with one vector type: 64-byte vectors in the AVX2 clone
 * have no register mode and run far slower.)  HKT_ISA_BUILDS is 0 off x86-64
 * and for compilers other than GCC and clang (whose target pragma and
 * attribute hkt_isa.h uses); the portable build then serves alone. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(HKT_NO_ISA_BUILDS)
#define HKT_ISA_BUILDS 1
#else
#define HKT_ISA_BUILDS 0
#endif
#if HKT_ISA_BUILDS && defined(HKT_ISA_AVX512)
#define HKT_ISA avx512
#define HKT_VEC_BYTES 64
#elif HKT_ISA_BUILDS && defined(HKT_ISA_AVX2)
#define HKT_ISA avx2
#define HKT_VEC_BYTES 32
#else
/* the portable build: 16-byte vectors, which every 64-bit target has in
 * registers (SSE2 on x86-64, NEON/ASIMD on AArch64); the compiler splits wider
 * generic vectors into pieces kept in memory (BLKmode), far slower than these */
#define HKT_ISA generic
#define HKT_VEC_BYTES 16
#endif
#define HKT_CAT2(a, b) a##_##b
#define HKT_CAT(a, b) HKT_CAT2(a, b)
#define HKT_ISA_NAME(x) HKT_CAT(x, HKT_ISA) /* x_generic, x_avx2, x_avx512 */

/* The native bfloat16 kernels (hkt_bf16_body.h) need the AVX512_BF16 (and
 * AMX) intrinsics and target attributes of GCC 11 or clang (14, the oldest
 * that has built them), and are built into the AVX-512 set only; elsewhere
 * bfloat16 is upcast by the caller. */
#if defined(__clang__)
#define HKT_BF16_COMPILER (__clang_major__ >= 14)
#else
#define HKT_BF16_COMPILER (__GNUC__ >= 11)
#endif
#if HKT_ISA_BUILDS && HKT_BF16_COMPILER && !defined(HKT_NO_BF16)
#define HKT_BF16_NATIVE 1
#else
#define HKT_BF16_NATIVE 0
#endif
/* Their products on AMX tiles (TDPBF16PS) where the CPU has AMX-BF16: needs
 * Linux's per-process permission for the tile data (arch_prctl, 5.16 on). */
#if HKT_BF16_NATIVE && defined(__linux__)
#define HKT_AMX 1
#else
#define HKT_AMX 0
#endif
/* this translation unit builds them: the AVX-512 set's float32 file */
#if HKT_BF16_NATIVE && defined(HKT_ISA_AVX512)
#define HKT_BF16_HERE 1
#else
#define HKT_BF16_HERE 0
#endif

/* One thread's workspace (after WS_HEADER): offsets, in reals, of its regions.
 * Sizes: a tile is BQ x BK; "levels" regions hold one block per level (level l:
 * rows_max(l) x cols_max(l), at *_off[l]). */
typedef struct {
    int64_t scores;         /* BQ x BK: the tile's scores, then P */
    int64_t gram;           /* levels: q[l] k[l]^T of the tile's blocks (the backward's dw needs them) */
    int64_t folded;         /* levels: scale w_l G_l + up2(folded of level l + 1) */
    int64_t key_tile;       /* levels: the tile's keys transposed, (D, cols) per level */
    /* backward only */
    int64_t dscores;        /* BQ x BK: dP, then dS */
    int64_t pdrop;          /* BQ x BK: P after dropout */
    int64_t capgrad;        /* BQ x BK, with a soft cap (else 0): the cap's derivative at each score */
    int64_t dscores_coarse; /* levels: dS summed over 2^l x 2^l blocks */
    int64_t values_t;       /* (Dv, BK): the tile's values transposed */
    int64_t dw_acc;         /* BWD_KEY_TILES x L: dw of the key tiles held */
    int64_t key_rows;       /* levels: the tile's key rows, (cols, D) each at key_tile_off[l], if pack_k */
    int64_t q_packed;       /* levels: one query head's q[l] rows, (ceil(T / 2^l), D) each, at pack_off[l] */
    int64_t dq_packed;      /* levels: its dq[l] rows, the same shapes */
    int64_t do_packed;      /* (T, Dv): its dO rows */
    /* forward only */
    int64_t keys_all;       /* levels: one (b, kv head)'s keys transposed, key tile by key tile: (D,
                             * cols_max(l)) blocks of level l, in tile order from keys_all_off[l] */
    int64_t keys_ready;     /* one flag per key tile: already in keys_all */
    int64_t row_max;        /* BQ: running max per query row */
    int64_t row_sums;       /* BQ x one 64-byte vector: running lane sums per row */
    int64_t q_tile;         /* levels: the task's query rows, (rows, D) each at pack_off[l], if pack_q_tile */
    int64_t values_packed;  /* (S, Dv): the cached (b, kv head)'s value rows, if pack_v */
    /* bfloat16 forward only (keys_all and key_tile then hold bfloat16 pairs) */
    int64_t values_all;     /* one (b, kv head)'s values as row pairs, (ceil(S / 2), Dv) 32-bit words */
    int64_t value_tile;     /* (BK / 2, Dv) words: one tile's values as row pairs */
    int64_t p_bf16;         /* BQ x BK bfloat16: the tile's P, rounded */
    int64_t out_tile;       /* (BQ, Dv), with bf16_out: the task's out rows, summed in float32 */
    /* bfloat16 backward only (key_tile and values_t then hold pairs) */
    int64_t key_pairs;      /* levels: the tile's keys as row pairs, (ceil(cols / 2), D) words each */
    int64_t q_pairs;        /* levels: the pair's query rows as row pairs, (ceil(rows / 2), D) words each */
    int64_t do_pairs;       /* (BQ / 2, Dv) words: the pair's dO rows as row pairs */
    int64_t p_pairs;        /* (BQ / 2, BK) words: P as row pairs */
    int64_t ds_bf16;        /* (BQ, BK) bfloat16: one level's scaled dS rounded */
    int64_t ds_pairs;       /* (BQ / 2, BK) words: the same as row pairs */
    int64_t pairs_t;        /* (BK, BQ / 2) words: P or dS as row pairs, transposed (AMX's A for dv, dk) */
    int64_t key_pairs_off[HKT_MAX_LEVELS], q_off[HKT_MAX_LEVELS]; /* per level, in words */
    /* backward: key_tile, values_t, key_rows and key_pairs each hold
     * BWD_KEY_TILES tiles, this far apart (key_slot in the kernels' body);
     * key_rows, the same keys untransposed, steps as key_tile does */
    int64_t key_tile_step, values_t_step, key_pairs_step;
    int64_t key_t_rows;     /* rows of a transposed key block: D, or bfloat16's (D + 1) / 2 pairs */
    int64_t pack_off[HKT_MAX_LEVELS]; /* per level: offsets in q_packed and dq_packed (backward), q_tile (forward) */
    int64_t total;
    int64_t gram_off[HKT_MAX_LEVELS], key_tile_off[HKT_MAX_LEVELS], keys_all_off[HKT_MAX_LEVELS];
    int keys_cached;        /* forward: keys_all is used (it fits the key_cache_bytes budget) */
    /* backward, one task per (b, kv head): the query side's rows of each query
     * head are copied into q_packed / do_packed (and dq accumulated in
     * dq_packed, then copied out) where the arrays are strided */
    int pack_q, pack_dq, pack_do;
    int pack_k;             /* backward: the key tile's rows are strided (copied into key_rows) */
    int pack_q_tile;        /* forward: a task's strided query rows are copied into q_tile */
    int pack_v;             /* forward: strided value rows cached with the keys (values_packed) */
    int amx;                /* bfloat16: products on AMX tiles (hkt_cpu_bf16_amx) */
} ws_layout;

ws_layout hkt_ws_layout(const hkt_params *p, int backward);
/* The backward with bf16_out: acc = p with dq, dk and dv pointed at their
 * float32 sums in p->grad_acc (hkt_grad_acc_bytes), C-contiguous. */
void hkt_grad_acc_params(const hkt_params *p, hkt_params *acc);

static inline int64_t rows_max(int l) { return (BQ >> l) > 0 ? (BQ >> l) : 1; }
static inline int64_t cols_max(int l) { return (BK >> l) > 0 ? (BK >> l) : 1; }
static inline int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }
/* n bytes rounded up to a 64-byte multiple; SIZE_MAX when that overflows */
static inline size_t round64(size_t n) { return n > SIZE_MAX - 63 ? SIZE_MAX : (n + 63) & ~(size_t)63; }
/* Rows of level l of an n-row sequence: ceil(n / 2^l). */
static inline int64_t level_len(int64_t n, int l) { return n > 0 ? ((n - 1) >> l) + 1 : 0; }

static inline int num_threads(const hkt_params *p) { return p->num_threads > 0 ? p->num_threads : 1; }

static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* for (int64_t t = 0; t < n; t++) body, on nt threads with OpenMP's schedule
 * sched (parenthesised: (dynamic, 1)), or as a plain loop when nt is 1: a
 * team of one, even behind if(0), still costs libgomp a futex syscall at its
 * end, one per call of the small calls that run on one thread (seen with
 * strace; about half a microsecond).  The body gets tid, the thread's index
 * in this loop's team (0 in the plain loop, even where the caller itself runs
 * in an OpenMP team, as the packed calls' tasks do): what picks its workspace
 * block.  The tasks are the same either way. */
#define HKT_PRAGMA(x) _Pragma(#x)
#define PARALLEL_TASKS(nt, sched, n, t, tid, ...)                                                 \
    do {                                                                                          \
        if ((nt) > 1) {                                                                           \
            HKT_PRAGMA(omp parallel for schedule sched num_threads(nt))                           \
            for (int64_t t = 0; t < (n); t++) {                                                   \
                const int tid = thread_id();                                                      \
                (void)tid;                                                                        \
                __VA_ARGS__                                                                       \
            }                                                                                     \
        } else {                                                                                  \
            for (int64_t t = 0; t < (n); t++) {                                                   \
                const int tid = 0;                                                                \
                (void)tid;                                                                        \
                __VA_ARGS__                                                                       \
            }                                                                                     \
        }                                                                                         \
    } while (0)

/* The kv head that query head h reads (grouped-query attention; H_kv == H: h). */
static inline int64_t kv_head(const hkt_params *p, int64_t h) { return h / (p->H / p->H_kv); }

/* which side of the backward a pass computes */
/* ROWS_PACKED (bfloat16): the query tile's rows, packed as pairs for dk and
 * dv, are in the workspace already, from the pair before (the same query tile
 * against the key tile held before this one) */
enum { WANT_KV = 1, WANT_Q = 2, ROWS_PACKED = 4 };

/* Decoding (hkt_decode.c): keys per chunk, between these (see hkt_decode_plan). */
#define DECODE_CHUNK_MIN 256
#define DECODE_CHUNK_MAX 1024

/* How a call is cut up, and where its workspace goes (byte offsets past the
 * 64-byte-aligned start; total is SIZE_MAX when the sizes overflow). */
typedef struct {
    int64_t C, nch, longest;   /* keys per chunk, chunks per row, keys of the longest row */
    size_t partials, scratch;  /* offsets: partials after the counters, then per-thread scratch */
    size_t per_thread, total;
} hkt_decode_plan_t;

hkt_decode_plan_t hkt_decode_plan(const hkt_decode_params *p);

/* The instruction-set dispatch, one table for every kernel family: each
 * set's build (hkt_cpu_{f32,f64}.c and hkt_window_{f32,f64}.c, and their
 * *_avx2.c / *_avx512.c builds) gives per real type the entry points below,
 * and hkt_dispatch.c gathers them in one table per set and picks one
 * (hkt_isa).  The type-free callers (hkt_attention.c, hkt_decode.c,
 * hkt_window.c; hkt_varlen.c through hkt_attention.c's entry points) take a
 * type's row with hkt_kernels_of. */
typedef struct {
    void (*forward)(const hkt_params *);
    void (*backward)(const hkt_params *); /* float32's: also the bfloat16 backward (avx512f only) */
    void (*decode)(const hkt_decode_params *);
    void (*window_forward)(const hkt_window_params *);
    void (*window_backward)(const hkt_window_params *);
    void (*window_decode)(const hkt_window_decode_params *);
    /* one thread's workspace of the windowed kernels: the same layout in every set */
    size_t (*window_thread_bytes)(const hkt_window_params *, int backward);
    size_t (*window_decode_thread_bytes)(const hkt_window_decode_params *);
} hkt_real_kernels;

typedef struct {
    const char *name; /* hkt_cpu_kernels(): "avx512f", "avx2", "default" */
    hkt_real_kernels f32, f64;
    void (*forward_bf16)(const hkt_params *); /* NULL: no native bfloat16 */
} hkt_isa_table;

/* The set this process runs: the widest the CPU has, or the one the
 * environment variable HKT_CPU_KERNELS names ("avx512f", "avx2", "default")
 * if the CPU has it; chosen at the first call. */
const hkt_isa_table *hkt_isa(void);

/* The kernels of dtype (HKT_FLOAT64, else float32's: bfloat16's backward too)
 * in the set this process runs. */
static inline const hkt_real_kernels *hkt_kernels_of(int dtype) {
    return dtype == HKT_FLOAT64 ? &hkt_isa()->f64 : &hkt_isa()->f32;
}

#define HKT_DECLARE_REAL(t, isa)                                                                             \
    void hkt_forward_##t##_##isa(const hkt_params *p);                                                     \
    void hkt_backward_##t##_##isa(const hkt_params *p);                                                    \
    void hkt_decode_##t##_##isa(const hkt_decode_params *p);                                               \
    void hkt_window_forward_##t##_##isa(const hkt_window_params *p);                                       \
    void hkt_window_backward_##t##_##isa(const hkt_window_params *p);                                      \
    void hkt_window_decode_##t##_##isa(const hkt_window_decode_params *p);                                 \
    size_t hkt_window_thread_bytes_##t##_##isa(const hkt_window_params *p, int backward);                  \
    size_t hkt_window_decode_thread_bytes_##t##_##isa(const hkt_window_decode_params *p);
#define HKT_DECLARE_ISA(isa) HKT_DECLARE_REAL(f32, isa) HKT_DECLARE_REAL(f64, isa)
HKT_DECLARE_ISA(generic)
HKT_DECLARE_ISA(avx2)
HKT_DECLARE_ISA(avx512)
void hkt_forward_bf16_avx512(const hkt_params *p);

/* AMX's tile configuration is per OS thread, and other code (oneDNN in torch)
 * may reconfigure or release it on the same thread between two of our calls.
 * Each bfloat16 call bumps this counter before its threads start
 * (hkt_forward_cpu, hkt_backward_cpu); a thread loads the configuration when the counter differs from the
 * value it last loaded it at (hkt_bf16_body.h, amx_ready). */
extern uint64_t hkt_amx_epoch;

#endif
