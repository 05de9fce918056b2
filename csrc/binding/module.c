/*
 * hkt._C, the module: the queries of the build and the CPU (which kernels
 * run, bfloat16, threads, the CUDA limits and scratch), the method table with
 * each call file's entries, and the module's multi-phase init -- PyInit__C,
 * the binding's one exported symbol.  binding.h says how the binding is laid
 * out.
 */
#include "binding.h"

#include <pthread.h>

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

/* the module's own entries; the calls' are in their files' tables */
static PyMethodDef methods[] = {
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
     "process use it), unless the environment variable HKT_BF16=avx512bf16 asks for AVX512_BF16's vdpbf16ps "
     "(read once, at the first call that asks)."},
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
#ifdef HKT_OPENMP_MISSING
    /* pip shows a build's own warning only with -v: a user who built without an
     * OpenMP runtime by chance learns it here, once per process (setup.py's
     * message, passed in as the macro's string) */
    if (PyErr_WarnEx(PyExc_RuntimeWarning, HKT_OPENMP_MISSING, 1) < 0) return -1;
#endif
    char problem[256];
    if (hkt_settings_problem(problem, sizeof problem) && PyErr_WarnEx(PyExc_RuntimeWarning, problem, 1) < 0)
        return -1; /* warnings turned into errors */
    PyMethodDef *const tables[] = {binding_attention_methods, binding_varlen_methods, binding_decode_methods,
                                   binding_downsample_methods, binding_window_methods};
    for (size_t x = 0; x < sizeof tables / sizeof tables[0]; x++)
        if (PyModule_AddFunctions(m, tables[x]) < 0) return -1;
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
