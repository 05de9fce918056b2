/*
 * HKT attention over packed variable-length batches, on the CPU (hkt.h, section
 * "Packed variable-length batches").
 *
 * Sequence s alone is an ordinary (1, H, T_s, D) problem, and a packed
 * (total, H, D) array restricted to its rows is a strided (1, H, T_s, D) view
 * (head stride = the array's head stride, row stride = its row stride); its
 * heads h0 .. h0 + n are a view too.  So nothing new is computed here: the
 * kernels of hkt_attention.c run on views of the packed arrays, and every row
 * gets bitwise what it gets when its sequence runs alone.  Nothing is padded and
 * nothing crosses a sequence boundary.
 *
 * Scheduling.  The work is split into tasks of one sequence and one group of
 * query heads sharing a kv head (H / H_kv heads: their dk, dv are summed
 * inside the kernel), run in ONE parallel region, costliest first, each task on
 * one thread: a dynamic schedule over many tasks balances uneven lengths and
 * survives a thread being preempted (a region per sequence would wait at every
 * barrier).  A sequence whose tasks are too large to balance (more than a
 * quarter of one thread's share) runs first, whole, on every thread, through
 * the kernels' own parallel loops.
 *
 * Determinism.  The kernels' results do not depend on their thread count.  dw
 * is always taken per head (a shared w is passed as a per-head w with head
 * stride 0), into one slot per (sequence, head), and summed here over sequences
 * (and heads, for a shared w) in index order, so every result is bitwise the
 * same for any thread count, however the work was split.
 */
#include "hkt_cpu.h"

#include <stdlib.h>
#include <string.h>


int64_t hkt_varlen_level_rows(const int64_t *cu, int64_t nseq, int l) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseq; s++) n += level_len(cu[s + 1] - cu[s], l);
    return n;
}

static int64_t seq_T(const hkt_varlen_params *vp, int64_t s) { return vp->cu_q[s + 1] - vp->cu_q[s]; }
static int64_t seq_S(const hkt_varlen_params *vp, int64_t s) { return vp->cu_k[s + 1] - vp->cu_k[s]; }
/* Element sizes: vl_elem of the compute dtype (w, lse, the gradients, the
 * forward's out unless bf16_out), vl_in_elem of the inputs q, k, v, dout and
 * the backward's out (bfloat16 inputs run natively: 2 bytes, computed in
 * float32). */
static size_t vl_elem(const hkt_varlen_params *vp) { return vp->p.dtype == HKT_FLOAT64 ? 8 : 4; }
static size_t vl_in_elem(const hkt_varlen_params *vp) { return vp->p.dtype == HKT_BFLOAT16 ? 2 : vl_elem(vp); }
/* out is the forward's float32 (or, bf16_out, bfloat16) result, the backward's bfloat16 input */
static size_t vl_out_elem(const hkt_varlen_params *vp, int backward) {
    return backward || vp->p.bf16_out ? vl_in_elem(vp) : vl_elem(vp);
}
/* query heads per kv head: the heads of one task */
static int64_t vl_group(const hkt_varlen_params *vp) { return vp->p.H_kv > 0 ? vp->p.H / vp->p.H_kv : 0; }

/* Relative cost of one task of sequence s (0: nothing to do).  The forward has
 * nothing to write without queries; the backward still zeroes the keys'
 * gradients. */
static double task_cost(const hkt_varlen_params *vp, int64_t s, int backward) {
    const double T = (double)seq_T(vp, s), S = (double)seq_S(vp, s);
    if (T == 0 && (!backward || S == 0)) return 0;
    return (double)vl_group(vp) * (T * S + T + S);
}

/* Whether sequence s runs whole on every thread: one of its tasks would be more
 * than a quarter of one thread's share of the total. */
static int runs_whole(const hkt_varlen_params *vp, int64_t s, int backward, double total) {
    const int nt = num_threads(&vp->p);
    return nt > 1 && task_cost(vp, s, backward) * 4.0 * nt > total;
}

static double total_cost(const hkt_varlen_params *vp, int backward) {
    double c = 0;
    for (int64_t s = 0; s < vp->nseq; s++) c += task_cost(vp, s, backward) * (double)vp->p.H_kv;
    return c;
}

typedef struct {
    double cost;
    int64_t s, g;
} vl_task;

/* Byte offsets of the caller's workspace regions. */
typedef struct {
    size_t table;   /* level offsets: q then k, each L x (nseq + 1) int64 */
    size_t tasks;   /* nseq x H_kv vl_task */
    size_t dws;     /* backward: dw per (sequence, head), nseq x H x L reals */
    size_t dwp;     /* backward: per-thread dw_partial blocks of dwpb bytes */
    size_t ws;      /* per-thread kernel workspace blocks of wsb bytes */
    size_t dwpb, wsb, total;
} vl_layout;

/* off[l * (nseq + 1) + s] = sum over r < s of ceil(len_r / 2^l) */
static void fill_offsets(const int64_t *cu, int64_t nseq, int L, int64_t *off) {
    for (int l = 0; l < L; l++) {
        int64_t *o = off + (size_t)l * (size_t)(nseq + 1);
        o[0] = 0;
        for (int64_t s = 0; s < nseq; s++) o[s + 1] = o[s] + level_len(cu[s + 1] - cu[s], l);
    }
}

/* ptr advanced by n elements (NULL stays NULL: the forward has no gradient arrays) */
static void *elems_at(const void *ptr, int64_t n, size_t elem) {
    return ptr ? (char *)ptr + n * (int64_t)elem : NULL;
}

/* The problem of sequence s alone, all heads (offq, offk: fill_offsets' tables,
 * or NULL when only sizes are wanted). */
static void seq_params(const hkt_varlen_params *vp, const int64_t *offq, const int64_t *offk, int64_t s,
                       int backward, hkt_params *ps) {
    const hkt_params *p = &vp->p;
    const size_t elem = vl_elem(vp), in = vl_in_elem(vp), n1 = (size_t)(vp->nseq + 1);
    *ps = *p;
    ps->B = 1;
    ps->T = seq_T(vp, s);
    ps->S = seq_S(vp, s);
    ps->mask_kind = HKT_MASK_NONE;
    ps->dropout_p = 0;
    ps->dmask = NULL;
    /* dw per head always (see the top of the file) */
    ps->w_per_head = 1;
    ps->w_stride[0] = p->w_per_head ? p->w_stride[0] : 0;
    if (!offq) return;
    for (int l = 0; l < p->L; l++) {
        const int64_t rq = offq[l * n1 + s], rk = offk[l * n1 + s];
        ps->q[l] = elems_at(p->q[l], rq * p->q_stride[l][2], in);
        ps->k[l] = elems_at(p->k[l], rk * p->k_stride[l][2], in);
        ps->dq[l] = elems_at(p->dq[l], rq * p->dq_stride[l][2], elem);
        ps->dk[l] = elems_at(p->dk[l], rk * p->dk_stride[l][2], elem);
    }
    ps->v = elems_at(p->v, vp->cu_k[s] * p->v_stride[2], in);
    ps->dv = elems_at(p->dv, vp->cu_k[s] * p->dv_stride[2], elem);
    ps->out = elems_at(p->out, vp->cu_q[s] * p->out_stride[2], vl_out_elem(vp, backward));
    ps->dout = elems_at(p->dout, vp->cu_q[s] * p->dout_stride[2], in);
    ps->lse = elems_at(p->lse, vp->cu_q[s] * p->H, elem); /* (H, T_s) blocks back to back */
}

/* ps (sequence s, all heads) narrowed to the query heads of kv head g. */
static void group_params(const hkt_varlen_params *vp, int64_t g, int backward, hkt_params *ps) {
    const size_t elem = vl_elem(vp), in = vl_in_elem(vp);
    const int64_t G = vl_group(vp), h0 = g * G;
    ps->H = G;
    ps->H_kv = 1;
    for (int l = 0; l < ps->L; l++) {
        ps->q[l] = elems_at(ps->q[l], h0 * ps->q_stride[l][1], in);
        ps->k[l] = elems_at(ps->k[l], g * ps->k_stride[l][1], in);
        ps->dq[l] = elems_at(ps->dq[l], h0 * ps->dq_stride[l][1], elem);
        ps->dk[l] = elems_at(ps->dk[l], g * ps->dk_stride[l][1], elem);
    }
    ps->v = elems_at(ps->v, g * ps->v_stride[1], in);
    ps->dv = elems_at(ps->dv, g * ps->dv_stride[1], elem);
    ps->out = elems_at(ps->out, h0 * ps->out_stride[1], vl_out_elem(vp, backward));
    ps->dout = elems_at(ps->dout, h0 * ps->dout_stride[1], in);
    ps->lse = elems_at(ps->lse, h0 * ps->T, elem);
    ps->w = elems_at(ps->w, h0 * ps->w_stride[0], elem);
    ps->dw = elems_at(ps->dw, h0 * ps->L, elem);
}

static vl_layout layout_of(const hkt_varlen_params *vp, int backward) {
    vl_layout y;
    const int nt = num_threads(&vp->p);
    const double total = total_cost(vp, backward);
    y.wsb = y.dwpb = 0;
    for (int64_t s = 0; s < vp->nseq; s++) {
        if (task_cost(vp, s, backward) == 0) continue;
        hkt_params ps;
        seq_params(vp, NULL, NULL, s, backward, &ps);
        ps.num_threads = nt;
        if (!runs_whole(vp, s, backward, total)) {
            group_params(vp, 0, backward, &ps);
            ps.num_threads = 1;
        }
        /* a sequence on every thread lays out nt blocks of its size back to back
         * from the first slot; a task uses one block at its thread's slot */
        const size_t w = round64(hkt_workspace_bytes(&ps, backward));
        if (w > y.wsb) y.wsb = w;
        const size_t d = backward ? round64(hkt_dw_partial_bytes(&ps)) : 0;
        if (d > y.dwpb) y.dwpb = d;
    }
    const size_t nslots = (size_t)vp->nseq * (size_t)vp->p.H * (size_t)vp->p.L;
    y.table = 0;
    y.tasks = round64(2 * (size_t)vp->p.L * (size_t)(vp->nseq + 1) * sizeof(int64_t));
    y.dws = y.tasks + round64((size_t)vp->nseq * (size_t)vp->p.H_kv * sizeof(vl_task));
    y.dwp = y.dws + (backward ? round64(nslots * vl_elem(vp)) : 0);
    y.ws = y.dwp + (size_t)nt * y.dwpb;
    y.total = y.ws + (size_t)nt * y.wsb + 64;
    return y;
}

size_t hkt_varlen_workspace_bytes(const hkt_varlen_params *vp, int backward) {
    return layout_of(vp, backward).total;
}

/* costliest first; ties in index order (any order gives the same results) */
static int by_cost(const void *a, const void *b) {
    const vl_task *x = a, *y = b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    if (x->s != y->s) return x->s < y->s ? -1 : 1;
    return (x->g > y->g) - (x->g < y->g);
}

/* Runs every sequence through run (hkt_forward_cpu or hkt_backward_cpu): the
 * large ones whole, in turn, on every thread; then the (sequence, kv head)
 * tasks of the others in one parallel region.  The backward's dw goes into the
 * per-(sequence, head) slots. */
static void run_all(const hkt_varlen_params *vp, int backward, void (*run)(const hkt_params *)) {
    const vl_layout y = layout_of(vp, backward);
    char *base = (char *)vp->p.workspace;
    const int L = vp->p.L, nt = num_threads(&vp->p);
    const double total = total_cost(vp, backward);
    int64_t *offq = (int64_t *)(base + y.table), *offk = offq + (size_t)L * (size_t)(vp->nseq + 1);
    vl_task *tasks = (vl_task *)(base + y.tasks);
    const size_t elem = vl_elem(vp), seq_dw = (size_t)vp->p.H * (size_t)L * elem;
    int64_t ntask = 0;
    fill_offsets(vp->cu_q, vp->nseq, L, offq);
    fill_offsets(vp->cu_k, vp->nseq, L, offk);
    if (backward) memset(base + y.dws, 0, (size_t)vp->nseq * seq_dw); /* sequences with nothing to do */
    for (int64_t s = 0; s < vp->nseq; s++) {
        const double c = task_cost(vp, s, backward);
        if (c == 0) continue;
        if (!runs_whole(vp, s, backward, total)) {
            for (int64_t g = 0; g < vp->p.H_kv; g++) tasks[ntask++] = (vl_task){c, s, g};
            continue;
        }
        hkt_params ps;
        seq_params(vp, offq, offk, s, backward, &ps);
        ps.num_threads = nt;
        ps.workspace = base + y.ws;
        ps.dw_partial = backward ? base + y.dwp : NULL;
        ps.dw = backward ? base + y.dws + (size_t)s * seq_dw : NULL;
        run(&ps);
    }
    if (ntask == 0) return;
    qsort(tasks, (size_t)ntask, sizeof *tasks, by_cost);
    PARALLEL_TASKS(nt, (dynamic, 1), ntask, x, tid, {
        hkt_params ps;
        const size_t t = (size_t)tid;
        seq_params(vp, offq, offk, tasks[x].s, backward, &ps);
        ps.dw = backward ? base + y.dws + (size_t)tasks[x].s * seq_dw : NULL;
        group_params(vp, tasks[x].g, backward, &ps);
        /* the kernel runs on one thread inside this task: a plain loop whose
         * tid is 0 (PARALLEL_TASKS), using the first block at ps.workspace */
        ps.num_threads = 1;
        ps.workspace = base + y.ws + t * y.wsb;
        ps.dw_partial = backward ? base + y.dwp + t * y.dwpb : NULL;
        run(&ps);
    });
}

void hkt_forward_varlen_cpu(const hkt_varlen_params *vp) { run_all(vp, 0, hkt_forward_cpu); }

void hkt_backward_varlen_cpu(const hkt_varlen_params *vp) {
    run_all(vp, 1, hkt_backward_cpu);
    /* dw = the slots summed over sequences (and heads, for a shared w) in index
     * order: the same additions whatever ran where */
    const vl_layout y = layout_of(vp, 1);
    const int64_t H = vp->p.H, L = vp->p.L, nw = vp->p.w_per_head ? H * L : L;
    const char *slots = (const char *)vp->p.workspace + y.dws;
#define HKT_VL_REDUCE(real)                                                   \
    do {                                                                      \
        real *dw = (real *)vp->p.dw;                                          \
        const real *part = (const real *)slots;                               \
        for (int64_t x = 0; x < nw; x++) dw[x] = 0;                           \
        for (int64_t s = 0; s < vp->nseq; s++)                                \
            for (int64_t x = 0; x < H * L; x++)                               \
                dw[vp->p.w_per_head ? x : x % L] += part[s * H * L + x];      \
    } while (0)
    if (vp->p.dtype == HKT_FLOAT64) HKT_VL_REDUCE(double);
    else HKT_VL_REDUCE(float);
#undef HKT_VL_REDUCE
}
