/*
 * hkt._C's packed variable-length calls: varlen_forward and varlen_backward
 * (hkt_varlen.c), whose arrays are packed along rows.
 */
#include "binding.h"

/* ---- packed variable-length batches (hkt_varlen.c) ----
 * Arrays are packed along rows: q[l] (rows, H, D) and the like.  A row stride
 * and a head stride map onto hkt_params' (batch, head, row) strides as
 * {unused, head, row}. */

/* q[0] of a packed call: float32/float64, or bfloat16 where the CPU runs it
 * natively (the others must match it), on the CPU, (rows, heads, D) with D >= 1. */
static const DLTensor *take_packed0(held *hd, PyObject *obj, const char *name, const char *dims) {
    const DLTensor *t = import_array(hd, obj, name);
    if (!t) return NULL;
    if (is_bf16(t)) {
        if (check_cpu_bf16()) return NULL;
    } else if (t->dtype.code != kDLFloat || (t->dtype.bits != 32 && t->dtype.bits != 64) || t->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: dtype must be float32 or float64 (or bfloat16 on a CPU with "
                     "AVX512_BF16), got %s", name, dtype_name(t->dtype));
        return NULL;
    }
    if (t->device.device_type != kDLCPU) {
        PyErr_Format(PyExc_ValueError, "%s: packed variable-length attention runs on the CPU only "
                     "(device type %d)", name, t->device.device_type);
        return NULL;
    }
    if (t->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "%s: expected 3 dimensions %s, got %d", name, dims, t->ndim);
        return NULL;
    }
    if (t->shape[2] < 1) {
        PyErr_Format(PyExc_ValueError, "%s: head dimension D must be at least 1", name);
        return NULL;
    }
    if (is_bf16(t) && check_bf16_d(t->shape[2])) return NULL;
    return t;
}

/* cu_seqlens: a 1-D int32 or int64 CPU array of nseq + 1 offsets (nseq = want - 1
 * when want > 0), starting at 0, never decreasing, ending at total (the rows of
 * total_of).  Read into cu (want entries, or *n when want is 0: the caller frees). */
static int take_cu(held *hd, PyObject *obj, const char *name, int64_t want, int64_t total, const char *total_of,
                   int64_t **cu, int64_t *n) {
    const DLTensor *t = import_array(hd, obj, name);
    *cu = NULL;
    if (!t) return -1;
    if (t->dtype.code != kDLInt || (t->dtype.bits != 32 && t->dtype.bits != 64) || t->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: dtype must be int32 or int64, got %s", name, dtype_name(t->dtype));
        return -1;
    }
    if (t->device.device_type != kDLCPU) {
        PyErr_Format(PyExc_ValueError, "%s: must be on the CPU (device type %d)", name, t->device.device_type);
        return -1;
    }
    if (t->ndim != 1 || t->shape[0] < 1 || (want > 0 && t->shape[0] != want)) {
        char got[160];
        format_shape(got, sizeof got, t->shape, t->ndim);
        if (want > 0)
            PyErr_Format(PyExc_ValueError, "%s: expected shape (%lld,) like cu_seqlens_q (nseq + 1 offsets), got %s",
                         name, (long long)want, got);
        else
            PyErr_Format(PyExc_ValueError, "%s: expected a 1-D array of nseq + 1 offsets, got shape %s", name, got);
        return -1;
    }
    const int64_t len = t->shape[0], st = stride_of(t, 0);
    *cu = malloc(sizeof(int64_t) * (size_t)len);
    if (!*cu) {
        PyErr_NoMemory();
        return -1;
    }
    const char *at = data_of(t);
    for (int64_t s = 0; s < len; s++) {
        if (t->dtype.bits == 32) {
            int32_t x;
            memcpy(&x, at + s * st * 4, 4);
            (*cu)[s] = x;
        } else {
            memcpy(&(*cu)[s], at + s * st * 8, 8);
        }
    }
    if ((*cu)[0] != 0) {
        PyErr_Format(PyExc_ValueError, "%s: must start at 0, got %s[0] = %lld", name, name, (long long)(*cu)[0]);
        return -1;
    }
    for (int64_t s = 1; s < len; s++)
        if ((*cu)[s] < (*cu)[s - 1]) {
            PyErr_Format(PyExc_ValueError, "%s: offsets not increasing: %s[%lld] = %lld after %s[%lld] = %lld",
                         name, name, (long long)s, (long long)(*cu)[s], name, (long long)(s - 1),
                         (long long)(*cu)[s - 1]);
            return -1;
        }
    if ((*cu)[len - 1] != total) {
        PyErr_Format(PyExc_ValueError, "%s: the last offset, %lld, must equal the %lld rows of %s", name,
                     (long long)(*cu)[len - 1], (long long)total, total_of);
        return -1;
    }
    *n = len;
    return 0;
}

/* max_seqlen_q / _k: None, or an int at least the longest sequence (flash-attn
 * callers pass it; the kernels need no hint, but a wrong one is a bug upstream). */
static int check_max_seqlen(PyObject *obj, const char *name, const int64_t *cu, int64_t nseq, int64_t *longest) {
    *longest = 0;
    for (int64_t s = 0; s < nseq; s++)
        if (cu[s + 1] - cu[s] > *longest) *longest = cu[s + 1] - cu[s];
    if (obj == Py_None) return 0;
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        char tn[128];
        PyErr_Format(PyExc_TypeError, "%s: expected an int or None, got %.100s", name, type_name(obj, tn, sizeof tn));
        return -1;
    }
    int overflow = 0;
    const long long m = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (m == -1 && PyErr_Occurred()) return -1;
    if (overflow < 0 || (!overflow && m < *longest)) {
        PyErr_Format(PyExc_ValueError, "%s: %R is less than the longest sequence, %lld rows", name, obj,
                     (long long)*longest);
        return -1;
    }
    return 0;
}

/* q and k of every level: q[l] (Tl_total, H, D), k[l] (Sl_total, H_kv, D), where
 * level l packs each sequence's ceil(len / 2^l) rows. */
static int take_packed_levels(hkt_varlen_params *vp, held *hd, PyObject *qt, PyObject *kt, const DLTensor *q0,
                              const DLTensor *k0) {
    hkt_params *p = &vp->p;
    char name[32];
    for (int l = 0; l < p->L; l++) {
        int64_t wq[3] = {hkt_varlen_level_rows(vp->cu_q, vp->nseq, l), p->H, p->D};
        int64_t wk[3] = {hkt_varlen_level_rows(vp->cu_k, vp->nseq, l), p->H_kv, p->D};
        const DLTensor *t;
        level_name(name, "q", l);
        t = l ? import_array(hd, PyTuple_GetItem(qt, l), name) : q0;
        if (!t || take_3d(t, name, q0, wq, "= (sum of ceil(len/%lld) over cu_seqlens_q, H, D)", 1LL << l, 0,
                          &p->q[l], p->q_stride[l]))
            return -1;
        note_span(hd, t, name, 0);
        level_name(name, "k", l);
        t = l ? import_array(hd, PyTuple_GetItem(kt, l), name) : k0;
        if (!t || take_3d(t, name, q0, wk, "= (sum of ceil(len/%lld) over cu_seqlens_k, H_kv, D)", 1LL << l, 0,
                          &p->k[l], p->k_stride[l]))
            return -1;
        note_span(hd, t, name, 0);
    }
    return 0;
}

/* The part of fill_varlen that needs the arrays of q and k as tuples. */
static int fill_varlen_qk(hkt_varlen_params *vp, held *hd, PyObject *qt, PyObject *kt, PyObject *cuq,
                          PyObject *cuk, PyObject *maxq, PyObject *maxk, const DLTensor **q0_out) {
    hkt_params *p = &vp->p;
    const DLTensor *q0 = take_packed0(hd, PyTuple_GetItem(qt, 0), "q[0]", "(total_q, H, D)");
    if (!q0) return -1;
    p->dtype = is_bf16(q0) ? HKT_BFLOAT16 : q0->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p->H = q0->shape[1];
    p->D = q0->shape[2];
    const DLTensor *k0 = import_array(hd, PyTuple_GetItem(kt, 0), "k[0]");
    if (!k0) return -1;
    if (k0->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "k[0]: expected 3 dimensions (total_k, H_kv, D), got %d", k0->ndim);
        return -1;
    }
    p->H_kv = k0->shape[1];
    if (check_kv_heads("k[0]", p->H, p->H_kv)) return -1;
    p->T = q0->shape[0];
    p->S = k0->shape[0];
    int64_t n, longest_q, longest_k;
    int64_t *cu_q, *cu_k;
    int rc = take_cu(hd, cuq, "cu_seqlens_q", 0, p->T, "q[0] (total_q)", &cu_q, &n);
    vp->cu_q = cu_q;
    if (rc) return -1;
    rc = take_cu(hd, cuk, "cu_seqlens_k", n, p->S, "k[0] (total_k)", &cu_k, &n);
    vp->cu_k = cu_k;
    if (rc) return -1;
    vp->nseq = n - 1;
    if (check_max_seqlen(maxq, "max_seqlen_q", cu_q, vp->nseq, &longest_q) ||
        check_max_seqlen(maxk, "max_seqlen_k", cu_k, vp->nseq, &longest_k) ||
        check_count("q[0]", "total_q x H x D", p->T, p->H, p->D, 1) ||
        check_count("k[0]", "total_k x H_kv x D", p->S, p->H_kv, p->D, 1) ||
        check_count("k[0]", "query-key pairs of the longest sequences H x T x S", 1, p->H, longest_q, longest_k) ||
        take_packed_levels(vp, hd, qt, kt, q0, k0))
        return -1;
    *q0_out = q0;
    return 0;
}

/* Parses and checks everything the packed forward and backward share; fills vp
 * (vp->cu_q and vp->cu_k are malloc'd: free them, also on failure).  out and
 * lse are the forward's outputs (output = 1) or the backward's inputs (0). */
static int fill_varlen(hkt_varlen_params *vp, held *hd, PyObject *qs, PyObject *ks, PyObject *v, PyObject *w,
                       PyObject *out, PyObject *lse, PyObject *cuq, PyObject *cuk, PyObject *maxq,
                       PyObject *maxk, int causal, PyObject *scale, PyObject *num_threads, int output,
                       const DLTensor **q0_out) {
    hkt_params *p = &vp->p;
    PyObject *qt = NULL, *kt = NULL;
    const DLTensor *q0 = NULL, *t;
    int rc = -1;
    memset(vp, 0, sizeof *vp);
    if ((p->L = level_tuples(qs, ks, "k", &qt, &kt)) < 0 || fill_varlen_qk(vp, hd, qt, kt, cuq, cuk, maxq, maxk, &q0))
        goto done;
    p->B = 1;
    if (!(t = import_array(hd, v, "v"))) goto done;
    if (t->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "v: expected 3 dimensions (total_k, H_kv, Dv), got %d", t->ndim);
        goto done;
    }
    p->Dv = t->shape[2];
    {
        int64_t want[3] = {p->S, p->H_kv, p->Dv};
        if (check_count("v", "total_k x H_kv x Dv", p->S, p->H_kv, p->Dv, 1) ||
            take_3d(t, "v", q0, want, "= (total_k, H_kv, Dv)", 0, 0, &p->v, p->v_stride))
            goto done;
        note_span(hd, t, "v", 0);
    }
    /* bfloat16 q, k and v compute in float32: w, lse and the forward's out are float32 */
    DLTensor cref_f32;
    const DLTensor *cref = compute_ref(q0, &cref_f32);
    if (take_weights(p, hd, w, cref)) goto done;
    if (!(t = import_array(hd, out, "out"))) goto done;
    {
        int64_t want[3] = {p->T, p->H, p->Dv};
        const void *ptr;
        /* the forward writes float32, or bfloat16 (bf16_out); the backward reads the bfloat16 result */
        p->bf16_out = output && p->dtype == HKT_BFLOAT16 && is_bf16(t);
        if (take_3d(t, "out", output && !p->bf16_out ? cref : q0, want, "= (total_q, H, Dv)", 0, output, &ptr,
                    p->out_stride))
            goto done;
        p->out = (void *)ptr;
        note_span(hd, t, "out", output);
    }
    if (!(t = import_array(hd, lse, "lse"))) goto done;
    {
        int64_t want[1] = {p->H * p->T};
        if (check_real(t, "lse", cref) || check_shape(t, "lse", want, 1, "= (H * total_q,)", 0) ||
            check_contiguous(t, "lse"))
            goto done;
        p->lse = data_of(t);
        note_span(hd, t, "lse", output);
    }
    p->causal = causal;
    if (parse_scale(scale, p->D, &p->scale) || parse_threads(num_threads, &p->num_threads)) goto done;
    p->key_cache_bytes = -1;
    *q0_out = q0;
    rc = 0;
done:
    Py_XDECREF(qt);
    Py_XDECREF(kt);
    return rc;
}

/* Runs the packed kernels with a freshly allocated workspace, GIL released. */
static int run_varlen(hkt_varlen_params *vp, int backward) {
    if (check_caller_stack()) return -1;
    const size_t need = hkt_varlen_workspace_bytes(vp, backward);
    char *mem = malloc(need);
    if (!mem) {
        char gib[32]; /* PyErr_Format has no %g */
        snprintf(gib, sizeof gib, "%.3g", (double)need / 1073741824.0);
        PyErr_Format(PyExc_MemoryError, "k[0]: %lld sequences need %s GiB of workspace on %d threads, which "
                     "could not be allocated", (long long)vp->nseq, gib, vp->p.num_threads);
        return -1;
    }
    vp->p.workspace = mem;
    Py_BEGIN_ALLOW_THREADS
    if (backward) hkt_backward_varlen_cpu(vp);
    else hkt_forward_varlen_cpu(vp);
    Py_END_ALLOW_THREADS
    free(mem);
    return 0;
}

PyDoc_STRVAR(varlen_forward_doc,
"varlen_forward(q, k, v, w, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,\n"
"               max_seqlen_k=None, is_causal=False, scale=None, num_threads=0)\n--\n\n"
"HKT attention forward over packed variable-length sequences (CPU).\n"
"cu_seqlens_q, cu_seqlens_k: 1-D int32/int64 arrays of nseq + 1 offsets\n"
"(0, never decreasing, ending at total_q / total_k): sequence s owns level-0\n"
"rows [cu[s], cu[s+1]).  q, k: sequences of L arrays (Tl, H, D) and\n"
"(Sl, H_kv, D), level l packing each sequence's ceil(len / 2^l) rows one after\n"
"another; v (total_k, H_kv, Dv); w (L,) or (H, L).  Writes out (total_q, H, Dv)\n"
"and lse (H * total_q,), C-contiguous, of q's dtype, sharing memory with no\n"
"other argument.  Each sequence is computed as it would be alone.  max_seqlen_*:\n"
"None or at least the longest sequence.  bfloat16 q, k and v (where\n"
"cpu_has_bf16(), even D) run natively, as for forward: w and lse float32, out\n"
"float32 or bfloat16.");

static PyObject *py_varlen_forward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "v", "w", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                             "max_seqlen_k", "is_causal", "scale", "num_threads", NULL};
    PyObject *qs, *ks, *v, *w, *out, *lse, *cuq, *cuk, *maxq = Py_None, *maxk = Py_None, *scale = Py_None;
    PyObject *nthreads = NULL;
    int causal = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOO|OOpOO:varlen_forward", kwlist, &qs, &ks, &v, &w, &out,
                                     &lse, &cuq, &cuk, &maxq, &maxk, &causal, &scale, &nthreads))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_varlen_params vp;
    const DLTensor *q0;
    int rc = fill_varlen(&vp, &hd, qs, ks, v, w, out, lse, cuq, cuk, maxq, maxk, causal, scale, nthreads, 1, &q0);
    if (rc == 0) rc = check_overlaps(&hd);
    if (rc == 0) rc = run_varlen(&vp, 0);
    free((void *)vp.cu_q);
    free((void *)vp.cu_k);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* dq / dk of a packed call: shaped like q / k. */
static int take_packed_grads(held *hd, PyObject *seq, const char *base, const hkt_varlen_params *vp,
                             const DLTensor *q0, int is_q, void **ptrs, int64_t (*strides)[3]) {
    const hkt_params *p = &vp->p;
    int64_t want[HKT_MAX_LEVELS][4];
    for (int l = 0; l < p->L; l++) {
        want[l][0] = hkt_varlen_level_rows(is_q ? vp->cu_q : vp->cu_k, vp->nseq, l);
        want[l][1] = is_q ? p->H : p->H_kv;
        want[l][2] = p->D;
    }
    return take_level_outputs(hd, seq, base, p->L, 3, (const int64_t (*)[4])want, is_q ? "like q" : "like k", q0,
                              NULL, ptrs, strides);
}

/* dout, dq, dk, dv and dw of a packed backward. */
static int take_varlen_grads(hkt_varlen_params *vp, held *hd, const DLTensor *q0, PyObject *dout, PyObject *dq,
                             PyObject *dk, PyObject *dv, PyObject *dw) {
    hkt_params *p = &vp->p;
    const DLTensor *t;
    const void *ptr;
    int64_t want[3] = {p->T, p->H, p->Dv};
    if (p->dtype == HKT_BFLOAT16 && check_bf16_backward_dv(p->Dv)) return -1;
    /* the gradients are float32 when the inputs are bfloat16 */
    DLTensor cref_f32;
    const DLTensor *cref = compute_ref(q0, &cref_f32);
    if (!(t = import_array(hd, dout, "dout")) ||
        take_3d(t, "dout", q0, want, "= (total_q, H, Dv)", 0, 0, &p->dout, p->dout_stride))
        return -1;
    note_span(hd, t, "dout", 0);
    if (take_packed_grads(hd, dq, "dq", vp, cref, 1, p->dq, p->dq_stride) ||
        take_packed_grads(hd, dk, "dk", vp, cref, 0, p->dk, p->dk_stride))
        return -1;
    want[0] = p->S;
    want[1] = p->H_kv;
    if (!(t = import_array(hd, dv, "dv")) || take_3d(t, "dv", cref, want, "like v", 0, 1, &ptr, p->dv_stride))
        return -1;
    p->dv = (void *)ptr;
    note_span(hd, t, "dv", 1);
    want[0] = p->H;
    want[1] = p->L;
    if (!(t = import_array(hd, dw, "dw")) || check_real(t, "dw", cref) ||
        (p->w_per_head ? check_shape(t, "dw", want, 2, "= (H, L) like w", 0)
                       : check_shape(t, "dw", want + 1, 1, "= (L,) like w", 0)) ||
        check_contiguous(t, "dw"))
        return -1;
    p->dw = data_of(t);
    note_span(hd, t, "dw", 1);
    return 0;
}

PyDoc_STRVAR(varlen_backward_doc,
"varlen_backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, cu_seqlens_q,\n"
"                cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,\n"
"                is_causal=False, scale=None, num_threads=0)\n--\n\n"
"Backward of varlen_forward.  Takes its inputs, out and lse, and dout\n"
"(total_q, H, Dv); overwrites dq[l], dk[l] (like q[l], k[l]), dv (like v) and\n"
"dw (like w; summed over sequences in index order), all C-contiguous and\n"
"sharing memory with no other argument.  bfloat16 q, k, v, dout and out (where\n"
"cpu_has_bf16(), D and Dv even) run natively, with lse, w and the gradients\n"
"float32.");

static PyObject *py_varlen_backward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dout", "q", "k", "v", "w", "out", "lse", "dq", "dk", "dv", "dw", "cu_seqlens_q",
                             "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "is_causal", "scale", "num_threads",
                             NULL};
    PyObject *dout, *qs, *ks, *v, *w, *out, *lse, *dq, *dk, *dv, *dw, *cuq, *cuk;
    PyObject *maxq = Py_None, *maxk = Py_None, *scale = Py_None, *nthreads = NULL;
    int causal = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOOOO|OOpOO:varlen_backward", kwlist, &dout, &qs, &ks, &v,
                                     &w, &out, &lse, &dq, &dk, &dv, &dw, &cuq, &cuk, &maxq, &maxk, &causal, &scale,
                                     &nthreads))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_varlen_params vp;
    const DLTensor *q0;
    int rc = fill_varlen(&vp, &hd, qs, ks, v, w, out, lse, cuq, cuk, maxq, maxk, causal, scale, nthreads, 0, &q0);
    if (rc == 0) rc = take_varlen_grads(&vp, &hd, q0, dout, dq, dk, dv, dw);
    if (rc == 0) rc = check_overlaps(&hd);
    if (rc == 0) rc = run_varlen(&vp, 1);
    free((void *)vp.cu_q);
    free((void *)vp.cu_k);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef binding_varlen_methods[] = {
    {"varlen_forward", (PyCFunction)(void (*)(void))py_varlen_forward, METH_VARARGS | METH_KEYWORDS,
     varlen_forward_doc},
    {"varlen_backward", (PyCFunction)(void (*)(void))py_varlen_backward, METH_VARARGS | METH_KEYWORDS,
     varlen_backward_doc},
    {NULL, NULL, 0, NULL},
};
