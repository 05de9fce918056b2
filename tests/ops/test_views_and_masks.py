"""Inputs as torch hands them over, where DLPack or a dtype conversion would
change what they mean: negated views (the sign bit is not in the memory DLPack
carries), float masks of another dtype (a conversion must not hide an entry),
nested tensors, and shapes named as the caller passed them."""
import re

import pytest
import torch

import hkt
from hkt.reference import hkt_attention_reference as reference

from helpers import level_len, sample_inputs

F64 = torch.float64


def negated(x):
    """-x as torch's lazy negated view (is_neg() True, memory holding x), from public ops."""
    y = torch.complex(torch.zeros_like(x), x).conj().imag
    assert y.is_neg() and torch.equal(y, -x)
    return y


# ---- negated views: what they read as, never the memory behind them ----

def _inputs(D=4, Dv=4, L=2, T=6):
    return sample_inputs(1, 2, T, T, D, Dv, L, seed=1)


@pytest.mark.parametrize("which", ["q0", "k1", "v", "w", "mask"])
def test_negated_view_inputs_read_as_their_values(which):
    # a view whose last dimension has size 1 (or any float mask) goes over without a
    # copy; any other is copied to unit feature stride, which resolves the sign
    q, k, v, w = _inputs(D=1 if which in ("q0", "k1") else 4, Dv=1 if which == "v" else 4,
                         L=1 if which == "w" else 2)
    mask = torch.randn(1, 2, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(2))
    args = {"q": list(q), "k": list(k), "v": v, "w": w, "mask": mask}
    plain = {"q": list(q), "k": list(k), "v": v, "w": w, "mask": mask}
    if which == "q0":
        args["q"][0], plain["q"][0] = negated(q[0]), -q[0]
    elif which == "k1":
        args["k"][1], plain["k"][1] = negated(k[1]), -k[1]
    else:
        args[which], plain[which] = negated(args[which]), -args[which]
    got = hkt.hkt_attention(args["q"], args["k"], args["v"], args["w"], attn_mask=args["mask"])
    want = reference(plain["q"], plain["k"], plain["v"], plain["w"], attn_mask=plain["mask"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_negated_view_output_gradient():
    q, k, v, w = _inputs(Dv=1)
    q = [x.requires_grad_() for x in q]
    out = hkt.hkt_attention(q, k, v, w)
    dout = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, q, negated(dout))
    want = torch.autograd.grad(hkt.hkt_attention(q, k, v, w), q, -dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_negated_view_module_mask():
    m = hkt.MultiheadHKT(8, 2, batch_first=True, levels=2).double()
    x = torch.randn(2, 5, 8, dtype=F64, generator=torch.Generator().manual_seed(4))
    mask = torch.randn(5, 5, dtype=F64, generator=torch.Generator().manual_seed(5))
    got, _ = m(x, x, x, attn_mask=negated(mask), need_weights=False)
    want, _ = m(x, x, x, attn_mask=-mask, need_weights=False)
    assert torch.equal(got, want)


def test_negated_view_caches():
    L = 2
    g = torch.Generator().manual_seed(6)
    # caches only read: as their values
    qd, kc, vc, wd = sample_inputs(1, 2, 1, 8, 4, 4, L, seed=7)
    got = hkt.hkt_attention_with_kvcache(qd, [negated(x) for x in kc], negated(vc), wd, 5)
    want = hkt.hkt_attention_with_kvcache(qd, [-x for x in kc], -vc, wd, 5)
    assert torch.equal(got, want)
    # caches written in place: a negated view cannot take the writes
    kn = [torch.randn(1, 2, 1, 4, dtype=F64, generator=g) for _ in range(L)]
    vn = torch.randn(1, 2, 1, 4, dtype=F64, generator=g)
    with pytest.raises(ValueError, match=r"^k_cache\[0\]: a negated view"):
        hkt.hkt_attention_with_kvcache(qd, [negated(x) for x in kc], vc, wd, 5, kn, vn)
    with pytest.raises(ValueError, match="^v_cache: a negated view"):
        hkt.hkt_attention_with_kvcache(qd, kc, negated(vc), wd, 5, kn, vn)


# ---- float masks of another dtype ----

def _padding_row_mask(dtype, T=4):
    """A float mask hiding row 1 entirely with dtype's most negative finite number
    (how padding masks are commonly made): row 1 then sees every key equally."""
    m = torch.zeros(T, T, dtype=dtype)
    m[1] = torch.finfo(dtype).min
    return m


def test_wider_float_mask_keeps_finite_values_finite():
    """A float64 mask on float32 inputs: finfo(float64).min is -inf in float32, which
    would hide row 1 (zeros) where it means "equally unlikely" (the average of v)."""
    q, k, v, w = sample_inputs(1, 1, 4, 4, 3, 2, 2, seed=8, dtype=torch.float32)
    mask = _padding_row_mask(F64)
    for got in (hkt.hkt_attention(q, k, v, w, attn_mask=mask),
                hkt.hkt_attention(q, k, v, w, attn_mask=mask, backend="sdpa"),
                reference(q, k, v, w, attn_mask=mask)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got[0, 0, 1], v[0, 0].mean(0))
    # the rest of the mask rounds as any conversion does, alike on every path
    mask[0, 2] = 0.1
    torch.testing.assert_close(hkt.hkt_attention(q, k, v, w, attn_mask=mask),
                               reference(q, k, v, w, attn_mask=mask), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("module_dtype,mask_dtype", [(torch.float32, F64), (torch.bfloat16, torch.float32)])
def test_module_float_masks_of_another_dtype(module_dtype, mask_dtype):
    """MultiheadHKT converts masks to its dtype itself: the same rule (attn_mask and
    key_padding_mask); a row hidden by the most negative finite number stays visible."""
    E = 8
    g = torch.Generator().manual_seed(12)
    m = hkt.MultiheadHKT(E, 2, batch_first=True, levels=2)
    x = torch.randn(2, 5, E, generator=g)
    mask = _padding_row_mask(mask_dtype, T=5)
    kpm = torch.zeros(2, 5, dtype=mask_dtype)
    kpm[1] = torch.finfo(mask_dtype).min  # batch element 1 sees no key but through the mask's values
    with torch.no_grad():
        want_a = m(x, x, x, attn_mask=mask.float(), need_weights=False)[0] if mask_dtype == torch.float32 else None
        m64 = hkt.MultiheadHKT(E, 2, batch_first=True, levels=2)
        m64.load_state_dict(m.state_dict())
        m64.double()
        ref_a = m64(x.double(), x.double(), x.double(), attn_mask=mask.double(), need_weights=False)[0]
        ref_k = m64(x.double(), x.double(), x.double(), key_padding_mask=kpm.double(), need_weights=False)[0]
        m.to(module_dtype)
        xm = x.to(module_dtype)
        got_a = m(xm, xm, xm, attn_mask=mask, need_weights=False)[0]
        got_k = m(xm, xm, xm, key_padding_mask=kpm, need_weights=False)[0]
    tol = 2e-2 if module_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got_a[:, 1].double(), ref_a[:, 1], rtol=tol, atol=tol)
    torch.testing.assert_close(got_k[1].double(), ref_k[1], rtol=tol, atol=tol)
    assert want_a is None or want_a.abs().sum() > 0


def test_float32_mask_on_bfloat16_sdpa_backend():
    """backend="sdpa" computes bfloat16 in bfloat16: a float32 mask is converted, and
    finfo(float32).min lies beyond bfloat16's largest number."""
    q, k, v, w = sample_inputs(1, 1, 4, 4, 4, 4, 2, seed=9, dtype=torch.float32)
    q, k, v, w = [x.bfloat16() for x in q], [x.bfloat16() for x in k], v.bfloat16(), w.bfloat16()
    mask = _padding_row_mask(torch.float32)
    mean = v[0, 0].float().mean(0)
    for backend in ("kernels", "sdpa"):
        got = hkt.hkt_attention(q, k, v, w, attn_mask=mask, backend=backend)
        torch.testing.assert_close(got[0, 0, 1].float(), mean, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qf, kf, vf, wf = [x.float() for x in q], [x.float() for x in k], v.float(), w.float()
        got = hkt.hkt_attention(qf, kf, vf, wf, attn_mask=mask, backend="sdpa")
    torch.testing.assert_close(got[0, 0, 1].float(), mean, rtol=2e-2, atol=2e-2)


def test_infinite_and_nan_mask_values_convert_as_they_are():
    from hkt.reference import float_mask_in
    m = torch.tensor([0.0, -1e300, 1e300, float("-inf"), float("inf"), float("nan"), 0.5], dtype=F64)
    got = float_mask_in(m, torch.float32)
    big = torch.finfo(torch.float32).max
    assert got.dtype == torch.float32
    assert got[:5].tolist() == [0.0, -big, big, float("-inf"), float("inf")]
    assert got[5].isnan() and got[6] == 0.5
    assert float_mask_in(m.float(), F64).dtype == F64  # widening: every value as it is


def test_row_hidden_by_finite_mask_gets_the_uniform_gradient():
    """A row every key of which carries torch.finfo(dtype).min: the forward is the
    uniform average (right); its gradient is that of the average too, though lse =
    max + log(5) rounds to max there (the backward refines such rows)."""
    q, k, v, w = sample_inputs(1, 1, 3, 5, 2, 2, 1, seed=10)
    v.requires_grad_()
    mask = _padding_row_mask(F64, T=5)[:3]
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask)
    torch.testing.assert_close(out[0, 0, 1], v[0, 0].mean(0))
    dout = torch.zeros_like(out)
    dout[0, 0, 1] = 1.0  # the loss reads that row only: each value row weighs 1/5
    (dv,) = torch.autograd.grad(out, v, dout)
    torch.testing.assert_close(dv[0, 0], torch.full((5, 2), 0.2, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("huge", ["finfo.min", "-1e9", "two values"])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_of_huge_finite_scores_get_their_gradients(dtype, huge, causal):
    """Rows whose scores all sit near a huge finite value (a padding mask of
    finfo.min or -1e9; or two such values, the larger shared by three keys):
    every gradient, the float mask's included, is the plain softmax's (the
    reference's, autograd through torch.softmax), also over several tiles and
    levels; ordinary rows alongside keep theirs."""
    T, S = (70, 70) if causal else (70, 150)
    q, k, v, w = sample_inputs(2, 2, T, S, 8, 6, 3, seed=3, dtype=dtype)
    big = {"finfo.min": torch.finfo(dtype).min, "-1e9": -1e9, "two values": -1e9}[huge]
    mask = torch.zeros(T, S, dtype=dtype)
    mask[5] = big
    mask[66] = big
    if huge == "two values":
        mask[5, :3] = mask[66, 10:13] = big / 2  # the larger of the two: the row's max
    mask.requires_grad_()
    leaves = [*q, *k, v, w, mask]
    for x in leaves[:-1]:
        x.requires_grad_()
    dout = torch.randn(2, 2, T, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=causal), leaves, dout)
    want = torch.autograd.grad(reference(q, k, v, w, attn_mask=mask, is_causal=causal), leaves, dout)
    # float64 keeps q k's part of a -1e9 score to about 1e-7, rounded in another
    # order by the reference; finfo.min leaves no part of it in either dtype
    tol = 2e-4 if dtype == torch.float32 else 1e-10 if huge == "finfo.min" else 1e-6
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---- nested tensors and shapes ----

@pytest.mark.parametrize("which", ["q0", "v", "mask"])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_named(which):
    q, k, v, w = _inputs()
    nested = torch.nested.nested_tensor([torch.randn(2, 6, 4, dtype=F64)])
    args = {"q": list(q), "v": v, "mask": None}
    name = {"q0": "q[0]", "v": "v", "mask": "attn_mask"}[which]
    if which == "q0":
        args["q"][0] = nested
    else:
        args[which] = nested
    with pytest.raises(TypeError, match="^" + re.escape(name) + ": nested tensors"):
        hkt.hkt_attention(args["q"], k, args["v"], w, attn_mask=args["mask"])


def test_mask_shape_named_as_passed():
    q, k, v, w = _inputs()
    with pytest.raises(ValueError, match=r"^attn_mask: shape \(6, 7\) does not broadcast to \(B, H, T, S\) = "
                                         r"\(1, 2, 6, 6\)"):
        hkt.hkt_attention(q, k, v, w, attn_mask=torch.zeros(6, 7, dtype=F64))


def test_module_backward_under_a_relayout_saved_tensor_hook():
    """A saved-tensors hook may hand a tensor back in another memory layout (same
    values); the packed self-attention's backward still writes its gradient."""
    from torch.autograd.graph import saved_tensors_hooks

    def relayout(t):
        return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t
    m = hkt.MultiheadHKT(8, 2, batch_first=True, levels=2).double()
    x = torch.randn(2, 5, 8, dtype=F64, generator=torch.Generator().manual_seed(11), requires_grad=True)
    want = torch.autograd.grad(m(x, x, x, need_weights=False)[0].square().sum(), [x, *m.parameters()])
    with saved_tensors_hooks(relayout, lambda t: t):
        out = m(x, x, x, need_weights=False)[0]
    got = torch.autograd.grad(out.square().sum(), [x, *m.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
