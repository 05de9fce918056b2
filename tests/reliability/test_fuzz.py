"""The kernels against the plain-PyTorch reference on awkward input.

Three parts, in float64 (the fuzz also in float32 and bfloat16):

* float attn_mask gradients, in every broadcast shape SDPA accepts, through
  hkt.hkt_attention and hkt.MultiheadHKT;
* non-finite values: which rows NaN reaches and which entries it must not;
* a property-based differential fuzz (hypothesis): random sizes, levels, grouped
  heads, masks, strides, broadcasts, NaN/inf and soft-caps, forward and every gradient against
  hkt.reference, and one thread against two, bitwise.  Plus NumPy arrays with
  negative strides at the extension level.

The fuzz runs HKT_FUZZ_EXAMPLES examples (default 150; `make fuzz` runs 20,000; the
NumPy stride fuzz a quarter of that), derandomized, so `make test` always tries the
same ones; HKT_FUZZ_SEED=n draws a different fixed set.
"""
import math
import os
import re

import numpy as np
import pytest
import torch
from torch import nn

import hkt
from hkt import _C
from hkt.reference import attention_probs, repeat_kv, upsample_level
from hkt.reference import hkt_attention_reference as reference

from helpers import level_len, sample_inputs, with_threads

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-9)
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------- helpers -----------

def run(fn, q, k, v, w, mask, dout, **kw):
    """fn's output and the gradients of <out, dout> w.r.t. q..., k..., v, w and the
    mask (when it requires grad); None gradients (unused inputs) become zeros."""
    leaves = [*q, *k, v, w] + ([mask] if mask is not None and mask.requires_grad else [])
    out = fn(q, k, v, w, attn_mask=mask, **kw)
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def grad_names(L, mask):
    return [f"q[{l}]" for l in range(L)] + [f"k[{l}]" for l in range(L)] + ["v", "w"] + (
        ["attn_mask"] if mask is not None and mask.requires_grad else [])


def assert_same(a, b, what, strict=True):
    """a (kernels) against b (reference).  strict: equal within TOL, NaN where NaN;
    "finite": equal wherever both are finite.
    Otherwise (gradients of q, k, w when those hold NaN/inf, where the reference's
    matmuls turn 0 * NaN into NaN that the kernels need not reproduce): equal wherever
    the reference is finite, and NaN nowhere the reference is finite."""
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if strict == "finite":  # only where both are finite: NaN may be on either side
        fin = torch.isfinite(a) & torch.isfinite(b)
        torch.testing.assert_close(a[fin], b[fin], **TOL, msg=lambda m: f"{what} (where both are finite): {m}")
        return
    if strict:
        torch.testing.assert_close(a, b, equal_nan=True, **TOL, msg=lambda m: f"{what}: {m}")
        return
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin], **TOL, msg=lambda m: f"{what} (where the reference is finite): {m}")


def assert_matches_reference(q, k, v, w, mask, dout, *, loose=False, got=None, **kw):
    """Forward and every gradient, kernels (``got``, or computed here) vs reference.
    loose: True compares the gradients of q, k and w loosely (assert_same), "all"
    the output and every gradient where both sides are finite.  Returns the kernels' results."""
    got = got or run(hkt.hkt_attention, q, k, v, w, mask, dout, **kw)
    ref = run(reference, q, k, v, w, mask, dout, **kw)
    assert_same(got[0], ref[0], "out", strict="finite" if loose == "all" else True)
    L = len(q)
    for name, a, b in zip(grad_names(L, mask), got[1], ref[1]):
        assert_same(a, b, f"grad {name}",
                    strict="finite" if loose == "all" else not (loose and name[0] in "qkw"))
    return got


def leaf(x):
    return x.detach().requires_grad_()


def inputs(B, H, T, S, D, Dv, L, seed=0, per_head=True):
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, per_head=per_head, seed=seed)
    return [leaf(x) for x in q], [leaf(x) for x in k], leaf(v), leaf(w)


def dout_like(B, H, T, Dv, seed=7):
    return torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------ 1. float mask gradients -------

B0, H0, T0, S0 = 2, 3, 13, 11
MASK_SHAPES = [(S0,), (1,), (T0, S0), (1, S0), (T0, 1), (1, 1), (H0, T0, S0), (H0, 1, S0), (1, T0, S0),
               (B0, 1, 1, S0), (B0, H0, T0, S0), (1, H0, 1, S0), (1, 1, T0, S0), (B0, 1, T0, 1), (B0, H0, 1, 1),
               (1, 1, 1, 1)]


def float_mask(shape, seed, neg_inf=0.25, full_rows=True):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g, dtype=torch.float64)
    m[torch.rand(shape, generator=g) < neg_inf] = -INF
    if full_rows and len(shape) >= 2 and shape[-2] > 2 and shape[-1] > 1:
        m[..., 2, :] = -INF  # a row that sees nothing
    return m


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_float_mask_gradient_every_broadcast_shape(shape, causal):
    q, k, v, w = inputs(B0, H0, T0, S0, 5, 4, 3, seed=len(shape))
    mask = leaf(float_mask(shape, seed=sum(shape)))
    got = assert_matches_reference(q, k, v, w, mask, dout_like(B0, H0, T0, 4), is_causal=causal)
    dmask = got[1][-1]
    assert dmask.shape == mask.shape
    assert torch.isfinite(dmask).all()
    # a -inf entry is hidden: exactly no gradient (unless broadcasting sums it with visible ones)
    if mask.shape == (B0, H0, T0, S0):
        assert (dmask[mask.detach() == -INF] == 0).all()
        if causal:
            assert (dmask.triu(1) == 0).all()


def test_float_mask_gradient_float32_and_mask_not_requiring_grad():
    q, k, v, w = inputs(1, 2, 9, 9, 4, 3, 2)
    m = float_mask((9, 9), seed=1)
    # without requires_grad: no mask gradient asked for, the rest unchanged
    got = run(hkt.hkt_attention, q, k, v, w, m, dout_like(1, 2, 9, 3))
    with_grad = run(hkt.hkt_attention, q, k, v, w, leaf(m), dout_like(1, 2, 9, 3))
    for a, b in zip([got[0], *got[1]], [with_grad[0], *with_grad[1][:-1]]):
        assert torch.equal(a, b)
    # float32 inputs with a float32 mask: its gradient in float32, near the float64 one
    q32, k32 = [leaf(x.detach().float()) for x in q], [leaf(x.detach().float()) for x in k]
    m32 = leaf(m.float())
    out = hkt.hkt_attention(q32, k32, v.detach().float(), w.detach().float(), attn_mask=m32)
    (g32,) = torch.autograd.grad(out, [m32], dout_like(1, 2, 9, 3).float())
    assert g32.dtype == torch.float32
    torch.testing.assert_close(g32.double(), with_grad[1][-1], rtol=1e-4, atol=1e-5)


def test_float_mask_gradient_with_float32_mask_for_float64_inputs():
    # the op casts the mask to q's dtype; the gradient comes back to the float32 mask
    q, k, v, w = inputs(1, 2, 6, 7, 3, 2, 2)
    m64 = leaf(float_mask((6, 7), seed=4))
    m32 = leaf(m64.detach().float())
    (g64,) = torch.autograd.grad(hkt.hkt_attention(q, k, v, w, attn_mask=m64).sum(), [m64])
    (g32,) = torch.autograd.grad(hkt.hkt_attention(q, k, v, w, attn_mask=m32).sum(), [m32])
    assert g32.dtype == torch.float32
    torch.testing.assert_close(g32, g64.float(), rtol=1e-6, atol=1e-7)


def mha_pair(E, H, levels):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    mod = hkt.MultiheadHKT.from_mha(mha, levels=levels)
    return mha.eval(), mod.eval()


@pytest.mark.parametrize("kind", ["2d", "3d", "key_padding", "both"])
def test_multihead_float_mask_gradient_matches_mha(kind):
    # levels=1 computes what nn.MultiheadAttention computes: the mask gradients too
    E, H, B, T, S = 12, 3, 2, 7, 9
    mha, mod = mha_pair(E, H, levels=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, E, generator=g, dtype=torch.float64)
    kv = torch.randn(B, S, E, generator=g, dtype=torch.float64)
    am = float_mask((T, S) if kind in ("2d", "both") else (B * H, T, S), seed=2, full_rows=False)
    kpm = float_mask((B, S), seed=3, neg_inf=0.2, full_rows=False)
    kpm[:, 0] = 0.0  # MHA gives NaN for a row with no key; keep one visible everywhere
    am[..., 0] = 0.0
    use_am, use_kpm = kind != "key_padding", kind in ("key_padding", "both")
    results = []
    for module in (mha, mod):
        a, p = leaf(am), leaf(kpm)
        out, _ = module(x, kv, kv, attn_mask=a if use_am else None, key_padding_mask=p if use_kpm else None,
                        need_weights=False)
        wanted = ([a] if use_am else []) + ([p] if use_kpm else [])
        results.append((out, torch.autograd.grad(out, wanted, dout_like(B, T, 1, E).reshape(B, T, E))))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_levels3_float_mask_gradient_matches_reference_path(causal, monkeypatch):
    E, H, B, T, S = 12, 3, 2, 11, 11
    _, mod = mha_pair(E, H, levels=3)
    with torch.no_grad():  # switch the coarse levels on
        for p in mod.parameters():
            p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(p.numel())))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, E, generator=g, dtype=torch.float64)
    am = float_mask((B * H, T, S), seed=6)
    kpm = float_mask((B, S), seed=8, neg_inf=0.2, full_rows=False)

    def grads():
        a, p = leaf(am), leaf(kpm)
        out, _ = mod(x, x, x, attn_mask=a, key_padding_mask=p, need_weights=False, is_causal=causal)
        return [out.detach(), *torch.autograd.grad(out, [a, p, *mod.parameters()], torch.ones_like(out))]

    def reference_qkv(qkv, q, k, v, w, mask, causal, dropout_p):
        return reference(q, k, v, w, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)

    got = grads()
    with monkeypatch.context() as mp:  # both of the module's ways into the attention
        mp.setattr(hkt.nn.modules, "hkt_attention", reference)
        mp.setattr(hkt.nn.modules, "qkv_attention", reference_qkv)
        want = grads()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL)


# ------------------------------------------------ 2. NaN and inf --------------

def nan_rows(out):
    """(B, H, T) bool: rows of out holding a NaN."""
    return torch.isnan(out).any(-1)


def test_nan_in_query_reaches_exactly_its_rows():
    B, H, T, S, L = 1, 2, 12, 10, 3
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    clean = hkt.hkt_attention(q, k, v, w, is_causal=True).detach()
    with torch.no_grad():
        q[0][0, 0, 3, 1] = NAN   # row 3 of head 0
        q[2][0, 1, 2, 0] = NAN   # level 2, block 2: rows 8..11 of head 1
    got = assert_matches_reference(q, k, v, w, None, dout_like(B, H, T, 3), loose=True, is_causal=True)
    expect = torch.zeros(B, H, T, dtype=torch.bool)
    expect[0, 0, 3] = True
    expect[0, 1, 8:12] = True
    assert torch.equal(nan_rows(got[0]), expect)
    torch.testing.assert_close(got[0][~expect], clean[~expect], rtol=0, atol=1e-15)
    assert torch.isnan(got[0][expect]).all()  # every column of those rows
    # a NaN row passes NaN to its own query gradient and keeps the others finite
    dq0 = got[1][0]
    assert torch.isnan(dq0[0, 0, 3]).all() and torch.isfinite(dq0[0, 0, :3]).all()


def test_nan_in_key_reaches_the_rows_that_see_it():
    B, H, T, S, L = 1, 1, 16, 16, 2
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    with torch.no_grad():
        k[1][0, 0, 4, 2] = NAN  # level-1 key block 4: keys 8, 9
    got = assert_matches_reference(q, k, v, w, None, dout_like(B, H, T, 3), loose=True, is_causal=True)
    rows = nan_rows(got[0])[0, 0]
    assert rows[8:].all() and not rows[:8].any()  # causal: rows >= 8 see key 8
    assert torch.isnan(got[1][2 * L][0, 0, 8]).any()  # dv of key 8: P from the NaN rows


@pytest.mark.parametrize("hide", ["bool", "float", "causal"])
def test_hidden_nan_key_contributes_nothing(hide):
    # A -inf float-mask entry over a NaN score is NaN (-inf + NaN, as in SDPA), so
    # there a NaN key is visible: every row that has it in its level blocks is NaN.
    B, H, T, S, L = 2, 2, 9, 12, 2
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    j = 11  # last key: hidden from every row by the mask, or by causality (T = 9 <= j)
    if hide == "bool":
        mask = torch.ones(T, S, dtype=torch.bool)
        mask[:, 10:] = False  # level-1 block 5 = keys 10, 11
    elif hide == "float":
        mask = leaf(float_mask((T, S), seed=1, neg_inf=0.1, full_rows=False).masked_fill(
            torch.arange(S) >= 10, -INF))
    else:
        mask = None
    kw = dict(is_causal=hide == "causal")
    dout = dout_like(B, H, T, 3)
    clean = run(hkt.hkt_attention, q, k, v, w, mask, dout, **kw)
    with torch.no_grad():
        k[0][:, :, j] = NAN
        k[1][:, :, j // 2] = NAN
    got = assert_matches_reference(q, k, v, w, mask, dout, loose=True, **kw)
    if hide == "float":
        assert torch.isnan(got[0]).all(), "-inf + NaN is a visible NaN: every row holds key 11"
        return
    assert torch.equal(got[0], clean[0]), "a hidden NaN key changed the output"
    torch.testing.assert_close(got[1][2 * L], clean[1][2 * L], rtol=0, atol=0)  # dv: P of the hidden key is 0
    if hide == "float":
        assert torch.equal(got[1][-1], clean[1][-1]), "a hidden NaN key changed the mask gradient"
        assert (got[1][-1][:, 10:] == 0).all()


def test_hidden_entries_of_a_nan_row_get_no_mask_gradient():
    B, H, T, S, L = 1, 2, 8, 8, 2
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    m = float_mask((B, H, T, S), seed=3, neg_inf=0.3, full_rows=False)
    m[0, 0, 5, 0] = 0.0  # row 5 sees key 0 at least
    mask = leaf(m)
    with torch.no_grad():
        q[0][0, 0, 5, 0] = NAN
    got = assert_matches_reference(q, k, v, w, mask, dout_like(B, H, T, 3), loose=True, is_causal=True)
    dmask = got[1][-1][0, 0, 5]
    # the float mask's -inf entries do not hide a NaN score (-inf + NaN is NaN);
    # causality does
    visible = torch.arange(S) <= 5
    assert torch.isnan(dmask[visible]).all()
    assert (dmask[~visible] == 0).all(), "a hidden entry of a NaN row got a gradient"
    others = torch.ones(B, H, T, dtype=torch.bool)
    others[0, 0, 5] = False
    assert torch.isfinite(got[1][-1][others]).all() and torch.isfinite(got[0][others]).all()


@pytest.mark.parametrize("how", ["bool", "float", "causal-empty-keys"])
def test_row_without_visible_keys_is_zero_even_with_nan_query(how):
    B, H, T, S, L = 1, 1, 6, 5, 2
    q, k, v, w = inputs(B, H, T, S if how != "causal-empty-keys" else 0, 3, 2, L)
    S = k[0].shape[2]
    if how == "bool":
        mask = torch.ones(T, S, dtype=torch.bool)
        mask[4] = False
    elif how == "float":
        m = float_mask((T, S), seed=2, neg_inf=0.0, full_rows=False)
        m[4] = -INF
        mask = leaf(m)
    else:
        mask = None
    with torch.no_grad():
        q[0][0, 0, 4] = NAN  # row 4: NaN, but it sees nothing
    got = assert_matches_reference(q, k, v, w, mask, dout_like(B, H, T, 2), loose=True)
    if how == "float":
        # a row of -inf float-mask entries over NaN scores is a NaN row (-inf + NaN
        # is NaN, as in SDPA): only bool masks and causality hide a NaN
        assert torch.isnan(got[0][0, 0, 4]).all()
        return
    assert (got[0][0, 0, 4] == 0).all()
    assert (got[1][0][0, 0, 4] == 0).all(), "dq of a row that sees nothing must be 0"
    if how != "causal-empty-keys":
        assert torch.isfinite(got[0]).all()


def test_nan_in_float_mask_reaches_its_row_only():
    B, H, T, S, L = 1, 2, 7, 9, 2
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    m = float_mask((H, T, S), seed=5, neg_inf=0.2, full_rows=False)
    m[1, 3, 4] = NAN    # visible (not causal): row 3 of head 1
    m[0, 2, 6] = INF    # +inf, visible: row 2 of head 0
    mask = leaf(m)
    got = assert_matches_reference(q, k, v, w, mask, dout_like(B, H, T, 3))
    expect = torch.zeros(B, H, T, dtype=torch.bool)
    expect[0, 1, 3] = expect[0, 0, 2] = True
    assert torch.equal(nan_rows(got[0]), expect)


def test_nan_in_float_mask_hidden_by_causality_is_ignored():
    B, H, T, S, L = 1, 1, 6, 6, 1
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    m = float_mask((T, S), seed=5, neg_inf=0.0, full_rows=False)
    clean = run(hkt.hkt_attention, q, k, v, w, leaf(m), dout_like(B, H, T, 3), is_causal=True)
    m[1, 4] = NAN  # above the diagonal
    m[2, 5] = INF
    got = assert_matches_reference(q, k, v, w, leaf(m), dout_like(B, H, T, 3), is_causal=True)
    assert torch.equal(got[0], clean[0])
    for a, b in zip(got[1], clean[1]):
        assert torch.equal(a, b)


def test_nan_in_level_weight_reaches_its_head():
    B, H, T, S, L = 2, 3, 8, 8, 3
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    mask = torch.ones(T, S, dtype=torch.bool)
    mask[6] = False  # row 6 sees nothing: zeros even in the NaN head
    with torch.no_grad():
        w[1, 2] = NAN
    got = assert_matches_reference(q, k, v, w, mask, dout_like(B, H, T, 3), loose=True)
    rows = nan_rows(got[0])
    expect = torch.zeros(B, H, T, dtype=torch.bool)
    expect[:, 1] = True
    expect[:, 1, 6] = False
    assert torch.equal(rows, expect)
    assert (got[0][:, 1, 6] == 0).all()


def test_inf_key_is_nan_or_hidden_by_the_sign_of_its_score():
    # +inf in one feature of key j: score(i, j) = scale * w * q[i, d] * inf = +-inf.
    # +inf: the row is NaN.  -inf: key j weighs nothing, as if masked out.
    B, H, T, S, L, d, j = 1, 1, 10, 8, 1, 1, 3
    q, k, v, w = inputs(B, H, T, S, 4, 3, L, per_head=False)
    with torch.no_grad():
        w.abs_()
    hidden_j = torch.ones(T, S, dtype=torch.bool)
    hidden_j[:, j] = False
    masked = run(hkt.hkt_attention, q, k, v, w, hidden_j, dout_like(B, H, T, 3))
    with torch.no_grad():
        k[0][0, 0, j, d] = INF
    got = assert_matches_reference(q, k, v, w, None, dout_like(B, H, T, 3), loose=True)
    positive = q[0].detach()[0, 0, :, d] > 0
    assert positive.any() and (~positive).any()
    assert torch.equal(nan_rows(got[0])[0, 0], positive)
    torch.testing.assert_close(got[0][0, 0, ~positive], masked[0][0, 0, ~positive], rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "attention"), (torch.float32, "decode"),
                                          (torch.float64, "attention"), (torch.float64, "decode"),
                                          (torch.bfloat16, "attention")],
                         ids=["float32", "float32-decode", "float64", "float64-decode", "bfloat16"])
@pytest.mark.parametrize("below", [False, True], ids=["scale-subnormal", "scale-rounds-to-0"])
def test_inf_key_with_a_level_factor_below_the_subnormals(kernel, dtype, below):
    # scale the dtype's smallest subnormal and |w| < 1/2: scale * w rounds to 0,
    # and the kernels multiply each level's dot products by that one factor.  An
    # inf in a key must still give +-inf scores (NaN rows, or the key hidden), as
    # the exact factor does, not 0 * inf = NaN in every row; the reference takes
    # the same factor (hkt.reference.level_factor), the float32 case's in float64.
    # bfloat16 computes in float32 (natively or upcast), with the scale in float32.
    # below: a scale that itself rounds to 0 in float32 (a quarter of its smallest
    # subnormal), still a nonzero number as given, so the same rule holds.
    fdt = torch.float32 if dtype == torch.bfloat16 else dtype
    tiny = float(torch.finfo(fdt).smallest_normal * torch.finfo(fdt).eps)
    if below:
        if fdt == torch.float64:
            pytest.skip("a Python float scale cannot be below float64's subnormals")
        tiny /= 4
        assert tiny > 0 and torch.tensor(tiny, dtype=fdt) == 0
    T = S = 6
    g = torch.Generator().manual_seed(3)
    q = [torch.randn(1, 1, level_len(T, l), 2, generator=g, dtype=dtype) for l in range(2)]
    k = [torch.randn(1, 1, level_len(S, l), 2, generator=g, dtype=dtype) for l in range(2)]
    v, w = torch.randn(1, 1, S, 3, generator=g, dtype=dtype), torch.tensor([0.25, -0.375], dtype=dtype)
    assert tiny > 0 and (torch.tensor(tiny, dtype=fdt) * w.to(fdt) == 0).all()  # scale * w_l is 0 there
    k[0][0, 0, 2, 1] = math.inf
    if kernel == "attention":
        got = hkt.hkt_attention(q, k, v, w, scale=tiny, is_causal=True)
    else:  # every row decoded against the whole cache so far, its own key last
        with torch.no_grad():
            got = torch.cat([hkt.hkt_attention_with_kvcache([x[:, :, (i >> l):(i >> l) + 1] for l, x in enumerate(q)],
                                                            k, v, w, i, scale=tiny) for i in range(T)], dim=2)
    want = reference([x.double() for x in q], [x.double() for x in k], v.double(), w.double(), scale=tiny,
                     is_causal=True)
    nan = torch.isnan(want[0, 0]).any(-1)
    positive = q[0][0, 0, :, 1] > 0  # the inf score's sign, for the rows that see key 2
    assert torch.equal(nan, positive & (torch.arange(T) >= 2)) and nan.any() and (~nan[2:]).any()
    assert torch.equal(torch.isnan(got[0, 0]).any(-1), nan)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got[0, 0][~nan].double(), want[0, 0][~nan], rtol=tol, atol=tol)


def test_nan_in_value_reaches_every_row_in_its_column():
    B, H, T, S, L = 1, 2, 7, 9, 2
    q, k, v, w = inputs(B, H, T, S, 4, 3, L)
    with torch.no_grad():
        v[0, 1, 5, 2] = NAN
    got = assert_matches_reference(q, k, v, w, None, dout_like(B, H, T, 3))
    assert torch.isnan(got[0][0, 1, :, 2]).all()
    assert torch.isfinite(got[0][0, 1, :, :2]).all() and torch.isfinite(got[0][0, 0]).all()
    assert torch.isfinite(got[1][2 * L]).all()  # dv = P^T dout: no NaN in P


# ------------------------------------------------ 3. the fuzz -----------------

EXAMPLES = int(os.environ.get("HKT_FUZZ_EXAMPLES", "150"))
SEED = os.environ.get("HKT_FUZZ_SEED")


def fuzz_settings(n):
    def wrap(fn):
        fn = settings(max_examples=n, derandomize=SEED is None, database=None, deadline=None, print_blob=True,
                      suppress_health_check=list(HealthCheck))(fn)
        return hypothesis.seed(int(SEED))(fn) if SEED is not None else fn
    return wrap


LENGTHS = st.one_of(st.integers(0, 70), st.sampled_from([1, 2, 63, 64, 65, 127, 128, 129, 130]))
# how an input is laid out in memory (the values are the same either way)
LAYOUTS = ["contiguous", "permuted", "stepped", "offset", "broadcast", "feature-stride"]


@st.composite
def fuzz_cases(draw):
    c = dict(
        B=draw(st.integers(0, 3)), H=draw(st.integers(1, 4)), T=draw(LENGTHS), S=draw(LENGTHS),
        D=draw(st.integers(1, 17)), Dv=draw(st.integers(1, 17)), L=draw(st.integers(1, 6)),
        per_head=draw(st.booleans()), causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False), st.sampled_from([0.0, 1e-3, 8.0]))),
        mask=draw(st.sampled_from(["none", "bool", "float"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        # soft-capping (contract 1.12), in the float64 fuzzes: none, or a cap the scores reach
        softcap=draw(st.sampled_from([None, None, 0.5, 1.5, 30.0])),
    )
    rank = draw(st.integers(1, 4))
    c["mask_dims"] = [draw(st.booleans()) for _ in range(rank)]  # True: full size, False: 1 (broadcast)
    c["mask_density"] = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    c["mask_empty_row"] = draw(st.booleans())
    c["mask_grad"] = draw(st.booleans())
    c["layouts"] = draw(st.lists(st.sampled_from(LAYOUTS), min_size=2 * c["L"] + 3, max_size=2 * c["L"] + 3))
    targets = ["q nan", "k nan", "k inf", "w nan"]
    if c["mask"] == "float":
        targets += ["mask nan", "mask inf"]
    if c["mask"] == "none" and not c["causal"]:
        targets += ["v nan"]  # NaN in v at a hidden key is unspecified: only without hiding
    c["inject"] = draw(st.lists(st.sampled_from(targets), max_size=3))
    # grouped-query heads: k and v with H_kv heads, H_kv dividing H
    c["Hk"] = draw(st.sampled_from([d for d in range(1, c["H"] + 1) if c["H"] % d == 0]))
    return c


def laid_out(shape, layout, rng, make, inject=None):
    """A tensor of ``shape`` whose values come from ``make(base_shape)`` and whose memory
    layout is ``layout``; ``inject(values)`` edits the values first."""
    shape = tuple(shape)
    nd = len(shape)
    big = [d for d in range(nd) if shape[d] > 1]
    if layout == "broadcast" and big:
        d = big[rng.integers(len(big))]
        base = list(shape)
        base[d] = 1
        values = make(tuple(base))
        if inject:
            inject(values)
        return values.expand(shape)
    values = make(shape)
    if inject:
        inject(values)
    if layout == "permuted" and nd >= 2:
        perm = [int(x) for x in rng.permutation(nd)]
        inv = [perm.index(d) for d in range(nd)]
        return values.permute(perm).contiguous().permute(inv)
    if layout == "stepped" and nd >= 1:
        d = int(rng.integers(nd))
        alloc = list(shape)
        alloc[d] = 2 * shape[d] + 1
        buf = torch.zeros(alloc, dtype=values.dtype)
        view = buf.narrow(d, 1, 2 * shape[d]).unflatten(d, (shape[d], 2)).select(d + 1, 0) if shape[d] else \
            buf.narrow(d, 0, 0)
        view.copy_(values)
        return view
    if layout == "offset":
        buf = torch.zeros(values.numel() + 1, dtype=values.dtype)
        view = buf[1:].view(shape)
        view.copy_(values)
        return view
    if layout == "feature-stride" and nd >= 1 and shape[-1] > 1:
        buf = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=values.dtype)
        view = buf[..., ::2]
        view.copy_(values)
        return view
    return values.clone()


def build(c, dtype=torch.float64):
    """q, k, v, w, mask (leaves where they take gradients), dout, and whether q/k/w
    hold NaN/inf; in ``dtype`` (a float mask too), drawn in float64 and rounded,
    so every dtype sees the same case."""
    rng = np.random.default_rng(c["seed"])
    g = torch.Generator().manual_seed(c["seed"])
    B, H, T, S, D, Dv, L = (c[x] for x in "B H T S D Dv L".split())
    layouts = iter(c["layouts"])
    inject = list(c["inject"])

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    def poke(target, value):
        def edit(x):
            if x.numel():
                x.view(-1)[int(rng.integers(x.numel()))] = value
        return edit

    def injector(name, level=None):
        edits = []
        for item in inject:
            tgt, kind = item.split()
            if tgt == name and (level is None or rng.integers(2) == 0 or level == 0):
                edits.append(poke(tgt, NAN if kind == "nan" else INF))

        def run_all(x):
            for e in edits:
                e(x)
        return run_all if edits else None

    q = [leaf(laid_out((B, H, level_len(T, l), D), next(layouts), rng, randn, injector("q", l))) for l in range(L)]
    Hk = c["Hk"]
    k = [leaf(laid_out((B, Hk, level_len(S, l), D), next(layouts), rng, randn, injector("k", l))) for l in range(L)]
    v = leaf(laid_out((B, Hk, S, Dv), next(layouts), rng, randn, injector("v")))
    w = leaf(laid_out((H, L) if c["per_head"] else (L,), next(layouts), rng, randn, injector("w")))
    mask = None
    if c["mask"] != "none":
        full = (B, H, T, S)
        shape = tuple(n if keep else 1 for n, keep in zip(full[4 - len(c["mask_dims"]):], c["mask_dims"]))

        def make_mask(sh):
            u = torch.rand(sh, generator=g, dtype=torch.float64)
            if c["mask"] == "bool":
                m = u < c["mask_density"]
                if c["mask_empty_row"] and len(sh) >= 2 and sh[-2] > 0:
                    m[..., int(rng.integers(sh[-2])), :] = False
                return m
            m = randn(sh).masked_fill(u >= c["mask_density"], -INF)
            if c["mask_empty_row"] and len(sh) >= 2 and sh[-2] > 0:
                m[..., int(rng.integers(sh[-2])), :] = -INF
            return m
        mask = laid_out(shape, next(layouts), rng, make_mask, injector("mask"))
        if c["mask"] == "float" and c["mask_grad"]:
            mask = leaf(mask)
    dout = randn((B, H, T, Dv))
    # NaN/inf in q, k or w reaches gradients through 0 * NaN in the reference's
    # matmuls; in v, it reaches the output of rows for which that key is hidden
    # (a mask, causality, or a -inf score from an inf in k) in the reference and
    # in whichever tiles of the kernels hold hidden and visible keys together, and
    # from such an output the kernels' gradients (through rowsum(dO * out)), where
    # the reference's masked softmax keeps them finite: the contract leaves all of
    # this open (docs/contract.md, non-finite values), so with NaN in v only the
    # entries finite on both sides are compared (the targeted tests pin the rest)
    loose = "all" if any(item.split()[0] == "v" for item in inject) else \
        any(item.split()[0] in ("q", "k", "w") for item in inject)
    return q, k, v, w, mask, dout, loose


def kernels_on_one_thread(q, k, v, w, mask, dout, **kw):
    """The kernels' results on one thread, checked bitwise against two threads'."""
    two = with_threads(2, lambda: run(hkt.hkt_attention, q, k, v, w, mask, dout, **kw))
    one = with_threads(1, lambda: run(hkt.hkt_attention, q, k, v, w, mask, dout, **kw))
    for name, a, b in zip(["out"] + grad_names(len(q), mask), [two[0], *two[1]], [one[0], *one[1]]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{name}: 1 thread vs 2 threads: {m}")
    return one


def check_case(c):
    q, k, v, w, mask, dout, loose = build(c)
    kw = dict(is_causal=c["causal"], scale=c["scale"], softcap=c["softcap"])
    one = kernels_on_one_thread(q, k, v, w, mask, dout, **kw)
    # the reference is plain torch: one thread is the quickest at these sizes
    with_threads(1, lambda: assert_matches_reference(q, k, v, w, mask, dout, loose=loose, got=one, **kw))


def test_fuzz_against_reference():
    count = [0]

    @fuzz_settings(EXAMPLES)
    @given(fuzz_cases())
    def prop(c):
        count[0] += 1
        check_case(c)

    prop()
    print(f"\nfuzz: {count[0]} examples against the reference (HKT_FUZZ_EXAMPLES={EXAMPLES}, "
          f"{'derandomized' if SEED is None else 'seed ' + SEED})")


# ------------------------------- windows per level (section 1.11) -------------

@st.composite
def window_cases(draw):
    """A fuzz case (sizes, layouts, masks, NaN and inf) with growing windows
    (None from some level up); a mask may be made the same for every query
    (key padding: the kernels' counts path for a bool one)."""
    c = draw(fuzz_cases())
    windows, below = [], 0
    top = draw(st.integers(0, c["L"]))  # levels >= top have no window
    for l in range(c["L"]):
        if l >= top:
            windows.append(None)
            continue
        least = below // (1 << l) + 1  # W_l > W_{l-1}, a multiple of 2^l
        W = (1 << l) * draw(st.integers(least, least + 6))
        windows.append(W)
        below = W
    c["windows"] = windows
    if len(c["mask_dims"]) >= 2 and draw(st.booleans()):
        c["mask_dims"][-2] = False  # broadcast over the queries
    return c


def test_fuzz_windows_against_reference():
    count = [0]

    @fuzz_settings(max(EXAMPLES // 2, 10))
    @given(window_cases())
    def prop(c):
        count[0] += 1
        q, k, v, w, mask, dout, loose = build(c)
        kw = dict(is_causal=c["causal"], scale=c["scale"], windows=c["windows"], softcap=c["softcap"])
        one = kernels_on_one_thread(q, k, v, w, mask, dout, **kw)
        with_threads(1, lambda: assert_matches_reference(q, k, v, w, mask, dout, loose=loose, got=one, **kw))

    prop()
    print(f"\nwindows fuzz: {count[0]} examples against the reference")


# ------------------- the same fuzz in float32 and bfloat16 -------------------
#
# What users run: the float32 kernels of the CPU's instruction set (AVX-512's
# vscalefps exp, its fold and pair sums) and bfloat16 (natively where the CPU
# prefers it: vdpbf16ps or AMX tiles, P and dS rounded to bfloat16; elsewhere
# upcast).  The same cases, drawn in float64 and rounded to the dtype, against
# the float64 reference on those rounded values.  The bar is a first-order
# rounding-error bound computed from each case's data (rounding_scale): every
# entry within LOWP_ULPS units of the dtype's rounding of the sum of the
# absolute values of the terms that make it.  That is the only bar that holds
# for results that cancel (dq of a row with one visible key is exactly 0 in
# float64 and rounding noise in float32; dw sums dS, whose rows sum to 0) and
# that still sees an error of a few hundred ulps anywhere.  Non-finite entries
# where the float64 fuzz pins them; 1 thread against 2, bitwise.

# in units of the dtype's eps (bfloat16's is 2^-7), a few times the worst entry the
# kernels have used on the fuzz's cases (docs/performance.md, LOWP_ULPS)
LOWP_ULPS = {torch.float32: 16, torch.bfloat16: 4}


def _pool(x, f):
    """x (..., T, S) summed over f x f blocks (ragged ones at the end too)."""
    if f == 1:
        return x
    T, S = x.shape[-2:]
    x = torch.nn.functional.pad(x, (0, -S % f, 0, -T % f))
    return x.unflatten(-1, (-1, f)).sum(-1).unflatten(-2, (-1, f)).sum(-2)


def group_sum(x, Hk):
    """(B, H, ...) summed over each kv head's group of query heads: (B, Hk, ...)."""
    return x.unflatten(1, (Hk, -1)).sum(2)


def rounding_scale(q, k, v, w, mask, dout, causal, scale):
    """Per result (out, dq..., dk..., dv, dw[, mask gradient]), in float64: the sum
    of |terms| of the computation that makes each entry, with each probability
    weighed by 1 + the sum of |terms| of its score + the largest such sum in its
    row (P = exp(score - lse): the exp turns the absolute rounding errors of the
    score and of lse, which is about the row's largest score, into P's relative
    one; a P far below its row's largest carries lse's error alone).  Non-finite
    inputs count as 0 (they reach an entry only as NaN or inf, which are compared
    as such)."""
    def mag(x):
        return torch.nan_to_num(x.detach().double().abs(), nan=0.0, posinf=0.0, neginf=0.0)
    L, D = len(q), q[0].shape[-1]
    H, Hk, T, S = q[0].shape[1], k[0].shape[1], q[0].shape[2], k[0].shape[2]
    sc = abs(1.0 / D ** 0.5 if scale is None else scale)
    d64 = [x.detach().double() for x in (*q, *k, v, w)]
    m64 = mask.detach().double() if mask is not None and mask.is_floating_point() else mask
    P = mag(attention_probs(d64[:L], d64[L:2 * L], d64[-1], attn_mask=m64, is_causal=causal, scale=scale))
    wa = mag(w).expand(H, L) if w.dim() == 2 else mag(w).unsqueeze(0).expand(H, L)
    qa, ka = [mag(x) for x in q], [repeat_kv(mag(x), H) for x in k]
    G = [qa[l] @ ka[l].transpose(-1, -2) for l in range(L)]
    score = sum(sc * wa[:, l].view(1, H, 1, 1) * upsample_level(G[l], l, T, S) for l in range(L))
    if mask is not None and mask.is_floating_point():
        score = score + mag(mask)
    row_max = score.amax(-1, keepdim=True) if S > 0 else 0.0
    A = P * (1 + score + row_max)
    va, da = repeat_kv(mag(v), H), mag(dout)
    out = A @ va
    dS = A * (da @ va.transpose(-1, -2) + (da * out).sum(-1, keepdim=True))
    pooled = [_pool(dS, 1 << l) for l in range(L)]
    dq = [sc * wa[:, l].view(1, H, 1, 1) * pooled[l] @ ka[l] for l in range(L)]
    dk = [group_sum(sc * wa[:, l].view(1, H, 1, 1) * pooled[l].transpose(-1, -2) @ qa[l], Hk) for l in range(L)]
    dw = torch.stack([sc * (pooled[l] * G[l]).sum((0, 2, 3)) for l in range(L)], -1)  # (H, L)
    res = [out, *dq, *dk, group_sum(A.transpose(-1, -2) @ da, Hk), dw if w.dim() == 2 else dw.sum(0)]
    if mask is not None and mask.requires_grad:
        lead = dS.dim() - mask.dim()
        dims = [d for d in range(dS.dim()) if d < lead or mask.shape[d - lead] == 1]
        res.append(dS.sum(dims, keepdim=True).reshape(mask.shape) if dims else dS)
    return res


def assert_lowp(got, want, bound, dtype, what, strict):
    """got (kernels, dtype) against want (float64 reference), entry by entry
    within LOWP_ULPS[dtype] units of dtype's rounding of bound.  strict as assert_same:
    True, non-finite entries where want has them, exactly; "finite", only
    entries finite on both sides; False, entries where want is finite (got
    finite there too)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    g, r = got.double(), want.double()
    fin_r, fin_g = torch.isfinite(r), torch.isfinite(g)
    if strict is True:
        assert torch.equal(fin_g, fin_r), f"{what}: non-finite at {(fin_g != fin_r).nonzero()[:5].tolist()} " \
            f"(kernels {g[fin_g != fin_r][:5].tolist()}, reference {r[fin_g != fin_r][:5].tolist()})"
        both_nan = torch.isnan(g) & torch.isnan(r)
        odd = ~fin_r & ~both_nan
        assert torch.equal(g[odd], r[odd]), f"{what}: infinities differ"
        cmp = fin_r
    elif strict == "finite":
        cmp = fin_r & fin_g
    else:
        assert bool(fin_g[fin_r].all()), f"{what}: non-finite where the reference is finite"
        cmp = fin_r
    err = (g - r).abs()
    # and what float32's underflow loses (the kernels compute in float32, whose
    # exp gives 0 below about 1e-38 where float64's goes on)
    allowed = LOWP_ULPS[dtype] * torch.finfo(dtype).eps * bound.expand_as(r) + 1e6 * torch.finfo(torch.float32).tiny
    bad = cmp & (err > allowed)
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: error {err[at].item():.3g} against float64 at {list(at)} (kernels "
                             f"{g[at].item():.9g}, reference {r[at].item():.9g}) is more than {LOWP_ULPS[dtype]} "
                             f"ulps of {dtype} at the sum of its terms, {bound.expand_as(r)[at].item():.3g}")


def check_case_lowp(c, dtype):
    q, k, v, w, mask, dout, loose = build(c, dtype)
    # the scale as the kernels apply it, in float32 (1e-58 is 0 there, and 0 x inf NaN)
    scale = c["scale"] if c["scale"] is None else float(torch.tensor(c["scale"], dtype=torch.float32))
    kw = dict(is_causal=c["causal"], scale=scale)
    one = kernels_on_one_thread(q, k, v, w, mask, dout, **kw)
    names = ["out"] + grad_names(c["L"], mask)

    def wide(x):  # the same values in float64, a leaf where x is one
        if x is None or not x.is_floating_point():
            return x
        y = x.detach().double()
        return leaf(y) if x.requires_grad else y
    want = with_threads(1, lambda: run(reference, [wide(x) for x in q], [wide(x) for x in k], wide(v), wide(w),
                                       wide(mask), dout.double(), **kw))
    bounds = rounding_scale(q, k, v, w, mask, dout, c["causal"], scale)
    for name, g, r, bound in zip(names, [one[0], *one[1]], [want[0], *want[1]], bounds):
        strict = "finite" if loose == "all" else (True if name == "out" else not (loose and name[0] in "qkw"))
        assert_lowp(g, r, bound, dtype, name, strict)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fuzz_low_precision_against_reference(dtype):
    count = [0]

    @fuzz_settings(EXAMPLES)
    @given(fuzz_cases())
    def prop(c):
        count[0] += 1
        check_case_lowp(c, dtype)

    prop()
    path = ("native, " + ("AMX" if _C.cpu_bf16_amx() else "AVX512_BF16") if hkt._core.kernels.native_bf16
            else "upcast to float32") if dtype == torch.bfloat16 else _C.cpu_kernels()
    print(f"\nfuzz: {count[0]} {dtype} examples ({path}) against the reference (HKT_FUZZ_EXAMPLES={EXAMPLES}, "
          f"{'derandomized' if SEED is None else 'seed ' + SEED})")


# ------------------------------ NumPy at the extension: negative strides ------

ARGS = ["q", "k", "v", "w", "attn_mask", "out", "lse"]


@st.composite
def numpy_cases(draw):
    c = dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 2)), T=draw(st.integers(1, 20)),
             S=draw(st.integers(1, 20)), D=draw(st.integers(1, 6)), Dv=draw(st.integers(1, 6)),
             L=draw(st.integers(1, 4)), causal=draw(st.booleans()), mask=draw(st.booleans()),
             seed=draw(st.integers(0, 2**31 - 1)))
    c["flip"] = draw(st.one_of(st.none(), st.sampled_from(["q", "k", "v", "attn_mask", "out", "lse"])))
    c["level"] = draw(st.integers(0, c["L"] - 1))
    c["axis"] = draw(st.integers(0, 3))
    c["backward_flip"] = draw(st.one_of(st.none(), st.sampled_from(["dout", "dq", "dk", "dv"])))
    return c


def numpy_check(c):
    rng = np.random.default_rng(c["seed"])
    B, H, T, S, D, Dv, L = (c[x] for x in "B H T S D Dv L".split())
    q = [rng.standard_normal((B, H, level_len(T, l), D)) for l in range(L)]
    k = [rng.standard_normal((B, H, level_len(S, l), D)) for l in range(L)]
    v, w = rng.standard_normal((B, H, S, Dv)), rng.standard_normal((H, L))
    mask = rng.random((B, H, T, S)) > 0.3 if c["mask"] else None
    out, lse = np.empty((B, H, T, Dv)), np.empty((B, H, T))
    args = dict(q=q, k=k, v=v, w=w, attn_mask=mask, out=out, lse=lse)
    flip, name = c["flip"], c["flip"]
    if flip == "attn_mask" and mask is None:
        flip = None
    if flip is not None:
        arr = args[flip][c["level"]] if flip in "qk" else args[flip]
        axis = min(c["axis"], arr.ndim - 1)
        flipped = np.flip(arr, axis)
        if flip in "qk":
            args[flip] = list(args[flip])
            args[flip][c["level"]] = flipped
            name = f"{flip}[{c['level']}]"
        else:
            args[flip] = flipped
        if arr.shape[axis] > 1:
            with pytest.raises(ValueError, match="^" + re.escape(name) + ":"):
                _C.forward(args["q"], args["k"], args["v"], args["w"], args["out"], args["lse"], args["attn_mask"],
                           c["causal"])
            return
    _C.forward(args["q"], args["k"], args["v"], args["w"], args["out"], args["lse"], args["attn_mask"], c["causal"])
    tq, tk = [torch.from_numpy(x.copy()) for x in args["q"]], [torch.from_numpy(x.copy()) for x in args["k"]]
    tmask = None if args["attn_mask"] is None else torch.from_numpy(args["attn_mask"].copy())
    ref = reference(tq, tk, torch.from_numpy(args["v"].copy()), torch.from_numpy(w), attn_mask=tmask,
                    is_causal=c["causal"])
    np.testing.assert_allclose(args["out"], ref.numpy(), **TOL)
    # backward, with one of its arrays flipped
    dout = rng.standard_normal((B, H, T, Dv))
    bargs = dict(dout=dout, dq=[np.empty_like(x) for x in q], dk=[np.empty_like(x) for x in k], dv=np.empty_like(v))
    bf = c["backward_flip"]
    if bf is not None:
        arr = bargs[bf][0] if bf in ("dq", "dk") else bargs[bf]
        if arr.shape[-2] > 1:
            flipped = np.flip(arr, -2)
            if bf in ("dq", "dk"):
                bargs[bf][0] = flipped
            else:
                bargs[bf] = flipped
            bname = f"{bf}[0]" if bf in ("dq", "dk") else bf
            with pytest.raises(ValueError, match="^" + re.escape(bname) + ":"):
                _C.backward(bargs["dout"], args["q"], args["k"], args["v"], w, args["out"], args["lse"],
                            bargs["dq"], bargs["dk"], bargs["dv"], np.empty_like(w), args["attn_mask"], c["causal"])


def test_fuzz_numpy_negative_strides():
    count = [0]

    @fuzz_settings(max(EXAMPLES // 4, 20))
    @given(numpy_cases())
    def prop(c):
        count[0] += 1
        numpy_check(c)

    prop()
    print(f"\nfuzz: {count[0]} NumPy stride examples")
