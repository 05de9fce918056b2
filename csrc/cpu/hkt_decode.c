/*
 * HKT decoding with a KV cache on the CPU: the type-free part.  How a call is
 * cut into key chunks and where its workspace goes (hkt_decode_plan), and the
 * dispatch to the float32 / float64 kernel, hkt_decode_body.h compiled into
 * hkt_cpu_f32.c and hkt_cpu_f64.c.
 */
#include "hkt_cpu.h"

#include <string.h>

/* The chunk length C depends on L and the longest row only, never on the
 * thread count.  Long chunks stream faster: a chunk reads each level's keys and
 * the values as separate runs, and the hardware prefetchers start over with
 * each run; short ones give the threads more tasks.  So C
 * doubles from 256 up to 1024 as long as the longest row keeps 4 chunks.
 *
 * C is a power of two and, when there is more than one chunk, a multiple of
 * 2^(L-1): then no coarse block straddles two chunks (none is dotted twice),
 * and a chunk's first block of each level l < L-1 is even, which the fold in
 * chunk_scores (hkt_decode_body.h) relies on.  With many levels and a short
 * cache one chunk of 2^k >= S keys, starting at 0, does instead, and keeps the
 * scratch small. */
hkt_decode_plan_t hkt_decode_plan(const hkt_decode_params *p) {
    hkt_decode_plan_t pl;
    int64_t longest = 0; /* seqlens[b] + Tn keys */
    for (int64_t b = 0; b < p->B; b++)
        if (p->seqlens[b] + p->Tn > longest) longest = p->seqlens[b] + p->Tn;
    pl.longest = longest;
    const int64_t block = (int64_t)1 << (p->L - 1);
    pl.C = DECODE_CHUNK_MIN;
    while (pl.C < DECODE_CHUNK_MAX && 8 * pl.C <= longest) pl.C *= 2;
    while (pl.C < block && pl.C < longest) pl.C *= 2;
    pl.nch = (longest + pl.C - 1) / pl.C;
    const size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
    const int nt = p->num_threads > 0 ? p->num_threads : 1;
    /* per thread: the chunk's scores (C), each coarse level's dots (ceil(C / 2^l),
     * under C + L in all), the scaled query (D) */
    pl.per_thread = round64((size_t)(2 * pl.C + p->L + p->D) * elem);
    size_t slots, part, threads, total;
    int bad = __builtin_mul_overflow((uint64_t)(p->B * p->H * p->Tn), (uint64_t)pl.nch, &slots) ||
              __builtin_mul_overflow(slots, (size_t)(p->Dv + 2) * elem, &part) ||
              __builtin_mul_overflow(pl.per_thread, (size_t)nt, &threads);
    pl.partials = round64((size_t)(p->B * p->H) * sizeof(int64_t)); /* chunks done per (b, h) */
    pl.scratch = bad ? 0 : pl.partials + round64(part);
    bad = bad || __builtin_add_overflow(pl.scratch, threads, &total) || total > SIZE_MAX - 64;
    pl.total = bad ? SIZE_MAX : total + 64;
    return pl;
}

size_t hkt_decode_workspace_bytes(const hkt_decode_params *p) { return hkt_decode_plan(p).total; }

void hkt_decode_cpu(const hkt_decode_params *p) {
    hkt_kernels_of(p->dtype)->decode(p);
}
