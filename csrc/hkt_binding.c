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
 * Every capsule a call imports, bare or returned by __dlpack__(), is consumed
 * as the DLPack protocol asks of a consumer: renamed "used_dltensor" (its
 * producer's destructor then leaves it alone, and no other consumer can take
 * it) and its DLManagedTensor kept, whose deleter release_all calls once the
 * call is done with it, on every path, once.  Holding a bare capsule by
 * reference only was not enough: Python code that runs later in the call (a
 * later argument's __dlpack__, scale's __float__, another thread while the
 * kernels run) could consume it (torch.from_dlpack) and free the memory the
 * kernels then wrote into.  A capsule passed twice in one call is refused the
 * second time (it is consumed by then).
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
    const DLTensor *t; /* held for the call: its layout, when two spans meet */
    int output;
    char name[24];
} span_t;

typedef struct {
    DLManagedTensor *owned[MAX_HELD]; /* consumed capsules' tensors, for release_all to delete */
    int n;
    span_t spans[MAX_HELD];
    int nspans;
    /* the CUDA stream the kernels will run on, as DLPack's __dlpack__(stream=)
     * names it for a producer (1: the legacy default stream); 0 = unset */
    unsigned long long dl_stream;
} held;

/* An empty held: the counts only.  Zeroing the whole struct (14 KiB of spans)
 * was a fair part of a small call's binding time. */
static inline void held_start(held *hd) {
    hd->n = 0;
    hd->nspans = 0;
    hd->dl_stream = 0;
}

/* Deletes every tensor the call consumed, once (hd->n is reset).  A deleter may
 * run Python code (NumPy's drops its array), which must not find the call's
 * exception set: it is put aside meanwhile. */
static void release_all(held *hd) {
    if (hd->n == 0) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (int x = 0; x < hd->n; x++)
        if (hd->owned[x]->deleter) hd->owned[x]->deleter(hd->owned[x]);
    hd->n = 0;
    PyErr_Restore(type, value, tb);
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

static int is_empty(const DLTensor *t);

/* Consumes the "dltensor" capsule cap for the call (renames it and keeps its
 * tensor for release_all) and returns that tensor, or NULL with an exception
 * set.  exported: cap came from obj.__dlpack__(), not passed as it is. */
static const DLTensor *consume(held *hd, PyObject *cap, const char *name, int exported) {
    if (!PyCapsule_IsValid(cap, "dltensor")) {
        const int used = PyCapsule_IsValid(cap, "used_dltensor");
        if (exported)
            PyErr_Format(PyExc_TypeError, used ? "%s: __dlpack__ returned a DLPack capsule that was already "
                         "consumed (renamed 'used_dltensor')" : "%s: __dlpack__ did not return a 'dltensor' capsule",
                         name);
        else if (used)
            PyErr_Format(PyExc_TypeError, "%s: a DLPack capsule must be an unconsumed 'dltensor'; this one was "
                         "already consumed (renamed 'used_dltensor', by another consumer or as an earlier argument "
                         "of this call): pass a fresh capsule for each argument", name);
        else
            PyErr_Format(PyExc_TypeError, "%s: a DLPack capsule must be an unconsumed 'dltensor'", name);
        return NULL;
    }
    if (hd->n >= MAX_HELD) { /* before consuming it: the caller keeps what it is refused */
        PyErr_SetString(PyExc_ValueError, "too many arrays in one call");
        return NULL;
    }
    DLManagedTensor *mt = (DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor");
    if (mt == NULL || PyCapsule_SetName(cap, "used_dltensor") != 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s: the DLPack capsule holds no tensor", name);
        return NULL;
    }
    hd->owned[hd->n++] = mt; /* ours now, on every path: release_all deletes it */
    const DLTensor *t = &mt->dl_tensor;
    /* torch's to_dlpack exports a tensor without storage (a __torch_dispatch__
     * wrapper subclass, a FakeTensor) as a CPU array at address 0: the kernels
     * would read and write through a null pointer.  An empty array may have
     * none (torch's empty tensors do): nothing of it is touched. */
    if (t->data == NULL && !is_empty(t)) {
        PyErr_Format(PyExc_ValueError, "%s: array has no data (a tensor without storage, e.g. a wrapper "
                     "subclass or a FakeTensor)", name);
        return NULL;
    }
    return t;
}

static const DLTensor *import_array(held *hd, PyObject *obj, const char *name) {
    if (PyCapsule_CheckExact(obj)) /* e.g. from torch.utils.dlpack.to_dlpack: the cheapest way in */
        return consume(hd, obj, name, 0);
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
    /* consumed like a bare one: __dlpack__ may hand out a capsule that someone
     * else holds too */
    const DLTensor *t = consume(hd, cap, name, 1);
    Py_DECREF(cap); /* renamed: its destructor leaves the tensor to release_all */
    return t;
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

/* An output written by several threads, each its own elements: no two of its
 * elements may share memory (any order of the dimensions in memory will do:
 * gradients laid out like their inputs, say).  With its dimensions sorted by
 * stride, each stride must reach past everything the smaller ones span.  why
 * says why it matters, for the message. */
static int check_disjoint(const DLTensor *t, const char *name, const char *why) {
    if (is_empty(t)) return 0;
    int idx[8], n = 0;
    for (int d = 0; d < t->ndim && n < 8; d++)
        if (t->shape[d] > 1) idx[n++] = d;
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && stride_of(t, idx[b]) < stride_of(t, idx[b - 1]); b--) {
            const int x = idx[b];
            idx[b] = idx[b - 1];
            idx[b - 1] = x;
        }
    __int128 span = 1; /* elements the smaller strides reach, plus one */
    for (int a = 0; a < n; a++) {
        if ((__int128)stride_of(t, idx[a]) < span) {
            PyErr_Format(PyExc_ValueError, "%s: %s, so its elements must not overlap each other; dimension %d "
                         "has stride %lld", name, why, idx[a], (long long)stride_of(t, idx[a]));
            return -1;
        }
        span += (__int128)stride_of(t, idx[a]) * (t->shape[idx[a]] - 1);
    }
    return 0;
}

/* A (B, H, rows, cols) array: shape, dtype, device, strides; fills ptr and strides.
 * An output may lie in memory in any order of its dimensions (the kernels
 * follow its strides), the features contiguous, its elements disjoint. */
static int take_4d(const DLTensor *t, const char *name, const DLTensor *ref, const int64_t *want,
                   const char *meaning, long long factor, int output, const void **ptr, int64_t *st3) {
    if (check_real(t, name, ref) || check_shape(t, name, want, 4, meaning, factor) || check_strides(t, name))
        return -1;
    if (output && check_disjoint(t, name, "is an output")) return -1;
    *ptr = data_of(t);
    for (int d = 0; d < 3; d++) st3[d] = stride_of(t, d);
    return 0;
}

/* A packed (rows, heads, cols) array (variable-length batches: sequences packed
 * along rows): shape, dtype, device, strides; fills ptr and strides as hkt_params'
 * (batch, head, row) ones, {unused, head, row}. */
static int take_3d(const DLTensor *t, const char *name, const DLTensor *ref, const int64_t *want,
                   const char *meaning, long long factor, int output, const void **ptr, int64_t *st3) {
    if (check_real(t, name, ref) || check_shape(t, name, want, 3, meaning, factor) || check_strides(t, name))
        return -1;
    if (output && check_contiguous(t, name)) return -1;
    *ptr = data_of(t);
    st3[0] = 0;
    st3[1] = stride_of(t, 1);
    st3[2] = stride_of(t, 0);
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

/* q and the keys (named kname: "k", "k_cache") as private tuples of the same
 * number of levels, 1 to HKT_MAX_LEVELS; returns that number, or -1 with an
 * exception set (*qt / *kt may then hold a tuple, for the caller to release). */
static int level_tuples(PyObject *qs, PyObject *ks, const char *kname, PyObject **qt, PyObject **kt) {
    if (sequence_of(qs, "q", qt) || sequence_of(ks, kname, kt)) return -1;
    const Py_ssize_t L = PyTuple_Size(*qt);
    if (L < 1 || L > HKT_MAX_LEVELS) {
        PyErr_Format(PyExc_ValueError, "q: expected 1 to %d levels, got %zd", HKT_MAX_LEVELS, L);
        return -1;
    }
    if (PyTuple_Size(*kt) != L) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd levels like q, got %zd", kname, L, PyTuple_Size(*kt));
        return -1;
    }
    return (int)L;
}

/* ---- sizes ----
 * Every count the kernels form (elements of an array, query-key pairs) must fit
 * in int64 with room to spare; 2^60 is far beyond any array that fits in memory
 * (stride-0 broadcasting can describe larger ones) and leaves headroom for the
 * workspace arithmetic. */
#define HKT_MAX_COUNT ((int64_t)1 << 60)
#define HKT_MAX_THREADS 1024

/* Grouped-query attention: query head h reads kv head h / (H / H_kv), so H_kv
 * (the heads of `name`, the key array) must divide H (or both be 0). */
static int check_kv_heads(const char *name, int64_t H, int64_t H_kv) {
    if (H_kv < 1 ? H == 0 && H_kv == 0 : H % H_kv == 0) return 0;
    PyErr_Format(PyExc_ValueError, "%s: its %lld heads (H_kv) must divide q[0]'s %lld heads (H)", name,
                 (long long)H_kv, (long long)H);
    return -1;
}

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
    sp->t = t;
    sp->output = output;
    /* a bounded copy, not snprintf: its format parsing was 2% of a small call */
    size_t n = strlen(name);
    if (n >= sizeof sp->name) n = sizeof sp->name - 1;
    memcpy(sp->name, name, n);
    sp->name[n] = '\0';
}

/* Whether t's bytes are one block of *width bytes repeated every `period`
 * bytes from its lowest address: every stride of at least the period a
 * multiple of it, the smaller ones spanning at most the period. */
static int periodic_block(const DLTensor *t, __int128 period, __int128 *width) {
    const __int128 es = (t->dtype.bits * t->dtype.lanes + 7) / 8;
    __int128 ext = es;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] <= 1) continue;
        const __int128 st = (__int128)llabs(stride_of(t, d)) * es;
        if (st >= period) {
            if (st % period) return 0;
        } else {
            ext += (__int128)(t->shape[d] - 1) * st;
        }
    }
    *width = ext;
    return ext <= period;
}

/* Whether two arrays whose spans meet share a byte: not when, for a period
 * (one of a's strides), both are blocks repeated with it (periodic_block) and
 * the blocks do not meet.  A module's q, k and v heads, split off one
 * projection, each take a block of H * D features in every row of 3 * H * D:
 * their spans interleave, their blocks do not. */
static int spans_share(const span_t *a, const span_t *b) {
    const __int128 es = (a->t->dtype.bits * a->t->dtype.lanes + 7) / 8;
    for (int d = 0; d < a->t->ndim; d++) {
        const __int128 period = (__int128)llabs(stride_of(a->t, d)) * es;
        __int128 wa, wb;
        if (a->t->shape[d] <= 1 || period == 0 || !periodic_block(a->t, period, &wa) ||
            !periodic_block(b->t, period, &wb))
            continue;
        __int128 off = (b->lo - a->lo) % period; /* where b's block starts in a's period */
        if (off < 0) off += period;
        if (off >= wa && period - off >= wb) return 0;
    }
    return 1;
}

static int check_overlaps(const held *hd) {
    for (int a = 0; a < hd->nspans; a++) {
        if (!hd->spans[a].output) continue;
        for (int b = 0; b < hd->nspans; b++) {
            if (a == b || (hd->spans[b].output && b < a)) continue;
            if (hd->spans[a].lo < hd->spans[b].hi && hd->spans[b].lo < hd->spans[a].hi &&
                spans_share(&hd->spans[a], &hd->spans[b])) {
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
    /* as Python writes it (repr: 1.0000001, not %g's 1) */
    PyObject *v = PyFloat_FromDouble(dropout_p);
    if (v) {
        PyErr_Format(PyExc_ValueError, "dropout_p: must be in [0, 1], got %R", v);
        Py_DECREF(v);
    }
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
    if (*out > 1 && hkt_worker_stack() < HKT_MIN_WORKER_STACK) {
        /* OMP_STACKSIZE too small for the kernels' frames: their results do not
         * depend on the thread count, so one thread computes the same, slower */
        static int warned = 0;
        if (!warned) {
            warned = 1;
            if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                 "OpenMP's worker threads have %zu KiB of stack (OMP_STACKSIZE), less than the %zu "
                                 "KiB hkt's kernels need: they run on one thread",
                                 hkt_worker_stack() >> 10, HKT_MIN_WORKER_STACK >> 10) < 0)
                return -1;
        }
        *out = 1;
    }
    return 0;
}

/* ---- the calling thread's stack ----
 * The kernels run on OpenMP's thread 0, the calling thread, too: their frames
 * need its stack as much as a worker's (parse_threads checks the workers').
 * Measured by painting the stack below the point where this check runs
 * (x86-64, GCC 12, every entry point, float32/float64/bfloat16, 1 and 2
 * threads): the packed backward takes up to 29 KiB, the backward 22, the
 * forward 9, decoding 2, downsampling 1.  A signal delivered meanwhile pushes
 * its frame on the same stack (3 KiB with AVX-512 state, 11 with AMX tiles),
 * and another compiler may inline differently: HKT_MIN_WORKER_STACK (64 KiB),
 * about twice the deepest, is asked of the caller too.  A Python thread made
 * after threading.stack_size(32 KiB .. 64 KiB) has less left and died of
 * SIGSEGV; the default (the platform's, 8 MiB with glibc) leaves megabytes. */
#define HKT_MIN_CALLER_STACK HKT_MIN_WORKER_STACK

/* 0 when the calling thread has HKT_MIN_CALLER_STACK of stack left below this
 * frame, or when that cannot be known; else -1 with a RuntimeError.  Runs
 * before every kernel, so it costs a thread-local read and a compare: the
 * thread's stack bounds are asked once per thread (pthread_getattr_np reads
 * /proc/self/maps for the main thread), and do not change for its life. */
static int check_caller_stack(void) {
#ifdef __linux__
    static __thread uintptr_t lo, hi; /* the thread's stack; hi == 0: not asked yet; lo == hi: unknown */
    if (hi == 0) {
        pthread_attr_t a;
        void *addr;
        size_t size;
        lo = hi = 1;
        if (pthread_getattr_np(pthread_self(), &a) == 0) {
            if (pthread_attr_getstack(&a, &addr, &size) == 0 && size > 0) {
                lo = (uintptr_t)addr;
                hi = lo + size;
            }
            pthread_attr_destroy(&a);
        }
    }
    const uintptr_t sp = (uintptr_t)__builtin_frame_address(0);
    /* outside the bounds asked (unknown, or a stack of its own: a coroutine's,
     * a signal stack): not checked */
    if (sp <= lo || sp >= hi || sp - lo >= HKT_MIN_CALLER_STACK) return 0;
    PyErr_Format(PyExc_RuntimeError, "the calling thread has %zu KiB of stack left, less than the %zu KiB hkt's "
                 "kernels need (they run on the calling thread too): call hkt from the main thread, or from a "
                 "thread made with a larger stack (threading.stack_size(); 0 restores the default)",
                 (size_t)(sp - lo) >> 10, HKT_MIN_CALLER_STACK >> 10);
    return -1;
#else
    return 0; /* no pthread_getattr_np: not checked */
#endif
}

/* ---- arrays ---- */

/* 1 when q[0] (so every array of the call) is on a CUDA device: the CUDA
 * kernels run.  The one place that decides it (tests/test_cuda.py's emulation
 * makes it return 1 to run the CUDA kernels on CPU arrays). */
static int q0_on_cuda(const DLTensor *q0) {
#ifdef HKT_WITH_CUDA
    return q0->device.device_type == kDLCUDA;
#else
    (void)q0;
    return 0;
#endif
}

/* A bfloat16 call on CUDA within the tensor-core kernels' limits (hkt.h):
 * 0, else -1 with a ValueError that names the argument. */
static int check_cuda_tc(const hkt_params *p, int backward) {
    const char *why = backward ? hkt_cuda_tc_backward_refusal(p) : hkt_cuda_tc_refusal(p); /* "argument: reason" */
    if (!why) return 0;
    PyErr_Format(PyExc_ValueError, "%s; pass float32", why);
    return -1;
}

/* Native bfloat16 on the CPU (hkt_attention's and the packed calls'): the
 * CPU must have AVX512_BF16; the dot products take D, and the backward's dP
 * products Dv, in pairs. */
static int is_bf16(const DLTensor *t) {
    return t->dtype.code == kDLBfloat && t->dtype.bits == 16 && t->dtype.lanes == 1;
}
static int check_cpu_bf16(void) {
    if (hkt_cpu_has_bf16()) return 0;
    PyErr_SetString(PyExc_TypeError, "q[0]: native bfloat16 needs a CPU with AVX512_BF16 (and a build "
                    "with GCC >= 11 on x86-64), which this is not; pass float32");
    return -1;
}
static int check_bf16_d(int64_t D) {
    if (D % 2 == 0) return 0;
    PyErr_Format(PyExc_ValueError, "q[0]: native bfloat16 needs an even head dimension D, got %lld; pass "
                 "float32", (long long)D);
    return -1;
}
static int check_bf16_backward_dv(int64_t Dv) {
    if (Dv % 2 == 0) return 0;
    PyErr_Format(PyExc_ValueError, "v: the native bfloat16 backward needs an even value dimension Dv, got "
                 "%lld; pass float32", (long long)Dv);
    return -1;
}

/* What the arrays of the compute dtype (w, a float mask, lse, the gradients,
 * the forward's out) are checked against: q[0] itself, or for bfloat16 q[0]
 * as float32 (in *f32, the caller's). */
static const DLTensor *compute_ref(const DLTensor *q0, DLTensor *f32) {
    if (!is_bf16(q0)) return q0;
    *f32 = *q0;
    f32->dtype.code = kDLFloat;
    f32->dtype.bits = 32;
    return f32;
}

/* q[0], imported: the array every other one is checked against (dtype, device). */
static const DLTensor *check_q0(const DLTensor *q0, int allow_bf16) {
    const int bf16 = is_bf16(q0);
    if (bf16 && allow_bf16) {
        /* hkt.hkt_attention upcasts bfloat16 to float32 wherever this is refused;
         * on CUDA, the forward checks its limits once the shapes are known */
        if (!q0_on_cuda(q0) && q0->device.device_type != kDLCPU) {
            PyErr_SetString(PyExc_TypeError, "q[0]: native bfloat16 runs on the CPU and CUDA only; pass float32");
            return NULL;
        }
        if (!q0_on_cuda(q0) && check_cpu_bf16()) return NULL;
    } else if (q0->dtype.code != kDLFloat || (q0->dtype.bits != 32 && q0->dtype.bits != 64) ||
               q0->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "q[0]: dtype must be float32 or float64%s, got %s",
                     allow_bf16 ? " (or bfloat16 on a CPU with AVX512_BF16, or for the CUDA forward)" : "", dtype_name(q0->dtype));
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
    if (bf16 && check_bf16_d(q0->shape[3])) return NULL;
    return q0;
}

static const DLTensor *take_q0(held *hd, PyObject *obj, int allow_bf16) {
    const DLTensor *q0 = import_array(hd, obj, "q[0]");
    return q0 ? check_q0(q0, allow_bf16) : NULL;
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
    /* bool only: a uint8 mask (DLPack's bool before kDLBool) is refused, as SDPA refuses it */
    if (mt->dtype.lanes == 1 && mt->dtype.bits == 8 && mt->dtype.code == kDLBool) {
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
    if (mask != Py_None && !(*mask_out = take_mask(p, hd, mask, cref))) goto done;

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
    const size_t per = hkt_workspace_bytes(p, backward);
    /* the forward's lse when the caller passed None: (B, H, T) reals after the rest */
    size_t lse_room = 0;
    if (!backward && p->lse == NULL &&
        (__builtin_mul_overflow((size_t)p->B * (size_t)p->H, (size_t)p->T, &lse_room) ||
         __builtin_mul_overflow(lse_room, p->dtype == HKT_FLOAT64 ? 8u : 4u, &lse_room)))
        lse_room = SIZE_MAX;
    /* the backward's delta and dw partials, then (bfloat16 gradients) their float32 sums, 64-byte aligned */
    const size_t partial = backward ? (hkt_dw_partial_bytes(p) + 63) / 64 * 64 : 0;
    const size_t acc = backward ? hkt_grad_acc_bytes(p) : 0;
    size_t total, extra = SIZE_MAX;
    char *mem = NULL;
    if (!__builtin_add_overflow(partial, acc, &extra) && !__builtin_add_overflow(extra, lse_room, &extra) &&
        !__builtin_mul_overflow(per, (size_t)p->num_threads, &total) &&
        !__builtin_add_overflow(total, extra, &total) && !__builtin_add_overflow(total, 64, &total))
        mem = malloc(total); /* PyMem_RawMalloc is not in the 3.10 limited API */
    if (!mem) {
        char gib[32]; /* PyErr_Format has no %g */
        snprintf(gib, sizeof gib, "%.3g", ((double)per * p->num_threads + (double)extra) / 1073741824.0);
        PyErr_Format(PyExc_MemoryError, "k[0]: (B, H_kv, S, D) = (%lld, %lld, %lld, %lld) needs %s GiB of "
                     "workspace on %d threads, which could not be allocated", (long long)p->B,
                     (long long)p->H_kv, (long long)p->S, (long long)p->D, gib, p->num_threads);
        return -1;
    }
    p->workspace = mem;
    p->dw_partial = backward ? mem + per * (size_t)p->num_threads : NULL;
    p->grad_acc = acc ? mem + per * (size_t)p->num_threads + partial : NULL;
    if (lse_room) p->lse = mem + per * (size_t)p->num_threads;
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
"keys are transposed tile by tile and strided values read where they lie.\n\n"
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
    held hd;
    held_start(&hd);
    hkt_params p;
    const DLTensor *q0, *mt;
    void *stream_handle;
    if (parse_stream(stream, &hd, &stream_handle)) return NULL;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed,
                         nthreads, 1, &q0, &mt);
    p.stream = stream_handle;
    p.key_cache_bytes = key_cache_bytes;
    if (rc == 0 && p.dtype == HKT_BFLOAT16 && q0_on_cuda(q0)) rc = check_cuda_tc(&p, 0);
    if (rc == 0) rc = check_overlaps(&hd);
    if (rc == 0) rc = run_kernel(&p, 0, q0);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* Which dtype the backward's dq, dk and dv are written in: alt (bfloat16 q on
 * the CPU: the inputs' dtype) or the compute dtype (the ref take_level_outputs
 * and the like are given), the same for all of them, the first one met
 * deciding.  alt NULL: the compute dtype only. */
typedef struct {
    const DLTensor *alt;
    int chose_alt; /* -1 until the first gradient is met */
} grad_dtype;

static const DLTensor *grad_ref(grad_dtype *gd, const DLTensor *t, const DLTensor *ref) {
    if (!gd || !gd->alt) return ref;
    if (gd->chose_alt < 0) gd->chose_alt = is_bf16(t);
    return gd->chose_alt ? gd->alt : ref;
}

/* dq / dk: a sequence of L output arrays, level l of shape want[l] (nd = 4:
 * (B, heads, rows, D) through take_4d; nd = 3: packed (rows, heads, D) through
 * take_3d); fills ptrs and strides. */
static int take_level_outputs(held *hd, PyObject *seq, const char *base, int L, int nd, const int64_t (*want)[4],
                              const char *meaning, const DLTensor *q0, grad_dtype *gd, void **ptrs,
                              int64_t (*strides)[3]) {
    PyObject *tuple;
    char name[32];
    int rc = -1;
    if (sequence_of(seq, base, &tuple)) return -1;
    if (PyTuple_Size(tuple) != L) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d levels, got %zd", base, L, PyTuple_Size(tuple));
        goto done;
    }
    for (int l = 0; l < L; l++) {
        const void *ptr;
        level_name(name, base, l);
        const DLTensor *t = import_array(hd, PyTuple_GetItem(tuple, l), name);
        if (!t) goto done;
        const DLTensor *ref = grad_ref(gd, t, q0);
        if (nd == 4 ? take_4d(t, name, ref, want[l], meaning, 0, 1, &ptr, strides[l])
                    : take_3d(t, name, ref, want[l], meaning, 0, 1, &ptr, strides[l]))
            goto done;
        ptrs[l] = (void *)ptr;
        note_span(hd, t, name, 1);
    }
    rc = 0;
done:
    Py_DECREF(tuple);
    return rc;
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
"         dmask=None, stream=None, scratch=None)\n--\n\n"
"HKT attention backward.  Takes forward's inputs, out and lse, and the output\n"
"gradient dout (B, H, T, Dv); overwrites dq[l], dk[l] (like q[l], k[l]), dv\n"
"(like v) and dw (like w, C-contiguous), with unit stride along features and\n"
"sharing no element with any other argument (outputs whose rows interleave,\n"
"as heads side by side in one buffer do, are fine).  With a float attn_mask,\n"
"dmask (shaped like it) receives the mask's gradient, summed over its\n"
"broadcast dimensions.  dropout_p and seed must be\n"
"the forward's.\n\n"
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
    held hd;
    held_start(&hd);
    hkt_params p;
    const DLTensor *q0, *mt, *t;
    void *stream_handle;
    if (parse_stream(stream, &hd, &stream_handle)) return NULL;
    int rc = fill_common(&p, &hd, qs, ks, v, w, out, lse, mask, causal, scale, dropout_p, seed,
                         nthreads, 0, &q0, &mt);
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

static PyObject *py_cpu_has_bf16(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(hkt_cpu_has_bf16());
}

static PyObject *py_cpu_bf16_preferred(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(hkt_cpu_bf16_preferred());
}

static PyObject *py_cpu_bf16_amx(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(hkt_cpu_bf16_amx());
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

static PyObject *py_cuda_tc_refusal(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"D", "Dv", "L", "dropout_p", "backward", "mask_grad", NULL};
    long long D, Dv;
    int L, backward = 0, mask_grad = 0;
    double dropout_p;
    static char dummy; /* stands for a dmask array: only whether there is one matters */
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLid|pp:cuda_tc_refusal", kwlist, &D, &Dv, &L, &dropout_p,
                                     &backward, &mask_grad))
        return NULL;
    /* the limits are asked of real calls' shapes: anything else is a caller's slip */
    if (D < 1 || Dv < 1) {
        PyErr_Format(PyExc_ValueError, "%s: must be at least 1, got %lld", D < 1 ? "D" : "Dv", D < 1 ? D : Dv);
        return NULL;
    }
    if (L < 1 || L > HKT_MAX_LEVELS) {
        PyErr_Format(PyExc_ValueError, "L: must be between 1 and %d, got %d", HKT_MAX_LEVELS, L);
        return NULL;
    }
    if (check_dropout(dropout_p)) return NULL;
    hkt_params p;
    memset(&p, 0, sizeof p);
    p.D = D;
    p.Dv = Dv;
    p.L = L;
    p.dropout_p = dropout_p;
    p.dmask = mask_grad ? &dummy : NULL;
    const char *why = backward ? hkt_cuda_tc_backward_refusal(&p) : hkt_cuda_tc_refusal(&p);
    if (!why) Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

static PyObject *py_default_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(hkt_default_threads());
}

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
                       PyObject *nthreads, int64_t **lens) {
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
    if (parse_scale(scale, p->D, &p->scale) || parse_threads(nthreads, &p->num_threads)) goto done;
    rc = 0;
done:
    Py_XDECREF(qt);
    Py_XDECREF(kt);
    return rc;
}

PyDoc_STRVAR(decode_doc,
"decode(q, k_cache, v_cache, w, cache_seqlens, out, k=None, v=None, scale=None,\n"
"       num_threads=0)\n--\n\n"
"HKT attention of Tn new positions against a KV cache (CPU, forward only).\n"
"q: L arrays (B, H, Tn, D), row i the level-l query of position\n"
"t_i = cache_seqlens[b] + i; k_cache: L arrays (B, H_kv, >= ceil(S_max/2^l), D);\n"
"v_cache (B, H_kv, S_max, Dv), H_kv dividing H; w (L,) or (H, L);\n"
"cache_seqlens: an int or a 1-D int32/int64 CPU array (B,), each >= 0 and\n"
"<= S_max - Tn (read, never updated).  Row i sees keys j <= t_i.  Writes out\n"
"(B, H, Tn, Dv), C-contiguous.  k (L arrays (B, H_kv, Tn, D)) and v\n"
"(B, H_kv, Tn, Dv), given together, are first written into the caches (level l\n"
"slot t_i >> l, in order of i); the caches must then share memory with no\n"
"other argument nor overlap themselves.");

static PyObject *py_decode(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k_cache", "v_cache", "w", "cache_seqlens", "out", "k", "v", "scale",
                             "num_threads", NULL};
    PyObject *qs, *kcs, *vc, *w, *seqlens, *out, *ks = Py_None, *v = Py_None, *scale = Py_None, *nthreads = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO|OOOO:decode", kwlist, &qs, &kcs, &vc, &w, &seqlens, &out,
                                     &ks, &v, &scale, &nthreads))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_decode_params p;
    int64_t *lens = NULL;
    int rc = fill_decode(&p, &hd, qs, kcs, vc, w, seqlens, out, ks, v, scale, nthreads, &lens);
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

/* ---- causal downsampling ---- */

/* One array of a downsampling call: a CPU float32/float64 array of nd
 * dimensions and x's dtype (x itself: any real dtype the kernels take), shaped
 * want where want is given, unit stride along features; outputs C-contiguous. */
static const DLTensor *take_ds_array(held *hd, PyObject *obj, const char *name, const DLTensor *x, int nd,
                                     const int64_t *want, const char *meaning, int output) {
    const DLTensor *t = import_array(hd, obj, name);
    if (!t) return NULL;
    if (t->device.device_type != kDLCPU) {
        PyErr_Format(PyExc_ValueError, "%s: causal downsampling runs on the CPU only (device type %d)", name,
                     t->device.device_type);
        return NULL;
    }
    const DLTensor *ref = x ? x : t;
    if (ref->dtype.code != kDLFloat || (ref->dtype.bits != 32 && ref->dtype.bits != 64) || ref->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: expected float32 or float64, got %s", name, dtype_name(t->dtype));
        return NULL;
    }
    if (x && (t->dtype.code != x->dtype.code || t->dtype.bits != x->dtype.bits || t->dtype.lanes != 1)) {
        PyErr_Format(PyExc_TypeError, "%s: dtype %s does not match x's %s", name, dtype_name(t->dtype),
                     dtype_name(x->dtype));
        return NULL;
    }
    if (t->ndim != nd) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d dimensions %s, got %d", name, nd, meaning, t->ndim);
        return NULL;
    }
    if ((want && check_shape(t, name, want, nd, meaning, 0)) || check_aligned(t, name) || check_strides(t, name) ||
        (output && check_contiguous(t, name)))
        return NULL;
    note_span(hd, t, name, output);
    return t;
}

/* Checks x and taps and fills the shared part of p. */
static int fill_downsample(hkt_downsample_params *p, held *hd, PyObject *x, PyObject *taps, PyObject *nthreads,
                           const DLTensor **xt) {
    memset(p, 0, sizeof *p);
    if (!(*xt = take_ds_array(hd, x, "x", NULL, 3, NULL, "(B, n, C)", 0))) return -1;
    const DLTensor *t = *xt;
    p->B = t->shape[0];
    p->n = t->shape[1];
    p->C = t->shape[2];
    p->dtype = t->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
    p->x = data_of(t);
    p->x_stride[0] = stride_of(t, 0);
    p->x_stride[1] = stride_of(t, 1);
    const DLTensor *tt = take_ds_array(hd, taps, "taps", t, 2, NULL, "(K, C)", 0);
    if (!tt) return -1;
    if (tt->shape[1] != p->C || tt->shape[0] < 1) {
        char got[160];
        format_shape(got, sizeof got, tt->shape, 2);
        PyErr_Format(PyExc_ValueError, "taps: expected shape (K, %lld) with K >= 1 (x has C = %lld features), "
                     "got %s", (long long)p->C, (long long)p->C, got);
        return -1;
    }
    p->K = tt->shape[0];
    p->taps = data_of(tt);
    p->taps_stride = stride_of(tt, 0);
    if (check_count("x", "B x n x C x K", p->B, p->n, p->C, p->K)) return -1;
    return parse_threads(nthreads, &p->num_threads);
}

PyDoc_STRVAR(downsample_forward_doc,
"downsample_forward(x, taps, out, num_threads=0)\n--\n\n"
"Causal downsampling by 2 (CPU, float32/float64): out[b, p, c] = sum over\n"
"r < K of taps[r, c] * x[b, 2p - r, c], x = 0 before row 0.  x (B, n, C) and\n"
"taps (K, C) with unit stride along C; writes out (B, ceil(n / 2), C),\n"
"C-contiguous.  Bitwise the torch expression of\n"
"hkt.modules.causal_downsample, for any num_threads.");

static PyObject *py_downsample_forward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"x", "taps", "out", "num_threads", NULL};
    PyObject *x, *taps, *out, *nthreads = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O:downsample_forward", kwlist, &x, &taps, &out, &nthreads))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_downsample_params p;
    const DLTensor *xt = NULL, *ot;
    int rc = fill_downsample(&p, &hd, x, taps, nthreads, &xt);
    if (rc == 0) {
        const int64_t want[3] = {p.B, (p.n + 1) / 2, p.C};
        rc = !(ot = take_ds_array(&hd, out, "out", xt, 3, want, "= (B, ceil(n / 2), C)", 1)) || check_overlaps(&hd);
        if (rc == 0) p.out = data_of(ot);
    }
    if (rc == 0 && p.B * p.n * p.C > 0 && (rc = check_caller_stack()) == 0) {
        Py_BEGIN_ALLOW_THREADS
        hkt_downsample_forward_cpu(&p);
        Py_END_ALLOW_THREADS
    }
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(downsample_backward_doc,
"downsample_backward(grad, x, taps, grad_x, grad_taps, num_threads=0)\n--\n\n"
"The backward of downsample_forward: from grad (B, ceil(n / 2), C) (unit\n"
"stride along C), overwrites grad_x (B, n, C; None: not computed) and\n"
"grad_taps (K, C), both C-contiguous.  grad_taps is summed in an order fixed\n"
"by the sizes: bitwise the same for any num_threads.");

static PyObject *py_downsample_backward(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"grad", "x", "taps", "grad_x", "grad_taps", "num_threads", NULL};
    PyObject *grad, *x, *taps, *gx, *gt, *nthreads = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO|O:downsample_backward", kwlist, &grad, &x, &taps, &gx, &gt,
                                     &nthreads))
        return NULL;
    held hd;
    held_start(&hd);
    hkt_downsample_params p;
    const DLTensor *xt = NULL, *t;
    char *mem = NULL;
    int rc = fill_downsample(&p, &hd, x, taps, nthreads, &xt);
    if (rc == 0) {
        const int64_t wg[3] = {p.B, (p.n + 1) / 2, p.C}, wx[3] = {p.B, p.n, p.C}, wt[2] = {p.K, p.C};
        rc = -1;
        if (!(t = take_ds_array(&hd, grad, "grad", xt, 3, wg, "= (B, ceil(n / 2), C)", 0))) goto done;
        p.grad = data_of(t);
        p.grad_stride[0] = stride_of(t, 0);
        p.grad_stride[1] = stride_of(t, 1);
        if (gx != Py_None) { /* None: x needs no gradient */
            if (!(t = take_ds_array(&hd, gx, "grad_x", xt, 3, wx, "= (B, n, C)", 1))) goto done;
            p.out = data_of(t);
        }
        if (!(t = take_ds_array(&hd, gt, "grad_taps", xt, 2, wt, "= (K, C)", 1))) goto done;
        p.grad_taps = data_of(t);
        if (check_overlaps(&hd) || check_caller_stack()) goto done;
        if (!(mem = malloc(hkt_downsample_workspace_bytes(&p) + 1))) {
            PyErr_NoMemory();
            goto done;
        }
        p.workspace = mem;
        rc = 0;
        Py_BEGIN_ALLOW_THREADS
        hkt_downsample_backward_cpu(&p);
        Py_END_ALLOW_THREADS
    }
done:
    free(mem);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

/* ---- windowed attention (hkt_window.h): one block, both directions ---- */
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
 * with dimension 2 replaced by ceil(n / 2^l) */
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
        const int64_t shape[4] = {want[0], want[1], level_len(n, l), want[3]};
        rc = win_array(hd, PyTuple_GetItem(t, l), name, ref, shape, 4, output, &ptrs[l]);
    }
    Py_DECREF(t);
    return rc;
}

PyDoc_STRVAR(window_doc,
"window(q, k, vs, w, out, lse, radius, is_causal=False, scale=1.0, num_threads=0,\n"
"       dout=None, dq=None, dk=None, dvs=None, dw=None)\n--\n\n"
"Windowed HKT attention (csrc/hkt_window.h).  q, k, vs: L C-contiguous arrays\n"
"(B, H, ceil(T/2^l), D), (B, H_kv, ceil(S/2^l), D), (B, H_kv, ceil(S/2^l), Dv),\n"
"vs[0] = v and vs[l] its level-l block sums; w (H, L); out (B, H, T, Dv), lse\n"
"(B, H, T); radius: L ints, W_l / 2^l (0: no window), growing as hkt_window.h\n"
"requires.  Without dout: the forward, writing out and lse.  With dout (like out):\n"
"the backward from out and lse, writing dq, dk, dvs (like q, k, vs) and dw (H, L).\n"
"float32 or float64, on the CPU.");

static PyObject *py_window(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"q", "k", "vs", "w", "out", "lse", "radius", "is_causal", "scale", "num_threads",
                             "dout", "dq", "dk", "dvs", "dw", NULL};
    PyObject *qs, *ks, *vss, *w, *out, *lse, *radius, *nthreads = NULL;
    PyObject *dout = Py_None, *dqs = Py_None, *dks = Py_None, *dvss = Py_None, *dw = Py_None;
    int causal = 0;
    double scale = 1.0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOO|pdOOOOOO:window", kwlist, &qs, &ks, &vss, &w, &out, &lse,
                                     &radius, &causal, &scale, &nthreads, &dout, &dqs, &dks, &dvss, &dw))
        return NULL;
    const int backward = dout != Py_None;
    hkt_window_params p;
    memset(&p, 0, sizeof p);
    p.is_causal = causal;
    p.scale = scale;
    if (!isfinite(scale)) {
        PyErr_SetString(PyExc_ValueError, "scale: must be finite");
        return NULL;
    }
    if (parse_threads(nthreads, &p.num_threads)) return NULL;
    held hd;
    held_start(&hd);
    PyObject *qt = NULL, *kt = NULL, *rt = NULL;
    char *mem = NULL;
    int rc = -1;
    const int L = level_tuples(qs, ks, "k", &qt, &kt);
    if (L < 0) goto done;
    p.L = L;
    if (sequence_of(radius, "radius", &rt)) goto done;
    if (PyTuple_Size(rt) != L) {
        PyErr_Format(PyExc_ValueError, "radius: expected %d entries, got %zd", L, PyTuple_Size(rt));
        goto done;
    }
    for (int l = 0; l < L; l++) {
        const long long r = PyLong_AsLongLong(PyTuple_GetItem(rt, l));
        if (r == -1 && PyErr_Occurred()) goto done;
        const long long below = l ? (long long)p.radius[l - 1] : -1;
        /* growing windows: W_l > W_{l-1}, i.e. radius_l > radius_{l-1} / 2; none above a level without one */
        if (r < 0 || (l && below == 0 && r != 0) || (l && r != 0 && 2 * r <= below)) {
            PyErr_Format(PyExc_ValueError, "radius[%d]: %lld does not make the windows grow with the level", l, r);
            goto done;
        }
        p.radius[l] = r;
    }
    const DLTensor *q0 = import_array(&hd, PyTuple_GetItem(qt, 0), "q[0]");
    if (q0 == NULL) goto done;
    if (q0->ndim != 4 || q0->dtype.code != kDLFloat || (q0->dtype.bits != 32 && q0->dtype.bits != 64) ||
        q0->dtype.lanes != 1 || q0->device.device_type != kDLCPU) {
        PyErr_SetString(PyExc_TypeError, "q[0]: the windowed kernels take 4-D float32 or float64 CPU arrays");
        goto done;
    }
    p.dtype = q0->dtype.bits == 64 ? HKT_FLOAT64 : HKT_FLOAT32;
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
    if (backward &&
        (win_array(&hd, dout, "dout", q0, wo, 4, 0, &p.dout) ||
         win_levels(&hd, dqs, "dq", L, q0, wq, p.T, 1, (const void **)p.dq) ||
         win_levels(&hd, dks, "dk", L, q0, wk, p.S, 1, (const void **)p.dk) ||
         win_levels(&hd, dvss, "dvs", L, q0, wv, p.S, 1, (const void **)p.dvs) ||
         win_array(&hd, dw, "dw", q0, ww, 2, 1, (const void **)&p.dw)))
        goto done;
    if (check_overlaps(&hd) || check_caller_stack()) goto done;
    const size_t bytes = hkt_window_workspace_bytes(&p, backward);
    mem = bytes == SIZE_MAX ? NULL : aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (mem == NULL) {
        PyErr_Format(PyExc_MemoryError, "k[0]: the windowed kernels' workspace (%zu bytes) could not be allocated",
                     bytes);
        goto done;
    }
    p.workspace = mem;
    Py_BEGIN_ALLOW_THREADS
    if (backward) hkt_window_backward_cpu(&p);
    else hkt_window_forward_cpu(&p);
    Py_END_ALLOW_THREADS
    rc = 0;
done:
    free(mem);
    Py_XDECREF(qt);
    Py_XDECREF(kt);
    Py_XDECREF(rt);
    release_all(&hd);
    if (rc) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"forward", (PyCFunction)(void (*)(void))py_forward, METH_VARARGS | METH_KEYWORDS, forward_doc},
    {"backward", (PyCFunction)(void (*)(void))py_backward, METH_VARARGS | METH_KEYWORDS, backward_doc},
    {"varlen_forward", (PyCFunction)(void (*)(void))py_varlen_forward, METH_VARARGS | METH_KEYWORDS,
     varlen_forward_doc},
    {"varlen_backward", (PyCFunction)(void (*)(void))py_varlen_backward, METH_VARARGS | METH_KEYWORDS,
     varlen_backward_doc},
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_VARARGS | METH_KEYWORDS, decode_doc},
    {"downsample_forward", (PyCFunction)(void (*)(void))py_downsample_forward, METH_VARARGS | METH_KEYWORDS,
     downsample_forward_doc},
    {"downsample_backward", (PyCFunction)(void (*)(void))py_downsample_backward, METH_VARARGS | METH_KEYWORDS,
     downsample_backward_doc},
    {"dropout_mask", (PyCFunction)(void (*)(void))py_dropout_mask, METH_VARARGS | METH_KEYWORDS,
     dropout_mask_doc},
    {"window", (PyCFunction)(void (*)(void))py_window, METH_VARARGS | METH_KEYWORDS, window_doc},
    {"default_threads", py_default_threads, METH_NOARGS, "OpenMP's default thread count."},
    {"cuda_scratch_bytes", py_cuda_scratch_bytes, METH_VARARGS, cuda_scratch_bytes_doc},
    {"cuda_tc_refusal", (PyCFunction)(void (*)(void))py_cuda_tc_refusal, METH_VARARGS | METH_KEYWORDS,
     "cuda_tc_refusal(D, Dv, L, dropout_p, backward=False, mask_grad=False) -> None when the CUDA bfloat16 "
     "forward (backward: the backward, with a float mask's gradient if mask_grad) on tensor cores takes a call "
     "of these sizes, else the message that names the limit it breaks.  Defined for every build."},
    {"cpu_kernels", py_cpu_kernels, METH_NOARGS,
     "Which build of the CPU kernels this process runs: 'avx512f', 'avx2' or 'default' (the widest the CPU "
     "has, or a narrower one named by the environment variable HKT_CPU_KERNELS)."},
    {"cpu_has_bf16", py_cpu_has_bf16, METH_NOARGS,
     "True when forward takes bfloat16 q, k, v natively on this CPU (AVX512_BF16; w, a float mask, out and "
     "lse float32; even D)."},
    {"cpu_bf16_preferred", py_cpu_bf16_preferred, METH_NOARGS,
     "True when hkt runs bfloat16 on those native kernels rather than upcast to float32: cpu_has_bf16() and a "
     "core that issues vdpbf16ps at the float32 FMA's rate (AMD's; Intel's run it at half that rate) or has "
     "AMX.  The environment variable HKT_BF16=native, avx512bf16 or upcast overrides."},
    {"cpu_bf16_amx", py_cpu_bf16_amx, METH_NOARGS,
     "True when the native bfloat16 kernels take their products on AMX tiles (AMX-BF16, and the OS lets this "
     "process use it), unless the environment variable HKT_BF16=avx512bf16 asks for AVX512_BF16's vdpbf16ps. "
     "Read at each call."},
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
#ifdef HKT_SOURCE_HASH
    /* which C sources this was built from (setup.py): hkt/__init__.py warns when
     * the csrc/ beside it has changed since (a checkout pulled, not rebuilt) */
    if (PyModule_AddStringConstant(m, "source_hash", HKT_SOURCE_HASH) < 0) return -1;
#endif
    char problem[256];
    if (hkt_settings_problem(problem, sizeof problem) && PyErr_WarnEx(PyExc_RuntimeWarning, problem, 1) < 0)
        return -1; /* warnings turned into errors */
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
