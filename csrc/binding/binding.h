/*
 * hkt._C's private header: what the binding's files (csrc/binding/) share.
 *
 * The binding is the only C that knows Python: raw CPython C API (no
 * pybind11), arrays through DLPack (any exporter works: torch tensors, NumPy
 * arrays; nothing here links libtorch).  Every argument is checked, with a
 * message that names it, before the kernels see a plain hkt_params struct;
 * the GIL is released around kernels.  Written against the limited API of
 * CPython 3.10 (setup.py defines Py_LIMITED_API = 0x030A0000), so the one
 * binary (an abi3 wheel) loads into every CPython >= 3.10: no macros that
 * reach into object structs (PyTuple_GET_ITEM, tp_name, ...), only the stable
 * ABI's functions.
 *
 * One file per concern: capsules.c (DLPack import, capsule ownership),
 * checks.c (arrays), arguments.c (the other arguments), attention.c,
 * varlen.c, decode.c, downsample.c and window.c (the calls), module.c (the queries of
 * the build and the CPU, the method tables, the module's init).  Helpers
 * return -1 (or NULL) with the exception set.  What the files share is hidden
 * from the extension's dynamic symbols: PyInit__C is the binding's only
 * export.
 */
#ifndef HKT_BINDING_H
#define HKT_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"
#include "hkt.h"

#pragma GCC visibility push(hidden)

/* the capsules one call may consume and the arrays whose memory it notes
 * (capsules.c) */
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
    /* check_forward's arrays, described by shape and dtype (no data); NULL in
     * every call that runs kernels */
    struct described *desc;
} held;

/* Arrays described, not passed: (shape, dtype code, bits) tuples, each made a
 * C-contiguous CPU DLTensor without data, whose checks are an array's. */
#define MAX_DESC_DIMS 8
typedef struct described {
    DLTensor t[MAX_HELD];
    int64_t shape[MAX_HELD][MAX_DESC_DIMS];
    int n;
} described;

/* An empty held: the counts only.  Zeroing the whole struct (14 KiB of spans)
 * was a fair part of a small call's binding time. */
static inline void held_start(held *hd) {
    hd->n = 0;
    hd->nspans = 0;
    hd->dl_stream = 0;
    hd->desc = NULL;
}

static inline int64_t stride_of(const DLTensor *t, int d) {
    if (t->strides) return t->strides[d];
    int64_t s = 1;
    for (int x = t->ndim - 1; x > d; x--) s *= t->shape[x];
    return s;
}

static inline void *data_of(const DLTensor *t) { return (char *)t->data + t->byte_offset; }

static inline int is_empty(const DLTensor *t) {
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0) return 1;
    return 0;
}

static inline int64_t level_len(int64_t n, int l) { return n > 0 ? ((n - 1) >> l) + 1 : 0; }

/* ---- sizes ----
 * Every count the kernels form (elements of an array, query-key pairs) must fit
 * in int64 with room to spare; 2^60 is far beyond any array that fits in memory
 * (stride-0 broadcasting can describe larger ones) and leaves headroom for the
 * workspace arithmetic. */
#define HKT_MAX_COUNT ((int64_t)1 << 60)
#define HKT_MAX_THREADS 1024

/* Which dtype the backward's dq, dk and dv are written in: alt (bfloat16 q on
 * the CPU: the inputs' dtype) or the compute dtype (the ref take_level_outputs
 * and the like are given), the same for all of them, the first one met
 * deciding.  alt NULL: the compute dtype only. */
typedef struct {
    const DLTensor *alt;
    int chose_alt; /* -1 until the first gradient is met */
} grad_dtype;

/* capsules.c */
const char *type_name(PyObject *obj, char *buf, size_t n);
void release_all(held *hd);
const DLTensor *import_array(held *hd, PyObject *obj, const char *name);

/* checks.c */
void format_shape(char *buf, size_t n, const int64_t *shape, int nd);
const char *dtype_name(DLDataType dt);
int check_shape(const DLTensor *t, const char *name, const int64_t *want, int nd, const char *meaning,
                long long factor);
void level_name(char *buf, const char *base, int l);
int check_device(const DLTensor *t, const char *name, const DLTensor *ref);
int check_aligned(const DLTensor *t, const char *name);
int check_real(const DLTensor *t, const char *name, const DLTensor *ref);
int check_strides(const DLTensor *t, const char *name);
int check_contiguous(const DLTensor *t, const char *name);
int check_disjoint(const DLTensor *t, const char *name, const char *why);
int take_4d(const DLTensor *t, const char *name, const DLTensor *ref, const int64_t *want, const char *meaning,
            long long factor, int output, const void **ptr, int64_t *st3);
int take_3d(const DLTensor *t, const char *name, const DLTensor *ref, const int64_t *want, const char *meaning,
            long long factor, int output, const void **ptr, int64_t *st3);
void note_span(held *hd, const DLTensor *t, const char *name, int output);
int check_overlaps(const held *hd);
int q0_on_cuda(const DLTensor *q0);
int is_bf16(const DLTensor *t);
int check_cpu_bf16(void);
int check_bf16_d(int64_t D);
int check_bf16_backward_dv(int64_t Dv);
const DLTensor *compute_ref(const DLTensor *q0, DLTensor *f32);
const DLTensor *check_q0(const DLTensor *q0, int allow_bf16);
const DLTensor *take_q0(held *hd, PyObject *obj, int allow_bf16);
int take_weights(hkt_params *p, held *hd, PyObject *w, const DLTensor *q0);
const DLTensor *take_mask(held *hd, PyObject *mask, const DLTensor *q0, const int64_t *full, int *kind,
                          int64_t *stride, const void **data);
const DLTensor *grad_ref(grad_dtype *gd, const DLTensor *t, const DLTensor *ref);
int take_level_outputs(held *hd, PyObject *seq, const char *base, int L, int nd, const int64_t (*want)[4],
                       const char *meaning, const DLTensor *q0, grad_dtype *gd, void **ptrs, int64_t (*strides)[3]);

/* arguments.c */
int sequence_of(PyObject *obj, const char *name, PyObject **tuple);
int level_tuples(PyObject *qs, PyObject *ks, const char *kname, PyObject **qt, PyObject **kt);
int check_kv_heads(const char *name, int64_t H, int64_t H_kv);
int check_count(const char *name, const char *what, int64_t a, int64_t b, int64_t c, int64_t d);
int parse_scale(PyObject *scale, int64_t D, double *out);
int check_dropout(double dropout_p);
int parse_softcap(PyObject *softcap, double *out);
int check_softcap_kernels(double softcap, int on_cuda, int native_bf16);
int parse_sliding_window(PyObject *obj, int64_t *out);
int check_band_kernels(int64_t sliding_window, int on_cuda);
int parse_stream(PyObject *obj, held *hd, void **handle);
void after_fork_in_child(void);
int parse_threads(PyObject *obj, int *out);
int check_caller_stack(void);

/* each call file's entries of the module (module.c adds them) */
extern PyMethodDef binding_attention_methods[];
extern PyMethodDef binding_varlen_methods[];
extern PyMethodDef binding_decode_methods[];
extern PyMethodDef binding_downsample_methods[];
extern PyMethodDef binding_window_methods[];

#pragma GCC visibility pop

#endif
