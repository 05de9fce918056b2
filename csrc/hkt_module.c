/*
 * hkt._C -- the one file that knows Python.
 *
 * Raw CPython C API (no pybind11).  Arrays arrive through DLPack, so any
 * exporter works (torch tensors, NumPy arrays); nothing here links libtorch.
 * Every argument is checked here, with a message that names it, before the
 * kernels see a plain hkt_params struct.  The GIL is released around kernels.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"
#include "hkt.h"

/* ---- DLPack import ----
 * Capsules are held for the duration of a call and released afterwards; we
 * never rename them to "used_dltensor", so the exporter's capsule destructor
 * runs the deleter and the producer keeps ownership of the memory. */
#define MAX_HELD (6 * HKT_MAX_LEVELS + 16)

typedef struct {
    PyObject *caps[MAX_HELD];
    int n;
} held;

static void release_all(held *hd) {
    for (int x = 0; x < hd->n; x++) Py_DECREF(hd->caps[x]);
    hd->n = 0;
}

static const DLTensor *import_array(held *hd, PyObject *obj, const char *name) {
    if (PyCapsule_CheckExact(obj)) {
        /* an unconsumed capsule, e.g. from torch.utils.dlpack.to_dlpack: the
         * cheapest way in; its creator still owns it */
        if (!PyCapsule_IsValid(obj, "dltensor")) {
            PyErr_Format(PyExc_TypeError, "%s: a DLPack capsule must be an unconsumed 'dltensor'", name);
            return NULL;
        }
        if (hd->n >= MAX_HELD) {
            PyErr_SetString(PyExc_ValueError, "too many arrays in one call");
            return NULL;
        }
        Py_INCREF(obj);
        hd->caps[hd->n++] = obj;
        return &((DLManagedTensor *)PyCapsule_GetPointer(obj, "dltensor"))->dl_tensor;
    }
    if (obj == Py_None || !PyObject_HasAttrString(obj, "__dlpack__")) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a tensor or array that supports DLPack "
                     "(torch.Tensor, numpy.ndarray) or a DLPack capsule, got %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyObject *cap = PyObject_CallMethod(obj, "__dlpack__", NULL);
    if (cap == NULL) {
        /* e.g. a tensor that requires grad, or a read-only array */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *msg = value ? PyObject_Str(value) : NULL;
        PyErr_Format(PyExc_ValueError, "%s: cannot be exported through DLPack: %s", name,
                     msg ? PyUnicode_AsUTF8(msg) : "unknown error");
        Py_XDECREF(msg);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    DLManagedTensor *mt = (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
    if (mt == NULL) {
        Py_DECREF(cap);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__ did not return a 'dltensor' capsule", name);
        return NULL;
    }
    if (hd->n >= MAX_HELD) {
        Py_DECREF(cap);
        PyErr_SetString(PyExc_ValueError, "too many arrays in one call");
        return NULL;
    }
    hd->caps[hd->n++] = cap;
    return &mt->dl_tensor;
}

/* ---- checks ---- */
static int64_t stride_of(const DLTensor *t, int d) {
    if (t->strides) return t->strides[d];
    int64_t s = 1;
    for (int x = t->ndim - 1; x > d; x--) s *= t->shape[x];
    return s;
}

static void *data_of(const DLTensor *t) { return (char *)t->data + t->byte_offset; }

static void format_shape(char *buf, size_t n, const int64_t *shape, int nd) {
    size_t at = 0;
    at += (size_t)snprintf(buf + at, n - at, "(");
    for (int d = 0; d < nd && at < n; d++)
        at += (size_t)snprintf(buf + at, n - at, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (at < n) snprintf(buf + at, n - at, nd == 1 ? ",)" : ")");
}

static const char *dtype_name(DLDataType dt) {
    if (dt.lanes != 1) return "vector";
    switch (dt.code) {
    case kDLFloat: return dt.bits == 32 ? "float32" : dt.bits == 64 ? "float64" : dt.bits == 16 ? "float16" : "float";
    case kDLBfloat: return "bfloat16";
    case kDLInt: return "int";
    case kDLUInt: return dt.bits == 8 ? "uint8" : "uint";
    case kDLBool: return "bool";
    default: return "unknown";
    }
}

/* Shape must equal want (ndim nd). */
static int check_shape(const DLTensor *t, const char *name, const int64_t *want, int nd,
                       const char *meaning) {
    int ok = t->ndim == nd;
    for (int d = 0; ok && d < nd; d++) ok = t->shape[d] == want[d];
    if (ok) return 0;
    char got[160], exp[160];
    format_shape(got, sizeof got, t->shape, t->ndim);
    format_shape(exp, sizeof exp, want, nd);
    PyErr_Format(PyExc_ValueError, "%s: expected shape %s %s, got %s", name, exp, meaning, got);
    return -1;
}

static int check_device(const DLTensor *t, const char *name, const DLTensor *ref) {
    if (t->device.device_type != ref->device.device_type || t->device.device_id != ref->device.device_id) {
        PyErr_Format(PyExc_ValueError, "%s: is on device %d:%d but q[0] is on %d:%d", name,
                     t->device.device_type, t->device.device_id, ref->device.device_type,
                     ref->device.device_id);
        return -1;
    }
    return 0;
}

static int check_real(const DLTensor *t, const char *name, const DLTensor *ref) {
    if (t->dtype.code != ref->dtype.code || t->dtype.bits != ref->dtype.bits || t->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: dtype %s does not match q[0]'s %s", name,
                     dtype_name(t->dtype), dtype_name(ref->dtype));
        return -1;
    }
    return check_device(t, name, ref);
}

static int is_empty(const DLTensor *t) {
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 1;
    return 0;
}

static int check_strides(const DLTensor *t, const char *name) {
    if (is_empty(t)) return 0; /* nothing is read, strides are arbitrary */
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1 && stride_of(t, d) < 0) {
            PyErr_Format(PyExc_ValueError, "%s: negative strides are not supported", name);
            return -1;
        }
    if (t->ndim > 0 && t->shape[t->ndim - 1] > 1 && stride_of(t, t->ndim - 1) != 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the last dimension must be contiguous (stride 1), got stride %lld",
                     name, (long long)stride_of(t, t->ndim - 1));
        return -1;
    }
    return 0;
}

/* Outputs are written by several threads: they must not overlap themselves. */
static int check_contiguous(const DLTensor *t, const char *name) {
    if (is_empty(t)) return 0; /* nothing is written, strides are arbitrary */
    int64_t s = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] > 1 && stride_of(t, d) != s) {
            PyErr_Format(PyExc_ValueError, "%s: output arrays must be C-contiguous", name);
            return -1;
        }
        s *= t->shape[d];
    }
    return 0;
}

/* A (B, H, rows, cols) array: shape, dtype, device, strides; fills ptr and strides. */
static int take_4d(const DLTensor *t, const char *name, const DLTensor *ref, const int64_t *want,
                   const char *meaning, int output, const void **ptr, int64_t *st3) {
    if (check_real(t, name, ref) || check_shape(t, name, want, 4, meaning) || check_strides(t, name))
        return -1;
    if (output && check_contiguous(t, name)) return -1;
    *ptr = data_of(t);
    for (int d = 0; d < 3; d++) st3[d] = stride_of(t, d);
    return 0;
}

static int64_t level_len(int64_t n, int l) { return n > 0 ? ((n - 1) >> l) + 1 : 0; }

static int sequence_of(PyObject *obj, const char *name, PyObject **fast) {
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a list or tuple of arrays, one per level, got %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *fast = PySequence_Fast(obj, name);
    return *fast ? 0 : -1;
}

/* Parses and checks everything forward and backward share; fills p. */
static int fill_common(hkt_params *p, held *hd, PyObject *qs, PyObject *ks, PyObject *v,
                       PyObject *w, PyObject *out, PyObject *lse, PyObject *mask,
                       int causal, PyObject *scale, double dropout_p, unsigned long long seed,
                       int num_threads, const DLTensor **q0_out) {
    PyObject *qf = NULL, *kf = NULL;
    char name[32];
    int rc = -1;
    memset(p, 0, sizeof *p);
    if (sequence_of(qs, "q", &qf) || sequence_of(ks, "k", &kf)) goto done;
    Py_ssize_t L = PySequence_Fast_GET_SIZE(qf);
    if (L < 1 || L > HKT_MAX_LEVELS) {
        PyErr_Format(PyExc_ValueError, "q: expected 1 to %d levels, got %zd", HKT_MAX_LEVELS, L);
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(kf) != L) {
        PyErr_Format(PyExc_ValueError, "k: expected %zd levels like q, got %zd", L,
                     PySequence_Fast_GET_SIZE(kf));
        goto done;
    }
    p->L = (int)L;
    const DLTensor *q0 = import_array(hd, PySequence_Fast_GET_ITEM(qf, 0), "q[0]");
    if (!q0) goto done;
    if (q0->dtype.code != kDLFloat || (q0->dtype.bits != 32 && q0->dtype.bits != 64) || q0->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "q[0]: dtype must be float32 or float64, got %s", dtype_name(q0->dtype));
        goto done;
    }
    if (q0->device.device_type != kDLCPU) {
#ifdef HKT_WITH_CUDA
        if (q0->device.device_type != kDLCUDA)
#endif
        {
            PyErr_Format(PyExc_ValueError,
                         "q[0]: device type %d is not supported by this build of hkt (CPU%s)",
                         q0->device.device_type,
#ifdef HKT_WITH_CUDA
                         " and CUDA"
#else
                         " only; rebuild with HKT_CUDA=1 for CUDA"
#endif
            );
            goto done;
        }
    }
    if (q0->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "q[0]: expected 4 dimensions (B, H, T, D), got %d", q0->ndim);
        goto done;
    }
    p->dtype = q0->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p->B = q0->shape[0];
    p->H = q0->shape[1];
    p->T = q0->shape[2];
    p->D = q0->shape[3];
    if (p->D < 1) {
        PyErr_SetString(PyExc_ValueError, "q[0]: head dimension D must be at least 1");
        goto done;
    }
    const DLTensor *k0 = import_array(hd, PySequence_Fast_GET_ITEM(kf, 0), "k[0]");
    if (!k0) goto done;
    if (k0->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "k[0]: expected 4 dimensions (B, H, S, D), got %d", k0->ndim);
        goto done;
    }
    p->S = k0->shape[2];
    for (int l = 0; l < p->L; l++) {
        int64_t wq[4] = {p->B, p->H, level_len(p->T, l), p->D};
        int64_t wk[4] = {p->B, p->H, level_len(p->S, l), p->D};
        char meaning[64];
        const DLTensor *t;
        snprintf(name, sizeof name, "q[%d]", l);
        snprintf(meaning, sizeof meaning, "= (B, H, ceil(T/%lld), D)", (long long)1 << l);
        t = l ? import_array(hd, PySequence_Fast_GET_ITEM(qf, l), name) : q0;
        if (!t || take_4d(t, name, q0, wq, meaning, 0, &p->q[l], p->q_stride[l])) goto done;
        snprintf(name, sizeof name, "k[%d]", l);
        snprintf(meaning, sizeof meaning, "= (B, H, ceil(S/%lld), D)", (long long)1 << l);
        t = l ? import_array(hd, PySequence_Fast_GET_ITEM(kf, l), name) : k0;
        if (!t || take_4d(t, name, q0, wk, meaning, 0, &p->k[l], p->k_stride[l])) goto done;
    }
    const DLTensor *vt = import_array(hd, v, "v");
    if (!vt) goto done;
    if (vt->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "v: expected 4 dimensions (B, H, S, Dv), got %d", vt->ndim);
        goto done;
    }
    p->Dv = vt->shape[3];
    {
        int64_t want[4] = {p->B, p->H, p->S, p->Dv};
        if (take_4d(vt, "v", q0, want, "= (B, H, S, Dv)", 0, &p->v, p->v_stride)) goto done;
    }
    const DLTensor *wt = import_array(hd, w, "w");
    if (!wt || check_real(wt, "w", q0)) goto done;
    if (wt->ndim == 1) {
        int64_t want[1] = {p->L};
        if (check_shape(wt, "w", want, 1, "= (L,)")) goto done;
        p->w_per_head = 0;
        p->w_stride[0] = 0;
        p->w_stride[1] = stride_of(wt, 0);
    } else {
        int64_t want[2] = {p->H, p->L};
        if (check_shape(wt, "w", want, 2, "= (H, L) or (L,)")) goto done;
        p->w_per_head = 1;
        p->w_stride[0] = stride_of(wt, 0);
        p->w_stride[1] = stride_of(wt, 1);
    }
    p->w = data_of(wt);

    p->mask_kind = HKT_MASK_NONE;
    if (mask != Py_None) {
        const DLTensor *mt = import_array(hd, mask, "attn_mask");
        if (!mt) goto done;
        int64_t want[4] = {p->B, p->H, p->T, p->S};
        if (check_device(mt, "attn_mask", q0) || check_shape(mt, "attn_mask", want, 4, "= (B, H, T, S)"))
            goto done;
        if (mt->dtype.lanes == 1 && mt->dtype.bits == 8 && (mt->dtype.code == kDLBool || mt->dtype.code == kDLUInt)) {
            p->mask_kind = HKT_MASK_BOOL;
        } else if (mt->dtype.lanes == 1 && mt->dtype.code == q0->dtype.code && mt->dtype.bits == q0->dtype.bits) {
            p->mask_kind = HKT_MASK_FLOAT;
        } else {
            PyErr_Format(PyExc_TypeError, "attn_mask: dtype must be bool or %s like q[0], got %s",
                         dtype_name(q0->dtype), dtype_name(mt->dtype));
            goto done;
        }
        for (int d = 0; d < 4; d++) {
            p->mask_stride[d] = mt->shape[d] > 1 ? stride_of(mt, d) : 0;
            if (p->mask_stride[d] < 0) {
                PyErr_SetString(PyExc_ValueError, "attn_mask: negative strides are not supported");
                goto done;
            }
        }
        p->mask = data_of(mt);
    }

    const DLTensor *ot = import_array(hd, out, "out");
    if (!ot) goto done;
    {
        int64_t want[4] = {p->B, p->H, p->T, p->Dv};
        const void *ptr;
        if (take_4d(ot, "out", q0, want, "= (B, H, T, Dv)", 1, &ptr, p->out_stride)) goto done;
        p->out = (void *)ptr;
    }
    const DLTensor *lt = import_array(hd, lse, "lse");
    if (!lt) goto done;
    {
        int64_t want[3] = {p->B, p->H, p->T};
        if (check_real(lt, "lse", q0) || check_shape(lt, "lse", want, 3, "= (B, H, T)") ||
            check_contiguous(lt, "lse"))
            goto done;
        p->lse = data_of(lt);
    }

    p->causal = causal;
    if (scale == Py_None) {
        p->scale = 1.0 / sqrt((double)p->D);
    } else {
        p->scale = PyFloat_AsDouble(scale);
        if (p->scale == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "scale: expected a float or None, got %.100s",
                         Py_TYPE(scale)->tp_name);
            goto done;
        }
        if (!isfinite(p->scale)) {
            PyErr_Format(PyExc_ValueError, "scale: must be a finite number, got %R", scale);
            goto done;
        }
    }
    if (!(dropout_p >= 0.0 && dropout_p <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "dropout_p: must be in [0, 1], got %g", dropout_p);
        goto done;
    }
    p->dropout_p = dropout_p;
    p->seed = (uint64_t)seed;
    p->num_threads = num_threads > 0 ? num_threads : hkt_default_threads();
    /* a knob for tests and tuning, not API: HKT_KEY_CACHE_BYTES=0 forces per-tile key transposes */
    const char *cache = getenv("HKT_KEY_CACHE_BYTES");
    p->key_cache_bytes = cache ? strtoll(cache, NULL, 10) : -1;
    *q0_out = q0;
    rc = 0;
done:
    Py_XDECREF(qf);
    Py_XDECREF(kf);
    return rc;
}

/* Runs the kernel over p, GIL released: on the CPU with a freshly allocated
 * per-thread workspace; on CUDA without one (those kernels keep their own
 * device scratch, a host buffer would be of no use to them). */
static int run_kernel(hkt_params *p, int backward, const DLTensor *q0) {
#ifdef HKT_WITH_CUDA
    if (q0->device.device_type == kDLCUDA) {
        char err[256] = "unknown error";
        int rc;
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
    size_t per = hkt_workspace_bytes(p, backward);
    size_t extra = backward ? hkt_dw_partial_bytes(p) : 0;
    char *mem = PyMem_RawMalloc(per * (size_t)p->num_threads + extra + 64);
    if (!mem) {
        PyErr_NoMemory();
        return -1;
    }
    p->workspace = mem;
    p->dw_partial = backward ? mem + per * (size_t)p->num_threads : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (backward) hkt_backward_cpu(p);
    else hkt_forward_cpu(p);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(mem);
    return 0;
}

PyDoc_STRVAR(forward_doc,
"forward(q, k, v, w, out, lse, attn_mask=None, is_causal=False, scale=None,\n"
"        dropout_p=0.0, seed=0, num_threads=0)\n--\n\n"
"HKT attention forward.  q, k: sequences of L arrays (B, H, ceil(T/2^l), D) and\n"
"(B, H, ceil(S/2^l), D); v (B, H, S, Dv); w (L,) or (H, L).  Writes out\n"
"(B, H, T, Dv) and lse (B, H, T), both C-contiguous and of q's dtype.\n"
"attn_mask: None or (B, H, T, S) bool (True = visible) or float (added), any\n"
"strides.  num_threads <= 0 uses OpenMP's default.");

static PyObject *py_forward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "v", "w", "out", "lse", "attn_mask", "is_causal",
                             "scale", "dropout_p", "seed", "num_threads", NULL};
    PyObject *qs, *ks, *v, *w, *out, *lse, *mask = Py_None, *scale = Py_None;
    int causal = 0, nthreads = 0;
    double dropout_p = 0.0;
    unsigned long long seed = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OpOdKi:forward", kwlist, &qs, &ks, &v, &w,
                                     &out, &lse, &mask, &causal, &scale, &dropout_p, &seed, &nthreads))
        return NULL;
    held hd = {.n = 0};
    hkt_params p;
    const DLTensor *q0;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed,
                         nthreads, &q0);
    if (rc == 0) rc = run_kernel(&p, 0, q0);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* dq / dk: sequences of L outputs shaped like q / k. */
static int take_grads(held *hd, PyObject *seq, const char *base, const hkt_params *p,
                      const DLTensor *q0, int is_q, void **ptrs, int64_t (*strides)[3]) {
    PyObject *fast;
    char name[32];
    if (sequence_of(seq, base, &fast)) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != p->L) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d levels, got %zd", base, p->L,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (int l = 0; l < p->L; l++) {
        int64_t want[4] = {p->B, p->H, level_len(is_q ? p->T : p->S, l), p->D};
        const void *ptr;
        snprintf(name, sizeof name, "%s[%d]", base, l);
        const DLTensor *t = import_array(hd, PySequence_Fast_GET_ITEM(fast, l), name);
        if (!t || take_4d(t, name, q0, want, is_q ? "like q" : "like k", 1, &ptr, strides[l])) {
            Py_DECREF(fast);
            return -1;
        }
        ptrs[l] = (void *)ptr;
    }
    Py_DECREF(fast);
    return 0;
}

PyDoc_STRVAR(backward_doc,
"backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, attn_mask=None,\n"
"         is_causal=False, scale=None, dropout_p=0.0, seed=0, num_threads=0)\n--\n\n"
"HKT attention backward.  Takes forward's inputs, out and lse, and the output\n"
"gradient dout (B, H, T, Dv); overwrites dq[l], dk[l] (like q[l], k[l]), dv\n"
"(like v) and dw (like w), all C-contiguous.  dropout_p and seed must be the\n"
"forward's.");

static PyObject *py_backward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dout", "q", "k", "v", "w", "out", "lse", "dq", "dk", "dv", "dw",
                             "attn_mask", "is_causal", "scale", "dropout_p", "seed",
                             "num_threads", NULL};
    PyObject *dout, *qs, *ks, *v, *w, *out, *lse, *dq, *dk, *dv, *dw;
    PyObject *mask = Py_None, *scale = Py_None;
    int causal = 0, nthreads = 0;
    double dropout_p = 0.0;
    unsigned long long seed = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOO|OpOdKi:backward", kwlist, &dout, &qs,
                                     &ks, &v, &w, &out, &lse, &dq, &dk, &dv, &dw, &mask, &causal,
                                     &scale, &dropout_p, &seed, &nthreads))
        return NULL;
    held hd = {.n = 0};
    hkt_params p;
    const DLTensor *q0, *t;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed,
                         nthreads, &q0);
    if (rc) goto done;
    rc = -1;
    {
        int64_t want[4] = {p.B, p.H, p.T, p.Dv};
        t = import_array(&hd, dout, "dout");
        if (!t || take_4d(t, "dout", q0, want, "= (B, H, T, Dv)", 0, &p.dout, p.dout_stride)) goto done;
    }
    if (take_grads(&hd, dq, "dq", &p, q0, 1, p.dq, p.dq_stride)) goto done;
    if (take_grads(&hd, dk, "dk", &p, q0, 0, p.dk, p.dk_stride)) goto done;
    {
        int64_t want[4] = {p.B, p.H, p.S, p.Dv};
        const void *ptr;
        t = import_array(&hd, dv, "dv");
        if (!t || take_4d(t, "dv", q0, want, "like v", 1, &ptr, p.dv_stride)) goto done;
        p.dv = (void *)ptr;
    }
    {
        int64_t want[2] = {p.H, p.L};
        t = import_array(&hd, dw, "dw");
        if (!t || check_real(t, "dw", q0)) goto done;
        if (p.w_per_head ? check_shape(t, "dw", want, 2, "= (H, L) like w")
                         : check_shape(t, "dw", want + 1, 1, "= (L,) like w"))
            goto done;
        if (check_contiguous(t, "dw")) goto done;
        p.dw = data_of(t);
    }
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
    held hd = {.n = 0};
    const DLTensor *t = import_array(&hd, keep, "keep");
    int rc = -1;
    if (!t) goto done;
    if (t->ndim != 4 || t->dtype.bits != 8 || t->dtype.lanes != 1 ||
        (t->dtype.code != kDLBool && t->dtype.code != kDLUInt) || t->device.device_type != kDLCPU) {
        PyErr_SetString(PyExc_ValueError, "keep: expected a 4-D uint8 or bool CPU array (B, H, T, S)");
        goto done;
    }
    if (check_contiguous(t, "keep")) goto done;
    if (!(dp >= 0.0 && dp <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "dropout_p: must be in [0, 1], got %g", dp);
        goto done;
    }
    hkt_dropout_mask_cpu((unsigned char *)data_of(t), (uint64_t)seed, dp, t->shape[0], t->shape[1],
                         t->shape[2], t->shape[3]);
    rc = 0;
done:
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_default_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(hkt_default_threads());
}

static PyMethodDef methods[] = {
    {"forward", (PyCFunction)(void (*)(void))py_forward, METH_VARARGS | METH_KEYWORDS, forward_doc},
    {"backward", (PyCFunction)(void (*)(void))py_backward, METH_VARARGS | METH_KEYWORDS, backward_doc},
    {"dropout_mask", (PyCFunction)(void (*)(void))py_dropout_mask, METH_VARARGS | METH_KEYWORDS,
     dropout_mask_doc},
    {"default_threads", py_default_threads, METH_NOARGS, "OpenMP's default thread count."},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *m) {
#ifdef HKT_WITH_CUDA
    PyObject *cuda = Py_True;
#else
    PyObject *cuda = Py_False;
#endif
    if (PyModule_AddObjectRef(m, "has_cuda", cuda) < 0) return -1;
    if (PyModule_AddIntConstant(m, "max_levels", HKT_MAX_LEVELS) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hkt._C",
    .m_doc = "C kernels of hkt (HKT attention), reached through DLPack.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
