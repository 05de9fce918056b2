/*
 * hkt._C's decoding call: decode, the attention of new positions against a KV
 * cache (hkt_decode.c), which may first write the new keys and values into the
 * caches.
 */
#include "binding.h"

/* ---- decoding with a KV cache (hkt_decode.c) ---- */

/* cache_seqlens: an int (every batch row) or a 1-D int32/int64 CPU array of B
 * entries, each >= 0 with room for Tn more positions in S_max.  Read into
 * *out (B entries; the caller frees it). */
static int take_seqlens(held *hd, PyObject *obj, int64_t B, int64_t Tn, int64_t S_max, int64_t **out) {
    *out = malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    if (!*out) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyLong_Check(obj) && !PyBool_Check(obj)) {
        int overflow = 0;
        const long long n = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (n == -1 && PyErr_Occurred()) return -1;
        for (int64_t b = 0; b < B; b++) (*out)[b] = overflow > 0 ? INT64_MAX : overflow < 0 ? INT64_MIN : n;
    } else if (PyBool_Check(obj) || PyFloat_Check(obj) || obj == Py_None) {
        char tn[128];
        PyErr_Format(PyExc_TypeError, "cache_seqlens: expected an int or an int32/int64 array of shape (B,), got "
                     "%.100s", type_name(obj, tn, sizeof tn));
        return -1;
    } else {
        const DLTensor *t = import_array(hd, obj, "cache_seqlens");
        if (!t) return -1;
        if (t->dtype.code != kDLInt || (t->dtype.bits != 32 && t->dtype.bits != 64) || t->dtype.lanes != 1) {
            PyErr_Format(PyExc_TypeError, "cache_seqlens: dtype must be int32 or int64, got %s", dtype_name(t->dtype));
            return -1;
        }
        if (t->device.device_type != kDLCPU) {
            PyErr_Format(PyExc_ValueError, "cache_seqlens: must be on the CPU (device type %d)", t->device.device_type);
            return -1;
        }
        const int64_t want[1] = {B};
        if (check_shape(t, "cache_seqlens", want, 1, "= (B,)", 0)) return -1;
        const char *at = data_of(t);
        const int64_t st = B > 1 ? stride_of(t, 0) : 0;
        for (int64_t b = 0; b < B; b++) {
            if (t->dtype.bits == 32) {
                int32_t x;
                memcpy(&x, at + b * st * 4, 4);
                (*out)[b] = x;
            } else {
                memcpy(&(*out)[b], at + b * st * 8, 8);
            }
        }
    }
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = (*out)[b];
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "cache_seqlens: cache_seqlens[%lld] = %lld is negative", (long long)b,
                         (long long)n);
            return -1;
        }
        if (n > S_max - Tn) {
            PyErr_Format(PyExc_ValueError, "v_cache: too small: it holds S_max = %lld positions, and "
                         "cache_seqlens[%lld] + Tn = %lld + %lld do not fit", (long long)S_max, (long long)b,
                         (long long)n, (long long)Tn);
            return -1;
        }
    }
    return 0;
}

/* k_cache[0] (into *k0, for take_decode_levels) and v_cache: H_kv (dividing H),
 * S_max and Dv; written = the caches are outputs (k and v given). */
static int take_cache0(hkt_decode_params *p, held *hd, PyObject *kt, PyObject *vc, const DLTensor *q0,
                       int written, int64_t *S_max, const DLTensor **k0_out) {
    const DLTensor *k0 = *k0_out = import_array(hd, PyTuple_GetItem(kt, 0), "k_cache[0]");
    if (!k0) return -1;
    if (k0->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "k_cache[0]: expected 4 dimensions (B, H_kv, S_max, D), got %d", k0->ndim);
        return -1;
    }
    p->H_kv = k0->shape[1];
    if (check_kv_heads("k_cache[0]", p->H, p->H_kv)) return -1;
    const DLTensor *vt = import_array(hd, vc, "v_cache");
    if (!vt) return -1;
    if (vt->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "v_cache: expected 4 dimensions (B, H_kv, S_max, Dv), got %d", vt->ndim);
        return -1;
    }
    *S_max = vt->shape[2];
    p->Dv = vt->shape[3];
    const int64_t want[4] = {p->B, p->H_kv, *S_max, p->Dv};
    const void *ptr;
    if (check_count("v_cache", "B x H_kv x S_max x Dv", p->B, p->H_kv, *S_max, p->Dv) ||
        check_count("v_cache", "query-key pairs B x H x Tn x S_max", p->B, p->H, p->Tn, *S_max) ||
        take_4d(vt, "v_cache", q0, want, "= (B, H_kv, S_max, Dv) like k_cache[0]", 0, 0, &ptr, p->v_cache_stride) ||
        (written && check_disjoint(vt, "v_cache", "is written in place (k and v given)")))
        return -1;
    p->v_cache = (void *)ptr;
    note_span(hd, vt, "v_cache", written);
    return 0;
}

/* q[l] (B, H, Tn, D) and k_cache[l] (B, H_kv, >= ceil(S_max / 2^l), D); level 0's
 * imported already (each array is imported once: a capsule is consumed). */
static int take_decode_levels(hkt_decode_params *p, held *hd, PyObject *qt, PyObject *kt, const DLTensor *q0,
                              const DLTensor *k0, int64_t S_max, int written) {
    char name[32];
    for (int l = 0; l < p->L; l++) {
        const int64_t wq[4] = {p->B, p->H, p->Tn, p->D};
        const DLTensor *t;
        level_name(name, "q", l);
        t = l ? import_array(hd, PyTuple_GetItem(qt, l), name) : q0;
        if (!t || take_4d(t, name, q0, wq, "= (B, H, Tn, D) like q[0]", 0, 0, &p->q[l], p->q_stride[l])) return -1;
        note_span(hd, t, name, 0);
        level_name(name, "k_cache", l);
        t = l ? import_array(hd, PyTuple_GetItem(kt, l), name) : k0;
        if (!t) return -1;
        const int64_t need = level_len(S_max, l);
        const int64_t wk[4] = {p->B, p->H_kv, t->ndim == 4 && t->shape[2] > need ? t->shape[2] : need, p->D};
        const void *ptr;
        if (take_4d(t, name, q0, wk, "= (B, H_kv, at least ceil(S_max/%lld), D)", 1LL << l, 0, &ptr,
                    p->k_cache_stride[l]) ||
            (written && check_disjoint(t, name, "is written in place (k and v given)")))
            return -1;
        p->k_cache[l] = (void *)ptr;
        note_span(hd, t, name, written);
    }
    return 0;
}

/* k[l] (B, H_kv, Tn, D) and v (B, H_kv, Tn, Dv), the new positions' keys and
 * values, both given or neither. */
static int take_new_kv(hkt_decode_params *p, held *hd, PyObject *ks, PyObject *v, const DLTensor *q0) {
    if ((ks == Py_None) != (v == Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s: k and v must be given together (or neither), got %s = None",
                     ks == Py_None ? "k" : "v", ks == Py_None ? "k" : "v");
        return -1;
    }
    if (ks == Py_None) return 0;
    PyObject *kt;
    char name[32];
    if (sequence_of(ks, "k", &kt)) return -1;
    int rc = -1;
    if (PyTuple_Size(kt) != p->L) {
        PyErr_Format(PyExc_ValueError, "k: expected %d levels like q, got %zd", p->L, PyTuple_Size(kt));
        goto done;
    }
    for (int l = 0; l < p->L; l++) {
        const int64_t want[4] = {p->B, p->H_kv, p->Tn, p->D};
        level_name(name, "k", l);
        const DLTensor *t = import_array(hd, PyTuple_GetItem(kt, l), name);
        if (!t || take_4d(t, name, q0, want, "= (B, H_kv, Tn, D)", 0, 0, &p->k_new[l], p->k_new_stride[l]))
            goto done;
        note_span(hd, t, name, 0);
    }
    const DLTensor *t = import_array(hd, v, "v");
    const int64_t want[4] = {p->B, p->H_kv, p->Tn, p->Dv};
    if (!t || take_4d(t, "v", q0, want, "= (B, H_kv, Tn, Dv)", 0, 0, &p->v_new, p->v_new_stride)) goto done;
    note_span(hd, t, "v", 0);
    rc = 0;
done:
    Py_DECREF(kt);
    return rc;
}

/* w through take_weights, which fills an hkt_params: (L,) or (H, L). */
static int take_decode_weights(hkt_decode_params *p, held *hd, PyObject *w, const DLTensor *q0) {
    hkt_params tmp;
    memset(&tmp, 0, sizeof tmp);
    tmp.H = p->H;
    tmp.L = p->L;
    if (take_weights(&tmp, hd, w, q0)) return -1;
    p->w = tmp.w;
    p->w_stride[0] = tmp.w_per_head ? tmp.w_stride[0] : 0;
    p->w_stride[1] = tmp.w_stride[1];
    return 0;
}

/* Checks every argument of decode and fills p; *seqlens is the caller's to free. */
static int fill_decode(hkt_decode_params *p, held *hd, PyObject *qs, PyObject *kcs, PyObject *vc, PyObject *w,
                       PyObject *seqlens, PyObject *out, PyObject *ks, PyObject *v, PyObject *scale,
                       PyObject *softcap, PyObject *sliding_window, PyObject *nthreads, int64_t **lens) {
    PyObject *qt = NULL, *kt = NULL;
    const DLTensor *k0 = NULL;
    int rc = -1;
    const int written = ks != Py_None || v != Py_None;
    int64_t S_max = 0;
    memset(p, 0, sizeof *p);
    *lens = NULL;
    if ((p->L = level_tuples(qs, kcs, "k_cache", &qt, &kt)) < 0) goto done;
    /* the device first: take_q0 would suggest a CUDA build, which decodes on the CPU too */
    const DLTensor *q0 = import_array(hd, PyTuple_GetItem(qt, 0), "q[0]");
    if (!q0) goto done;
    if (q0->device.device_type != kDLCPU) {
        PyErr_Format(PyExc_ValueError, "q[0]: decoding with a KV cache runs on the CPU only (device type %d)",
                     q0->device.device_type);
        goto done;
    }
    if (!check_q0(q0, 0)) goto done;
    p->dtype = q0->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p->B = q0->shape[0];
    p->H = q0->shape[1];
    p->Tn = q0->shape[2];
    p->D = q0->shape[3];
    if (check_count("q[0]", "B x H x Tn x D", p->B, p->H, p->Tn, p->D) ||
        take_cache0(p, hd, kt, vc, q0, written, &S_max, &k0) ||
        take_decode_levels(p, hd, qt, kt, q0, k0, S_max, written) ||
        take_decode_weights(p, hd, w, q0) || take_seqlens(hd, seqlens, p->B, p->Tn, S_max, lens) ||
        take_new_kv(p, hd, ks, v, q0))
        goto done;
    p->seqlens = *lens;
    const DLTensor *ot = import_array(hd, out, "out");
    const int64_t want[4] = {p->B, p->H, p->Tn, p->Dv};
    const void *ptr;
    if (!ot || take_4d(ot, "out", q0, want, "= (B, H, Tn, Dv)", 0, 1, &ptr, p->out_stride)) goto done;
    p->out = (void *)ptr;
    note_span(hd, ot, "out", 1);
    if (parse_scale(scale, p->D, &p->scale) || parse_softcap(softcap, &p->softcap) ||
        parse_sliding_window(sliding_window, &p->sliding_window) || parse_threads(nthreads, &p->num_threads))
        goto done;
    rc = 0;
done:
    Py_XDECREF(qt);
    Py_XDECREF(kt);
    return rc;
}

PyDoc_STRVAR(decode_doc,
"decode(q, k_cache, v_cache, w, cache_seqlens, out, k=None, v=None, scale=None,\n"
"       num_threads=0, softcap=None, sliding_window=None)\n--\n\n"
"HKT attention of Tn new positions against a KV cache (CPU, forward only).\n"
"q: L arrays (B, H, Tn, D), row i the level-l query of position\n"
"t_i = cache_seqlens[b] + i; k_cache: L arrays (B, H_kv, >= ceil(S_max/2^l), D);\n"
"v_cache (B, H_kv, S_max, Dv), H_kv dividing H; w (L,) or (H, L);\n"
"cache_seqlens: an int or a 1-D int32/int64 CPU array (B,), each >= 0 and\n"
"<= S_max - Tn (read, never updated).  Row i sees keys j <= t_i.  Writes out\n"
"(B, H, Tn, Dv), C-contiguous.  k (L arrays (B, H_kv, Tn, D)) and v\n"
"(B, H_kv, Tn, Dv), given together, are first written into the caches (level l\n"
"slot t_i >> l, in order of i); the caches must then share memory with no\n"
"other argument nor overlap themselves.  softcap: None or 0.0 for none, else\n"
"c > 0: each score s becomes c tanh(s / c), as in forward.  sliding_window:\n"
"None for none, else an int W >= 1: row i sees keys t_i - W < j <= t_i only.");

static PyObject *py_decode(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k_cache", "v_cache", "w", "cache_seqlens", "out", "k", "v", "scale",
                             "num_threads", "softcap", "sliding_window", NULL};
    PyObject *qs, *kcs, *vc, *w, *seqlens, *out, *ks = Py_None, *v = Py_None, *scale = Py_None, *nthreads = NULL;
    PyObject *softcap = NULL, *sliding_window = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OOOOOO:decode", kwlist, &qs, &kcs, &vc, &w, &seqlens, &out,
                                     &ks, &v, &scale, &nthreads, &softcap, &sliding_window))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_decode_params p;
    int64_t *lens = NULL;
    int rc = fill_decode(&p, &hd, qs, kcs, vc, w, seqlens, out, ks, v, scale, softcap, sliding_window, nthreads,
                         &lens);
    if (rc == 0) rc = check_overlaps(&hd);
    if (rc == 0) rc = check_caller_stack();
    char *mem = NULL;
    if (rc == 0) {
        const size_t need = hkt_decode_workspace_bytes(&p);
        if (!(mem = malloc(need))) {
            char gib[32]; /* PyErr_Format has no %g */
            snprintf(gib, sizeof gib, "%.3g", (double)need / 1073741824.0);
            PyErr_Format(PyExc_MemoryError, "v_cache: decoding needs %s GiB of workspace, which could not be "
                         "allocated", gib);
            rc = -1;
        }
    }
    if (rc == 0) {
        p.workspace = mem;
        Py_BEGIN_ALLOW_THREADS
        hkt_decode_cpu(&p);
        Py_END_ALLOW_THREADS
    }
    free(mem);
    free(lens);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef binding_decode_methods[] = {
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_VARARGS | METH_KEYWORDS, decode_doc},
    {NULL, NULL, 0, NULL},
};
