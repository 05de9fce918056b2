"""Helpers the test files share (imported as ``helpers``; pytest puts tests/ on
the path): random HKT inputs and the attention masks the tests sweep.  It puts
the source tree's root on the path too, for the research/ code some tests check
(it is not installed with hkt)."""
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from research.timing import random_inputs  # noqa: E402


def level_len(n, l):
    return -(-n // 2**l)


def sample_inputs(B, H, T, S, D, Dv, L, *, dtype=torch.float64, per_head=True, requires_grad=False,
                  device="cpu", seed=0, kv_heads=None):
    """Random HKT inputs: q, k lists of L levels, v, w; k and v with kv_heads
    heads (default H).  The benchmarks' generator (research.timing.random_inputs)."""
    return random_inputs(B, H, T, S, D, Dv, L, dtype=dtype, per_head=per_head, requires_grad=requires_grad,
                         device=device, seed=seed, kv_heads=kv_heads)


MASKS = [None, "bool", "float", "bool4d"]


def grad_leaves(q, k, v, w, mask=None):
    """q, k, v, w (and a float mask) as fresh leaves that require grad."""
    xs = [x.detach().requires_grad_(True) for x in (*q, *k, v, w)]
    L = len(q)
    m = mask
    if mask is not None and mask.is_floating_point():
        m = mask.detach().requires_grad_(True)
    return xs[:L], xs[L:2 * L], xs[2 * L], xs[2 * L + 1], m


def outputs_and_grads(fn, q, k, v, w, mask, **kw):
    """fn's output and its gradients in q, k, v, w (and a mask that requires
    grad) for one fixed random output gradient."""
    out = fn(q, k, v, w, attn_mask=mask, **kw)
    wrt = [*q, *k, v, w] + ([mask] if mask is not None and mask.requires_grad else [])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out.dtype)
    return out, torch.autograd.grad(out, wrt, g)


def make_mask(kind, B, H, T, S, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool":
        return torch.rand(T, S, generator=g) > 0.3
    if kind == "bool4d":  # whole rows masked out too
        m = torch.rand(B, 1, T, S, generator=g) > 0.5
        m[:, :, ::5] = False
        return m
    m = torch.randn(1, H, T, S, generator=g, dtype=dtype)
    m[..., ::3, 1::2] = float("-inf")
    return m


def bad_input_base(dtype=torch.float64):
    """The valid call every BAD_CASES entry spoils one argument of."""
    return sample_inputs(2, 3, 10, 7, 4, 5, 3, dtype=dtype)


def requiring_grad(x):
    """x (a tensor, or a list of them) with its floating tensors requiring grad:
    a bad-input case again through the autograd path."""
    if isinstance(x, (list, tuple)):
        return type(x)(requiring_grad(y) for y in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.is_leaf:
        return x.detach().requires_grad_()
    return x


def swap(seq, i, x):
    seq = list(seq)
    seq[i] = x
    return seq


def bad_cases():
    q, k, v, w = bad_input_base()
    f32 = bad_input_base(torch.float32)
    yield "q-not-seq", TypeError, "q", dict(q=q[0])
    yield "q-empty", ValueError, "q", dict(q=[])
    yield "q-item-not-tensor", TypeError, "q[1]", dict(q=swap(q, 1, "x"))
    yield "q-rank", ValueError, "q[0]", dict(q=swap(q, 0, q[0][0]))
    # 0-d: no sizes to read at all (was an IndexError before any check named it)
    yield "q-0d", ValueError, "q[0]", dict(q=swap(q, 0, torch.tensor(1.0, dtype=torch.float64)))
    yield "q-level-length", ValueError, "q[1]", dict(q=swap(q, 1, torch.randn(2, 3, 4, 4, dtype=torch.float64)))
    yield "q-level-head-dim", ValueError, "q[2]", dict(q=swap(q, 2, torch.randn(2, 3, 3, 6, dtype=torch.float64)))
    yield "k-level-length", ValueError, "k[2]", dict(k=swap(k, 2, torch.randn(2, 3, 3, 4, dtype=torch.float64)))
    yield "k-head-dim", ValueError, "k[0]", dict(k=swap(k, 0, torch.randn(2, 3, 7, 3, dtype=torch.float64)))
    yield "k-batch", ValueError, "k[0]", dict(k=swap(k, 0, torch.randn(1, 3, 7, 4, dtype=torch.float64)))
    yield "k-levels", ValueError, "k", dict(k=k[:2])
    yield "k-more-levels", ValueError, "k", dict(k=[*k, k[2][:, :, :1]])
    yield "v-length", ValueError, "v", dict(v=torch.randn(2, 3, 8, 5, dtype=torch.float64))
    yield "v-rank", ValueError, "v", dict(v=torch.randn(3, 7, 5, dtype=torch.float64))
    yield "v-type", TypeError, "v", dict(v=np.zeros((2, 3, 7, 5)))
    yield "w-length", ValueError, "w", dict(w=torch.randn(4, dtype=torch.float64))
    yield "w-heads", ValueError, "w", dict(w=torch.randn(2, 3, dtype=torch.float64))
    yield "mixed-dtype", TypeError, "k[1]", dict(k=swap(k, 1, f32[1][1]))
    yield "mixed-dtype-w", TypeError, "w", dict(w=f32[3])
    # a bfloat16 array next to float32 ones is refused, not upcast in silence
    yield "mixed-bfloat16", TypeError, "k[1]", dict(q=f32[0], k=swap(f32[1], 1, f32[1][1].bfloat16()), v=f32[2], w=f32[3])
    yield "half", TypeError, "q[0]", dict(q=[x.half() for x in q], k=[x.half() for x in k], v=v.half(), w=w.half())
    yield "int", TypeError, "q[0]", dict(q=[x.long() for x in q])
    yield "device", ValueError, "v", dict(v=torch.empty(2, 3, 7, 5, dtype=torch.float64, device="meta"))
    yield "nan-scale", ValueError, "scale", dict(scale=float("nan"))
    yield "inf-scale", ValueError, "scale", dict(scale=float("inf"))
    yield "str-scale", TypeError, "scale", dict(scale="0.5")
    yield "mask-shape", ValueError, "attn_mask", dict(attn_mask=torch.ones(10, 8, dtype=torch.bool))
    yield "mask-dtype", TypeError, "attn_mask", dict(attn_mask=torch.ones(10, 7, dtype=torch.int32))
    # uint8, once DLPack's stand-in for bool, is not taken as one (as SDPA, and the "sdpa" backend)
    yield "mask-uint8", TypeError, "attn_mask", dict(attn_mask=torch.ones(10, 7, dtype=torch.uint8))
    yield "mask-type", TypeError, "attn_mask", dict(attn_mask=[[True]])
    yield "dropout", ValueError, "dropout_p", dict(dropout_p=1.5)
    yield "dropout-neg", ValueError, "dropout_p", dict(dropout_p=-0.1)
    yield "causal-type", TypeError, "is_causal", dict(is_causal="yes")
    yield "head-dim-zero", ValueError, "q[0]", dict(q=[torch.randn(2, 3, -(-10 // 2**l), 0, dtype=torch.float64)
                                                     for l in range(3)],
                                                  k=[torch.randn(2, 3, -(-7 // 2**l), 0, dtype=torch.float64)
                                                     for l in range(3)])
    yield "too-many-levels", ValueError, "q", dict(
        q=[torch.randn(1, 1, 1, 2, dtype=torch.float64)] * 30, k=[torch.randn(1, 1, 1, 2, dtype=torch.float64)] * 30,
        v=torch.randn(1, 1, 1, 2, dtype=torch.float64), w=torch.randn(30, dtype=torch.float64))


# (name, exception, argument the message starts with, overrides of bad_input_base's call)
BAD_CASES = list(bad_cases())


def with_threads(n, fn):
    """fn() with torch at n threads, the old count restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


# ---- low-precision tolerances, derived rather than fixed

def _double_leaves(xs):
    return [x.detach().double().requires_grad_() for x in xs]


def _lowp_leaves(xs, dtype):
    return [x.detach().to(dtype).requires_grad_() for x in xs]


def assert_within_lowp_error(run, reference, q, k, v, w, dtype, *, factor=2.0, dout_seed=0, **kwargs):
    """The output and every gradient of ``run`` (the kernels, fed ``dtype``
    inputs) must be as close to the float64 ``reference`` as ``factor`` times
    the error that plain PyTorch (``reference`` run in ``dtype`` itself) makes
    on the same data, plus a few ulps of ``dtype`` at the result's magnitude
    for results plain PyTorch gets exactly.  The way flash-attention sets
    its tolerances: the bar is what the precision allows on this data, not a
    number picked once."""
    L = len(q)
    leaves64 = _double_leaves([*q, *k, v, w])
    leaves_lo = _lowp_leaves([*q, *k, v, w], dtype)
    leaves = _lowp_leaves([*q, *k, v, w], dtype)

    def results(fn, xs):
        out = fn(xs[:L], xs[L:2 * L], xs[2 * L], xs[2 * L + 1], **kwargs)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(dout_seed), dtype=torch.float64)
        grads = torch.autograd.grad(out, xs, dout.to(out.dtype))
        return [out, *grads]

    want = results(reference, leaves64)
    plain = results(reference, leaves_lo)
    got = results(run, leaves)
    names = ["out"] + [f"dq[{l}]" for l in range(L)] + [f"dk[{l}]" for l in range(L)] + ["dv", "dw"]
    assert_close_to_double(got, plain, want, dtype, names=names, factor=factor)


def assert_close_to_double(got, plain, want, dtype, *, names=None, factor=2.0):
    """Each got[i] (computed in ``dtype``) must be within ``factor`` times the
    error plain[i] (plain PyTorch in ``dtype``, same data) makes against
    want[i] (float64), plus 4 ulps of ``dtype`` at want[i]'s magnitude."""
    ulp = torch.finfo(dtype).eps
    names = names or [f"result {i}" for i in range(len(want))]
    for name, g, p, r in zip(names, got, plain, want):
        assert g.dtype == dtype, f"{name}: dtype {g.dtype}, expected {dtype}"
        r = r.double()
        base = (p.double() - r).abs().max().item()
        bound = factor * base + 4 * ulp * r.abs().max().item()
        err = (g.double() - r).abs().max().item()
        assert err <= bound, (f"{name}: error {err:.3g} against float64 is more than {factor} x plain PyTorch's "
                              f"{dtype} error {base:.3g} (+ 4 ulps)")


# ---- one torch thread per test (this section is appended, so its import is here)
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Every test of a module that imports this runs on one torch thread, the
    old count restored after: training runs compared step for step then
    reduce in one fixed order, and stay off a shared machine's other cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def randomize(module, seed=0, scale=0.5):
    """Every parameter of ``module`` set to N(0, scale^2) draws (taps of both
    signs, uneven level weights), so that no coarse level is switched off and no
    term is trivially zero or symmetric; returns the module."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return module


def load_benchmark(name):
    """benchmarks/<name>.py loaded as a module (benchmarks/ is not a package)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_on_kernels(script, kernels):
    """The JSON a test script prints last, run in a fresh interpreter on kernel
    set ``kernels`` (HKT_CPU_KERNELS) with tests/ as its argument."""
    import json
    import subprocess
    env = {**os.environ, "HKT_CPU_KERNELS": kernels}
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", script, tests], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_build_matches(res, kernels):
    """run_on_kernels' result of a script that records each case's error
    against the reference (``errors``) and whether the thread count changed a
    bit (``same_bits``): within float32's or float64's tolerance, bitwise the
    same for any thread count; skipped where this CPU or build lacks the set."""
    if res["kernels"] != kernels:
        pytest.skip(f"this CPU or build has no {kernels} kernels (runs {res['kernels']})")
    for case, err in res["errors"].items():
        tol = 5e-5 if "float32" in case else 1e-12
        assert err <= tol, (kernels, case, err)
    assert res["same_bits"], f"{kernels}: results depend on the thread count"
