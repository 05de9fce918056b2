/*
 * hkt._C's windowed attention call: window, both directions
 * (hkt_window.h; docs/contract.md section 1.11).
 */
#include "binding.h"
#include "hkt_window.h"

/* One C-contiguous array of the windowed call: dtype and device of q[0],
 * shape want (nd of them); an output is noted for the overlap check. */
static int win_array(held *hd, PyObject *obj, const char *name, const DLTensor *ref, const int64_t *want, int nd,
                     int output, const void **ptr) {
    const DLTensor *t = import_array(hd, obj, name);
    if (t == NULL || check_real(t, name, ref) || check_shape(t, name, want, nd, "", 0)) return -1;
    int64_t s = 1;
    for (int d = nd - 1; d >= 0; d--) {
        if (t->shape[d] > 1 && stride_of(t, d) != s && !is_empty(t)) {
            PyErr_Format(PyExc_ValueError, "%s: the windowed kernels take C-contiguous arrays", name);
            return -1;
        }
        s *= t->shape[d];
    }
    note_span(hd, t, name, output);
    *ptr = data_of(t);
    return 0;
}

/* L arrays of a sequence (q, k, vs, dq, dk, dvs): level l's shape is want
 * with dimension 2 replaced by ceil(n / 2^l), or by n itself at every level
 * for n < 0 (-n: a decoding call's new rows) */
static int win_levels(held *hd, PyObject *seq, const char *base, int L, const DLTensor *ref, const int64_t *want,
                      int64_t n, int output, const void **ptrs) {
    PyObject *t;
    if (sequence_of(seq, base, &t)) return -1;
    int rc = 0;
    if (PyTuple_Size(t) != L) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d levels, got %zd", base, L, PyTuple_Size(t));
        rc = -1;
    }
    for (int l = 0; rc == 0 && l < L; l++) {
        char name[24];
        level_name(name, base, l);
        const int64_t shape[4] = {want[0], want[1], n < 0 ? -n : level_len(n, l), want[3]};
        rc = win_array(hd, PyTuple_GetItem(t, l), name, ref, shape, 4, output, &ptrs[l]);
    }
    Py_DECREF(t);
    return rc;
}

/* a call's workspace, 64-byte aligned (SIZE_MAX: it does not fit a size_t);
 * NULL with MemoryError set where it cannot be had */
static char *win_workspace(size_t bytes) {
    char *mem = bytes == SIZE_MAX ? NULL : aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (mem == NULL)
        PyErr_Format(PyExc_MemoryError, "k[0]: the windowed kernels' workspace (%zu bytes) could not be allocated",
                     bytes);
    return mem;
}

/* What both windowed calls end with: the workspace freed, the tuples they
 * made (NULL where not made) and the arrays they imported released; None, or
 * NULL for an error (rc != 0, already set). */
static PyObject *win_finish(int rc, char *mem, held *hd, PyObject *qt, PyObject *kt, PyObject *rt, PyObject *vt) {
    free(mem);
    Py_XDECREF(qt);
    Py_XDECREF(kt);
    Py_XDECREF(rt);
    Py_XDECREF(vt);
    release_all(hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* radius: L ints, W_l / 2^l (0: no window), into p->radius; growing windows
 * (W_l > W_{l-1}, i.e. radius_l > radius_{l-1} / 2; none above a level
 * without one), as the kernels need. */
static int win_radius(int L, int64_t *radius, PyObject *rt) {
    if (PyTuple_Size(rt) != L) {
        PyErr_Format(PyExc_ValueError, "radius: expected %d entries, got %zd", L, PyTuple_Size(rt));
        return -1;
    }
    for (int l = 0; l < L; l++) {
        const long long r = PyLong_AsLongLong(PyTuple_GetItem(rt, l));
        if (r == -1 && PyErr_Occurred()) return -1;
        const long long below = l ? (long long)radius[l - 1] : -1;
        if (r < 0 || (l && below == 0 && r != 0) || (l && r != 0 && 2 * r <= below)) {
            PyErr_Format(PyExc_ValueError, "radius[%d]: %lld does not make the windows grow with the level", l, r);
            return -1;
        }
        radius[l] = r;
    }
    return 0;
}

/* What both windowed calls begin with: q and k as tuples of L levels, radius
 * (growing windows) into radius_out, and q[0], a 4-D float32 or float64 CPU
 * array, whose dtype goes into *dtype.  NULL on an error (set). */
static const DLTensor *win_start(held *hd, PyObject *qs, PyObject *ks, PyObject *radius, PyObject **qt,
                                 PyObject **kt, PyObject **rt, int *L, int64_t *radius_out, int *dtype) {
    *L = level_tuples(qs, ks, "k", qt, kt);
    if (*L < 0 || sequence_of(radius, "radius", rt) || win_radius(*L, radius_out, *rt)) return NULL;
    const DLTensor *q0 = import_array(hd, PyTuple_GetItem(*qt, 0), "q[0]");
    if (q0 == NULL) return NULL;
    if (q0->ndim != 4 || q0->dtype.code != kDLFloat || (q0->dtype.bits != 32 && q0->dtype.bits != 64) ||
        q0->dtype.lanes != 1 || q0->device.device_type != kDLCPU) {
        PyErr_SetString(PyExc_TypeError, "q[0]: the windowed kernels take 4-D float32 or float64 CPU arrays");
        return NULL;
    }
    *dtype = q0->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
    return q0;
}

/* The optional arrays: attn_mask (into mask_kind, mask, mask_stride), the
 * per-level counts of a key-only mask, and the backward's dmask. */
static int win_extras(hkt_window_params *p, held *hd, const DLTensor *q0, PyObject *mask, PyObject *counts,
                      PyObject *dmask) {
    const int64_t full[4] = {p->B, p->H, p->T, p->S};
    if (mask != Py_None && !take_mask(hd, mask, q0, full, &p->mask_kind, p->mask_stride, &p->mask)) return -1;
    if (counts != Py_None) {
        if (mask != Py_None) {
            PyErr_SetString(PyExc_ValueError, "counts: not with attn_mask (counts stand for a key-only mask)");
            return -1;
        }
        PyObject *ct;
        if (sequence_of(counts, "counts", &ct)) return -1;
        int rc = PyTuple_Size(ct) == p->L ? 0 : -1;
        if (rc) PyErr_Format(PyExc_ValueError, "counts: expected %d levels, got %zd", p->L, PyTuple_Size(ct));
        for (int l = 0; rc == 0 && l < p->L; l++) {
            char name[24];
            level_name(name, "counts", l);
            const int64_t want[3] = {p->B, p->H_kv, level_len(p->S, l)};
            rc = win_array(hd, PyTuple_GetItem(ct, l), name, q0, want, 3, 0, &p->counts[l]);
        }
        Py_DECREF(ct);
        if (rc) return -1;
    }
    if (dmask != Py_None) {
        if (p->mask_kind != HKT_MASK_FLOAT) {
            PyErr_SetString(PyExc_ValueError, "dmask: only a float attn_mask has a gradient");
            return -1;
        }
        if (win_array(hd, dmask, "dmask", q0, full, 4, 1, (const void **)&p->dmask)) return -1;
    }
    return 0;
}

PyDoc_STRVAR(window_doc,
"window(q, k, vs, w, out, lse, radius, is_causal=False, scale=1.0, num_threads=0,\n"
"       dout=None, dq=None, dk=None, dvs=None, dw=None, attn_mask=None, dropout_p=0.0,\n"
"       seed=0, counts=None, dmask=None, softcap=None)\n--\n\n"
"Windowed HKT attention (csrc/hkt_window.h).  q, k, vs: L C-contiguous arrays\n"
"(B, H, ceil(T/2^l), D), (B, H_kv, ceil(S/2^l), D), (B, H_kv, ceil(S/2^l), Dv),\n"
"vs[0] = v and vs[l] its level-l block sums; w (H, L); out (B, H, T, Dv), lse\n"
"(B, H, T); radius: L ints, W_l / 2^l (0: no window), growing as hkt_window.h\n"
"requires.  Without dout: the forward, writing out and lse.  With dout (like out):\n"
"the backward from out and lse, writing dq, dk, dvs (like q, k, vs) and dw (H, L).\n"
"attn_mask: None or 4-D, each dimension 1 or that of (B, H, T, S), bool or q's\n"
"dtype; dropout_p and seed as forward's; either makes the kernels visit every\n"
"key one by one.  counts: None or L arrays (B, H_kv, ceil(S/2^l)), each block's\n"
"visible keys (a key-only mask; vs then the visible keys' sums), not with\n"
"attn_mask.  dmask (backward, float attn_mask): (B, H, T, S) C-contiguous, the\n"
"score gradient of every entry.  softcap: None or 0.0 for none, else c > 0:\n"
"each combined score s becomes c * tanh(s / c) before the mask (the backward\n"
"takes the forward's).  float32 or float64, on the CPU.");

static PyObject *py_window(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "vs", "w", "out", "lse", "radius", "is_causal", "scale", "num_threads",
                             "dout", "dq", "dk", "dvs", "dw", "attn_mask", "dropout_p", "seed", "counts", "dmask",
                             "softcap", NULL};
    PyObject *qs, *ks, *vss, *w, *out, *lse, *radius, *nthreads = NULL;
    PyObject *dout = Py_None, *dqs = Py_None, *dks = Py_None, *dvss = Py_None, *dw = Py_None;
    PyObject *mask = Py_None, *counts = Py_None, *dmask = Py_None, *softcap = NULL;
    int causal = 0;
    double scale = 1.0, dropout_p = 0.0;
    unsigned long long seed = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOO|pdOOOOOOOdKOOO:window", kwlist, &qs, &ks, &vss, &w, &out,
                                     &lse, &radius, &causal, &scale, &nthreads, &dout, &dqs, &dks, &dvss, &dw,
                                     &mask, &dropout_p, &seed, &counts, &dmask, &softcap))
        return NULL;
    const int backward = dout != Py_None;
    hkt_window_params p;
    memset(&p, 0, sizeof p);
    p.is_causal = causal;
    p.scale = scale;
    p.dropout_p = dropout_p;
    p.seed = seed;
    if (!isfinite(scale)) {
        PyErr_SetString(PyExc_ValueError, "scale: must be finite");
        return NULL;
    }
    if (check_dropout(dropout_p) || parse_softcap(softcap, &p.softcap)) return NULL;
    if (parse_threads(nthreads, &p.num_threads)) return NULL;
    held hd;
    held_start(&hd);
    PyObject *qt = NULL, *kt = NULL, *rt = NULL;
    char *mem = NULL;
    int rc = -1;
    const DLTensor *q0 = win_start(&hd, qs, ks, radius, &qt, &kt, &rt, &p.L, p.radius, &p.dtype);
    if (q0 == NULL) goto done;
    const int L = p.L;
    p.B = q0->shape[0], p.H = q0->shape[1], p.T = q0->shape[2], p.D = q0->shape[3];
    {
        const DLTensor *k0 = import_array(&hd, PyTuple_GetItem(kt, 0), "k[0]");
        if (k0 == NULL) goto done;
        if (k0->ndim != 4) {
            PyErr_SetString(PyExc_ValueError, "k[0]: expected 4 dimensions (B, H_kv, S, D)");
            goto done;
        }
        p.H_kv = k0->shape[1], p.S = k0->shape[2];
        if (check_kv_heads("k[0]", p.H, p.H_kv)) goto done;
        PyObject *vt;
        if (sequence_of(vss, "vs", &vt)) goto done;
        const DLTensor *v0 = PyTuple_Size(vt) ? import_array(&hd, PyTuple_GetItem(vt, 0), "vs[0]") : NULL;
        Py_DECREF(vt);
        if (v0 == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "vs: expected one array per level");
            goto done;
        }
        p.Dv = v0->ndim == 4 ? v0->shape[3] : 0;
    }
    if (check_count("q[0]", "B x H x T x S", p.B, p.H, p.T, p.S)) goto done;
    const int64_t wq[4] = {p.B, p.H, p.T, p.D}, wk[4] = {p.B, p.H_kv, p.S, p.D}, wv[4] = {p.B, p.H_kv, p.S, p.Dv};
    const int64_t wo[4] = {p.B, p.H, p.T, p.Dv}, ww[2] = {p.H, L};
    /* re-imported as items of their sequences (the arrays above were shapes only) */
    if (win_levels(&hd, qt, "q", L, q0, wq, p.T, 0, p.q) || win_levels(&hd, kt, "k", L, q0, wk, p.S, 0, p.k) ||
        win_levels(&hd, vss, "vs", L, q0, wv, p.S, 0, p.vs) || win_array(&hd, w, "w", q0, ww, 2, 0, &p.w) ||
        win_array(&hd, out, "out", q0, wo, 4, !backward, (const void **)&p.out) ||
        win_array(&hd, lse, "lse", q0, wo, 3, !backward, (const void **)&p.lse))
        goto done;
    if (win_extras(&p, &hd, q0, mask, counts, backward ? dmask : Py_None)) goto done;
    if (!backward && dmask != Py_None) {
        PyErr_SetString(PyExc_ValueError, "dmask: a backward array (give dout too)");
        goto done;
    }
    if (backward &&
        (win_array(&hd, dout, "dout", q0, wo, 4, 0, &p.dout) ||
         win_levels(&hd, dqs, "dq", L, q0, wq, p.T, 1, (const void **)p.dq) ||
         win_levels(&hd, dks, "dk", L, q0, wk, p.S, 1, (const void **)p.dk) ||
         win_levels(&hd, dvss, "dvs", L, q0, wv, p.S, 1, (const void **)p.dvs) ||
         win_array(&hd, dw, "dw", q0, ww, 2, 1, (const void **)&p.dw)))
        goto done;
    if (check_overlaps(&hd) || check_caller_stack()) goto done;
    if (!(mem = win_workspace(hkt_window_workspace_bytes(&p, backward)))) goto done;
    p.workspace = mem;
    Py_BEGIN_ALLOW_THREADS
    if (backward) hkt_window_backward_cpu(&p);
    else hkt_window_forward_cpu(&p);
    Py_END_ALLOW_THREADS
    rc = 0;
done:
    return win_finish(rc, mem, &hd, qt, kt, rt, NULL);
}


/* A decoding cache's levels: k[l] (B, H_kv, rows_l, D) and vs[l] (B, H_kv,
 * rows_l, Dv), each level's rows its own (a ring, or every block), at least
 * one where a row is to be computed; rows_l into p->cap[l]. */
static int win_cache_levels(hkt_window_decode_params *p, held *hd, PyObject *kt, PyObject *vt, const DLTensor *q0) {
    if (PyTuple_Size(vt) != p->L) {
        PyErr_Format(PyExc_ValueError, "vs: expected %d levels, got %zd", p->L, PyTuple_Size(vt));
        return -1;
    }
    for (int l = 0; l < p->L; l++) {
        char kname[24], vname[24];
        level_name(kname, "k", l);
        level_name(vname, "vs", l);
        const DLTensor *kl = import_array(hd, PyTuple_GetItem(kt, l), kname);
        if (kl == NULL) return -1;
        p->cap[l] = kl->ndim == 4 ? kl->shape[2] : 0;
        if (p->cap[l] < 1 && p->B * p->H * p->n > 0) {
            PyErr_Format(PyExc_ValueError, "%s: expected (B, H_kv, rows, D) with at least one row", kname);
            return -1;
        }
        const int64_t need = level_len(p->t0 + p->n, l);
        if (p->radius[l] == 0 && p->cap[l] < need && p->B * p->H * p->n > 0) {
            PyErr_Format(PyExc_ValueError, "%s: a level without a window keeps every block: expected at least "
                         "%lld rows for positions through %lld, got %lld", kname, (long long)need,
                         (long long)(p->t0 + p->n - 1), (long long)p->cap[l]);
            return -1;
        }
        const int64_t wk[4] = {p->B, p->H_kv, p->cap[l], p->D}, wv[4] = {p->B, p->H_kv, p->cap[l], p->Dv};
        if (win_array(hd, PyTuple_GetItem(kt, l), kname, q0, wk, 4, 0, &p->k[l]) ||
            win_array(hd, PyTuple_GetItem(vt, l), vname, q0, wv, 4, 0, &p->vs[l]))
            return -1;
    }
    return 0;
}

PyDoc_STRVAR(window_decode_doc,
"window_decode(q, k, vs, w, out, t0, radius, scale=1.0, num_threads=0, softcap=None)\n--\n\n"
"Decoding with windows (csrc/hkt_window.h): the causal rows of positions t0 ..\n"
"t0 + n - 1 against a cache that already holds their keys and block sums.  q: L\n"
"arrays (B, H, n, D), row i the level-l query of position t0 + i's block; k: L\n"
"arrays (B, H_kv, rows_l, D); vs: L arrays (B, H_kv, rows_l, Dv), vs[0] the values,\n"
"vs[l] the complete level-l blocks' sums; level-l block c in row c % rows_l (a\n"
"ring, or every block); w (H, L); out (B, H, n, Dv), written.  softcap as\n"
"window's.  C-contiguous float32 or float64 CPU arrays.");

static PyObject *py_window_decode(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "vs", "w", "out", "t0", "radius", "scale", "num_threads", "softcap", NULL};
    PyObject *qs, *ks, *vss, *w, *out, *radius, *nthreads = NULL, *softcap = NULL;
    long long t0;
    double scale = 1.0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOLO|dOO:window_decode", kwlist, &qs, &ks, &vss, &w, &out, &t0,
                                     &radius, &scale, &nthreads, &softcap))
        return NULL;
    hkt_window_decode_params p;
    memset(&p, 0, sizeof p);
    p.scale = scale;
    p.t0 = t0;
    if (!isfinite(scale)) {
        PyErr_SetString(PyExc_ValueError, "scale: must be finite");
        return NULL;
    }
    if (parse_softcap(softcap, &p.softcap)) return NULL;
    if (t0 < 0 || t0 > ((long long)1 << 48)) { /* positions' sums and counts stay far inside int64 */
        PyErr_Format(PyExc_ValueError, "t0: must be in [0, 2^48], got %lld", t0);
        return NULL;
    }
    if (parse_threads(nthreads, &p.num_threads)) return NULL;
    held hd;
    held_start(&hd);
    PyObject *qt = NULL, *kt = NULL, *rt = NULL, *vt = NULL;
    char *mem = NULL;
    int rc = -1;
    const DLTensor *q0 = win_start(&hd, qs, ks, radius, &qt, &kt, &rt, &p.L, p.radius, &p.dtype);
    const int L = p.L;
    const DLTensor *k0 = q0 ? import_array(&hd, PyTuple_GetItem(kt, 0), "k[0]") : NULL;
    if (k0 == NULL || sequence_of(vss, "vs", &vt)) goto done;
    const DLTensor *v0 = PyTuple_Size(vt) ? import_array(&hd, PyTuple_GetItem(vt, 0), "vs[0]") : NULL;
    if (v0 == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "vs: expected one array per level");
        goto done;
    }
    if (k0->ndim != 4 || v0->ndim != 4) {
        PyErr_SetString(PyExc_ValueError, "k[0], vs[0]: expected 4 dimensions (B, H_kv, cap, D)");
        goto done;
    }
    p.B = q0->shape[0], p.H = q0->shape[1], p.n = q0->shape[2], p.D = q0->shape[3];
    p.H_kv = k0->shape[1], p.Dv = v0->shape[3];
    if (check_kv_heads("k[0]", p.H, p.H_kv) || win_cache_levels(&p, &hd, kt, vt, q0)) goto done;
    const int64_t wq[4] = {p.B, p.H, p.n, p.D}, wo[4] = {p.B, p.H, p.n, p.Dv}, ww[2] = {p.H, L};
    if (win_levels(&hd, qt, "q", L, q0, wq, -p.n, 0, p.q) || win_array(&hd, w, "w", q0, ww, 2, 0, &p.w) ||
        win_array(&hd, out, "out", q0, wo, 4, 1, (const void **)&p.out) || check_overlaps(&hd) ||
        check_caller_stack())
        goto done;
    if (!(mem = win_workspace(hkt_window_decode_workspace_bytes(&p)))) goto done;
    p.workspace = mem;
    Py_BEGIN_ALLOW_THREADS
    hkt_window_decode_cpu(&p);
    Py_END_ALLOW_THREADS
    rc = 0;
done:
    return win_finish(rc, mem, &hd, qt, kt, rt, vt);
}

PyDoc_STRVAR(window_softcap_doc,
"window_softcap(softcap)\n--\n\n"
"softcap as window and window_decode take it: 0.0 for None or 0.0, else the\n"
"positive finite float; raises what they would (TypeError, ValueError).  For\n"
"the Python layer, whose ops carry it as a float.");

static PyObject *py_window_softcap(PyObject *self, PyObject *softcap) {
    double c;
    (void)self;
    if (parse_softcap(softcap, &c)) return NULL;
    return PyFloat_FromDouble(c);
}

PyMethodDef binding_window_methods[] = {
    {"window_softcap", py_window_softcap, METH_O, window_softcap_doc},
    {"window", (PyCFunction)(void (*)(void))py_window, METH_VARARGS | METH_KEYWORDS, window_doc},
    {"window_decode", (PyCFunction)(void (*)(void))py_window_decode, METH_VARARGS | METH_KEYWORDS,
     window_decode_doc},
    {NULL, NULL, 0, NULL},
};
