/*
 * hkt._C's DLPack import and the ownership of the capsules a call consumes.
 *
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
 * them: the same stream order every torch op relies on.
 */
#include "binding.h"

/* Py_TYPE(obj)->tp_name, which the limited API does not expose (PyTypeObject is
 * opaque there): "list", "numpy.ndarray", "torch.Tensor", written into buf.
 * Called only while building an error message, before it is set. */
const char *type_name(PyObject *obj, char *buf, size_t n) {
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

/* Deletes every tensor the call consumed, once (hd->n is reset).  A deleter may
 * run Python code (NumPy's drops its array), which must not find the call's
 * exception set: it is put aside meanwhile. */
void release_all(held *hd) {
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

/* A (shape, dtype code, bits) tuple as a C-contiguous CPU DLTensor without
 * data, kept in d for the call (check_forward's arrays). */
static const DLTensor *describe(described *d, PyObject *obj, const char *name) {
    PyObject *shape;
    int code, bits;
    if (!PyArg_ParseTuple(obj, "O!ii", &PyTuple_Type, &shape, &code, &bits)) return NULL;
    const Py_ssize_t nd = PyTuple_Size(shape);
    if (nd > MAX_DESC_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: at most %d dimensions, got %zd", name, MAX_DESC_DIMS, nd);
        return NULL;
    }
    if (d->n >= MAX_HELD) {
        PyErr_SetString(PyExc_ValueError, "too many arrays in one call");
        return NULL;
    }
    for (Py_ssize_t x = 0; x < nd; x++) {
        d->shape[d->n][x] = PyLong_AsLongLong(PyTuple_GetItem(shape, x));
        if (d->shape[d->n][x] == -1 && PyErr_Occurred()) return NULL;
    }
    DLTensor *t = &d->t[d->n];
    memset(t, 0, sizeof *t);
    t->device.device_type = kDLCPU;
    t->ndim = (int)nd;
    t->dtype.code = (uint8_t)code;
    t->dtype.bits = (uint8_t)bits;
    t->dtype.lanes = 1;
    t->shape = d->shape[d->n++];
    return t;
}

const DLTensor *import_array(held *hd, PyObject *obj, const char *name) {
    if (hd->desc && PyTuple_Check(obj)) return describe(hd->desc, obj, name);
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
