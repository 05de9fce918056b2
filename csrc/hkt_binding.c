/*
 * hkt._C -- the one file that knows Python.
 *
 * Raw CPython C API (no pybind11).  Arrays arrive through DLPack, so any
 * exporter works (torch tensors, NumPy arrays); nothing here links libtorch.
 * Every argument is checked here, with a message that names it, before the
 * kernels see a plain hkt_params struct.  The GIL is released around kernels.
 *
 * Written against the limited API of CPython 3.10 (setup.py defines
 * Py_LIMITED_API = 0x030A0000), so the one binary (an abi3 wheel) loads into
 * every CPython >= 3.10: no macros that reach into object structs
 * (PyTuple_GET_ITEM, tp_name, ...), only the stable ABI's functions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"
#include "hkt.h"

/* Py_TYPE(obj)->tp_name, which the limited API does not expose (PyTypeObject is
 * opaque there): "list", "numpy.ndarray", "torch.Tensor", written into buf.
 * Called only while building an error message, before it is set. */
static const char *type_name(PyObject *obj, char *buf, size_t n) {
    PyObject *type = (PyObject *)Py_TYPE(obj);
    PyObject *mod = PyObject_GetAttrString(type, "__module__");
    PyObject *qual = PyObject_GetAttrString(type, "__qualname__");
    const char *m = mod && PyUnicode_Check(mod) ? PyUnicode_AsUTF8AndSize(mod, NULL) : NULL;
    const char *q = qual && PyUnicode_Check(qual) ? PyUnicode_AsUTF8AndSize(qual, NULL) : NULL;
    if (q == NULL) q = "object";
    if (m && strcmp(m, "builtins") != 0) snprintf(buf, n, "%s.%s", m, q);
    else snprintf(buf, n, "%s", q);
    Py_XDECREF(mod);
    Py_XDECREF(qual);
    PyErr_Clear(); /* a failed lookup only costs the name */
    return buf;
}

/* ---- DLPack import ----
 * Capsules are held for the duration of a call and released afterwards; we
 * never rename them to "used_dltensor", so the exporter's capsule destructor
 * runs the deleter and the producer keeps ownership of the memory.
 *
 * Streams.  An object is exported with __dlpack__(); a CUDA one (its
 * __dlpack_device__ says so, in a CUDA build) with __dlpack__(stream=s), s the
 * stream the kernels will run on (1 for the legacy default stream), as the
 * DLPack protocol asks of a consumer: the producer then orders its pending
 * writes before that stream (torch records an event on its current stream and
 * makes s wait for it, when s is another stream; without stream=, torch 2.13
 * exports with no synchronization at all).  A bare capsule was exported
 * already, with no stream: its producer must have written it on the stream
 * the kernels use, or synchronized.  hkt/_kernels.py passes capsules (cheaper)
 * and torch's current stream, which is where torch queued the work that wrote
 * them: the same stream order every torch op relies on. */
#define MAX_HELD (6 * HKT_MAX_LEVELS + 16)

/* where an array lies in memory, for the overlap check */
typedef struct {
    __int128 lo, hi;
    int output;
    char name[24];
} span_t;

typedef struct {
    PyObject *caps[MAX_HELD];
    int n;
    span_t spans[MAX_HELD];
    int nspans;
    /* the CUDA stream the kernels will run on, as DLPack's __dlpack__(stream=)
     * names it for a producer (1: the legacy default stream); 0 = unset */
    unsigned long long dl_stream;
} held;

static void release_all(held *hd) {
    for (int x = 0; x < hd->n; x++) Py_DECREF(hd->caps[x]);
    hd->n = 0;
}

#ifdef HKT_WITH_CUDA
/* 1 when obj's __dlpack_device__() names a CUDA device, 0 otherwise (also when
 * it has none or it fails: plain __dlpack__() then says what is wrong). */
static int on_cuda(PyObject *obj) {
    PyObject *dev = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    int cuda = 0;
    if (dev && PyTuple_Check(dev) && PyTuple_Size(dev) == 2) {
        const long type = PyLong_AsLong(PyTuple_GetItem(dev, 0));
        cuda = type == kDLCUDA;
    }
    Py_XDECREF(dev);
    PyErr_Clear();
    return cuda;
}
#endif

/* obj.__dlpack__(), with stream=dl_stream for a CUDA array when a stream is set */
static PyObject *export_array(PyObject *obj, unsigned long long dl_stream) {
#ifndef HKT_WITH_CUDA
    (void)dl_stream; /* a CPU-only build imports no CUDA array */
    return PyObject_CallMethod(obj, "__dlpack__", NULL);
#else
    if (dl_stream == 0 || !on_cuda(obj)) return PyObject_CallMethod(obj, "__dlpack__", NULL);
    PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__"), *args = PyTuple_New(0), *kw = PyDict_New();
    PyObject *stream = PyLong_FromUnsignedLongLong(dl_stream), *cap = NULL;
    if (meth && args && kw && stream && PyDict_SetItemString(kw, "stream", stream) == 0)
        cap = PyObject_Call(meth, args, kw);
    Py_XDECREF(meth);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    Py_XDECREF(stream);
    return cap;
#endif
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
        char tn[128];
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a tensor or array that supports DLPack "
                     "(torch.Tensor, numpy.ndarray) or a DLPack capsule, got %.100s",
                     name, type_name(obj, tn, sizeof tn));
        return NULL;
    }
    PyObject *cap = export_array(obj, hd->dl_stream);
    if (cap == NULL) {
        /* e.g. a tensor that requires grad, or a read-only array */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *msg = value ? PyObject_Str(value) : NULL;
        const char *text = msg ? PyUnicode_AsUTF8AndSize(msg, NULL) : NULL;
        if (text == NULL) {
            PyErr_Clear();
            text = "unknown error";
        }
        PyErr_Format(PyExc_ValueError, "%s: cannot be exported through DLPack: %s", name, text);
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

/* Shape must equal want (ndim nd).  meaning may hold one %lld, filled with factor
 * (formatted only on error: this runs for every array of every call). */
static int check_shape(const DLTensor *t, const char *name, const int64_t *want, int nd,
                       const char *meaning, long long factor) {
    int ok = t->ndim == nd;
    for (int d = 0; ok && d < nd; d++) ok = t->shape[d] == want[d];
    if (ok) return 0;
    char got[160], exp[160], mean[96];
    format_shape(got, sizeof got, t->shape, t->ndim);
    format_shape(exp, sizeof exp, want, nd);
    snprintf(mean, sizeof mean, meaning, factor);
    PyErr_Format(PyExc_ValueError, "%s: expected shape %s %s, got %s", name, exp, mean, got);
    return -1;
}

/* "q[3]" and the like, without printf (this too runs for every array of every call) */
static void level_name(char *buf, const char *base, int l) {
    size_t n = strlen(base);
    memcpy(buf, base, n);
    buf[n++] = '[';
    if (l >= 10) buf[n++] = (char)('0' + l / 10);
    buf[n++] = (char)('0' + l % 10);
    buf[n++] = ']';
    buf[n] = 0;
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

static int is_empty(const DLTensor *t) {
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 1;
    return 0;
}

/* The kernels read reals as reals: an array starting off its element alignment
 * (a byte-offset view of a buffer, say) is refused, not read misaligned. */
static int check_aligned(const DLTensor *t, const char *name) {
    const uintptr_t es = (uintptr_t)(t->dtype.bits * t->dtype.lanes + 7) / 8;
    if (es > 1 && !is_empty(t) && (uintptr_t)data_of(t) % es != 0) {
        PyErr_Format(PyExc_ValueError, "%s: data must start at a multiple of its %d-byte element size",
                     name, (int)es);
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
    return check_aligned(t, name) || check_device(t, name, ref);
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
                   const char *meaning, long long factor, int output, const void **ptr, int64_t *st3) {
    if (check_real(t, name, ref) || check_shape(t, name, want, 4, meaning, factor) || check_strides(t, name))
        return -1;
    if (output && check_contiguous(t, name)) return -1;
    *ptr = data_of(t);
    for (int d = 0; d < 3; d++) st3[d] = stride_of(t, d);
    return 0;
}

static int64_t level_len(int64_t n, int l) { return n > 0 ? ((n - 1) >> l) + 1 : 0; }

/* A private tuple copy of a list/tuple of arrays: converting an item calls back
 * into Python (__dlpack__), which may change the caller's list; the copy cannot
 * change under us and keeps every item alive. */
static int sequence_of(PyObject *obj, const char *name, PyObject **tuple) {
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        char tn[128];
        PyErr_Format(PyExc_TypeError, "%s: expected a list or tuple of arrays, one per level, got %.100s",
                     name, type_name(obj, tn, sizeof tn));
        return -1;
    }
    *tuple = PySequence_Tuple(obj);
    return *tuple ? 0 : -1;
}

/* ---- sizes ----
 * Every count the kernels form (elements of an array, query-key pairs) must fit
 * in int64 with room to spare; 2^60 is far beyond any array that fits in memory
 * (stride-0 broadcasting can describe larger ones) and leaves headroom for the
 * workspace arithmetic. */
#define HKT_MAX_COUNT ((int64_t)1 << 60)
#define HKT_MAX_THREADS 1024

static int check_count(const char *name, const char *what, int64_t a, int64_t b, int64_t c, int64_t d) {
    int64_t n = 1;
    const int64_t f[4] = {a, b, c, d};
    for (int x = 0; x < 4; x++)
        if (f[x] != 0 && n > HKT_MAX_COUNT / f[x]) {
            PyErr_Format(PyExc_ValueError, "%s: %s = %lld x %lld x %lld x %lld is more than 2^60", name, what,
                         (long long)a, (long long)b, (long long)c, (long long)d);
            return -1;
        } else {
            n *= f[x];
        }
    return 0;
}

/* ---- overlap ----
 * Outputs are written while inputs are read (and by several threads): an output
 * sharing memory with any other array gives wrong values, so it is refused. */
static void note_span(held *hd, const DLTensor *t, const char *name, int output) {
    if (hd->nspans >= MAX_HELD || is_empty(t)) return;
    const __int128 es = (t->dtype.bits * t->dtype.lanes + 7) / 8;
    __int128 lo = 0, hi = es;
    for (int d = 0; d < t->ndim; d++) {
        const __int128 ext = (__int128)(t->shape[d] - 1) * stride_of(t, d) * es;
        if (ext < 0) lo += ext;
        else hi += ext;
    }
    span_t *sp = &hd->spans[hd->nspans++];
    sp->lo = (__int128)(uintptr_t)data_of(t) + lo;
    sp->hi = (__int128)(uintptr_t)data_of(t) + hi;
    sp->output = output;
    snprintf(sp->name, sizeof sp->name, "%s", name);
}

static int check_overlaps(const held *hd) {
    for (int a = 0; a < hd->nspans; a++) {
        if (!hd->spans[a].output) continue;
        for (int b = 0; b < hd->nspans; b++) {
            if (a == b || (hd->spans[b].output && b < a)) continue;
            if (hd->spans[a].lo < hd->spans[b].hi && hd->spans[b].lo < hd->spans[a].hi) {
                PyErr_Format(PyExc_ValueError, "%s: shares memory with the %s %s; outputs must not overlap "
                             "any other array", hd->spans[a].name, hd->spans[b].output ? "output" : "input",
                             hd->spans[b].name);
                return -1;
            }
        }
    }
    return 0;
}

/* ---- scalars ---- */
static int parse_scale(PyObject *scale, int64_t D, double *out) {
    if (scale == Py_None) {
        *out = 1.0 / sqrt((double)D);
        return 0;
    }
    if (PyBool_Check(scale) || !(PyFloat_Check(scale) || PyLong_Check(scale))) {
        char tn[128];
        PyErr_Format(PyExc_TypeError, "scale: expected a float or None, got %.100s",
                     type_name(scale, tn, sizeof tn));
        return -1;
    }
    *out = PyFloat_AsDouble(scale);
    if (*out == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "scale: must be a finite number, got an int beyond the float range");
        return -1;
    }
    if (!isfinite(*out)) {
        PyErr_Format(PyExc_ValueError, "scale: must be a finite number, got %R", scale);
        return -1;
    }
    return 0;
}

static int check_dropout(double dropout_p) {
    if (dropout_p >= 0.0 && dropout_p <= 1.0) return 0;
    char buf[64]; /* PyErr_Format has no %g */
    snprintf(buf, sizeof buf, "%g", dropout_p);
    PyErr_Format(PyExc_ValueError, "dropout_p: must be in [0, 1], got %s", buf);
    return -1;
}

/* stream: None or a cudaStream_t as an int (torch.cuda.Stream.cuda_stream; 0 is
 * the legacy default stream).  Sets *handle and, in hd, the value a producer's
 * __dlpack__(stream=) takes for it (1 for the legacy default stream). */
static int parse_stream(PyObject *obj, held *hd, void **handle) {
    *handle = NULL;
    hd->dl_stream = 1;
    if (obj == NULL || obj == Py_None) return 0;
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        char tn[128];
        PyErr_Format(PyExc_TypeError, "stream: expected an int (a cudaStream_t, e.g. "
                     "torch.cuda.current_stream().cuda_stream) or None, got %.100s", type_name(obj, tn, sizeof tn));
        return -1;
    }
    const unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "stream: expected a cudaStream_t handle (an int >= 0), got %R", obj);
        return -1;
    }
    *handle = (void *)(uintptr_t)v;
    hd->dl_stream = v ? v : 1;
    return 0;
}

/* 1 in a child forked after OpenMP ran: libgomp's thread pool does not survive
 * fork (its threads are gone, its barrier would wait forever), so such a child
 * computes on one thread. */
static volatile int forked_child = 0;
static void after_fork_in_child(void) { forked_child = 1; }

/* obj NULL (not given) or <= 0: OpenMP's default. */
static int parse_threads(PyObject *obj, int *out) {
    long long n = 0;
    if (obj != NULL) {
        if (PyBool_Check(obj) || !PyLong_Check(obj)) {
            char tn[128];
            PyErr_Format(PyExc_TypeError, "num_threads: expected an int, got %.100s", type_name(obj, tn, sizeof tn));
            return -1;
        }
        int overflow = 0;
        n = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (n == -1 && PyErr_Occurred()) return -1;
        if (overflow > 0 || n > HKT_MAX_THREADS) {
            PyErr_Format(PyExc_ValueError, "num_threads: must be at most %d, got %R", HKT_MAX_THREADS, obj);
            return -1;
        }
    }
    *out = n > 0 ? (int)n : hkt_default_threads(); /* <= 0 (or a huge negative): OpenMP's default */
    if (*out > HKT_MAX_THREADS) *out = HKT_MAX_THREADS;
    if (forked_child) *out = 1;
    return 0;
}

/* ---- arrays ---- */

/* q[0]: the array every other one is checked against (dtype, device). */
static const DLTensor *take_q0(held *hd, PyObject *obj) {
    const DLTensor *q0 = import_array(hd, obj, "q[0]");
    if (!q0) return NULL;
    if (q0->dtype.code != kDLFloat || (q0->dtype.bits != 32 && q0->dtype.bits != 64) || q0->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "q[0]: dtype must be float32 or float64, got %s", dtype_name(q0->dtype));
        return NULL;
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
            return NULL;
        }
    }
    if (q0->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "q[0]: expected 4 dimensions (B, H, T, D), got %d", q0->ndim);
        return NULL;
    }
    if (q0->shape[3] < 1) {
        PyErr_SetString(PyExc_ValueError, "q[0]: head dimension D must be at least 1");
        return NULL;
    }
    return q0;
}

/* Every level of q and k: shapes (B, H, ceil(n / 2^l), D), fills p's pointers. */
static int take_levels(hkt_params *p, held *hd, PyObject *qt, PyObject *kt, const DLTensor *q0,
                       const DLTensor *k0) {
    char name[32];
    for (int l = 0; l < p->L; l++) {
        int64_t wq[4] = {p->B, p->H, level_len(p->T, l), p->D};
        int64_t wk[4] = {p->B, p->H, level_len(p->S, l), p->D};
        const DLTensor *t;
        level_name(name, "q", l);
        t = l ? import_array(hd, PyTuple_GetItem(qt, l), name) : q0;
        if (!t || take_4d(t, name, q0, wq, "= (B, H, ceil(T/%lld), D)", 1LL << l, 0, &p->q[l], p->q_stride[l]))
            return -1;
        note_span(hd, t, name, 0);
        level_name(name, "k", l);
        t = l ? import_array(hd, PyTuple_GetItem(kt, l), name) : k0;
        if (!t || take_4d(t, name, q0, wk, "= (B, H, ceil(S/%lld), D)", 1LL << l, 0, &p->k[l], p->k_stride[l]))
            return -1;
        note_span(hd, t, name, 0);
    }
    return 0;
}

static int take_weights(hkt_params *p, held *hd, PyObject *w, const DLTensor *q0) {
    const DLTensor *wt = import_array(hd, w, "w");
    if (!wt || check_real(wt, "w", q0)) return -1;
    if (wt->ndim == 1) {
        int64_t want[1] = {p->L};
        if (check_shape(wt, "w", want, 1, "= (L,)", 0)) return -1;
        p->w_per_head = 0;
        p->w_stride[0] = 0;
        p->w_stride[1] = stride_of(wt, 0);
    } else {
        int64_t want[2] = {p->H, p->L};
        if (check_shape(wt, "w", want, 2, "= (H, L) or (L,)", 0)) return -1;
        p->w_per_head = 1;
        p->w_stride[0] = stride_of(wt, 0);
        p->w_stride[1] = stride_of(wt, 1);
    }
    p->w = data_of(wt);
    note_span(hd, wt, "w", 0);
    return 0;
}

/* attn_mask: 4-D, each dim 1 (broadcast) or the full (B, H, T, S); bool or q's dtype. */
static const DLTensor *take_mask(hkt_params *p, held *hd, PyObject *mask, const DLTensor *q0) {
    const DLTensor *mt = import_array(hd, mask, "attn_mask");
    if (!mt || check_device(mt, "attn_mask", q0)) return NULL;
    const int64_t full[4] = {p->B, p->H, p->T, p->S};
    int ok = mt->ndim == 4;
    for (int d = 0; ok && d < 4; d++) ok = mt->shape[d] == full[d] || mt->shape[d] == 1;
    if (!ok) {
        char got[160], exp[160];
        format_shape(got, sizeof got, mt->shape, mt->ndim);
        format_shape(exp, sizeof exp, full, 4);
        PyErr_Format(PyExc_ValueError, "attn_mask: expected 4 dimensions, each 1 or that of (B, H, T, S) = %s, "
                     "got %s", exp, got);
        return NULL;
    }
    if (mt->dtype.lanes == 1 && mt->dtype.bits == 8 && (mt->dtype.code == kDLBool || mt->dtype.code == kDLUInt)) {
        p->mask_kind = HKT_MASK_BOOL;
    } else if (mt->dtype.lanes == 1 && mt->dtype.code == q0->dtype.code && mt->dtype.bits == q0->dtype.bits) {
        if (check_aligned(mt, "attn_mask")) return NULL;
        p->mask_kind = HKT_MASK_FLOAT;
    } else {
        PyErr_Format(PyExc_TypeError, "attn_mask: dtype must be bool or %s like q[0], got %s",
                     dtype_name(q0->dtype), dtype_name(mt->dtype));
        return NULL;
    }
    for (int d = 0; d < 4; d++) {
        p->mask_stride[d] = mt->shape[d] > 1 ? stride_of(mt, d) : 0;
        if (p->mask_stride[d] < 0) {
            PyErr_SetString(PyExc_ValueError, "attn_mask: negative strides are not supported");
            return NULL;
        }
    }
    p->mask = data_of(mt);
    note_span(hd, mt, "attn_mask", 0);
    return mt;
}

/* Parses and checks everything forward and backward share; fills p.  out and lse
 * are the forward's outputs (output = 1) or the backward's inputs (0). */
static int fill_common(hkt_params *p, held *hd, PyObject *qs, PyObject *ks, PyObject *v,
                       PyObject *w, PyObject *out, PyObject *lse, PyObject *mask,
                       int causal, PyObject *scale, double dropout_p, unsigned long long seed,
                       PyObject *num_threads, int output, const DLTensor **q0_out,
                       const DLTensor **mask_out) {
    PyObject *qt = NULL, *kt = NULL;
    int rc = -1;
    memset(p, 0, sizeof *p);
    if (sequence_of(qs, "q", &qt) || sequence_of(ks, "k", &kt)) goto done;
    const Py_ssize_t L = PyTuple_Size(qt);
    if (L < 1 || L > HKT_MAX_LEVELS) {
        PyErr_Format(PyExc_ValueError, "q: expected 1 to %d levels, got %zd", HKT_MAX_LEVELS, L);
        goto done;
    }
    if (PyTuple_Size(kt) != L) {
        PyErr_Format(PyExc_ValueError, "k: expected %zd levels like q, got %zd", L, PyTuple_Size(kt));
        goto done;
    }
    p->L = (int)L;
    const DLTensor *q0 = take_q0(hd, PyTuple_GetItem(qt, 0));
    if (!q0) goto done;
    p->dtype = q0->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p->B = q0->shape[0];
    p->H = q0->shape[1];
    p->T = q0->shape[2];
    p->D = q0->shape[3];
    const DLTensor *k0 = import_array(hd, PyTuple_GetItem(kt, 0), "k[0]");
    if (!k0) goto done;
    if (k0->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "k[0]: expected 4 dimensions (B, H, S, D), got %d", k0->ndim);
        goto done;
    }
    p->S = k0->shape[2];
    if (check_count("q[0]", "B x H x T x D", p->B, p->H, p->T, p->D) ||
        check_count("k[0]", "B x H x S x D", p->B, p->H, p->S, p->D) ||
        check_count("k[0]", "query-key pairs B x H x T x S", p->B, p->H, p->T, p->S))
        goto done;
    if (take_levels(p, hd, qt, kt, q0, k0)) goto done;
    const DLTensor *vt = import_array(hd, v, "v");
    if (!vt) goto done;
    if (vt->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "v: expected 4 dimensions (B, H, S, Dv), got %d", vt->ndim);
        goto done;
    }
    p->Dv = vt->shape[3];
    {
        int64_t want[4] = {p->B, p->H, p->S, p->Dv};
        if (check_count("v", "B x H x S x Dv", p->B, p->H, p->S, p->Dv) ||
            take_4d(vt, "v", q0, want, "= (B, H, S, Dv)", 0, 0, &p->v, p->v_stride))
            goto done;
        note_span(hd, vt, "v", 0);
    }
    if (take_weights(p, hd, w, q0)) goto done;
    p->mask_kind = HKT_MASK_NONE;
    *mask_out = NULL;
    if (mask != Py_None && !(*mask_out = take_mask(p, hd, mask, q0))) goto done;

    const DLTensor *ot = import_array(hd, out, "out");
    if (!ot) goto done;
    {
        int64_t want[4] = {p->B, p->H, p->T, p->Dv};
        const void *ptr;
        if (take_4d(ot, "out", q0, want, "= (B, H, T, Dv)", 0, output, &ptr, p->out_stride)) goto done;
        p->out = (void *)ptr;
        note_span(hd, ot, "out", output);
    }
    const DLTensor *lt = import_array(hd, lse, "lse");
    if (!lt) goto done;
    {
        int64_t want[3] = {p->B, p->H, p->T};
        if (check_real(lt, "lse", q0) || check_shape(lt, "lse", want, 3, "= (B, H, T)", 0) ||
            check_contiguous(lt, "lse"))
            goto done;
        p->lse = data_of(lt);
        note_span(hd, lt, "lse", output);
    }

    p->causal = causal;
    if (parse_scale(scale, p->D, &p->scale) || check_dropout(dropout_p) ||
        parse_threads(num_threads, &p->num_threads))
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
    if (q0->device.device_type == kDLCUDA) {
        char err[256] = "unknown error";
        int rc;
        const size_t need = hkt_cuda_scratch_bytes(p->B, p->H, p->T, p->L, p->dtype == HKT_FLOAT64 ? 8 : 4);
        if (backward && p->dw_partial == NULL && need > 0) {
            PyErr_Format(PyExc_ValueError, "scratch: the CUDA backward needs a device array of at least %zu "
                         "bytes on q[0]'s device (hkt._C.cuda_scratch_bytes(B, H, T, L, itemsize)), got None",
                         need);
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
    const size_t per = hkt_workspace_bytes(p, backward);
    const size_t extra = backward ? hkt_dw_partial_bytes(p) : 0;
    size_t total;
    char *mem = NULL;
    if (!__builtin_mul_overflow(per, (size_t)p->num_threads, &total) &&
        !__builtin_add_overflow(total, extra + 64, &total))
        mem = malloc(total); /* PyMem_RawMalloc is not in the 3.10 limited API */
    if (!mem) {
        char gib[32]; /* PyErr_Format has no %g */
        snprintf(gib, sizeof gib, "%.3g", ((double)per * p->num_threads + (double)extra) / 1073741824.0);
        PyErr_Format(PyExc_MemoryError, "k[0]: (B, H, S, D) = (%lld, %lld, %lld, %lld) needs %s GiB of "
                     "workspace on %d threads, which could not be allocated", (long long)p->B,
                     (long long)p->H, (long long)p->S, (long long)p->D, gib, p->num_threads);
        return -1;
    }
    p->workspace = mem;
    p->dw_partial = backward ? mem + per * (size_t)p->num_threads : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (backward) hkt_backward_cpu(p);
    else hkt_forward_cpu(p);
    Py_END_ALLOW_THREADS
    free(mem);
    return 0;
}

PyDoc_STRVAR(forward_doc,
"forward(q, k, v, w, out, lse, attn_mask=None, is_causal=False, scale=None,\n"
"        dropout_p=0.0, seed=0, num_threads=0, stream=None, key_cache_bytes=-1)\n--\n\n"
"HKT attention forward.  q, k: sequences of L arrays (B, H, ceil(T/2^l), D) and\n"
"(B, H, ceil(S/2^l), D); v (B, H, S, Dv); w (L,) or (H, L).  Writes out\n"
"(B, H, T, Dv) and lse (B, H, T), both C-contiguous and of q's dtype, sharing\n"
"memory with no other argument.  attn_mask: None or 4-D, each dimension 1 or\n"
"that of (B, H, T, S), bool (True = visible) or float (added), any strides.\n"
"num_threads <= 0 uses OpenMP's default; at most 1024.  key_cache_bytes caps\n"
"the CPU forward's per-thread transposed-key caches, all threads together\n"
"(negative: 64 MiB); past it, keys are transposed tile by tile.\n\n"
"CUDA arrays: the kernels are queued on stream, a cudaStream_t as an int\n"
"(torch.cuda.current_stream().cuda_stream; None or 0: the legacy default\n"
"stream), and the call returns without waiting for them.  Arrays passed as\n"
"objects are exported with __dlpack__(stream=...) so that their producer\n"
"orders its writes before that stream; bare capsules must already be ready\n"
"on it.");

static PyObject *py_forward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "v", "w", "out", "lse", "attn_mask", "is_causal",
                             "scale", "dropout_p", "seed", "num_threads", "stream", "key_cache_bytes", NULL};
    PyObject *qs, *ks, *v, *w, *out, *lse, *mask = Py_None, *scale = Py_None, *nthreads = NULL;
    PyObject *stream = Py_None;
    int causal = 0;
    double dropout_p = 0.0;
    unsigned long long seed = 0;
    long long key_cache_bytes = -1;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OpOdKOOL:forward", kwlist, &qs, &ks, &v, &w,
                                     &out, &lse, &mask, &causal, &scale, &dropout_p, &seed, &nthreads,
                                     &stream, &key_cache_bytes))
        return NULL;
    held hd = {.n = 0};
    hkt_params p;
    const DLTensor *q0, *mt;
    void *stream_handle;
    if (parse_stream(stream, &hd, &stream_handle)) return NULL;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed,
                         nthreads, 1, &q0, &mt);
    p.stream = stream_handle;
    p.key_cache_bytes = key_cache_bytes;
    if (rc == 0) rc = check_overlaps(&hd);
    if (rc == 0) rc = run_kernel(&p, 0, q0);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* dq / dk: sequences of L outputs shaped like q / k. */
static int take_grads(held *hd, PyObject *seq, const char *base, const hkt_params *p,
                      const DLTensor *q0, int is_q, void **ptrs, int64_t (*strides)[3]) {
    PyObject *tuple;
    char name[32];
    if (sequence_of(seq, base, &tuple)) return -1;
    if (PyTuple_Size(tuple) != p->L) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d levels, got %zd", base, p->L, PyTuple_Size(tuple));
        Py_DECREF(tuple);
        return -1;
    }
    for (int l = 0; l < p->L; l++) {
        int64_t want[4] = {p->B, p->H, level_len(is_q ? p->T : p->S, l), p->D};
        const void *ptr;
        level_name(name, base, l);
        const DLTensor *t = import_array(hd, PyTuple_GetItem(tuple, l), name);
        if (!t || take_4d(t, name, q0, want, is_q ? "like q" : "like k", 0, 1, &ptr, strides[l])) {
            Py_DECREF(tuple);
            return -1;
        }
        ptrs[l] = (void *)ptr;
        note_span(hd, t, name, 1);
    }
    Py_DECREF(tuple);
    return 0;
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
"         dmask=None, stream=None, scratch=None)\n--\n\n"
"HKT attention backward.  Takes forward's inputs, out and lse, and the output\n"
"gradient dout (B, H, T, Dv); overwrites dq[l], dk[l] (like q[l], k[l]), dv\n"
"(like v) and dw (like w), all C-contiguous and sharing memory with no other\n"
"argument.  With a float attn_mask, dmask (shaped like it) receives the mask's\n"
"gradient, summed over its broadcast dimensions.  dropout_p and seed must be\n"
"the forward's.\n\n"
"CUDA arrays: queued on stream, as for forward.  scratch: a C-contiguous\n"
"array on q's device of at least cuda_scratch_bytes(B, H, T, L, itemsize)\n"
"bytes, aligned to the real type, sharing memory with no other argument: the\n"
"CUDA kernels' workspace (they allocate nothing).  Ignored on the CPU.");

static PyObject *py_backward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dout", "q", "k", "v", "w", "out", "lse", "dq", "dk", "dv", "dw",
                             "attn_mask", "is_causal", "scale", "dropout_p", "seed",
                             "num_threads", "dmask", "stream", "scratch", NULL};
    PyObject *dout, *qs, *ks, *v, *w, *out, *lse, *dq, *dk, *dv, *dw;
    PyObject *mask = Py_None, *scale = Py_None, *nthreads = NULL, *dmask = Py_None;
    PyObject *stream = Py_None, *scratch = Py_None;
    int causal = 0;
    double dropout_p = 0.0;
    unsigned long long seed = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOO|OpOdKOOOO:backward", kwlist, &dout, &qs,
                                     &ks, &v, &w, &out, &lse, &dq, &dk, &dv, &dw, &mask, &causal,
                                     &scale, &dropout_p, &seed, &nthreads, &dmask, &stream, &scratch))
        return NULL;
    held hd = {.n = 0};
    hkt_params p;
    const DLTensor *q0, *mt, *t;
    void *stream_handle;
    if (parse_stream(stream, &hd, &stream_handle)) return NULL;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed,
                         nthreads, 0, &q0, &mt);
    if (rc) goto done;
    p.stream = stream_handle;
    rc = -1;
    {
        int64_t want[4] = {p.B, p.H, p.T, p.Dv};
        t = import_array(&hd, dout, "dout");
        if (!t || take_4d(t, "dout", q0, want, "= (B, H, T, Dv)", 0, 0, &p.dout, p.dout_stride)) goto done;
        note_span(&hd, t, "dout", 0);
    }
    if (take_grads(&hd, dq, "dq", &p, q0, 1, p.dq, p.dq_stride)) goto done;
    if (take_grads(&hd, dk, "dk", &p, q0, 0, p.dk, p.dk_stride)) goto done;
    {
        int64_t want[4] = {p.B, p.H, p.S, p.Dv};
        const void *ptr;
        t = import_array(&hd, dv, "dv");
        if (!t || take_4d(t, "dv", q0, want, "like v", 0, 1, &ptr, p.dv_stride)) goto done;
        p.dv = (void *)ptr;
        note_span(&hd, t, "dv", 1);
    }
    {
        int64_t want[2] = {p.H, p.L};
        t = import_array(&hd, dw, "dw");
        if (!t || check_real(t, "dw", q0)) goto done;
        if (p.w_per_head ? check_shape(t, "dw", want, 2, "= (H, L) like w", 0)
                         : check_shape(t, "dw", want + 1, 1, "= (L,) like w", 0))
            goto done;
        if (check_contiguous(t, "dw")) goto done;
        p.dw = data_of(t);
        note_span(&hd, t, "dw", 1);
    }
    if (dmask != Py_None && take_dmask(&p, &hd, dmask, mt, q0)) goto done;
    if (scratch != Py_None && take_scratch(&p, &hd, scratch, q0)) goto done;
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
    if (check_dropout(dp)) goto done;
    hkt_dropout_mask_cpu((unsigned char *)data_of(t), (uint64_t)seed, dp, t->shape[0], t->shape[1],
                         t->shape[2], t->shape[3]);
    rc = 0;
done:
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_cpu_kernels(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(hkt_cpu_kernels());
}

PyDoc_STRVAR(cuda_scratch_bytes_doc,
"cuda_scratch_bytes(B, H, T, L, itemsize)\n--\n\n"
"Bytes of device scratch the CUDA backward needs (backward's scratch=):\n"
"(B*H*T + B*H*ceil(T / 2^(L-1))*L) * itemsize, itemsize 4 (float32) or 8\n"
"(float64).  Defined in every build.");

static PyObject *py_cuda_scratch_bytes(PyObject *self, PyObject *args) {
    long long B, H, T;
    int L, itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLii:cuda_scratch_bytes", &B, &H, &T, &L, &itemsize)) return NULL;
    if (B < 0 || H < 0 || T < 0 || L < 1 || L > HKT_MAX_LEVELS || (itemsize != 4 && itemsize != 8)) {
        PyErr_Format(PyExc_ValueError, "cuda_scratch_bytes: expected B, H, T >= 0, 1 <= L <= %d and itemsize "
                     "4 or 8", HKT_MAX_LEVELS);
        return NULL;
    }
    const size_t n = hkt_cuda_scratch_bytes(B, H, T, L, (size_t)itemsize);
    if (n == SIZE_MAX) {
        PyErr_SetString(PyExc_OverflowError, "cuda_scratch_bytes: the size does not fit in size_t");
        return NULL;
    }
    return PyLong_FromSize_t(n);
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
    {"cuda_scratch_bytes", py_cuda_scratch_bytes, METH_VARARGS, cuda_scratch_bytes_doc},
    {"cpu_kernels", py_cpu_kernels, METH_NOARGS,
     "Which build of the CPU kernels' hot loops this CPU runs: 'avx512f', 'avx2' or 'default'."},
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
    if (PyModule_AddIntConstant(m, "cpu_tile", HKT_CPU_TILE) < 0) return -1;
    if (PyModule_AddIntConstant(m, "max_threads", HKT_MAX_THREADS) < 0) return -1;
    static int atfork_registered = 0;
    if (!atfork_registered && pthread_atfork(NULL, NULL, after_fork_in_child) == 0) atfork_registered = 1;
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
