"""The binding's own safety: what it holds of an array, what it refuses to read,
and the stack it runs the kernels on.

1. A DLPack capsule is consumed, as the protocol asks of a consumer: renamed
   "used_dltensor" and its tensor deleted once, when the call is done with it.
   A bare capsule was held by reference only: Python code that ran later in the
   call (a later argument's __dlpack__, scale's __float__, another thread while
   the kernels ran) could consume it and free the memory the kernels then wrote
   into (SIGSEGV, or another tensor's values overwritten).
2. A tensor without storage (a __torch_dispatch__ wrapper subclass, a
   FakeTensor) is exported by to_dlpack as a CPU array at address 0: refused by
   name, where the kernels read through the null pointer (SIGSEGV).
3. The kernels run on the calling thread too: a thread with less stack left
   than they need is refused with a RuntimeError saying so, where a Python
   thread made after threading.stack_size(32..48 KiB) died of SIGSEGV.

Calls that crashed the interpreter run in a child (``python
test_binding_safety.py NAME...``, one line per case): a crash fails that case,
and a fresh child carries on with the cases after it.
"""
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from typing import Callable, Dict

import numpy as np
import pytest
import torch

import hkt
from hkt import _C

from helpers import level_len, sample_inputs
from hostile_cases import child_env

_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def consumed(cap) -> bool:
    return _is_valid(cap, b"used_dltensor") == 1


def np_call(B=1, H=2, T=9, S=9, D=4, Dv=3, L=2, seed=0):
    """NumPy arrays of a forward call: q, k, v, w, out, lse."""
    rng = np.random.default_rng(seed)
    q = [rng.standard_normal((B, H, level_len(T, l), D)) for l in range(L)]
    k = [rng.standard_normal((B, H, level_len(S, l), D)) for l in range(L)]
    return q, k, rng.standard_normal((B, H, S, Dv)), rng.standard_normal((H, L)), np.empty((B, H, T, Dv)), \
        np.empty((B, H, T))


# ------------------------------------------------ 1. capsules are consumed ------

def test_capsules_are_consumed_and_released_when_the_call_ends():
    """Every capsule a call imports is renamed and its tensor deleted at the end
    of the call, once: NumPy's tensor holds a reference to its array, which
    drops then (not when the capsule object dies), and not again after."""
    q, k, v, w, out, lse = np_call()
    arrays = [*q, *k, v, w, out, lse]
    before = [sys.getrefcount(a) for a in arrays]
    caps = [a.__dlpack__() for a in arrays]
    assert [sys.getrefcount(a) for a in arrays] == [r + 1 for r in before]
    L = len(q)
    _C.forward(caps[:L], caps[L:2 * L], *caps[2 * L:])
    assert all(consumed(c) for c in caps)
    assert [sys.getrefcount(a) for a in arrays] == before
    del caps
    gc.collect()
    assert [sys.getrefcount(a) for a in arrays] == before
    want = np.empty_like(out)
    _C.forward(q, k, v, w, want, np.empty_like(lse))
    assert np.array_equal(out, want)


def test_capsules_are_released_on_an_error_path():
    """A call refused at k[1] (one row short): the capsules it imported up to
    there (q[0], k[0], q[1], k[1]) are consumed and released at once; those
    after (v, w, out, lse), never reached, stay their producers'."""
    q, k, v, w, out, lse = np_call()
    k[1] = k[1][:, :, 1:]
    arrays = [*q, *k, v, w, out, lse]
    before = [sys.getrefcount(a) for a in arrays]
    caps = [a.__dlpack__() for a in arrays]
    L = len(q)
    with pytest.raises(ValueError, match=r"^k\[1\]: expected shape"):
        _C.forward(caps[:L], caps[L:2 * L], *caps[2 * L:])
    reached = 2 * L
    assert [consumed(c) for c in caps] == [True] * reached + [False] * (len(caps) - reached)
    assert [sys.getrefcount(a) for a in arrays] == before[:reached] + [r + 1 for r in before[reached:]]
    del caps
    gc.collect()
    assert [sys.getrefcount(a) for a in arrays] == before


def test_one_capsule_passed_twice_is_refused_the_second_time():
    """A capsule is consumed once: the same one as q[0] and k[0] is refused at
    k[0], by name, and its tensor is still released exactly once."""
    q, k, v, w, out, lse = np_call()
    before = sys.getrefcount(q[0])
    cap = q[0].__dlpack__()
    with pytest.raises(TypeError, match=r"^k\[0\]: a DLPack capsule must be an unconsumed 'dltensor'; this one "
                                        r"was already consumed"):
        _C.forward([cap, q[1]], [cap, k[1]], v, w, out, lse)
    a = q[0]  # (a bare q[0] in an assert is one more reference, pytest's)
    assert consumed(cap) and sys.getrefcount(a) == before + 1
    del cap
    assert sys.getrefcount(a) == before + 1


def test_hkt_passes_fresh_capsules():
    """hkt's Python layer makes one capsule per argument per call (to_dlpack):
    every entry point still runs with them consumed."""
    q, k, v, w = sample_inputs(2, 2, 40, 40, 8, 8, 3, requires_grad=True)
    out = hkt.hkt_attention(q, k, v, w, is_causal=True, attn_mask=None)
    out.sum().backward()
    assert hkt.hkt_attention_with_kvcache([x[:, :, :1].detach() for x in q], [x.detach() for x in k],
                                          v.detach(), w.detach(), 20).shape == (2, 2, 1, 8)
    cu = torch.tensor([0, 15, 40])
    qv = [torch.randn(sum(level_len(n, l) for n in (15, 25)), 2, 8, dtype=torch.float64) for l in range(3)]
    assert hkt.hkt_attention_varlen(qv, qv, torch.randn(40, 2, 8, dtype=torch.float64), w.detach(), cu,
                                    cu).shape == (40, 2, 8)
    m = hkt.MultiheadHKT(16, 2, levels=3, batch_first=True)
    x = torch.randn(2, 20, 16, requires_grad=True)
    m(x, x, x)[0].sum().backward()
    assert x.grad is not None


MEMORY_SCRIPT = r"""
import gc, json, sys
import numpy as np, torch
from torch.utils.dlpack import to_dlpack
from hkt import _C
torch.set_num_threads(1)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def lvl(n, l):
    return -(-n // 2**l)

B, H, T, D, L = 1, 2, 64, 32, 2
q = [torch.randn(B, H, lvl(T, l), D) for l in range(L)]
k = [torch.randn(B, H, lvl(T, l), D) for l in range(L)]
v, w = torch.randn(B, H, T, D), torch.rand(H, L)
nq = [x.double().numpy() for x in q]
nk, nv, nw = [x.double().numpy() for x in k], v.double().numpy(), w.double().numpy()
nout, nlse = np.empty((B, H, T, D)), np.empty((B, H, T))
arrays = [*nq, *nk, nv, nw, nout, nlse]

def calls(n):
    for i in range(n):
        # torch's capsules, hkt's own route: out (16 KiB) owned by its capsule alone
        _C.forward([to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v), to_dlpack(w),
                   to_dlpack(torch.empty(B, H, T, D)), to_dlpack(torch.empty(B, H, T)))
        try:  # refused at lse, after every other capsule was consumed
            _C.forward([to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v), to_dlpack(w),
                       to_dlpack(torch.empty(B, H, T, D)), to_dlpack(torch.empty(B, H, T, dtype=torch.float64)))
        except TypeError:
            pass
        # NumPy's: bare capsules, and objects exported by the call
        _C.forward([x.__dlpack__() for x in nq], [x.__dlpack__() for x in nk], nv.__dlpack__(), nw, nout, nlse)
        try:
            _C.forward(nq, nk, nv.__dlpack__(), nw.__dlpack__(), nout.__dlpack__(), nlse.astype(np.float32))
        except TypeError:
            pass

calls(500)
gc.collect()
refs0 = [sys.getrefcount(a) for a in arrays]
r0 = rss()
calls(N_CALLS // 4)
gc.collect()
print(json.dumps(dict(growth=rss() - r0, refs0=refs0, refs1=[sys.getrefcount(a) for a in arrays])))
"""


def test_no_leak_nor_double_free_over_many_calls():
    """10,000 calls through capsules (torch's and NumPy's, bare and exported by
    the call; half of them refused after consuming): no tensor deleted twice
    (the child would abort), none kept (a 16 KiB out each call, arrays'
    references)."""
    env = child_env()
    if "ASAN_OPTIONS" in env:  # `make sanitize`: no quarantine, whose held blocks RSS would count as a leak
        env["ASAN_OPTIONS"] += ",quarantine_size_mb=0"
    res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT.replace("N_CALLS", "10000")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["refs1"] == got["refs0"]
    assert got["growth"] < 4 * 2**20, f"RSS grew {got['growth'] / 2**20:.1f} MB over 10,000 calls"


# ------------------------------------------------------ cases run in a child ----

CASES: Dict[str, Callable[[], object]] = {}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


def _big_forward():
    """A forward whose out (4 MiB: its own mapping, unmapped when freed) is a
    bare capsule with no other owner, and lse a tensor kept: (args, lse, the
    lse it must get)."""
    from torch.utils.dlpack import to_dlpack
    B, H, T, S, D = 1, 4, 4096, 64, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(B, H, T, D, generator=g)], [torch.randn(B, H, S, D, generator=g)], \
        torch.randn(B, H, S, D, generator=g)
    w = torch.ones(1)
    want = torch.empty(B, H, T)
    _C.forward(q, k, v, w, torch.empty(B, H, T, D), want, None, False, 0.125)
    return (q, k, v, w, to_dlpack(torch.empty(B, H, T, D))), torch.empty(B, H, T), want


def _take(cap, seen):
    """Another consumer: torch.from_dlpack, the tensor dropped at once (its
    memory freed, if the capsule was still to be had)."""
    try:
        t = torch.from_dlpack(cap)
        del t
        seen.append("took it")
    except RuntimeError:
        seen.append("refused")


@case("capsule-taken-by-a-later-argument")
def _():
    (q, k, v, w, out), lse, want = _big_forward()
    seen = []

    class Hook:  # lse's exporter consumes out's capsule first
        def __dlpack__(self, *args, **kwargs):
            _take(out, seen)
            return lse.__dlpack__()

    _C.forward(q, k, v, w, out, Hook(), None, False, 0.125)
    return {"other": seen, "lse_right": torch.equal(lse, want)}


@case("capsule-taken-by-scale")
def _():
    (q, k, v, w, out), lse, want = _big_forward()
    seen = []

    class Scale(int):  # read after every array is imported
        def __float__(self):
            _take(out, seen)
            return 0.125

    _C.forward(q, k, v, w, out, lse, None, False, Scale(1))
    return {"other": seen, "lse_right": torch.equal(lse, want)}


@case("capsule-taken-by-another-thread")
def _():
    # the other thread tries once the call has imported out (a later argument
    # says so), i.e. while the kernel runs with the GIL released, or after
    (q, k, v, w, out), lse, want = _big_forward()
    seen, inside = [], threading.Event()

    class Announce:
        def __dlpack__(self, *args, **kwargs):
            cap = lse.__dlpack__()
            inside.set()
            return cap

    def other():
        inside.wait(60)
        _take(out, seen)

    t = threading.Thread(target=other)
    t.start()
    try:
        _C.forward(q, k, v, w, out, Announce(), None, False, 0.125)
    finally:
        inside.set()
        t.join()
    return {"other": seen, "lse_right": torch.equal(lse, want)}


class Wrap(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass (DTensor's, torchao's pattern): no
    storage of its own; every op runs on the tensor it wraps."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                device=elem.device)
        r.elem = elem
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        un = lambda x: x.elem if isinstance(x, Wrap) else x  # noqa: E731
        out = func(*tree_map(un, args), **tree_map(un, kwargs or {}))
        return tree_map(lambda x: Wrap(x) if isinstance(x, torch.Tensor) else x, out)


def _small():
    return sample_inputs(1, 2, 6, 6, 4, 4, 2, dtype=torch.float32)


NO_DATA = {}  # case name -> the argument it must name


def no_data_case(name, arg):
    NO_DATA[name] = arg
    return case(name)


@no_data_case("wrapper-as-v", "v")
def _():
    q, k, v, w = _small()
    return hkt.hkt_attention(q, k, Wrap(v), w)


@no_data_case("wrapper-as-q0", "q[0]")
def _():
    q, k, v, w = _small()
    return hkt.hkt_attention([Wrap(q[0])] + q[1:], k, v, w)


@no_data_case("wrapper-as-w", "w")
def _():
    q, k, v, w = _small()
    return hkt.hkt_attention(q, k, v, Wrap(w))


@no_data_case("wrapper-as-mask", "attn_mask")
def _():
    q, k, v, w = _small()
    return hkt.hkt_attention(q, k, v, w, attn_mask=Wrap(torch.zeros(6, 6)))


@no_data_case("wrapper-as-grad-in-backward", "dout")
def _():
    q, k, v, w = _small()
    q = [x.requires_grad_() for x in q]
    hkt.hkt_attention(q, k, v, w).backward(Wrap(torch.randn(1, 2, 6, 4)))


@no_data_case("wrapper-as-v-cache-in-decode", "v_cache")
def _():
    q = [torch.randn(1, 2, 1, 4) for _ in range(2)]
    kc = [torch.randn(1, 2, level_len(8, l), 4) for l in range(2)]
    return hkt.hkt_attention_with_kvcache(q, kc, Wrap(torch.randn(1, 2, 8, 4)), torch.ones(2) / 2, 3)


@no_data_case("wrapper-as-v-in-varlen", "v")
def _():
    cu = torch.tensor([0, 3, 6])
    q = [torch.randn(2 * level_len(3, l), 2, 4) for l in range(2)]
    return hkt.hkt_attention_varlen(q, [x.clone() for x in q], Wrap(torch.randn(6, 2, 4)), torch.ones(2) / 2,
                                    cu, cu)


@no_data_case("wrapper-into-a-module-downsample", "x")
def _():
    m = hkt.MultiheadHKT(8, 2, levels=2)
    x = Wrap(torch.randn(5, 1, 8))
    return m(x, x, x)


@no_data_case("wrapper-as-dropout-mask-keep", "keep")
def _():
    from torch.utils.dlpack import to_dlpack
    return _C.dropout_mask(to_dlpack(Wrap(torch.zeros(1, 1, 4, 4, dtype=torch.uint8))), 0, 0.5)


@no_data_case("faketensor-as-v", "v")
def _():
    import warnings
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, _, w = _small()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FakeTensorMode(allow_non_fake_inputs=True):
            v = torch.randn(1, 2, 6, 4)
    return hkt.hkt_attention(q, k, v, w)


@case("empty-arrays-without-data-still-run")
def _():
    # torch's empty tensors have no data pointer either: nothing of them is read
    q, k, v, w = sample_inputs(0, 2, 6, 6, 4, 4, 2, dtype=torch.float32)
    return list(hkt.hkt_attention(q, k, v, w).shape)


def on_thread(stack_kib, fn):
    """fn() on a new thread made after threading.stack_size(stack_kib KiB; 0:
    the default); its result, or its exception raised here."""
    res = {}

    def body():
        try:
            res["value"] = fn()
        except BaseException as e:  # noqa: B902 -- handed to the caller
            res["error"] = e

    threading.stack_size(stack_kib * 1024)
    try:
        t = threading.Thread(target=body)
        t.start()
    finally:
        threading.stack_size(0)
    t.join()
    if "error" in res:
        raise res["error"]
    return res["value"]


def _raw_forward_backward():
    """_C.forward then _C.backward, one thread (r4's call): a digest of the results."""
    torch.set_num_threads(1)
    B, H, T, D = 1, 1, 64, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, w = [torch.randn(B, H, T, D, generator=g)], [torch.randn(B, H, T, D, generator=g)], \
        torch.randn(B, H, T, D, generator=g), torch.ones(1)
    out, lse = torch.empty(B, H, T, D), torch.empty(B, H, T)
    _C.forward(q, k, v, w, out, lse, None, False, None, 0.0, 0, 1)
    dq, dk, dv, dw = [torch.empty_like(q[0])], [torch.empty_like(k[0])], torch.empty_like(v), torch.empty_like(w)
    _C.backward(torch.ones_like(out), q, k, v, w, out, lse, dq, dk, dv, dw, None, False, None, 0.0, 0, 1)
    return [float(x.double().sum()) for x in [out, dq[0], dk[0], dv, dw]]


def _autograd():
    torch.set_num_threads(2)
    q, k, v, w = sample_inputs(1, 2, 300, 300, 64, 64, 3, requires_grad=True)
    hkt.hkt_attention(q, k, v, w, is_causal=True).sum().backward()
    return [float(x.grad.sum()) for x in [*q, *k, v, w]]


SMALL_STACK = {}  # case name -> stack KiB of its thread


def small_stack_case(name, kib, fn):
    SMALL_STACK[name] = kib
    case(name)(lambda: on_thread(kib, fn))


small_stack_case("small-stack-thread-raw-backward", 40, _raw_forward_backward)
small_stack_case("small-stack-thread-autograd", 48, _autograd)
small_stack_case("small-stack-thread-decode", 40, lambda: list(hkt.hkt_attention_with_kvcache(
    [torch.randn(1, 2, 1, 64) for _ in range(3)], [torch.randn(1, 2, level_len(300, l), 64) for l in range(3)],
    torch.randn(1, 2, 300, 64), torch.ones(3) / 3, 200).shape))
small_stack_case("small-stack-thread-module", 40, lambda: list(hkt.MultiheadHKT(16, 2, levels=3)(
    *[torch.randn(20, 1, 16)] * 3)[0].shape))

# no misfire: the main thread, Python's default threads, a modest explicit
# stack; each computes what the main thread does
MISFIRE = {"main-thread": lambda: len(_raw_forward_backward()) == 5 and len(_autograd()) == 8,
           "default-thread": lambda: on_thread(0, _raw_forward_backward) == _raw_forward_backward(),
           "256KiB-thread": lambda: on_thread(256, _raw_forward_backward) == _raw_forward_backward(),
           "default-thread-autograd": lambda: on_thread(0, _autograd) == _autograd()}
for _name, _fn in MISFIRE.items():
    case(_name)(_fn)

CONSUME = ["capsule-taken-by-a-later-argument", "capsule-taken-by-scale", "capsule-taken-by-another-thread"]


def _child(names):
    import faulthandler
    faulthandler.enable()
    for name in names:
        print("START " + name, flush=True)
        try:
            res = {"status": "returned", "value": CASES[name]()}
        except Exception as e:  # noqa: B902 -- reported to the parent
            res = {"status": "raised", "type": type(e).__name__, "msg": str(e)}
        print("RESULT " + json.dumps({"name": name, **res}, default=repr), flush=True)


def run_isolated(names, env=None, timeout=240) -> Dict[str, dict]:
    """{name: result} for every name: what the case returned or raised, or
    {"status": "crashed"} when the child died in it (a fresh one goes on)."""
    results, todo = {}, list(names)
    while todo:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *todo], capture_output=True, text=True,
                           timeout=timeout, env=env or child_env())
        started = None
        for line in p.stdout.splitlines():
            if line.startswith("START "):
                started = line[6:]
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["name"]] = r
                started = None
        if started is not None:
            results[started] = {"status": "crashed", "rc": p.returncode, "stderr": p.stderr[-3000:]}
        rest = [n for n in todo if n not in results]
        if rest and started is None:  # died outside any case: no use going on
            raise AssertionError(f"the child failed (rc {p.returncode}): {p.stderr[-3000:]}")
        todo = rest
    return results


@pytest.fixture(scope="module")
def results():
    return run_isolated(list(CASES))


@pytest.mark.parametrize("name", CONSUME)
def test_a_consumed_capsule_cannot_be_taken_mid_call(name, results):
    """Another consumer that tries to take a capsule hkt holds (its memory freed
    when it drops it) is refused, and the call computes what it should."""
    got = results[name]
    assert got["status"] == "returned", got
    assert got["value"] == {"other": ["refused"], "lse_right": True}, got


@pytest.mark.parametrize("name", list(NO_DATA))
def test_storage_less_tensor_is_refused_by_name(name, results):
    got = results[name]
    assert got["status"] == "raised" and got["type"] == "ValueError", got
    assert got["msg"].startswith(f"{NO_DATA[name]}: array has no data (a tensor without storage, e.g. a wrapper "
                                 "subclass or a FakeTensor)"), got


def test_empty_arrays_have_no_data_to_refuse(results):
    got = results["empty-arrays-without-data-still-run"]
    assert got["status"] == "returned" and got["value"] == [0, 2, 6, 4], got


@pytest.mark.parametrize("name", list(SMALL_STACK))
def test_small_caller_stack_is_refused(name, results):
    got = results[name]
    assert got["status"] == "raised" and got["type"] == "RuntimeError", got
    msg = got["msg"]
    assert msg.startswith("the calling thread has ") and " KiB of stack left, less than the 64 KiB" in msg, msg
    assert "threading.stack_size()" in msg, msg
    left = int(msg.split("the calling thread has ")[1].split(" KiB")[0])
    assert left < SMALL_STACK[name], msg


@pytest.mark.parametrize("name", list(MISFIRE))
def test_usual_stacks_run(name, results):
    """The check never refuses the main thread nor a thread with Python's
    default stack (8 MiB on Linux) or a modest one; results bitwise the same."""
    got = results[name]
    assert got["status"] == "returned" and got["value"] is True, got


SHIM = r"""
#include <errno.h>
#include <pthread.h>
int pthread_getattr_np(pthread_t thread, pthread_attr_t *attr) { (void)thread; (void)attr; return ENOSYS; }
"""


def test_check_skipped_where_the_stack_cannot_be_asked(tmp_path):
    """Where pthread_getattr_np fails (a stand-in that always fails, preloaded),
    the stack is not checked: calls run as before."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in")
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer asks pthread_getattr_np of every thread it starts: the stand-in stops it")
    src, lib = tmp_path / "shim.c", tmp_path / "libshim.so"
    src.write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    env = child_env()
    env["LD_PRELOAD"] = " ".join([str(lib)] + [p for p in env.get("LD_PRELOAD", "").split() if p])
    got = run_isolated(list(MISFIRE), env=env)
    assert all(r["status"] == "returned" and r["value"] is True for r in got.values()), got


def test_check_runs_with_an_unlimited_main_stack():
    """ulimit -s unlimited: the main thread's stack has no size of its own
    (glibc bounds it by the mapping below); nothing is refused."""
    import resource
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    if hard != resource.RLIM_INFINITY:
        pytest.skip("the hard stack limit is not unlimited")
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_binding_safety as t
        print(t._raw_forward_backward() == t.on_thread(0, t._raw_forward_backward))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=child_env(), preexec_fn=lambda: resource.setrlimit(
                             resource.RLIMIT_STACK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)))
    assert res.returncode == 0 and res.stdout.split()[-1] == "True", res.stdout + res.stderr[-3000:]


if __name__ == "__main__":
    _child(sys.argv[1:])
