/*
 * hkt._C's causal downsampling calls: downsample_forward and
 * downsample_backward (hkt_downsample.c).
 */
#include "binding.h"

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

PyMethodDef binding_downsample_methods[] = {
    {"downsample_forward", (PyCFunction)(void (*)(void))py_downsample_forward, METH_VARARGS | METH_KEYWORDS,
     downsample_forward_doc},
    {"downsample_backward", (PyCFunction)(void (*)(void))py_downsample_backward, METH_VARARGS | METH_KEYWORDS,
     downsample_backward_doc},
    {NULL, NULL, 0, NULL},
};
