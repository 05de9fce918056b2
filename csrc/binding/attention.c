/*
 * hkt._C's attention calls: forward, backward and dropout_mask over (B, H, T)
 * batches, on the CPU or (a CUDA build, CUDA arrays) on the GPU.  Every
 * argument is checked (checks.c, arguments.c) into a plain hkt_params before
 * the kernels run, GIL released.
 */
#include "binding.h"

/* A bfloat16 call on CUDA within the tensor-core kernels' limits (hkt.h):
 * 0, else -1 with a ValueError that names the argument. */
static int check_cuda_tc(const hkt_params *p, int backward) {
    const char *why = backward ? hkt_cuda_tc_backward_refusal(p) : hkt_cuda_tc_refusal(p); /* "argument: reason" */
    if (!why) return 0;
    PyErr_Format(PyExc_ValueError, "%s; pass float32", why);
    return -1;
}

/* Every level of q and k: shapes (B, H, ceil(T / 2^l), D) and (B, H_kv,
 * ceil(S / 2^l), D); fills p's pointers. */
static int take_levels(hkt_params *p, held *hd, PyObject *qt, PyObject *kt, const DLTensor *q0,
                       const DLTensor *k0) {
    char name[32];
    for (int l = 0; l < p->L; l++) {
        int64_t wq[4] = {p->B, p->H, level_len(p->T, l), p->D};
        int64_t wk[4] = {p->B, p->H_kv, level_len(p->S, l), p->D};
        const DLTensor *t;
        level_name(name, "q", l);
        t = l ? import_array(hd, PyTuple_GetItem(qt, l), name) : q0;
        if (!t || take_4d(t, name, q0, wq, "= (B, H, ceil(T/%lld), D)", 1LL << l, 0, &p->q[l], p->q_stride[l]))
            return -1;
        note_span(hd, t, name, 0);
        level_name(name, "k", l);
        t = l ? import_array(hd, PyTuple_GetItem(kt, l), name) : k0;
        if (!t || take_4d(t, name, q0, wk, "= (B, H_kv, ceil(S/%lld), D)", 1LL << l, 0, &p->k[l], p->k_stride[l]))
            return -1;
        note_span(hd, t, name, 0);
    }
    return 0;
}

/* Parses and checks everything forward and backward share; fills p.  out and lse
 * are the forward's outputs (output = 1) or the backward's inputs (0). */
static int fill_common(hkt_params *p, held *hd, PyObject *qs, PyObject *ks, PyObject *v,
                       PyObject *w, PyObject *out, PyObject *lse, PyObject *mask,
                       int causal, PyObject *scale, double dropout_p, unsigned long long seed,
                       PyObject *softcap, PyObject *sliding_window, PyObject *num_threads, int output,
                       const DLTensor **q0_out, const DLTensor **mask_out) {
    PyObject *qt = NULL, *kt = NULL;
    int rc = -1;
    memset(p, 0, sizeof *p);
    if ((p->L = level_tuples(qs, ks, "k", &qt, &kt)) < 0) goto done;
    /* bfloat16 q, k and v compute in float32: w, a float mask, lse and the
     * forward's out are float32, checked against cref */
    const DLTensor *q0 = take_q0(hd, PyTuple_GetItem(qt, 0), 1);
    if (!q0) goto done;
    DLTensor cref_f32;
    const DLTensor *cref = compute_ref(q0, &cref_f32);
    p->dtype = is_bf16(q0) ? HKT_BFLOAT16 : q0->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p->B = q0->shape[0];
    p->H = q0->shape[1];
    p->T = q0->shape[2];
    p->D = q0->shape[3];
    const DLTensor *k0 = import_array(hd, PyTuple_GetItem(kt, 0), "k[0]");
    if (!k0) goto done;
    if (k0->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "k[0]: expected 4 dimensions (B, H_kv, S, D), got %d", k0->ndim);
        goto done;
    }
    p->S = k0->shape[2];
    p->H_kv = k0->shape[1];
    if (check_kv_heads("k[0]", p->H, p->H_kv)) goto done;
    if (check_count("q[0]", "B x H x T x D", p->B, p->H, p->T, p->D) ||
        check_count("k[0]", "B x H_kv x S x D", p->B, p->H_kv, p->S, p->D) ||
        check_count("k[0]", "query-key pairs B x H x T x S", p->B, p->H, p->T, p->S))
        goto done;
    if (take_levels(p, hd, qt, kt, q0, k0)) goto done;
    const DLTensor *vt = import_array(hd, v, "v");
    if (!vt) goto done;
    if (vt->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "v: expected 4 dimensions (B, H_kv, S, Dv), got %d", vt->ndim);
        goto done;
    }
    p->Dv = vt->shape[3];
    {
        int64_t want[4] = {p->B, p->H_kv, p->S, p->Dv};
        if (check_count("v", "B x H_kv x S x Dv", p->B, p->H_kv, p->S, p->Dv) ||
            take_4d(vt, "v", q0, want, "= (B, H_kv, S, Dv)", 0, 0, &p->v, p->v_stride))
            goto done;
        note_span(hd, vt, "v", 0);
    }
    if (take_weights(p, hd, w, cref)) goto done;
    p->mask_kind = HKT_MASK_NONE;
    *mask_out = NULL;
    if (mask != Py_None) {
        const int64_t full[4] = {p->B, p->H, p->T, p->S};
        if (!(*mask_out = take_mask(hd, mask, cref, full, &p->mask_kind, p->mask_stride, &p->mask))) goto done;
    }

    const DLTensor *ot = import_array(hd, out, "out");
    if (!ot) goto done;
    {
        int64_t want[4] = {p->B, p->H, p->T, p->Dv};
        const void *ptr;
        /* the forward writes float32, or bfloat16 on the CPU (bf16_out); the
         * backward reads the bfloat16 result */
        p->bf16_out = output && p->dtype == HKT_BFLOAT16 && is_bf16(ot) && !q0_on_cuda(q0);
        if (take_4d(ot, "out", output && !p->bf16_out ? cref : q0, want, "= (B, H, T, Dv)", 0, output, &ptr,
                    p->out_stride))
            goto done;
        p->out = (void *)ptr;
        note_span(hd, ot, "out", output);
    }
    /* the forward's lse may be None on the CPU (a call that will not be
     * differentiated: run_kernel gives it room in the workspace) */
    const int no_lse = output && lse == Py_None;
    const DLTensor *lt = no_lse ? NULL : import_array(hd, lse, "lse");
    if (!lt && !no_lse) goto done;
    if (lt) {
        int64_t want[3] = {p->B, p->H, p->T};
        if (check_real(lt, "lse", cref) || check_shape(lt, "lse", want, 3, "= (B, H, T)", 0) ||
            check_contiguous(lt, "lse"))
            goto done;
        p->lse = data_of(lt);
        note_span(hd, lt, "lse", output);
    }

    p->causal = causal;
    if (parse_scale(scale, p->D, &p->scale) || check_dropout(dropout_p) || parse_softcap(softcap, &p->softcap) ||
        check_softcap_kernels(p->softcap, q0_on_cuda(q0), p->dtype == HKT_BFLOAT16) ||
        parse_sliding_window(sliding_window, &p->sliding_window) ||
        check_band_kernels(p->sliding_window, q0_on_cuda(q0)) || parse_threads(num_threads, &p->num_threads))
        goto done;
    p->dropout_p = dropout_p;
    p->seed = (uint64_t)seed;
    p->key_cache_bytes = -1; /* the default budget; forward's key_cache_bytes= overrides it */
    *q0_out = q0;
    rc = 0;
done:
    Py_XDECREF(qt);
    Py_XDECREF(kt);
    return rc;
}

/* Runs the kernel over p, GIL released: on the CPU with a freshly allocated
 * per-thread workspace; on CUDA queued on p->stream, with the caller's device
 * scratch in p->dw_partial (the backward's; a host buffer would be of no use
 * there, and the caller's allocator is torch's caching one). */
static int run_kernel(hkt_params *p, int backward, const DLTensor *q0) {
#ifdef HKT_WITH_CUDA
    if (q0_on_cuda(q0)) {
        char err[256] = "unknown error";
        int rc;
        const size_t need = hkt_cuda_scratch_bytes(p->B, p->H, p->T, p->L, p->dtype == HKT_FLOAT64 ? 8 : 4);
        if (backward && p->dw_partial == NULL && need > 0) {
            PyErr_Format(PyExc_ValueError, "scratch: the CUDA backward needs a device array of at least %zu "
                         "bytes on q[0]'s device (hkt._C.cuda_scratch_bytes(B, H, T, L, itemsize)), got None",
                         need);
            return -1;
        }
        if (!backward && p->lse == NULL && p->B * p->H * p->T > 0) { /* lse=None */
            PyErr_SetString(PyExc_ValueError, "lse: the CUDA forward writes lse into an array on q[0]'s device, "
                            "(B, H, T); None is taken on the CPU only");
            return -1;
        }
        p->device_id = (int)q0->device.device_id;
        Py_BEGIN_ALLOW_THREADS
        rc = backward ? hkt_backward_cuda(p, err, sizeof err) : hkt_forward_cuda(p, err, sizeof err);
        Py_END_ALLOW_THREADS
        if (rc) {
            PyErr_Format(PyExc_RuntimeError, "hkt CUDA %s: %s", backward ? "backward" : "forward", err);
            return -1;
        }
        return 0;
    }
#else
    (void)q0;
#endif
    if (check_caller_stack()) return -1;
    const hkt_cpu_workspace plan = hkt_cpu_workspace_plan(p, backward);
    /* PyMem_RawMalloc is not in the 3.10 limited API */
    char *mem = plan.total == SIZE_MAX ? NULL : malloc(plan.total);
    if (!mem) {
        char gib[32]; /* PyErr_Format has no %g */
        snprintf(gib, sizeof gib, "%.3g",
                 ((double)plan.per_thread * p->num_threads + (double)plan.extra) / 1073741824.0);
        PyErr_Format(PyExc_MemoryError, "k[0]: (B, H_kv, S, D) = (%lld, %lld, %lld, %lld) needs %s GiB of "
                     "workspace on %d threads, which could not be allocated", (long long)p->B,
                     (long long)p->H_kv, (long long)p->S, (long long)p->D, gib, p->num_threads);
        return -1;
    }
    hkt_cpu_workspace_place(p, backward, &plan, mem);
    Py_BEGIN_ALLOW_THREADS
    if (backward) hkt_backward_cpu(p);
    else hkt_forward_cpu(p);
    Py_END_ALLOW_THREADS
    free(mem);
    return 0;
}

PyDoc_STRVAR(forward_doc,
"forward(q, k, v, w, out, lse, attn_mask=None, is_causal=False, scale=None,\n"
"        dropout_p=0.0, seed=0, num_threads=0, stream=None, key_cache_bytes=-1,\n"
"        softcap=None, sliding_window=None)\n--\n\n"
"HKT attention forward.  q, k: sequences of L arrays (B, H, ceil(T/2^l), D) and\n"
"(B, H_kv, ceil(S/2^l), D); v (B, H_kv, S, Dv), H_kv dividing H (query head h\n"
"reads kv head h / (H / H_kv)); w (L,) or (H, L).  Writes out\n"
"(B, H, T, Dv) (unit stride along features, any other strides) and lse\n"
"(B, H, T) (C-contiguous), both of q's dtype, sharing no element with any\n"
"other argument; lse=None on the CPU: not kept (a call nobody will\n"
"differentiate).  Inputs may have any strides with unit stride along\n"
"features.  bfloat16 q, k and v (CPU, where\n"
"cpu_has_bf16(), even D) run natively and take w, a float mask and lse in\n"
"float32, out in float32 or bfloat16 (summed in float32, each row rounded\n"
"once as torch rounds).  attn_mask: None or 4-D, each dimension 1 or\n"
"that of (B, H, T, S), bool (True = visible) or float (added), any strides.\n"
"num_threads <= 0 uses OpenMP's default; at most 1024.  key_cache_bytes caps\n"
"the CPU forward's per-thread transposed-key caches (with the packed copies\n"
"of strided value rows), all threads together (negative: 64 MiB); past it,\n"
"keys are transposed tile by tile and strided values read where they lie.\n"
"softcap: None or 0.0 for none, else c > 0: each combined score s becomes\n"
"c tanh(s / c) before the mask (float32 and float64; bfloat16 and CUDA\n"
"arrays refuse it).  sliding_window: None for none, else an int W >= 1: key j\n"
"is visible to query i only when i - j < W (and, without is_causal, j - i < W),\n"
"key tiles outside the band skipped (CUDA arrays refuse it).\n\n"
"CUDA arrays: the kernels are queued on stream, a cudaStream_t as an int\n"
"(torch.cuda.current_stream().cuda_stream; None or 0: the legacy default\n"
"stream), and the call returns without waiting for them.  Arrays passed as\n"
"objects are exported with __dlpack__(stream=...) so that their producer\n"
"orders its writes before that stream; bare capsules must already be ready\n"
"on it.\n\n"
"Every entry point consumes the DLPack capsules it imports (renamed\n"
"'used_dltensor', deleted when the call returns): a capsule serves one\n"
"argument of one call.");

static PyObject *py_forward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "v", "w", "out", "lse", "attn_mask", "is_causal",
                             "scale", "dropout_p", "seed", "num_threads", "stream", "key_cache_bytes", "softcap",
                             "sliding_window", NULL};
    PyObject *qs, *ks, *v, *w, *out, *lse, *mask = Py_None, *scale = Py_None, *nthreads = NULL;
    PyObject *stream = Py_None, *softcap = NULL, *sliding_window = NULL;
    int causal = 0;
    double dropout_p = 0.0;
    unsigned long long seed = 0;
    long long key_cache_bytes = -1;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OpOdKOOLOO:forward", kwlist, &qs, &ks, &v, &w,
                                     &out, &lse, &mask, &causal, &scale, &dropout_p, &seed, &nthreads,
                                     &stream, &key_cache_bytes, &softcap, &sliding_window))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_params p;
    const DLTensor *q0, *mt;
    void *stream_handle;
    if (parse_stream(stream, &hd, &stream_handle)) return NULL;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed, softcap,
                         sliding_window, nthreads, 1, &q0, &mt);
    p.stream = stream_handle;
    p.key_cache_bytes = key_cache_bytes;
    if (rc == 0 && p.dtype == HKT_BFLOAT16 && q0_on_cuda(q0)) rc = check_cuda_tc(&p, 0);
    if (rc == 0) rc = check_overlaps(&hd);
    if (rc == 0) rc = run_kernel(&p, 0, q0);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(check_forward_doc,
"check_forward(q, k, v, w, out, lse, attn_mask=None, is_causal=False, scale=None,\n"
"              dropout_p=0.0, softcap=None, sliding_window=None)\n--\n\n"
"forward's checks of its arguments, without the kernels: raises what forward\n"
"would (naming the argument), else returns None.  Each array is passed as a\n"
"(shape, dtype code, bits) tuple (DLPack's codes: 2 float, 6 bool) and\n"
"checked as a C-contiguous CPU array of that shape: for the calls that never\n"
"reach the kernels (meta tensors, hkt's 'sdpa' backend).");

static PyObject *py_check_forward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "v", "w", "out", "lse", "attn_mask", "is_causal", "scale", "dropout_p",
                             "softcap", "sliding_window", NULL};
    PyObject *qs, *ks, *v, *w, *out, *lse, *mask = Py_None, *scale = Py_None, *softcap = NULL;
    PyObject *sliding_window = NULL;
    int causal = 0;
    double dropout_p = 0.0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OpOdOO:check_forward", kwlist, &qs, &ks, &v, &w, &out,
                                     &lse, &mask, &causal, &scale, &dropout_p, &softcap, &sliding_window))
        return NULL;
    described *d = malloc(sizeof *d); /* 20 KiB: not on the caller's stack */
    if (!d) return PyErr_NoMemory();
    d->n = 0;
    held hd;
    held_start(&hd);
    hd.desc = d;
    hkt_params p;
    const DLTensor *q0, *mt;
    const int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, 0, softcap,
                               sliding_window, NULL, 1, &q0, &mt);
    release_all(&hd);
    free(d);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* dq / dk of hkt_attention's backward: shaped like q / k. */
static int take_grads(held *hd, PyObject *seq, const char *base, const hkt_params *p,
                      const DLTensor *q0, int is_q, grad_dtype *gd, void **ptrs, int64_t (*strides)[3]) {
    int64_t want[HKT_MAX_LEVELS][4];
    for (int l = 0; l < p->L; l++) {
        want[l][0] = p->B;
        want[l][1] = is_q ? p->H : p->H_kv;
        want[l][2] = level_len(is_q ? p->T : p->S, l);
        want[l][3] = p->D;
    }
    return take_level_outputs(hd, seq, base, p->L, 4, (const int64_t (*)[4])want, is_q ? "like q" : "like k", q0,
                              gd, ptrs, strides);
}

/* dmask: the float mask's gradient, C-contiguous, shaped like the mask. */
static int take_dmask(hkt_params *p, held *hd, PyObject *dmask, const DLTensor *mt, const DLTensor *q0) {
    if (p->mask_kind != HKT_MASK_FLOAT) {
        PyErr_SetString(PyExc_ValueError, "dmask: only a float attn_mask has a gradient");
        return -1;
    }
    const DLTensor *t = import_array(hd, dmask, "dmask");
    if (!t || check_real(t, "dmask", q0) || check_shape(t, "dmask", mt->shape, 4, "like attn_mask", 0) ||
        check_contiguous(t, "dmask"))
        return -1;
    p->dmask = data_of(t);
    for (int d = 0; d < 4; d++) p->dmask_shape[d] = t->shape[d];
    note_span(hd, t, "dmask", 1);
    return 0;
}

/* scratch: the CUDA backward's device workspace (hkt_cuda_scratch_bytes), into
 * p->dw_partial; the CPU path replaces it by its own host workspace. */
static int take_scratch(hkt_params *p, held *hd, PyObject *scratch, const DLTensor *q0) {
    const DLTensor *t = import_array(hd, scratch, "scratch");
    if (!t || check_device(t, "scratch", q0) || check_contiguous(t, "scratch")) return -1;
    const size_t elem = p->dtype == HKT_FLOAT64 ? 8 : 4;
    const size_t need = hkt_cuda_scratch_bytes(p->B, p->H, p->T, p->L, elem);
    size_t have = (size_t)(t->dtype.bits * t->dtype.lanes + 7) / 8;
    for (int d = 0; d < t->ndim; d++) have *= (size_t)t->shape[d];
    if (have < need) {
        PyErr_Format(PyExc_ValueError, "scratch: needs at least %zu bytes (cuda_scratch_bytes), got %zu", need,
                     have);
        return -1;
    }
    if ((uintptr_t)data_of(t) % elem) {
        PyErr_Format(PyExc_ValueError, "scratch: must be aligned to %zu bytes", elem);
        return -1;
    }
    p->dw_partial = data_of(t);
    note_span(hd, t, "scratch", 1);
    return 0;
}

PyDoc_STRVAR(backward_doc,
"backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, attn_mask=None,\n"
"         is_causal=False, scale=None, dropout_p=0.0, seed=0, num_threads=0,\n"
"         dmask=None, stream=None, scratch=None, softcap=None,\n"
"         sliding_window=None)\n--\n\n"
"HKT attention backward.  Takes forward's inputs, out and lse, and the output\n"
"gradient dout (B, H, T, Dv); overwrites dq[l], dk[l] (like q[l], k[l]), dv\n"
"(like v) and dw (like w, C-contiguous), with unit stride along features and\n"
"sharing no element with any other argument (outputs whose rows interleave,\n"
"as heads side by side in one buffer do, are fine).  With a float attn_mask,\n"
"dmask (shaped like it) receives the mask's gradient, summed over its\n"
"broadcast dimensions.  dropout_p and seed must be\n"
"the forward's, and so must softcap and sliding_window.\n\n"
"bfloat16 q, k, v, dout and out (CPU, where cpu_has_bf16(), D and Dv even) run\n"
"natively, with lse, w, a float mask, dw and dmask float32, and dq, dk and dv\n"
"either all float32 or all bfloat16 (summed in float32 in memory the call\n"
"allocates, each row rounded once as torch rounds).\n\n"
"CUDA arrays: queued on stream, as for forward.  scratch: a C-contiguous\n"
"array on q's device of at least cuda_scratch_bytes(B, H, T, L, itemsize)\n"
"bytes, aligned to the real type, sharing memory with no other argument: the\n"
"CUDA kernels' workspace (they allocate nothing).  Ignored on the CPU.");

static PyObject *py_backward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dout", "q", "k", "v", "w", "out", "lse", "dq", "dk", "dv", "dw",
                             "attn_mask", "is_causal", "scale", "dropout_p", "seed",
                             "num_threads", "dmask", "stream", "scratch", "softcap", "sliding_window", NULL};
    PyObject *dout, *qs, *ks, *v, *w, *out, *lse, *dq, *dk, *dv, *dw;
    PyObject *mask = Py_None, *scale = Py_None, *nthreads = NULL, *dmask = Py_None;
    PyObject *stream = Py_None, *scratch = Py_None, *softcap = NULL, *sliding_window = NULL;
    int causal = 0;
    double dropout_p = 0.0;
    unsigned long long seed = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOO|OpOdKOOOOOO:backward", kwlist, &dout, &qs,
                                     &ks, &v, &w, &out, &lse, &dq, &dk, &dv, &dw, &mask, &causal,
                                     &scale, &dropout_p, &seed, &nthreads, &dmask, &stream, &scratch,
                                     &softcap, &sliding_window))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_params p;
    const DLTensor *q0, *mt, *t;
    void *stream_handle;
    if (parse_stream(stream, &hd, &stream_handle)) return NULL;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed, softcap,
                         sliding_window, nthreads, 0, &q0, &mt);
    if (rc) goto done;
    p.stream = stream_handle;
    rc = -1;
    if (p.dtype == HKT_BFLOAT16 && !q0_on_cuda(q0) && check_bf16_backward_dv(p.Dv)) goto done;
    /* the gradients (and dmask) are float32 when the inputs are bfloat16 */
    DLTensor cref_f32;
    const DLTensor *cref = compute_ref(q0, &cref_f32);
    {
        int64_t want[4] = {p.B, p.H, p.T, p.Dv};
        t = import_array(&hd, dout, "dout");
        if (!t || take_4d(t, "dout", q0, want, "= (B, H, T, Dv)", 0, 0, &p.dout, p.dout_stride)) goto done;
        note_span(&hd, t, "dout", 0);
    }
    /* dq, dk and dv: float32, or all bfloat16 on the CPU (bf16_out) */
    grad_dtype gd = {p.dtype == HKT_BFLOAT16 && !q0_on_cuda(q0) ? q0 : NULL, -1};
    if (take_grads(&hd, dq, "dq", &p, cref, 1, &gd, p.dq, p.dq_stride)) goto done;
    if (take_grads(&hd, dk, "dk", &p, cref, 0, &gd, p.dk, p.dk_stride)) goto done;
    {
        int64_t want[4] = {p.B, p.H_kv, p.S, p.Dv};
        const void *ptr;
        t = import_array(&hd, dv, "dv");
        if (!t || take_4d(t, "dv", grad_ref(&gd, t, cref), want, "like v", 0, 1, &ptr, p.dv_stride)) goto done;
        p.dv = (void *)ptr;
        note_span(&hd, t, "dv", 1);
    }
    p.bf16_out = gd.chose_alt == 1;
    {
        int64_t want[2] = {p.H, p.L};
        t = import_array(&hd, dw, "dw");
        if (!t || check_real(t, "dw", cref)) goto done;
        if (p.w_per_head ? check_shape(t, "dw", want, 2, "= (H, L) like w", 0)
                         : check_shape(t, "dw", want + 1, 1, "= (L,) like w", 0))
            goto done;
        if (check_contiguous(t, "dw")) goto done;
        p.dw = data_of(t);
        note_span(&hd, t, "dw", 1);
    }
    if (dmask != Py_None && take_dmask(&p, &hd, dmask, mt, cref)) goto done;
    if (scratch != Py_None && take_scratch(&p, &hd, scratch, q0)) goto done;
    if (p.dtype == HKT_BFLOAT16 && q0_on_cuda(q0) && check_cuda_tc(&p, 1)) goto done;
    if (check_overlaps(&hd)) goto done;
    rc = run_kernel(&p, 1, q0);
done:
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dropout_mask_doc,
"dropout_mask(keep, seed, dropout_p)\n--\n\n"
"Fills keep, a C-contiguous uint8 or bool CPU array (B, H, T, S), with the\n"
"kernels' dropout decision (1 = kept) for that seed: lets tests rebuild the\n"
"exact dropout pattern in plain PyTorch.");

static PyObject *py_dropout_mask(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"keep", "seed", "dropout_p", NULL};
    PyObject *keep;
    unsigned long long seed;
    double dp;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKd:dropout_mask", kwlist, &keep, &seed, &dp))
        return NULL;
    held hd;
    held_start(&hd);
    const DLTensor *t = import_array(&hd, keep, "keep");
    int rc = -1;
    if (!t) goto done;
    if (t->ndim != 4 || t->dtype.bits != 8 || t->dtype.lanes != 1 ||
        (t->dtype.code != kDLBool && t->dtype.code != kDLUInt) || t->device.device_type != kDLCPU) {
        PyErr_SetString(PyExc_ValueError, "keep: expected a 4-D uint8 or bool CPU array (B, H, T, S)");
        goto done;
    }
    if (check_contiguous(t, "keep")) goto done;
    if (check_dropout(dp) || check_caller_stack()) goto done;
    hkt_dropout_mask_cpu((unsigned char *)data_of(t), (uint64_t)seed, dp, t->shape[0], t->shape[1],
                         t->shape[2], t->shape[3]);
    rc = 0;
done:
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sliding_window_doc,
"sliding_window(sliding_window)\n--\n\n"
"sliding_window as forward, backward and decode take it: 0 for None, else\n"
"the int W >= 1 (kept at 2^60 past it); raises what they would (TypeError,\n"
"ValueError).  For the Python layer, whose ops carry it as an int.");

static PyObject *py_sliding_window(PyObject *self, PyObject *obj) {
    int64_t W;
    (void)self;
    if (parse_sliding_window(obj, &W)) return NULL;
    return PyLong_FromLongLong((long long)W);
}

PyMethodDef binding_attention_methods[] = {
    {"sliding_window", py_sliding_window, METH_O, sliding_window_doc},
    {"forward", (PyCFunction)(void (*)(void))py_forward, METH_VARARGS | METH_KEYWORDS, forward_doc},
    {"check_forward", (PyCFunction)(void (*)(void))py_check_forward, METH_VARARGS | METH_KEYWORDS,
     check_forward_doc},
    {"backward", (PyCFunction)(void (*)(void))py_backward, METH_VARARGS | METH_KEYWORDS, backward_doc},
    {"dropout_mask", (PyCFunction)(void (*)(void))py_dropout_mask, METH_VARARGS | METH_KEYWORDS, dropout_mask_doc},
    {NULL, NULL, 0, NULL},
};
