/*
 * hkt._C's checks of the arguments that are not arrays: the per-level
 * sequences, the sizes the kernels form, scale, dropout_p, the CUDA stream,
 * num_threads, and the calling thread's stack.
 */
#include "binding.h"

#include <pthread.h> /* after Python.h, which asks for _GNU_SOURCE: pthread_getattr_np */

/* A private tuple copy of a list/tuple of arrays: converting an item calls back
 * into Python (__dlpack__), which may change the caller's list; the copy cannot
 * change under us and keeps every item alive. */
int sequence_of(PyObject *obj, const char *name, PyObject **tuple) {
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
int level_tuples(PyObject *qs, PyObject *ks, const char *kname, PyObject **qt, PyObject **kt) {
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

/* Grouped-query attention: query head h reads kv head h / (H / H_kv), so H_kv
 * (the heads of `name`, the key array) must divide H (or both be 0). */
int check_kv_heads(const char *name, int64_t H, int64_t H_kv) {
    if (H_kv < 1 ? H == 0 && H_kv == 0 : H % H_kv == 0) return 0;
    PyErr_Format(PyExc_ValueError, "%s: its %lld heads (H_kv) must divide q[0]'s %lld heads (H)", name,
                 (long long)H_kv, (long long)H);
    return -1;
}

int check_count(const char *name, const char *what, int64_t a, int64_t b, int64_t c, int64_t d) {
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

/* ---- scalars ---- */
int parse_scale(PyObject *scale, int64_t D, double *out) {
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

/* Whether obj is an instance of numbers.<abc> (1 or 0; -1 with the exception
 * set): the rare case, a NumPy scalar say, asked only after the plain types. */
static int is_number(PyObject *obj, const char *abc) {
    PyObject *numbers = PyImport_ImportModule("numbers");
    PyObject *cls = numbers ? PyObject_GetAttrString(numbers, abc) : NULL;
    Py_XDECREF(numbers);
    if (!cls) return -1;
    const int yes = PyObject_IsInstance(obj, cls);
    Py_DECREF(cls);
    return yes;
}

/* softcap (docs/contract.md section 1.12): NULL (not given), None or 0.0 for
 * none (*out = 0), else a finite positive real number that is not a bool: a
 * float, an int or any numbers.Real (a NumPy scalar).  The messages are
 * hkt.reference's, word for word: this is the rule's one home, which the
 * meta, "sdpa" and windowed paths reach through check_forward. */
int parse_softcap(PyObject *obj, double *out) {
    *out = 0;
    if (obj == NULL || obj == Py_None) return 0;
    int real = !PyBool_Check(obj) && (PyFloat_Check(obj) || PyLong_Check(obj));
    if (!real && !PyBool_Check(obj) && (real = is_number(obj, "Real")) < 0) return -1;
    if (!real) {
        char tn[128];
        PyErr_Format(PyExc_TypeError, "softcap: expected None or a real number, got %.100s",
                     type_name(obj, tn, sizeof tn));
        return -1;
    }
    PyObject *f = PyNumber_Float(obj);
    if (!f) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "softcap: must be positive and finite (or None/0.0 for none), got an "
                        "int beyond the float range");
        return -1;
    }
    const double c = PyFloat_AsDouble(f);
    if (c == 0.0) {
        Py_DECREF(f);
        return 0;
    }
    if (!(c > 0.0 && c < INFINITY)) {
        PyErr_Format(PyExc_ValueError, "softcap: must be positive and finite (or None/0.0 for none), got %R", f);
        Py_DECREF(f);
        return -1;
    }
    Py_DECREF(f);
    *out = c;
    return 0;
}

/* sliding_window (docs/contract.md section 1.13): NULL (not given) or None for
 * no band (*out = 0), else an integer W >= 1 that is not a bool: an int or any
 * numbers.Integral (a NumPy integer), not a tensor.  A W past 2^60 is kept at
 * 2^60, which no count of ours reaches (the same band), so the kernels' i + W
 * cannot overflow. */
int parse_sliding_window(PyObject *obj, int64_t *out) {
    *out = 0;
    if (obj == NULL || obj == Py_None) return 0;
    int integral = !PyBool_Check(obj) && PyLong_Check(obj);
    if (!integral && !PyBool_Check(obj) && (integral = is_number(obj, "Integral")) < 0) return -1;
    if (!integral) {
        char tn[128];
        PyErr_Format(PyExc_TypeError, "sliding_window: expected None or an int >= 1, got %.100s",
                     type_name(obj, tn, sizeof tn));
        return -1;
    }
    PyObject *n = PyNumber_Index(obj);
    if (!n) return -1;
    int overflow = 0;
    const long long W = PyLong_AsLongLongAndOverflow(n, &overflow);
    if (W == -1 && PyErr_Occurred()) {
        Py_DECREF(n);
        return -1;
    }
    if (overflow < 0 || (!overflow && W < 1)) {
        PyErr_Format(PyExc_ValueError, "sliding_window: must be an int >= 1 (or None for no band), got %R", n);
        Py_DECREF(n);
        return -1;
    }
    Py_DECREF(n);
    *out = overflow > 0 || W > HKT_MAX_COUNT ? HKT_MAX_COUNT : (int64_t)W;
    return 0;
}

/* The CUDA kernels take no sliding-window band yet: refused by name rather
 * than run without it. */
int check_band_kernels(int64_t sliding_window, int on_cuda) {
    if (sliding_window == 0 || !on_cuda) return 0;
    PyErr_SetString(PyExc_NotImplementedError, "sliding_window: the CUDA kernels do not take a sliding-window band "
                    "yet; move the tensors to the CPU, or use backend='sdpa' (the band as a mask)");
    return -1;
}

/* The kernels that do not take a soft cap yet, refused by name rather than run
 * without it: the CUDA kernels and the CPU's native bfloat16 ones (hkt's
 * Python layer computes bfloat16 in float32 when there is a cap, so only a
 * direct call of the binding meets this). */
int check_softcap_kernels(double softcap, int on_cuda, int native_bf16) {
    if (softcap == 0) return 0;
    if (on_cuda) {
        PyErr_SetString(PyExc_NotImplementedError, "softcap: the CUDA kernels do not take softcap yet; move the "
                        "tensors to the CPU, or use backend=None without softcap");
        return -1;
    }
    if (native_bf16) {
        PyErr_SetString(PyExc_NotImplementedError, "softcap: the native bfloat16 kernels do not take softcap yet; "
                        "pass float32 (hkt.hkt_attention computes bfloat16 in float32 when softcap is given)");
        return -1;
    }
    return 0;
}

int check_dropout(double dropout_p) {
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
int parse_stream(PyObject *obj, held *hd, void **handle) {
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
void after_fork_in_child(void) { forked_child = 1; }

/* obj NULL (not given) or <= 0: OpenMP's default. */
int parse_threads(PyObject *obj, int *out) {
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
int check_caller_stack(void) {
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
