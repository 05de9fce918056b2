/*
 * HKT attention on CUDA: forward and backward, float32 and float64, and
 * bfloat16 on tensor cores.
 *
 * Shapes (see hkt.h): q[l] (B, H, ceil(T/2^l), D), k[l] (B, H_kv, ceil(S/2^l), D),
 * v (B, H_kv, S, Dv), w (H, L) or (L,); out (B, H, T, Dv), lse (B, H, T).
 * Forward writes out and lse (+inf for a row with no visible key); backward
 * OVERWRITES dq[l], dk[l], dv, dw and, when not NULL, dmask.  Same contract,
 * field for field, as hkt_attention.c; every pointer in hkt_params is a device
 * pointer on p->device_id.
 *
 * Three files: hkt_cuda_f32_f64.h (the float32 and float64 kernels),
 * hkt_cuda_tc.h (the bfloat16 ones on tensor cores), and this one, the host
 * side (the launches and hkt.h's CUDA entry points); hkt_cuda_common.h holds
 * what the kernels share.
 *
 * bfloat16 goes to tc_forward_kernel and tc_backward_kernel, on tensor cores
 * (hkt_cuda_tc.h's comment).  The float32 and float64 kernels are written to be
 * plainly right rather than fast (the CPU file is the fast one):
 *
 *   forward   one warp per query row i; its 32 lanes take 32 keys at a time,
 *             each lane computes its key's full score, the warp runs the online
 *             softmax (max and sum by shuffles), and lane e owns out[i][e]
 *             (e = lane, lane + 32, ...).  Nothing of size T x S is stored.
 *   backward  every gradient row is owned by exactly one warp, so there are no
 *             atomics and the result does not depend on scheduling:
 *               delta  one warp per row: delta[i] = rowsum(dO * out)
 *               dq     one warp per block of G = 2^(L-1) query rows, which holds
 *                      every level's dq rows of that block (level blocks nest);
 *                      lanes over keys, P recomputed from lse
 *               dk, dv the same per block of G key rows, lanes over queries
 *               dw     per-(b, h, query block) partials, reduced in a fixed
 *                      order by one small kernel
 *               dmask  one thread per dmask entry, adding the dS of every
 *                      (b, h, i, j) broadcast onto it in a fixed order.
 *
 * Non-finite values (hkt.h): an entry whose score is -inf (hidden by the bool
 * mask, causality or a -inf float mask) gets P = 0 and dS = 0 exactly, whatever
 * its row's lse and delta hold, and adds nothing to dq, dk or dw even where its
 * q or k holds NaN; a visible NaN or +inf score makes its row's out and lse NaN.
 * Every branch a warp takes together depends only on values that are bitwise
 * the same in all its lanes (loop bounds, and the butterfly max and sum), so a
 * NaN in one lane cannot split the warp before a shuffle or __syncwarp.
 *
 * Unlike the CPU kernels and the tensor-core ones, the float32 and float64
 * kernels compute the score of every (i, j) from all L levels (T*S*D*L
 * multiply-adds, not the T*S*D*sum 4^-l of docs/contract.md section 1.6):
 * sharing a coarse level's product across its 2^l x 2^l block needs a tiled
 * kernel, which only the tensor-core ones are so far.
 *
 * Allocation: "kernels never allocate" (docs/contract.md section 3) holds
 * here too: nothing in these files allocates.  The backward's scratch (delta,
 * B*H*T reals, then the dw partials, B*H*ceil(T/G)*L reals, both O(B*H*T);
 * hkt_cuda_scratch_bytes in hkt.h) is device memory the caller passes in
 * p->dw_partial; hkt/_kernels.py takes it from torch's caching allocator.
 *
 * Streams: every kernel is launched on p->stream (hkt/_kernels.py passes
 * torch's current stream of the device), so it runs in stream order after the
 * work that produced its inputs there, and the work queued after it on that
 * stream sees its outputs, exactly as for a torch op.  The entry points neither
 * wait for the device nor synchronize it: they return once the kernels are
 * queued (so a CUDA graph can capture them), after checking each launch with
 * cudaGetLastError.  A fault inside a kernel surfaces later, at the next
 * synchronizing call, as for any asynchronous CUDA work.
 */
#include "hkt_cuda_f32_f64.h"
#include "hkt_cuda_tc.h"

/* the tensor-core kernels, for D and Dv each up to 64 or up to 128 */
template <typename C>
static cudaError_t tc_forward_launch(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    const int64_t tasks = p.B * p.H * ((p.T + TC_BM - 1) / TC_BM);
    const unsigned grid = (unsigned)(tasks < MAX_BLOCKS ? tasks : MAX_BLOCKS);
    cudaStream_t stream = (cudaStream_t)p.stream;
    *what = "tensor-core forward kernel launch";
    if (tasks > 0) tc_forward_kernel<C><<<grid, TC_THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

template <typename C>
static cudaError_t tc_backward_launch(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    const int64_t tasks = C::DKV ? p.B * p.H_kv * ((p.S + TC_BM - 1) / TC_BM) : p.B * p.H * ((p.T + TC_BM - 1) / TC_BM);
    const unsigned grid = (unsigned)(tasks < MAX_BLOCKS ? tasks : MAX_BLOCKS);
    cudaStream_t stream = (cudaStream_t)p.stream;
    *what = !C::DKV ? "tensor-core dq kernel launch" : C::DV ? "tensor-core dv kernel launch"
                                                             : "tensor-core dk kernel launch";
    if (tasks > 0) tc_backward_kernel<C><<<grid, TC_THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

/* ---- host side ---- */
static unsigned blocks_for(int64_t warps) {
    const int64_t n = (warps + WARPS - 1) / WARPS;
    return (unsigned)(n < MAX_BLOCKS ? n : MAX_BLOCKS);
}

static cuda_args make_args(const hkt_params *p) {
    cuda_args a;
    memset(&a, 0, sizeof a);
    a.p = *p;
    a.seed_mixed = mix64(p->seed);
    a.threshold = keep_threshold(p->dropout_p);
    a.keep_scale = keep_scale(p->dropout_p);
    a.G = (int64_t)1 << (p->L - 1);
    a.nqb = (p->T + a.G - 1) / a.G;
    a.nkb = (p->S + a.G - 1) / a.G;
    return a;
}

template <typename real>
static cudaError_t forward_launch(const cuda_args &a, const char **what) {
    cudaStream_t stream = (cudaStream_t)a.p.stream;
    const int64_t rows = a.p.B * a.p.H * a.p.T;
    *what = "forward kernel launch";
    if (rows > 0) forward_kernel<real><<<blocks_for(rows), THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

template <typename real>
static cudaError_t backward_launch(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    cudaStream_t stream = (cudaStream_t)p.stream;
    const int64_t rows = p.B * p.H * p.T, qtasks = p.B * p.H * a.nqb, ktasks = p.B * p.H_kv * a.nkb;
    cudaError_t e;
    *what = "backward delta kernel launch";
    if (rows > 0) delta_kernel<real><<<blocks_for(rows), THREADS, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dq kernel launch";
    if (qtasks > 0 && p.L <= HKT_TC_LMAX)
        dq_kernel<real, HKT_TC_LMAX><<<blocks_for(qtasks), THREADS, 0, stream>>>(a);
    else if (qtasks > 0)
        dq_kernel<real, HKT_MAX_LEVELS><<<blocks_for(qtasks), THREADS, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dk/dv kernel launch";
    if (ktasks > 0) dkv_kernel<real><<<blocks_for(ktasks), THREADS, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dw kernel launch";
    if ((p.w_per_head ? p.H : 1) * p.L > 0) dw_kernel<real><<<1, 256, 0, stream>>>(a);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    *what = "backward dmask kernel launch";
    const int64_t nmask = p.dmask ? p.dmask_shape[0] * p.dmask_shape[1] * p.dmask_shape[2] * p.dmask_shape[3] : 0;
    if (nmask > 0) dmask_kernel<real><<<blocks_for((nmask + 31) / 32), THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

/* The tensor-core kernels' own guard (the binding has named the argument
 * already): why, the limit p breaks, or NULL; then sm_80 or later. */
static cudaError_t tc_check(const hkt_params &p, const char *why, const char **what) {
    int major = 0;
    cudaError_t e;
    if ((*what = why) != NULL) return cudaErrorInvalidValue;
    *what = "cudaDeviceGetAttribute";
    if ((e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.device_id)) != cudaSuccess) return e;
    *what = "bfloat16 needs a GPU of compute capability 8.0 or later (tensor cores with bfloat16)";
    return major < 8 ? cudaErrorInvalidValue : cudaSuccess;
}

/* bfloat16 forward: the tensor-core kernel for D and Dv up to 64 or 128 */
static cudaError_t tc_forward(const cuda_args &a, const char **what) {
    const hkt_params &p = a.p;
    const cudaError_t e = tc_check(p, hkt_cuda_tc_refusal(&p), what);
    if (e != cudaSuccess) return e;
    if (p.D <= 64)
        return p.Dv <= 64 ? tc_forward_launch<tc_cfg<64, 64>>(a, what) : tc_forward_launch<tc_cfg<64, 128>>(a, what);
    return p.Dv <= 64 ? tc_forward_launch<tc_cfg<128, 64>>(a, what) : tc_forward_launch<tc_cfg<128, 128>>(a, what);
}

/* bfloat16 backward: dq (and delta, dw partials per block of 64 queries),
 * then dv, then dk, then dw summed by dw_kernel */
static cudaError_t tc_backward(cuda_args a, const char **what) {
    const hkt_params &p = a.p;
    cudaError_t e = tc_check(p, hkt_cuda_tc_backward_refusal(&p), what);
    if (e != cudaSuccess) return e;
    a.nqb = (p.T + TC_BM - 1) / TC_BM; /* dw partials per block of TC_BM queries (fewer than per G) */
    if ((e = tc_backward_launch<tc_cfg<HKT_TC_BWD_DMAX, HKT_TC_BWD_DMAX, 0>>(a, what)) != cudaSuccess) return e;
    if ((e = tc_backward_launch<tc_cfg<HKT_TC_BWD_DMAX, HKT_TC_BWD_DMAX, 1>>(a, what)) != cudaSuccess) return e;
    if ((e = tc_backward_launch<tc_cfg<HKT_TC_BWD_DMAX, HKT_TC_BWD_DMAX, 2>>(a, what)) != cudaSuccess) return e;
    cudaStream_t stream = (cudaStream_t)p.stream;
    *what = "backward dw kernel launch";
    if ((p.w_per_head ? p.H : 1) * p.L > 0) dw_kernel<float><<<1, 256, 0, stream>>>(a);
    return cudaGetLastError();
}

static int report(cudaError_t e, const char *what, char *err, size_t errlen) {
    if (e == cudaSuccess) return 0;
    if (err && errlen) snprintf(err, errlen, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return -1;
}

/* Selects p's device (the stream's); *prev gets the caller's device, restored
 * by leave_device.  Nothing waits here: stream order does that. */
static cudaError_t enter_device(const hkt_params *p, int *prev, const char **what) {
    cudaError_t e;
    *what = "cudaGetDevice";
    if ((e = cudaGetDevice(prev)) != cudaSuccess) return e;
    *what = "cudaSetDevice";
    return cudaSetDevice(p->device_id);
}

static void leave_device(int prev) {
    if (prev >= 0) cudaSetDevice(prev);
}

/* The band (hkt_params.sliding_window) is the CPU kernels' only: refused by
 * name rather than computed without it (the binding refuses it first). */
static int refuse_band(const hkt_params *p, char *err, size_t errlen) {
    if (p->sliding_window == 0) return 0;
    snprintf(err, errlen, "sliding_window: the CUDA kernels take no sliding-window band");
    return -1;
}

extern "C" int hkt_forward_cuda(const hkt_params *p, char *err, size_t errlen) {
    if (refuse_band(p, err, errlen)) return -1;
    const char *what = "";
    int prev = -1;
    cudaError_t e = enter_device(p, &prev, &what);
    if (e == cudaSuccess) {
        const cuda_args a = make_args(p);
        if (p->dtype == HKT_BFLOAT16)
            e = tc_forward(a, &what);
        else
            e = p->dtype == HKT_FLOAT64 ? forward_launch<double>(a, &what) : forward_launch<float>(a, &what);
    }
    leave_device(prev);
    return report(e, what, err, errlen);
}

extern "C" int hkt_backward_cuda(const hkt_params *p, char *err, size_t errlen) {
    if (refuse_band(p, err, errlen)) return -1;
    const char *what = "";
    int prev = -1;
    cudaError_t e = enter_device(p, &prev, &what);
    if (e == cudaSuccess) {
        cuda_args a = make_args(p);
        const size_t elem = p->dtype == HKT_FLOAT64 ? sizeof(double) : sizeof(float);
        /* the layout hkt_cuda_scratch_bytes counts: delta, then the dw partials */
        a.delta = p->dw_partial;
        a.dw_part = (char *)p->dw_partial + (size_t)(p->B * p->H * p->T) * elem;
        what = "backward scratch: dw_partial is NULL";
        if (p->dw_partial == NULL && hkt_cuda_scratch_bytes(p->B, p->H, p->T, p->L, elem) > 0)
            e = cudaErrorInvalidValue;
        else
            e = p->dtype == HKT_BFLOAT16 ? tc_backward(a, &what)
                : p->dtype == HKT_FLOAT64  ? backward_launch<double>(a, &what)
                                           : backward_launch<float>(a, &what);
    }
    leave_device(prev);
    return report(e, what, err, errlen);
}
