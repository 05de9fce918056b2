/*
 * hkt._C's checks of the arrays a call gets: shape (with the expected shape as
 * a formula in the message), dtype, device, strides, alignment, and that no
 * output shares memory with another argument (note_span, check_overlaps); the
 * rules of q[0], the array every other one is checked against, and of the
 * arrays every entry point takes alike (w, the per-level outputs).
 */
#include "binding.h"

void format_shape(char *buf, size_t n, const int64_t *shape, int nd) {
    size_t at = 0;
    at += (size_t)snprintf(buf + at, n - at, "(");
    for (int d = 0; d < nd && at < n; d++)
        at += (size_t)snprintf(buf + at, n - at, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (at < n) snprintf(buf + at, n - at, nd == 1 ? ",)" : ")");
}

const char *dtype_name(DLDataType dt) {
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
int check_shape(const DLTensor *t, const char *name, const int64_t *want, int nd,
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
void level_name(char *buf, const char *base, int l) {
    size_t n = strlen(base);
    memcpy(buf, base, n);
    buf[n++] = '[';
    if (l >= 10) buf[n++] = (char)('0' + l / 10);
    buf[n++] = (char)('0' + l % 10);
    buf[n++] = ']';
    buf[n] = 0;
}

int check_device(const DLTensor *t, const char *name, const DLTensor *ref) {
    if (t->device.device_type != ref->device.device_type || t->device.device_id != ref->device.device_id) {
        PyErr_Format(PyExc_ValueError, "%s: is on device %d:%d but q[0] is on %d:%d", name,
                     t->device.device_type, t->device.device_id, ref->device.device_type,
                     ref->device.device_id);
        return -1;
    }
    return 0;
}

/* The kernels read reals as reals: an array starting off its element alignment
 * (a byte-offset view of a buffer, say) is refused, not read misaligned. */
int check_aligned(const DLTensor *t, const char *name) {
    const uintptr_t es = (uintptr_t)(t->dtype.bits * t->dtype.lanes + 7) / 8;
    if (es > 1 && !is_empty(t) && (uintptr_t)data_of(t) % es != 0) {
        PyErr_Format(PyExc_ValueError, "%s: data must start at a multiple of its %d-byte element size",
                     name, (int)es);
        return -1;
    }
    return 0;
}

int check_real(const DLTensor *t, const char *name, const DLTensor *ref) {
    if (t->dtype.code != ref->dtype.code || t->dtype.bits != ref->dtype.bits || t->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: dtype %s does not match q[0]'s %s", name,
                     dtype_name(t->dtype), dtype_name(ref->dtype));
        return -1;
    }
    return check_aligned(t, name) || check_device(t, name, ref);
}


int check_strides(const DLTensor *t, const char *name) {
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
int check_contiguous(const DLTensor *t, const char *name) {
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
int check_disjoint(const DLTensor *t, const char *name, const char *why) {
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
int take_4d(const DLTensor *t, const char *name, const DLTensor *ref, const int64_t *want,
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
int take_3d(const DLTensor *t, const char *name, const DLTensor *ref, const int64_t *want,
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

/* ---- overlap ----
 * Outputs are written while inputs are read (and by several threads): an output
 * sharing memory with any other array gives wrong values, so it is refused. */
void note_span(held *hd, const DLTensor *t, const char *name, int output) {
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
    /* a bounded copy, not snprintf: its format parsing weighs in a small call */
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

int check_overlaps(const held *hd) {
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

/* ---- arrays ---- */

/* 1 when q[0] (so every array of the call) is on a CUDA device: the CUDA
 * kernels run.  The one place that decides it (tests/kernels/test_cuda.py's emulation
 * makes it return 1 to run the CUDA kernels on CPU arrays). */
int q0_on_cuda(const DLTensor *q0) {
#ifdef HKT_WITH_CUDA
    return q0->device.device_type == kDLCUDA;
#else
    (void)q0;
    return 0;
#endif
}

/* Native bfloat16 on the CPU (hkt_attention's and the packed calls'): the
 * CPU must have AVX512_BF16; the dot products take D, and the backward's dP
 * products Dv, in pairs. */
int is_bf16(const DLTensor *t) {
    return t->dtype.code == kDLBfloat && t->dtype.bits == 16 && t->dtype.lanes == 1;
}
int check_cpu_bf16(void) {
    if (hkt_cpu_has_bf16()) return 0;
    PyErr_SetString(PyExc_TypeError, "q[0]: native bfloat16 needs a CPU with AVX512_BF16 (and a build "
                    "with GCC >= 11 on x86-64), which this is not; pass float32");
    return -1;
}
int check_bf16_d(int64_t D) {
    if (D % 2 == 0) return 0;
    PyErr_Format(PyExc_ValueError, "q[0]: native bfloat16 needs an even head dimension D, got %lld; pass "
                 "float32", (long long)D);
    return -1;
}
int check_bf16_backward_dv(int64_t Dv) {
    if (Dv % 2 == 0) return 0;
    PyErr_Format(PyExc_ValueError, "v: the native bfloat16 backward needs an even value dimension Dv, got "
                 "%lld; pass float32", (long long)Dv);
    return -1;
}

/* What the arrays of the compute dtype (w, a float mask, lse, the gradients,
 * the forward's out) are checked against: q[0] itself, or for bfloat16 q[0]
 * as float32 (in *f32, the caller's). */
const DLTensor *compute_ref(const DLTensor *q0, DLTensor *f32) {
    if (!is_bf16(q0)) return q0;
    *f32 = *q0;
    f32->dtype.code = kDLFloat;
    f32->dtype.bits = 32;
    return f32;
}

/* q[0], imported: the array every other one is checked against (dtype, device). */
const DLTensor *check_q0(const DLTensor *q0, int allow_bf16) {
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
                     allow_bf16 ? " (or bfloat16 on a CPU with AVX512_BF16, or for the CUDA forward)" : "",
                     dtype_name(q0->dtype));
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

const DLTensor *take_q0(held *hd, PyObject *obj, int allow_bf16) {
    const DLTensor *q0 = import_array(hd, obj, "q[0]");
    return q0 ? check_q0(q0, allow_bf16) : NULL;
}

/* attn_mask: 4-D, each dim 1 (broadcast) or that of full (B, H, T, S); bool or
 * q0's dtype.  Fills its kind (enum hkt_mask_kind), its element strides (0
 * where it broadcasts) and its data. */
const DLTensor *take_mask(held *hd, PyObject *mask, const DLTensor *q0, const int64_t *full, int *kind,
                          int64_t *stride, const void **data) {
    const DLTensor *mt = import_array(hd, mask, "attn_mask");
    if (!mt || check_device(mt, "attn_mask", q0)) return NULL;
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
        *kind = HKT_MASK_BOOL;
    } else if (mt->dtype.lanes == 1 && mt->dtype.code == q0->dtype.code && mt->dtype.bits == q0->dtype.bits) {
        if (check_aligned(mt, "attn_mask")) return NULL;
        *kind = HKT_MASK_FLOAT;
    } else {
        PyErr_Format(PyExc_TypeError, "attn_mask: dtype must be bool or %s like q[0], got %s",
                     dtype_name(q0->dtype), dtype_name(mt->dtype));
        return NULL;
    }
    for (int d = 0; d < 4; d++) {
        stride[d] = mt->shape[d] > 1 ? stride_of(mt, d) : 0;
        if (stride[d] < 0) {
            PyErr_SetString(PyExc_ValueError, "attn_mask: negative strides are not supported");
            return NULL;
        }
    }
    *data = data_of(mt);
    note_span(hd, mt, "attn_mask", 0);
    return mt;
}

int take_weights(hkt_params *p, held *hd, PyObject *w, const DLTensor *q0) {
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

const DLTensor *grad_ref(grad_dtype *gd, const DLTensor *t, const DLTensor *ref) {
    if (!gd || !gd->alt) return ref;
    if (gd->chose_alt < 0) gd->chose_alt = is_bf16(t);
    return gd->chose_alt ? gd->alt : ref;
}

/* dq / dk: a sequence of L output arrays, level l of shape want[l] (nd = 4:
 * (B, heads, rows, D) through take_4d; nd = 3: packed (rows, heads, D) through
 * take_3d); fills ptrs and strides. */
int take_level_outputs(held *hd, PyObject *seq, const char *base, int L, int nd, const int64_t (*want)[4],
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
