"""Hostile calls into hkt, each run where a crash cannot take the test run down.

Every case is a function that makes one hostile call, plus what it must do:

    RAISE(types, prefix)  raise one of ``types`` (exception class names) whose message
                          matches the regular expression ``prefix`` at its start
    COMPUTE               return normally (a positive control: legal but odd input)
    EITHER                return, or raise any exception except SystemError (which
                          means the extension broke the C API); only a crash, a hang
                          or a SystemError fails

``run_isolated(names)`` (used by tests/reliability/test_hostile.py) runs the cases in a runner
subprocess, ``python hostile_cases.py NAME...``, which prints one line per case.  When
the runner dies (SEGV, abort, a sanitizer report) or a case hangs past its timeout,
that case is recorded as crashed/hung and a fresh runner carries on with the cases
after it, so one crash never hides the others.
"""
import ctypes
import faulthandler
import json
import math
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))

# An argument's name at the start of a message: "q[0]:", "attn_mask:", "dv:" ...
ARG = r"[a-z_]+(\[\d+\])?:"


class Expect(NamedTuple):
    kind: str                       # "raise", "compute" or "either"
    types: Tuple[str, ...] = ()     # allowed exception class names ("raise")
    prefix: str = ""                # regex the message must match at its start ("raise")
    contains: Tuple[str, ...] = ()  # substrings the message must contain
    absent: Tuple[str, ...] = ()    # substrings it must not contain


def RAISE(types, prefix, contains=(), absent=()):
    types = (types,) if isinstance(types, str) else tuple(types)
    return Expect("raise", types, prefix, tuple(contains), tuple(absent))


COMPUTE = Expect("compute")
EITHER = Expect("either")

CASES: Dict[str, Tuple[Callable[[], object], Expect]] = {}


def case(name, expect):
    def register(fn):
        assert name not in CASES, name
        CASES[name] = (fn, expect)
        return fn
    return register


# ---------------------------------------------------------------- inputs -----

def lvl(n, l):
    return -(-n // 2**l)


def np_inputs(B=2, H=3, T=10, S=7, D=4, Dv=5, L=3, seed=0, dtype="float64"):
    """NumPy q, k, v, w and fresh outputs out, lse."""
    import numpy as np
    rng = np.random.default_rng(seed)
    q = [rng.standard_normal((B, H, lvl(T, l), D)).astype(dtype) for l in range(L)]
    k = [rng.standard_normal((B, H, lvl(S, l), D)).astype(dtype) for l in range(L)]
    v = rng.standard_normal((B, H, S, Dv)).astype(dtype)
    w = rng.standard_normal((H, L)).astype(dtype)
    return dict(q=q, k=k, v=v, w=w, out=np.empty((B, H, T, Dv), dtype), lse=np.empty((B, H, T), dtype))


def np_backward_args(B=2, H=3, T=10, S=7, D=4, Dv=5, L=3, seed=0):
    """Arguments of a valid _C.backward call (after running the forward)."""
    import numpy as np
    from hkt import _C
    a = np_inputs(B, H, T, S, D, Dv, L, seed)
    _C.forward(a["q"], a["k"], a["v"], a["w"], a["out"], a["lse"])
    a["dout"] = np.random.default_rng(seed + 1).standard_normal(a["out"].shape)
    a["dq"] = [np.empty_like(x) for x in a["q"]]
    a["dk"] = [np.empty_like(x) for x in a["k"]]
    a["dv"] = np.empty_like(a["v"])
    a["dw"] = np.empty_like(a["w"])
    return a


def fwd(a, **kw):
    from hkt import _C
    return _C.forward(a["q"], a["k"], a["v"], a["w"], a["out"], a["lse"], **kw)


def bwd(a, **kw):
    from hkt import _C
    return _C.backward(a["dout"], a["q"], a["k"], a["v"], a["w"], a["out"], a["lse"], a["dq"], a["dk"], a["dv"],
                       a["dw"], **kw)


def torch_inputs(B=2, H=3, T=10, S=7, D=4, Dv=5, L=3, dtype=None):
    import torch
    sys.path.insert(0, HERE)
    from helpers import sample_inputs
    return sample_inputs(B, H, T, S, D, Dv, L, dtype=dtype or torch.float64)


class Hook:
    """An array-like whose ``__dlpack__`` first runs ``action``, then exports ``arr``
    (or returns what ``action`` returned, when ``returns`` is set)."""

    def __init__(self, arr, action, returns=False):
        self.arr, self.action, self.returns = arr, action, returns

    def __dlpack__(self, *args, **kwargs):
        got = self.action()
        return got if self.returns else self.arr.__dlpack__()


def _capsule(pointer: int, name: bytes):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    _KEEP.append(name)  # the capsule keeps a pointer to its name
    return new(pointer, name, None)


_KEEP: List[object] = []


# ---------------------- the bad-input list of test_errors (helpers.BAD_CASES) --

def _errors_cases():
    sys.path.insert(0, HERE)
    import helpers
    return helpers


def _register_error_cases():
    try:
        t = _errors_cases()
    except Exception:  # collected without torch: the runner registers them itself
        return
    for name, exc, argname, override in t.BAD_CASES:
        def run(override=override):
            import hkt
            q, k, v, w = t.bad_input_base()
            args = dict(q=q, k=k, v=v, w=w)
            kw = {}
            for key, val in override.items():
                (args if key in args else kw)[key] = val
            return hkt.hkt_attention(args["q"], args["k"], args["v"], args["w"], **kw)
        case(f"errors-{name}", RAISE(exc.__name__, re.escape(argname) + ":"))(run)


_register_error_cases()


# ------------------------------- (a) __dlpack__ that mutates what is being read --

def _mutating_q(action_at, mutate):
    a = np_inputs()
    qlist = list(a["q"])
    qlist[action_at] = Hook(a["q"][action_at], lambda: mutate(qlist))
    a["q"] = qlist
    return fwd(a)


@case("dlpack-clears-q-list", EITHER)
def _():
    return _mutating_q(0, lambda ql: ql.clear())


@case("dlpack-pops-q-list", EITHER)
def _():
    return _mutating_q(0, lambda ql: ql.pop())


@case("dlpack-clears-q-list-from-middle-level", EITHER)
def _():
    return _mutating_q(1, lambda ql: ql.clear())


@case("dlpack-clears-q-list-from-last-level", EITHER)
def _():
    return _mutating_q(2, lambda ql: ql.clear())


@case("dlpack-replaces-q-items", EITHER)
def _():
    import numpy as np

    def swap(ql):
        ql[1] = "not an array"
        ql[2] = np.zeros((1,))
    return _mutating_q(0, swap)


@case("dlpack-grows-q-list", EITHER)
def _():
    import numpy as np
    return _mutating_q(0, lambda ql: ql.extend(np.zeros((2, 3, 1, 4)) for _ in range(1000)))


@case("dlpack-clears-q-tuple-owner", EITHER)
def _():
    # a tuple cannot change, but the list it came from can: no effect expected
    a = np_inputs()
    src = list(a["q"])
    src[0] = Hook(a["q"][0], lambda: src.clear())
    a["q"] = tuple(src)
    return fwd(a)


@case("dlpack-clears-k-list-from-q", EITHER)
def _():
    a = np_inputs()
    klist = list(a["k"])
    a["k"] = klist
    a["q"] = [Hook(a["q"][0], lambda: klist.clear())] + a["q"][1:]
    return fwd(a)


@case("dlpack-clears-k-list-from-k", EITHER)
def _():
    a = np_inputs()
    klist = list(a["k"])
    klist[0] = Hook(a["k"][0], lambda: klist.clear())
    a["k"] = klist
    return fwd(a)


@case("dlpack-clears-dq-list-in-backward", EITHER)
def _():
    a = np_backward_args()
    dql = list(a["dq"])
    dql[0] = Hook(a["dq"][0], lambda: dql.clear())
    a["dq"] = dql
    return bwd(a)


@case("dlpack-clears-dk-list-in-backward", EITHER)
def _():
    a = np_backward_args()
    dkl = list(a["dk"])
    dkl[1] = Hook(a["dk"][1], lambda: dkl.clear())
    a["dk"] = dkl
    return bwd(a)


@case("dlpack-clears-q-list-in-backward", EITHER)
def _():
    a = np_backward_args()
    ql = list(a["q"])
    ql[0] = Hook(a["q"][0], lambda: ql.clear())
    a["q"] = ql
    return bwd(a)


@case("dlpack-reenters-forward", EITHER)
def _():
    inner = np_inputs(seed=5)
    a = np_inputs()
    a["v"] = Hook(a["v"], lambda: fwd(inner))
    return fwd(a)


@case("dlpack-raises", RAISE("ValueError", r"q\[0\]:"))
def _():
    def boom():
        raise RuntimeError("refused")
    a = np_inputs()
    a["q"] = [Hook(a["q"][0], boom)] + a["q"][1:]
    return fwd(a)


@case("dlpack-returns-int", RAISE("TypeError", r"v:"))
def _():
    a = np_inputs()
    a["v"] = Hook(a["v"], lambda: 42, returns=True)
    return fwd(a)


@case("dlpack-returns-foreign-capsule", RAISE("TypeError", r"w:"))
def _():
    a = np_inputs()
    a["w"] = Hook(a["w"], lambda: _capsule(1, b"not_dltensor"), returns=True)
    return fwd(a)


@case("foreign-capsule-passed-directly", RAISE("TypeError", r"k\[1\]:"))
def _():
    a = np_inputs()
    a["k"][1] = _capsule(1, b"not_dltensor")
    return fwd(a)


@case("dlpack-returns-consumed-capsule", RAISE("TypeError", r"v:"))
def _():
    import numpy as np
    a = np_inputs()
    cap = a["v"].__dlpack__()
    np.from_dlpack(_Capsuled(cap))  # consumes (renames) it
    a["v"] = Hook(a["v"], lambda: cap, returns=True)
    return fwd(a)


class _Capsuled:
    """Offers an existing capsule to np.from_dlpack."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, *args, **kwargs):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


# ------------------------------------------------------- (b) num_threads ---------

for _n in (100000, 2**31 - 1, 2**40, 2**70):
    @case(f"num-threads-{_n}-forward", RAISE("ValueError", r"num_threads:"))
    def _(n=_n):
        return fwd(np_inputs(), num_threads=n)

    @case(f"num-threads-{_n}-backward", RAISE("ValueError", r"num_threads:"))
    def _(n=_n):
        return bwd(np_backward_args(), num_threads=n)


@case("num-threads-negative", EITHER)
def _():
    return fwd(np_inputs(), num_threads=-3)


# ------------------------------------ (c) stride-0 broadcasts to absurd sizes -----

def _huge_keys(S, T=1, B=1, H=1, D=1, Dv=1, L=2, mask=None, causal=False, functional=False):
    # D = Dv = 1 keeps every numel below 2^63, which torch itself requires
    import torch
    q = [torch.randn(B, H, lvl(T, l), D, dtype=torch.float64) for l in range(L)]
    k = [torch.randn(1, 1, 1, D, dtype=torch.float64).expand(B, H, lvl(S, l), D) for l in range(L)]
    v = torch.randn(1, 1, 1, Dv, dtype=torch.float64).expand(B, H, S, Dv)
    w = torch.randn(L, dtype=torch.float64)
    if functional:
        import hkt
        return hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=causal)
    from hkt import _C
    out = torch.empty(B, H, T, Dv, dtype=torch.float64)
    lse = torch.empty(B, H, T, dtype=torch.float64)
    return _C.forward(q, k, v, w, out, lse, mask, causal)


HUGE = RAISE(("ValueError", "MemoryError"), ARG)


@case("keys-broadcast-to-2**62", HUGE)
def _():
    return _huge_keys(2**62)


@case("keys-broadcast-to-2**62-causal", HUGE)
def _():
    return _huge_keys(2**62, T=3, causal=True)


@case("keys-broadcast-to-2**62-functional", HUGE)
def _():
    return _huge_keys(2**62, functional=True)


@case("keys-broadcast-to-2**63-1", HUGE)
def _():
    return _huge_keys(2**63 - 1, L=1)


@case("keys-broadcast-to-2**62-bool-mask", HUGE)
def _():
    import torch
    S = 2**62
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, 1, S)
    return _huge_keys(S, mask=mask)


@case("keys-broadcast-to-2**62-float-mask", HUGE)
def _():
    import torch
    S = 2**62
    mask = torch.zeros(1, 1, 1, 1, dtype=torch.float64).expand(1, 1, 1, S)
    return _huge_keys(S, mask=mask)


@case("keys-broadcast-batch-2**40", EITHER)
def _():
    # B * H * S * D overflows int64 (nothing to compute: T = 0)
    return _huge_keys(2**20, T=0, B=2**20, H=2**20, L=1)


@case("head-dim-broadcast-to-2**62", RAISE("ValueError", ARG))
def _():
    import torch
    from hkt import _C
    D = 2**62
    q = [torch.randn(1, 1, 1, 1, dtype=torch.float64).expand(1, 1, 1, D)]
    k = [torch.randn(1, 1, 1, 1, dtype=torch.float64).expand(1, 1, 1, D)]
    v = torch.randn(1, 1, 1, 2, dtype=torch.float64)
    return _C.forward(q, k, v, torch.ones(1, dtype=torch.float64), torch.empty(1, 1, 1, 2, dtype=torch.float64),
                      torch.empty(1, 1, 1, dtype=torch.float64))


@case("empty-output-with-huge-batch", EITHER)
def _():
    import torch
    from hkt import _C
    B, H = 2**28, 2**28
    q = [torch.zeros(1, 1, 0, 4, dtype=torch.float64).expand(B, H, 0, 4)]
    k = [torch.zeros(1, 1, 1, 4, dtype=torch.float64).expand(B, H, 5, 4)]
    v = torch.zeros(1, 1, 1, 3, dtype=torch.float64).expand(B, H, 5, 3)
    return _C.forward(q, k, v, torch.ones(1, dtype=torch.float64), torch.empty(B, H, 0, 3, dtype=torch.float64),
                      torch.empty(B, H, 0, dtype=torch.float64))


@case("dropout-mask-broadcast-huge", RAISE("ValueError", r"keep:"))
def _():
    import torch
    from hkt import _C
    keep = torch.ones(1, dtype=torch.bool).expand(2**40, 2**20, 1, 2)
    return _C.dropout_mask(keep, 1, 0.5)


@case("dropout-mask-empty-huge", EITHER)
def _():
    import torch
    from hkt import _C
    return _C.dropout_mask(torch.empty(2**40, 2**20, 0, 2, dtype=torch.bool), 1, 0.5)


# --------------------------------------------- (d) outputs aliasing other arrays --

def _buffer_views(n_first, shape_first, n_second_offset, shape_second):
    """Two float64 views of one buffer: the second starts n_second_offset elements in."""
    import numpy as np
    n1 = int(np.prod(shape_first))
    n2 = int(np.prod(shape_second))
    buf = np.random.default_rng(3).standard_normal(max(n1, n_second_offset + n2))
    return buf[:n1].reshape(shape_first), buf[n_second_offset:n_second_offset + n2].reshape(shape_second)


@case("out-is-v", RAISE("ValueError", r"out:"))
def _():
    a = np_inputs(T=7, S=7)
    a["out"] = a["v"]
    return fwd(a)


@case("out-overlaps-q0", RAISE("ValueError", r"out:"))
def _():
    a = np_inputs(D=5, Dv=5)
    n = a["q"][0].size
    a["q"][0], a["out"] = _buffer_views(n, a["q"][0].shape, n // 2, a["out"].shape)
    return fwd(a)


@case("out-overlaps-last-key-level", RAISE("ValueError", r"out:"))
def _():
    import numpy as np
    a = np_inputs()
    n, kl = a["out"].size, a["k"][2]
    buf = np.random.default_rng(1).standard_normal(n)
    a["out"] = buf.reshape(a["out"].shape)
    a["k"][2] = buf[n - kl.size:].reshape(kl.shape)  # the key level is the output's tail
    return fwd(a)


@case("out-overlaps-w", RAISE("ValueError", r"out:"))
def _():
    a = np_inputs()
    a["w"], a["out"] = _buffer_views(a["w"].size, a["w"].shape, 1, a["out"].shape)
    return fwd(a)


@case("out-overlaps-float-mask", RAISE("ValueError", r"(out|attn_mask):"))
def _():
    a = np_inputs()
    B, H, T, Dv = a["out"].shape
    S = a["v"].shape[2]
    mask, a["out"] = _buffer_views(B * H * T * S, (B, H, T, S), 7, (B, H, T, Dv))
    return fwd(a, attn_mask=mask)


@case("lse-overlaps-out", RAISE("ValueError", r"(out|lse):"))
def _():
    a = np_inputs()
    a["out"], a["lse"] = _buffer_views(a["out"].size, a["out"].shape, 4, a["lse"].shape)
    return fwd(a)


@case("lse-is-q0-column", RAISE("ValueError", r"lse:"))
def _():
    a = np_inputs(D=1)  # q[0] (B, H, T, 1) and lse (B, H, T) cover the same elements
    a["lse"] = a["q"][0].reshape(a["lse"].shape)
    return fwd(a)


@case("dv-is-dout", RAISE("ValueError", r"(dv|dout):"))
def _():
    a = np_backward_args(T=7, S=7)
    a["dv"] = a["dout"]
    return bwd(a)


@case("dv-is-out", RAISE("ValueError", r"dv:"))
def _():
    a = np_backward_args(T=7, S=7)
    a["dv"] = a["out"]
    return bwd(a)


@case("dq0-is-q0", RAISE("ValueError", r"dq\[0\]:"))
def _():
    a = np_backward_args()
    a["dq"][0] = a["q"][0]
    return bwd(a)


@case("dk1-overlaps-k1", RAISE("ValueError", r"dk\[1\]:"))
def _():
    a = np_backward_args()
    k1 = a["k"][1]
    a["k"][1], a["dk"][1] = _buffer_views(k1.size, k1.shape, 2, k1.shape)
    return bwd(a)


@case("dq0-is-dk0", RAISE("ValueError", r"d[qk]\[0\]:"))
def _():
    a = np_backward_args(T=7, S=7)
    a["dk"][0] = a["dq"][0]
    return bwd(a)


@case("dq-levels-share-one-array", RAISE("ValueError", r"dq\[\d\]:"))
def _():
    import numpy as np
    a = np_backward_args(T=1, S=5)  # every query level has one row
    shared = np.empty_like(a["dq"][0])
    a["dq"] = [shared, shared, shared]
    return bwd(a)


@case("dw-is-w", RAISE("ValueError", r"dw:"))
def _():
    a = np_backward_args()
    a["dw"] = a["w"]
    return bwd(a)


@case("dw-overlaps-dv", RAISE("ValueError", r"(dw|dv):"))
def _():
    a = np_backward_args()
    a["dv"], a["dw"] = _buffer_views(a["dv"].size, a["dv"].shape, a["dv"].size - 2, a["dw"].shape)
    return bwd(a)


@case("dout-overlaps-dq1", RAISE("ValueError", r"(dq\[1\]|dout):"))
def _():
    a = np_backward_args(D=5, Dv=5)
    a["dout"], a["dq"][1] = _buffer_views(a["dout"].size, a["dout"].shape, 5, a["dq"][1].shape)
    return bwd(a)


def _heads_of_one_buffer(a, offsets, width):
    """dq[0], dk[0] and dv as (B, H, n, D) views of one buffer of (B, n) rows
    of `width` elements, starting offsets[0], offsets[1], offsets[2] elements
    into each row (a module's self-attention gradient is one such buffer, q, k
    and v side by side); a view may run past its row's end into the next."""
    import numpy as np
    from numpy.lib.stride_tricks import as_strided
    B, H, T, D = a["dq"][0].shape
    flat = np.empty(B * T * width + max(offsets) + H * D)
    es = flat.itemsize
    views = [as_strided(flat[o:], (B, H, T, D), (T * width * es, D * es, width * es, es)) for o in offsets]
    a["dq"][0], a["dk"][0], a["dv"] = views
    return a


@case("dq0-dk0-dv-side-by-side-in-one-buffer", COMPUTE)
def _():
    a = np_backward_args(T=7, S=7, D=4, Dv=4)
    H, D = a["dq"][0].shape[1], a["dq"][0].shape[3]
    _heads_of_one_buffer(a, (0, H * D, 2 * H * D), 3 * H * D)  # rows interleave, no element is shared
    return bwd(a)


@case("dk0-half-a-head-into-dq0-in-one-buffer", RAISE("ValueError", r"d[qk]\[0\]:"))
def _():
    a = np_backward_args(T=7, S=7, D=4, Dv=4)
    H, D = a["dq"][0].shape[1], a["dq"][0].shape[3]
    _heads_of_one_buffer(a, (0, H * D - D // 2, 2 * H * D), 3 * H * D)  # dk[0]'s rows start inside dq[0]'s
    return bwd(a)


@case("dv-runs-into-the-next-row-of-dq0", RAISE("ValueError", r"(dq\[0\]|dv):"))
def _():
    a = np_backward_args(T=7, S=7, D=4, Dv=4)
    H, D = a["dq"][0].shape[1], a["dq"][0].shape[3]
    _heads_of_one_buffer(a, (0, H * D, 2 * H * D + D // 2), 3 * H * D)  # dv's rows end in the next row's dq[0]
    return bwd(a)


@case("inputs-share-memory", COMPUTE)
def _():
    # q and k the same arrays, v = q[0]: inputs may alias each other freely
    a = np_inputs(T=9, S=9, D=4, Dv=4)
    a["k"] = a["q"]
    a["v"] = a["q"][0]
    return fwd(a)


@case("output-adjacent-to-input", COMPUTE)
def _():
    a = np_inputs(D=5, Dv=5)
    n = a["q"][0].size
    a["q"][0], a["out"] = _buffer_views(n, a["q"][0].shape, n, a["out"].shape)
    return fwd(a)


@case("backward-inputs-share-memory", COMPUTE)
def _():
    a = np_backward_args(T=7, S=7, D=5, Dv=5)
    a["dout"] = a["out"]  # dout may be any array, out itself included
    a["k"] = a["q"]
    return bwd(a)


# ------------------------------------------------------ (e) dropout_p ------------

BAD_P = RAISE("ValueError", r"dropout_p:", contains=("1.5",), absent=("%g",))


@case("dropout-1.5-forward", BAD_P)
def _():
    return fwd(np_inputs(), dropout_p=1.5)


@case("dropout-1.5-backward", BAD_P)
def _():
    return bwd(np_backward_args(), dropout_p=1.5)


@case("dropout-1.5-mask", BAD_P)
def _():
    import numpy as np
    from hkt import _C
    return _C.dropout_mask(np.zeros((1, 1, 2, 2), bool), 1, 1.5)


@case("dropout-nan-forward", RAISE("ValueError", r"dropout_p:", contains=("nan",), absent=("%g",)))
def _():
    return fwd(np_inputs(), dropout_p=float("nan"))


@case("dropout-negative-backward", RAISE("ValueError", r"dropout_p:", contains=("-0.25",), absent=("%g",)))
def _():
    return bwd(np_backward_args(), dropout_p=-0.25)


@case("dropout-inf-mask", RAISE("ValueError", r"dropout_p:", contains=("inf",), absent=("%g",)))
def _():
    import numpy as np
    from hkt import _C
    return _C.dropout_mask(np.zeros((1, 1, 2, 2), bool), 1, float("inf"))


# ------------------------------------------- (f) scale and torch layouts --------

@case("scale-10**400-functional", RAISE("ValueError", r"scale:"))
def _():
    import hkt
    q, k, v, w = torch_inputs()
    return hkt.hkt_attention(q, k, v, w, scale=10**400)


@case("scale-minus-10**400-functional", RAISE("ValueError", r"scale:"))
def _():
    import hkt
    q, k, v, w = torch_inputs()
    return hkt.hkt_attention(q, k, v, w, scale=-10**400)


@case("scale-10**400-extension", RAISE(("ValueError", "TypeError"), r"scale:"))
def _():
    return fwd(np_inputs(), scale=10**400)


@case("scale-nan-extension", RAISE("ValueError", r"scale:"))
def _():
    return fwd(np_inputs(), scale=float("nan"))


@case("scale-complex-functional", RAISE("TypeError", r"scale:"))
def _():
    import hkt
    q, k, v, w = torch_inputs()
    return hkt.hkt_attention(q, k, v, w, scale=1j)


def _sparse(which):
    import hkt
    q, k, v, w = torch_inputs()
    mask = None
    if which == "v":
        v = v.to_sparse()
    elif which == "q[1]":
        q = [q[0], q[1].to_sparse(), q[2]]
    elif which == "k[0]":
        k = [k[0].to_sparse(), k[1], k[2]]
    elif which == "w":
        w = w.to_sparse()
    elif which == "attn_mask":
        import torch
        mask = (torch.rand(10, 7) > 0.5).to_sparse()
    return hkt.hkt_attention(q, k, v, w, attn_mask=mask)


for _which in ("v", "q[1]", "k[0]", "w", "attn_mask"):
    @case(f"sparse-{_which}", RAISE("TypeError", re.escape(_which) + ":"))
    def _(which=_which):
        return _sparse(which)


@case("complex-inputs", RAISE("TypeError", r"q\[0\]:"))
def _():
    import hkt
    q, k, v, w = torch_inputs()
    return hkt.hkt_attention([x.to(complex) for x in q], [x.to(complex) for x in k], v.to(complex), w.to(complex))


# ------------------------------------------- (g) NumPy arrays the kernels refuse --

def _flipped(a, axis):
    import numpy as np
    return np.flip(a, axis)


def _neg_stride_forward(arg, axis, mask=False):
    import numpy as np
    a = np_inputs()
    B, H, T, Dv = a["out"].shape
    S = a["v"].shape[2]
    m = np.random.default_rng(2).random((B, H, T, S)) > 0.3 if mask else None
    if arg.startswith(("q[", "k[")):
        lst, l = arg[0], int(arg[2])
        a[lst][l] = _flipped(a[lst][l], axis)
    elif arg == "attn_mask":
        m = _flipped(m, axis)
    else:
        a[arg] = _flipped(a[arg], axis)
    return fwd(a, attn_mask=m)


for _arg, _axis in [("q[0]", 2), ("q[1]", 3), ("k[0]", 0), ("k[2]", 1), ("v", 2), ("v", 3),
                    ("attn_mask", 2), ("attn_mask", 3), ("out", 2), ("lse", 1)]:
    @case(f"numpy-negative-stride-{_arg}-axis{_axis}", RAISE("ValueError", re.escape(_arg) + ":"))
    def _(arg=_arg, axis=_axis):
        return _neg_stride_forward(arg, axis, mask=arg == "attn_mask")


for _axis in (0, 1):
    @case(f"numpy-negative-stride-w-axis{_axis}", COMPUTE)
    def _(axis=_axis):
        # w is tiny and read element by element: refusing it (ValueError naming w)
        # or reading it right are both fine; a wrong result is not
        import numpy as np
        a, b = np_inputs(), np_inputs()
        a["w"] = _flipped(a["w"], axis)
        b["w"] = np.ascontiguousarray(a["w"])
        try:
            fwd(a)
        except ValueError as exc:
            assert str(exc).startswith("w:"), exc
            return
        fwd(b)
        assert np.array_equal(a["out"], b["out"]) and np.array_equal(a["lse"], b["lse"])


for _arg in ("dout", "dq[0]", "dk[1]", "dv", "dw"):
    @case(f"numpy-negative-stride-backward-{_arg}", RAISE("ValueError", re.escape(_arg) + ":"))
    def _(arg=_arg):
        a = np_backward_args()
        if "[" in arg:
            a[arg[:2]][int(arg[3])] = _flipped(a[arg[:2]][int(arg[3])], -1)
        else:
            a[arg] = _flipped(a[arg], -1)
        return bwd(a)


@case("numpy-negative-stride-size-one-axis", COMPUTE)
def _():
    a = np_inputs(B=1)
    a["v"] = a["v"][::-1]  # B = 1: the stride never moves
    return fwd(a)


@case("numpy-big-endian", RAISE(("TypeError", "ValueError"), r"k\[0\]:"))
def _():
    a = np_inputs()
    a["k"][0] = a["k"][0].astype(">f8")
    return fwd(a)


@case("numpy-read-only-output", RAISE(("TypeError", "ValueError"), r"out:"))
def _():
    a = np_inputs()
    a["out"].flags.writeable = False
    return fwd(a)


@case("numpy-object-array", RAISE(("TypeError", "ValueError"), r"v:"))
def _():
    a = np_inputs()
    a["v"] = a["v"].astype(object)
    return fwd(a)


@case("numpy-float16", RAISE("TypeError", r"q\[0\]:"))
def _():
    return fwd(np_inputs(dtype="float16"))


@case("numpy-int64-mask", RAISE("TypeError", r"attn_mask:"))
def _():
    import numpy as np
    return fwd(np_inputs(), attn_mask=np.ones((2, 3, 10, 7), np.int64))


@case("numpy-float32-mask-for-float64", RAISE("TypeError", r"attn_mask:"))
def _():
    import numpy as np
    return fwd(np_inputs(), attn_mask=np.zeros((2, 3, 10, 7), np.float32))


@case("numpy-0d-v", RAISE("ValueError", r"v:"))
def _():
    import numpy as np
    a = np_inputs()
    a["v"] = np.ones(())
    return fwd(a)


@case("numpy-5d-q0", RAISE("ValueError", r"q\[0\]:"))
def _():
    a = np_inputs()
    a["q"][0] = a["q"][0][None]
    return fwd(a)


@case("numpy-3d-mask", RAISE("ValueError", r"attn_mask:"))
def _():
    import numpy as np
    return fwd(np_inputs(), attn_mask=np.ones((3, 10, 7), bool))


@case("numpy-unaligned-float64", EITHER)
def _():
    import numpy as np
    a = np_inputs()
    q0 = a["q"][0]
    raw = np.zeros(q0.nbytes + 1, np.uint8)
    un = np.frombuffer(raw.data, dtype=np.float64, count=q0.size, offset=1).reshape(q0.shape)
    un[...] = q0
    a["q"][0] = un
    return fwd(a)


@case("numpy-offset-by-one-element", COMPUTE)
def _():
    # 8-byte aligned but not vector aligned: must work
    import numpy as np
    a = np_inputs()
    for name in ("v",):
        x = a[name]
        buf = np.empty(x.size + 1)
        y = buf[1:].reshape(x.shape)
        y[...] = x
        a[name] = y
    k0 = a["k"][0]
    buf = np.empty(k0.size + 3)
    a["k"][0] = buf[3:].reshape(k0.shape)
    a["k"][0][...] = k0
    return fwd(a)


@case("too-many-levels-extension", RAISE("ValueError", r"q:"))
def _():
    import numpy as np
    x = np.zeros((1, 1, 1, 2))
    return fwd(dict(q=[x] * 10**5, k=[x] * 10**5, v=np.zeros((1, 1, 1, 2)), w=np.zeros(10**5),
                    out=np.empty((1, 1, 1, 2)), lse=np.empty((1, 1, 1))))


@case("q-is-a-generator", RAISE("TypeError", r"q:"))
def _():
    a = np_inputs()
    a["q"] = (x for x in a["q"])
    return fwd(a)


@case("backward-with-garbage-lse", EITHER)
def _():
    a = np_backward_args()
    a["lse"][...] = float("nan")
    a["lse"][0, 0, 0] = float("-inf")
    a["lse"][0, 1, 0] = float("inf")
    return bwd(a)


@case("backward-with-garbage-out", EITHER)
def _():
    a = np_backward_args()
    a["out"][...] = 1e308
    return bwd(a)


@case("non-contiguous-lse", RAISE("ValueError", r"lse:"))
def _():
    import numpy as np
    a = np_inputs()
    a["lse"] = np.empty(a["lse"].shape + (2,))[..., 0]
    return fwd(a)


@case("seed-beyond-64-bits", EITHER)
def _():
    return fwd(np_inputs(), dropout_p=0.5, seed=2**80 + 3)


@case("empty-keys", COMPUTE)
def _():
    return fwd(np_inputs(S=0))


@case("empty-queries", COMPUTE)
def _():
    return bwd(np_backward_args(T=0))


# ---------------------------------------------------------------- runner ---------

def _describe(exc: BaseException) -> dict:
    return {"status": "raised", "type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "msg": str(exc)[:2000]}


def runner_main(names: List[str]) -> None:
    """Runs each named case in this process, printing START / RESULT lines."""
    faulthandler.enable()
    import numpy  # noqa: F401  (imports before the first START, so timeouts count the call only)
    import torch  # noqa: F401
    import hkt  # noqa: F401
    for name in names:
        print("START " + name, flush=True)
        fn, _ = CASES[name]
        try:
            fn()
            res = {"status": "returned"}
        except BaseException as exc:  # noqa: B902 -- KeyboardInterrupt from a case is a finding too
            res = _describe(exc)
        print("RESULT " + json.dumps({"name": name, **res}), flush=True)
    print("DONE", flush=True)


def child_env(env: Optional[dict] = None) -> dict:
    """The environment for a child interpreter: it imports the same hkt as this one
    (the sanitizer build's copy, say), wherever its working directory is."""
    import hkt
    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(hkt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_isolated(names: List[str], timeout: Optional[float] = None, env: Optional[dict] = None,
                 script: Optional[str] = None) -> Dict[str, dict]:
    """{name: result} for every name; a crash or a hang is that case's result.

    ``script`` (default: this file) is the runner: ``python script NAME...``."""
    timeout = timeout or float(os.environ.get("HKT_HOSTILE_TIMEOUT", "60"))
    results: Dict[str, dict] = {}
    todo = list(names)
    while todo:
        current, finished, how = None, False, None
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, script or os.path.abspath(__file__), *todo], stdout=subprocess.PIPE,
                                    stderr=err, cwd=HERE, env=child_env(env))
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline, buf = time.monotonic() + 300, b""  # the imports get 300 s
            while True:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    proc.kill()
                    how = "hung"
                    break
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    how = "crashed"
                    break
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    if text.startswith("START "):
                        current, deadline = text[6:], time.monotonic() + timeout
                    elif text.startswith("RESULT "):
                        res = json.loads(text[7:])
                        results[res.pop("name")] = res
                        current, deadline = None, time.monotonic() + timeout
                    elif text == "DONE":
                        finished = True
            proc.wait()
            sel.close()
            proc.stdout.close()
            err.seek(0)
            stderr = err.read().decode(errors="replace")[-6000:]
        if finished and proc.returncode != 0:
            # every case ran, then the interpreter died on the way out: blame them all
            for n in todo:
                results[n] = {"status": "crashed at exit", "rc": proc.returncode, "stderr": stderr}
            break
        if finished:
            break
        if current is None:
            # died outside any case (imports, or between two): the rest cannot be told apart
            for n in todo:
                results.setdefault(n, {"status": "runner " + (how or "failed"), "rc": proc.returncode,
                                       "stderr": stderr})
            break
        results[current] = {"status": how, "rc": proc.returncode, "stderr": stderr}
        todo = [n for n in todo if n not in results]
    return results


def check(name: str, res: dict) -> Optional[str]:
    """None when res satisfies the case's expectation, else why not."""
    exp = CASES[name][1]
    status = res["status"]
    if status not in ("returned", "raised"):
        return f"{status} (rc {res.get('rc')}):\n{res.get('stderr', '')}"
    if exp.kind == "compute":
        return None if status == "returned" else f"expected to compute, raised {res['type']}: {res['msg']}"
    if exp.kind == "either":
        if status == "raised" and "SystemError" in res["mro"]:
            return f"SystemError: {res['msg']}"
        if status == "raised" and "Exception" not in res["mro"]:
            return f"raised {res['type']}, not an Exception: {res['msg']}"
        return None
    if status == "returned":
        return f"expected {'/'.join(exp.types)}, but the call returned"
    if not any(t in res["mro"] for t in exp.types):
        return f"expected {'/'.join(exp.types)}, got {res['type']}: {res['msg']}"
    msg = res["msg"]
    if not re.match(exp.prefix, msg):
        return f"message should start with /{exp.prefix}/: {msg!r}"
    for s in exp.contains:
        if s not in msg:
            return f"message should contain {s!r}: {msg!r}"
    for s in exp.absent:
        if s in msg:
            return f"message should not contain {s!r}: {msg!r}"
    return None


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    runner_main(sys.argv[1:] or list(CASES))
