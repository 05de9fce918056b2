"""Soft-capping with windows (docs/contract.md sections 1.11 and 1.12): the
windowed kernels, forward, every gradient and decoding, against the dense
reference with windows= and softcap= in float64; what no cap gives (the
uncapped kernels' bits); NaN and huge scores; the argument's checks; the ops
under opcheck; the portable and AVX2 builds."""
import json
import os
import subprocess
import sys

import pytest
import torch

from hkt import _C
from hkt._core.kernels import dropout_keep_mask
from hkt.ops.window import block_sums, window_backward, window_forward, windowed_attention
from hkt.decoding.windowed import attend_windowed, attend_windowed_rows
from hkt.reference import hkt_attention_reference as reference

from window_cases import TOL, assert_op_matches, leaves, names

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def capped(q, k, v, w, *, windows, softcap=None, is_causal=False, attn_mask=None, scale=None, dropout_p=0.0):
    """hkt_attention with windows and a soft cap (the windowed branch hkt.hkt_attention takes)."""
    return windowed_attention(q, k, v, w, windows, attn_mask, is_causal, dropout_p, scale, None, softcap=softcap)


def outputs(fn, q, k, v, w, dout, extra=(), **kw):
    out = fn(q, k, v, w, **kw)
    return [out.detach(), *torch.autograd.grad(out, [*q, *k, v, w, *extra], dout)]


def assert_capped_matches(q, k, v, w, windows, causal, softcap, tol=TOL, extra=(), **kw):
    B, H, T = q[0].shape[:3]
    dout = torch.randn(B, H, T, v.shape[-1], dtype=v.dtype, generator=torch.Generator().manual_seed(5))
    kw = dict(is_causal=causal, windows=windows, softcap=softcap, **kw)
    got = outputs(capped, q, k, v, w, dout, extra, **kw)
    want = outputs(reference, q, k, v, w, dout, extra, **kw)
    for name, a, b in zip(names(len(q)) + ["dmask"], got, want):
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m: f"{name}: {m}")
    return got


CASES = [
    # T, S, L, windows, H, Hk
    (37, 37, 3, [4, 8, None], 2, 2),        # a global top level
    (45, 45, 4, [6, 12, 24, None], 4, 2),   # windows that do not divide T, GQA
    (64, 64, 3, [8, 16, 32], 4, 1),         # every level windowed, multi-query
    (50, 29, 3, [2, 8, 16], 2, 2),          # T > S
    (40, 40, 1, [6], 2, 2),                 # one level: sliding-window attention
    (130, 130, 5, [4, 8, 16, 32, None], 2, 1),  # levels >= 2 shared by their blocks' queries
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,S,L,windows,H,Hk", CASES)
def test_forward_and_every_gradient_match_the_reference(T, S, L, windows, H, Hk, causal):
    q, k, v, w = leaves(2, H, T, S, 5, 3, L, Hk=Hk, seed=T + S)
    # scores of a few units: a cap of 1.5 bends most of them, 40 hardly any
    with torch.no_grad():
        for x in q:
            x.mul_(2.0)
    for softcap in (1.5, 40.0):
        assert_capped_matches(q, k, v, w, windows, causal, softcap)


def test_the_cap_changes_the_result():
    q, k, v, w = leaves(1, 2, 33, 33, 4, 3, 3, seed=2)
    a = capped(q, k, v, w, windows=[4, 8, None], softcap=0.5)
    b = capped(q, k, v, w, windows=[4, 8, None])
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["key", "bool", "float"])
def test_masks_with_the_cap(kind, causal):
    """A key padding mask (the block-sharing path), a bool and a float mask (the
    per-key path; the float one's gradient is the capped score's)."""
    B, H, T = 2, 4, 41
    q, k, v, w = leaves(B, H, T, T, 5, 4, 3, Hk=2, seed=11)
    g = torch.Generator().manual_seed(3)
    extra = ()
    if kind == "key":
        mask = torch.rand(B, 1, 1, T, generator=g) > 0.3
    elif kind == "bool":
        mask = torch.rand(T, T, generator=g) > 0.3
    else:
        mask = torch.randn(B, 1, T, T, generator=g, dtype=torch.float64).requires_grad_()
        extra = (mask,)
    assert_capped_matches(q, k, v, w, [4, 8, None], causal, 1.2, extra=extra, attn_mask=mask)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_with_the_cap(causal):
    B, H, T, S, p = 2, 4, 41, 37, 0.3
    q, k, v, w = leaves(B, H, T, S, 5, 4, 3, Hk=2, seed=11)
    got = window_forward(q, k, v, w, None, [4, 4, 0], causal, 0.4, p, torch.tensor(1234), 0.8)[0]
    keep = dropout_keep_mask(1234, p, B, H, T, S)
    want = reference(q, k, v, w, is_causal=causal, scale=0.4, dropout_p=p, dropout_mask=keep, windows=[4, 8, None],
                     softcap=0.8)
    assert_op_matches(got, want, q, k, v, w)


def test_float32_within_its_tolerance():
    q, k, v, w = leaves(2, 4, 45, 45, 8, 6, 4, Hk=2, seed=4)
    q32, k32 = [x.detach().float().requires_grad_() for x in q], [x.detach().float().requires_grad_() for x in k]
    v32, w32 = v.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    dout = torch.randn(2, 4, 45, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for causal in (False, True):
        kw = dict(windows=[6, 12, 24, None], softcap=1.5, is_causal=causal)
        got = outputs(capped, q32, k32, v32, w32, dout.float(), **kw)
        want = outputs(reference, q, k, v, w, dout, **kw)
        for name, a, b in zip(names(4), got, want):
            torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_gradcheck():
    q, k, v, w = leaves(1, 2, 11, 11, 3, 2, 2, seed=6)

    def fn(*xs):
        return capped(list(xs[:2]), list(xs[2:4]), xs[4], xs[5], windows=[2, None], softcap=0.7, is_causal=True)
    assert torch.autograd.gradcheck(fn, (*q, *k, v, w))


def test_no_cap_is_the_uncapped_kernels_bit_for_bit():
    """softcap None and 0.0 are the same call: out and every gradient equal."""
    q, k, v, w = leaves(2, 4, 45, 45, 5, 3, 4, Hk=2, seed=8)
    dout = torch.randn(2, 4, 45, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for causal in (False, True):
        kw = dict(windows=[6, 12, 24, None], is_causal=causal)
        a = outputs(capped, q, k, v, w, dout, **kw)
        b = outputs(capped, q, k, v, w, dout, softcap=0.0, **kw)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_nan_in_gives_nan_out():
    q, k, v, w = leaves(1, 2, 33, 33, 4, 3, 3, seed=9)
    with torch.no_grad():
        q[0][0, 1, 7, 2] = float("nan")
    out = capped(q, k, v, w, windows=[4, 8, None], softcap=1.0)
    assert out[0, 1, 7].isnan().all()
    want = reference(q, k, v, w, windows=[4, 8, None], softcap=1.0)
    finite = ~want.isnan()
    assert torch.equal(finite, ~out.isnan())
    torch.testing.assert_close(out[finite], want[finite], **TOL)


def test_huge_scores_are_capped():
    """Scores far past the cap (1e6 times it) give +-cap, finite: the output and
    gradients are the reference's, whose scores are exactly +-cap."""
    q, k, v, w = leaves(1, 2, 29, 29, 4, 3, 3, seed=10)
    with torch.no_grad():
        for x in q:
            x.mul_(1e6)
    got = assert_capped_matches(q, k, v, w, [4, 8, None], True, 2.0)
    assert all(x.isfinite().all() for x in got)
    # every score is +-2: the probabilities are exp(+-2) over the row's keys
    ref = reference(q, k, v, w, windows=[4, 8, None], softcap=2.0, is_causal=True, return_probs=True)[1]
    top = ref.amax(dim=-1, keepdim=True)
    nz = ref[ref > 0]
    ratio = nz / top.expand_as(ref)[ref > 0]
    low = torch.exp(torch.tensor(-4.0, dtype=ratio.dtype))
    assert torch.all(((ratio - 1).abs() < 1e-9) | ((ratio - low).abs() < 1e-9))


def cache_case(B, H, Hk, N, D, Dv, L, seed):
    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(B, H, -(-N >> l), D, generator=g, dtype=torch.float64) * 2 for l in range(L)]
    k = [torch.randn(B, Hk, -(-N >> l), D, generator=g, dtype=torch.float64) for l in range(L)]
    v = torch.randn(B, Hk, N, Dv, generator=g, dtype=torch.float64)
    w = torch.randn(H, L, generator=g, dtype=torch.float64)
    return q, k, v, w


@pytest.mark.parametrize("L,windows,H,Hk,t0", [(3, [4, 8, None], 2, 2, 0), (4, [2, 8, 16, None], 4, 2, 13),
                                              (3, [4, 8, 16], 4, 1, 21), (1, [6], 2, 2, 30)])
def test_decoding_with_the_cap(L, windows, H, Hk, t0):
    """The decode kernel's rows t0 .. N-1 against the causal reference's, and
    against the torch rows (hkt.decoding.windowed.attend_windowed)."""
    B, N, D, Dv = 2, 41, 5, 3
    q, k, v, w = cache_case(B, H, Hk, N, D, Dv, L, seed=t0)
    want = reference(q, k, v, w, windows=windows, is_causal=True, softcap=1.3)[:, :, t0:]
    sums = [s.clone() for s in block_sums(v, L)]
    for l in range(1, L):  # the cache holds complete blocks' sums only
        sums[l][:, :, N >> l:] = 0
    rows = [torch.stack([x[:, :, t >> l] for t in range(t0, N)], dim=2) for l, x in enumerate(q)]
    got = attend_windowed_rows(rows, k, sums, w, t0, windows, softcap=1.3)
    torch.testing.assert_close(got, want, **TOL)
    torch_rows = torch.cat([attend_windowed([x[:, :, i:i + 1] for x in rows], k, sums, w, t0 + i, windows,
                                            softcap=1.3) for i in range(N - t0)], dim=2)
    torch.testing.assert_close(torch_rows, want, **TOL)
    plain = attend_windowed_rows(rows, k, sums, w, t0, windows)
    assert torch.equal(plain, attend_windowed_rows(rows, k, sums, w, t0, windows, softcap=0.0))
    assert (plain - got).abs().max() > 1e-6


def test_window_ops_with_the_cap_pass_opcheck():
    q, k, v, w = leaves(1, 2, 21, 21, 4, 3, 3, seed=15)
    seed = torch.tensor(77)
    masks = [None, torch.randn(1, 2, 21, 21, dtype=torch.float64, requires_grad=True), torch.rand(1, 1, 1, 21) > 0.3]
    for mask, dropout_p in zip(masks + [None], [0.0, 0.0, 0.0, 0.25]):
        args = (q, k, v, w, mask, [4, 4, 0], True, 0.5, dropout_p, seed, 1.5)
        torch.library.opcheck(window_forward, args)
        out, lse = window_forward(*args)
        plain = mask.detach() if mask is not None else None
        torch.library.opcheck(window_backward, (torch.randn_like(out), [x.detach() for x in q],
                                                [x.detach() for x in k], v.detach(), w.detach(), plain, out.detach(),
                                                lse.detach(), [4, 4, 0], True, 0.5, dropout_p, seed,
                                                plain is not None and plain.is_floating_point(), 1.5))


def test_compile_fullgraph_takes_the_cap():
    q, k, v, w = leaves(1, 2, 33, 33, 4, 3, 3, seed=12)
    dout = torch.randn(1, 2, 33, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def fn(q, k, v, w):
        return capped(q, k, v, w, windows=[4, 8, None], softcap=1.5, is_causal=True)
    eager = outputs(fn, q, k, v, w, dout)
    torch._dynamo.reset()
    compiled = outputs(torch.compile(fn, fullgraph=True), q, k, v, w, dout)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("softcap, error, message", [
    (True, TypeError, "softcap: expected None or a real number, got bool"),
    ("1.0", TypeError, "softcap: expected None or a real number, got str"),
    (-1.0, ValueError, r"softcap: must be positive and finite \(or None/0.0 for none\), got -1.0"),
    (float("inf"), ValueError, "softcap: must be positive and finite"),
    (float("nan"), ValueError, "softcap: must be positive and finite"),
])
def test_bad_softcap_is_refused_by_name(softcap, error, message):
    q, k, v, w = leaves(1, 2, 9, 9, 4, 3, 2, seed=1)
    with pytest.raises(error, match=message):
        capped(q, k, v, w, windows=[2, None], softcap=softcap)
    with pytest.raises(error, match=message):
        _C.window_softcap(softcap)
    # the kernels' entry points check it too, before anything runs
    rows = [x.detach()[:, :, :1].contiguous() for x in q]
    with pytest.raises(error, match=message):
        _C.window_decode(rows, [x.detach() for x in k], block_sums(v.detach(), 2), w.detach(), torch.empty(1, 2, 1, 3,
                         dtype=torch.float64), 0, (2, 0), softcap=softcap)


def test_the_binding_reads_none_and_numbers():
    assert _C.window_softcap(None) == 0.0
    assert _C.window_softcap(0) == 0.0
    assert _C.window_softcap(3) == 3.0
    assert _C.window_softcap(torch.tensor(2.5).numpy()[()]) == 2.5


SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from hkt import _C
from hkt.ops.window import windowed_attention
from hkt.reference import hkt_attention_reference as reference
from window_cases import leaves

res = {"kernels": _C.cpu_kernels(), "errors": {}}
for dtype in (torch.float32, torch.float64):
    for causal in (False, True):
        q, k, v, w = leaves(2, 4, 45, 45, 13, 7, 4, Hk=2, seed=3)
        g = torch.randn(2, 4, 45, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        xs = [x.detach().to(dtype).requires_grad_() for x in (*q, *k, v, w)]
        out = windowed_attention(xs[:4], xs[4:8], xs[8], xs[9], [6, 12, 24, None], None, causal, 0.0, None, None,
                                 softcap=1.5)
        got = [out, *torch.autograd.grad(out, xs, g.to(dtype))]
        r = reference(q, k, v, w, windows=[6, 12, 24, None], is_causal=causal, softcap=1.5)
        want = [r, *torch.autograd.grad(r, [*q, *k, v, w], g)]
        err = max(((a.double() - b).abs().max() / (1 + b.abs().max())).item() for a, b in zip(got, want))
        res["errors"][f"{dtype} causal={causal}"] = err
print(json.dumps(res))
"""


@pytest.mark.parametrize("kernels", ["avx512f", "avx2", "default"])
def test_every_build_caps(kernels):
    """Each instruction set's build of the windowed kernels (HKT_CPU_KERNELS
    picks it, once per process) against the reference."""
    env = {**os.environ, "HKT_CPU_KERNELS": kernels}
    run = subprocess.run([sys.executable, "-c", SCRIPT, TESTS], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    if res["kernels"] != kernels:
        pytest.skip(f"this CPU or build has no {kernels} kernels (runs {res['kernels']})")
    for case, err in res["errors"].items():
        assert err <= (5e-5 if "float32" in case else 1e-12), (kernels, case, err)
