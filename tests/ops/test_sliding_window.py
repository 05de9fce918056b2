"""The sliding-window band (docs/contract.md section 1.13):
hkt_attention(..., sliding_window=W) lets query i see key j only when
i - j < W (and, without is_causal, j - i < W), for the combined score of
every level.  The kernels against the float64 reference (forward and every
gradient, masks, dropout, grouped kv heads, softcap, T != S), the edges
(W = 1, W past the sequence, rows that see nothing, NaN), decoding, the
"sdpa" backend, the argument rules, the ops, and every instruction-set
build in a subprocess each."""
import re

import pytest
import torch

import hkt
from hkt import ops
from hkt.ops import decode as decode_op
from hkt.reference import hkt_attention_reference as reference
from hkt._core.kernels import dropout_keep_mask
from helpers import (assert_build_matches, grad_leaves as leaves, make_mask, outputs_and_grads, run_on_kernels,
                     sample_inputs, with_threads)

F64, F32 = torch.float64, torch.float32
# 200 queries, 190 keys: four 64-row query tiles and three key tiles, with
# tails; bands narrower than a tile (skipped tiles on both sides), one not a
# multiple of 64 wider than a tile, and one past both lengths
T, S = 200, 190


def inputs(B=1, H=4, T=T, S=S, D=5, Dv=4, L=3, dtype=F64, kv_heads=None, seed=0):
    return sample_inputs(B, H, T, S, D, Dv, L, dtype=dtype, seed=seed, kv_heads=kv_heads)


def grouped_reference(q, k, v, w, attn_mask=None, **kw):
    """The reference with k and v's heads repeated to q's (autograd sums their gradients back)."""
    r = q[0].shape[1] // k[0].shape[1]
    return reference(q, [x.repeat_interleave(r, 1) for x in k], v.repeat_interleave(r, 1), w, attn_mask=attn_mask,
                     **kw)


def assert_matches_reference(q, k, v, w, mask=None, rtol=1e-10, atol=1e-11, **kw):
    out, grads = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, **kw)
    want, want_grads = outputs_and_grads(grouped_reference, q, k, v, w, mask, **kw)
    torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    return out


# ---- against the reference ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "bool4d"])
@pytest.mark.parametrize("W", [1, 20, 100])
def test_matches_reference_float64(causal, mask_kind, W):
    q, k, v, w = inputs(kv_heads=2)
    mask = make_mask(mask_kind, 1, 4, T, S, F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)
    out = assert_matches_reference(q, k, v, w, mask, is_causal=causal, sliding_window=W)
    # the band matters here: without it the result is another one
    assert (hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=causal) - out).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Tq, Sk, W", [(70, 200, 30), (200, 70, 30), (131, 129, 65), (64, 64, 63)])
def test_uneven_lengths(causal, Tq, Sk, W):
    # T != S: i and j are both counted from 0, as causality counts them; with
    # T > S (and no causality) rows past S + W - 1 see nothing: zeros
    q, k, v, w = leaves(*inputs(T=Tq, S=Sk, L=2))[:4]
    assert_matches_reference(q, k, v, w, is_causal=causal, sliding_window=W)


@pytest.mark.parametrize("L", [1, 4])
def test_levels(L):
    q, k, v, w = leaves(*inputs(L=L, kv_heads=1))[:4]
    assert_matches_reference(q, k, v, w, is_causal=True, sliding_window=45)


def test_softcap_and_band():
    q, k, v, w = inputs(kv_heads=2)
    q = [x * 2.5 for x in q]
    mask = make_mask("float", 1, 4, T, S, F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)
    out = assert_matches_reference(q, k, v, w, mask, is_causal=True, sliding_window=33, softcap=1.5)
    assert (hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=True, sliding_window=33) - out).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_exact_against_reference(causal):
    # the ops take the seed: the reference with the kernels' own dropout decisions
    B, H, p, W = 1, 2, 0.3, 40
    q, k, v, w, _ = leaves(*inputs(B, H))
    out, _ = ops.attention_forward(list(q), list(k), v, w, None, causal, p, 0.4, torch.tensor(1234), 0.0, W)
    keep = dropout_keep_mask(1234, p, B, H, T, S)
    want = reference(q, k, v, w, is_causal=causal, dropout_p=p, scale=0.4, dropout_mask=keep, sliding_window=W)
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [*q, *k, v, w], g), torch.autograd.grad(want, [*q, *k, v, w], g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_dropout_in_eager_calls_keeps_the_band():
    # an eager call draws its own seed: every key outside the band still gets
    # nothing, so v's rows there get a zero gradient
    q, k, v, w, _ = leaves(*inputs(H=2))
    out = hkt.hkt_attention(q, k, v, w, is_causal=True, dropout_p=0.5, sliding_window=10)
    g = torch.zeros_like(out)
    g[:, :, 150] = 1  # row 150 sees keys 141 .. 150
    dv = torch.autograd.grad(out, v, g)[0]
    assert (dv[:, :, :141] == 0).all() and (dv[:, :, 151:] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_small(causal):
    q, k, v, w = sample_inputs(1, 2, 9, 7, 3, 2, 2)
    mask = torch.randn(1, 2, 9, 7, dtype=F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)

    def f(*xs):
        return hkt.hkt_attention(list(xs[:2]), list(xs[2:4]), xs[4], xs[5], attn_mask=xs[6], is_causal=causal,
                                 sliding_window=3)
    assert torch.autograd.gradcheck(f, (*q, *k, v, w, mask))


def test_double_backward_small():
    q, k, v, w, _ = leaves(*sample_inputs(1, 2, 6, 6, 3, 2, 2))

    def f(*xs):
        return hkt.hkt_attention(list(xs[:2]), list(xs[2:4]), xs[4], xs[5], is_causal=True, sliding_window=2)
    assert torch.autograd.gradgradcheck(f, (*q, *k, v, w))


def test_float32_within_tolerance():
    q, k, v, w = inputs(dtype=F32, kv_heads=2)
    q, k, v, w, _ = leaves(q, k, v, w)
    out, grads = outputs_and_grads(hkt.hkt_attention, q, k, v, w, None, is_causal=True, sliding_window=70)
    q64, k64, v64, w64, _ = leaves([x.double() for x in q], [x.double() for x in k], v.double(), w.double())
    want, want_grads = outputs_and_grads(grouped_reference, q64, k64, v64, w64, None, is_causal=True,
                                         sliding_window=70)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_bfloat16_against_float32():
    # bfloat16 (native where the CPU has it, else computed in float32): as close
    # to the float32 band as bfloat16's rounding allows, forward and gradients
    q, k, v, w = inputs(dtype=F32, D=8, Dv=8)
    q16, k16, v16, w16, _ = leaves([x.bfloat16() for x in q], [x.bfloat16() for x in k], v.bfloat16(),
                                   w.bfloat16())
    out, grads = outputs_and_grads(hkt.hkt_attention, q16, k16, v16, w16, None, is_causal=True, sliding_window=50)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    q32, k32, v32, w32, _ = leaves([x.float() for x in q16], [x.float() for x in k16], v16.float(), w16.float())
    want, want_grads = outputs_and_grads(hkt.hkt_attention, q32, k32, v32, w32, None, is_causal=True,
                                         sliding_window=50)
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.float(), b, rtol=6e-2, atol=6e-2)
    # the band applies: a row's output does not move when a key outside its band does
    v_far = v16.detach().clone()
    v_far[:, :, :100] += 5
    with torch.no_grad():
        moved = hkt.hkt_attention(q16, k16, v_far, w16, is_causal=True, sliding_window=50)
        assert torch.equal(moved[:, :, 149:], out.detach()[:, :, 149:])


def test_same_bits_for_any_thread_count():
    q, k, v, w = leaves(*inputs(B=2, kv_heads=2))[:4]
    mask = make_mask("float", 2, 4, T, S, F64).requires_grad_(True)

    def run():
        return outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, sliding_window=37)
    a, ga = with_threads(1, run)
    for n in (2, 3):
        b, gb = with_threads(n, run)
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


# ---- edges ----

@pytest.mark.parametrize("causal", [False, True])
def test_a_band_past_the_sequence_is_no_band_bitwise(causal):
    q, k, v, w = leaves(*inputs(kv_heads=2))[:4]
    mask = make_mask("float", 1, 4, T, S, F64).requires_grad_(True)
    a, ga = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=causal)
    for W in (max(T, S), 10 ** 30):
        b, gb = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=causal, sliding_window=W)
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_w1_causal_sees_itself_only():
    # row i sees key i alone (P = 1 exactly); rows past S see nothing
    q, k, v, w = inputs(H=2, kv_heads=1, Dv=4)
    out = hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=1)
    assert torch.equal(out[:, :, :S], v.expand(1, 2, S, 4)) and (out[:, :, S:] == 0).all()


def test_rows_with_nothing_visible_give_zeros():
    # without causality, query rows i >= S + W - 1 see no key: zeros, zero gradients
    Tq, Sk, W = 150, 40, 20
    q, k, v, w = leaves(*inputs(T=Tq, S=Sk, L=2))[:4]
    out = hkt.hkt_attention(q, k, v, w, sliding_window=W)
    assert (out[:, :, Sk + W - 1:] == 0).all() and (out[:, :, :Sk + W - 1].abs().sum(-1) > 0).all()
    g = torch.zeros_like(out)
    g[:, :, Sk + W - 1:] = 1
    for grad in torch.autograd.grad(out, [*q, *k, v, w], g):
        assert (grad == 0).all()
    # a bool mask that hides the band's keys of row 100 (causal, W = 3: keys 98 .. 100)
    mask = torch.ones(T, S, dtype=torch.bool)
    mask[100, 98:101] = False
    q, k, v, w = inputs()
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=True, sliding_window=3)
    assert (out[:, :, 100] == 0).all() and (out[:, :, 101].abs().sum() > 0)


def test_nan_in_gives_nan_out():
    q, k, v, w = inputs(H=2)
    q[0][0, 1, 120, 2] = float("nan")
    out = hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=30)
    assert torch.isnan(out[0, 1, 120]).all()
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[0, 1, 120] = False
    assert not torch.isnan(out[others]).any()
    # NaN in the key row 20: the rows whose band holds it are NaN, the others not
    q, k, v, w = inputs(H=2, L=1)
    k[0][0, 0, 20, 0] = float("nan")
    out = hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=30)
    assert torch.isnan(out[0, 0, 20:50]).all() and not torch.isnan(out[0, 1]).any()
    assert not torch.isnan(out[0, 0, :20]).any() and not torch.isnan(out[0, 0, 50:]).any()


# ---- the "sdpa" backend: the band as a mask ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool4d", "float"])
def test_sdpa_backend_takes_the_band_as_a_mask(causal, mask_kind):
    q, k, v, w = leaves(*inputs(kv_heads=2))[:4]
    mask = make_mask(mask_kind, 1, 4, T, S, F64)
    a, ga = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=causal, sliding_window=25)
    b, gb = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=causal, sliding_window=25,
                              backend="sdpa")
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_func_transforms_take_the_band():
    # torch.func runs the "sdpa" backend: the band as a mask there too
    q, k, v, w = inputs(H=2, T=70, S=70)
    want = hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=9)
    got = torch.func.vmap(lambda v: hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=9))(v.unsqueeze(0))
    torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-12)


# ---- arguments ----

BAD = [
    (0, ValueError, "sliding_window: must be an int >= 1 (or None for no band), got 0"),
    (-1, ValueError, "sliding_window: must be an int >= 1 (or None for no band), got -1"),
    (-(10 ** 30), ValueError, "sliding_window: must be an int >= 1 (or None for no band), got -" + str(10 ** 30)),
    (2.5, TypeError, "sliding_window: expected None or an int >= 1, got float"),
    (True, TypeError, "sliding_window: expected None or an int >= 1, got bool"),
    ("3", TypeError, "sliding_window: expected None or an int >= 1, got str"),
    (torch.tensor(3), TypeError, "sliding_window: expected None or an int >= 1, got torch.Tensor"),
]


@pytest.mark.parametrize("bad,exc,message", BAD)
def test_bad_sliding_window_named_as_the_reference_names_it(bad, exc, message):
    q, k, v, w = inputs(H=2, T=5, S=5, L=2)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        reference(q, k, v, w, sliding_window=bad)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(q, k, v, w, sliding_window=bad)
    ql, kl, vl, wl, _ = leaves(q, k, v, w)  # the autograd path
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(ql, kl, vl, wl, sliding_window=bad)
    meta = [[x.to("meta") for x in q], [x.to("meta") for x in k], v.to("meta"), w.to("meta")]
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(*meta, sliding_window=bad)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(q, k, v, w, sliding_window=bad, backend="sdpa")
    with torch.no_grad(), pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention_with_kvcache([x[:, :, -1:] for x in q], [x.clone() for x in k], v.clone(), w, 4,
                                       sliding_window=bad)


def test_numpy_ints_taken():
    np = pytest.importorskip("numpy")
    q, k, v, w = inputs(H=2, T=70, S=70)
    want = hkt.hkt_attention(q, k, v, w, sliding_window=9)
    assert torch.equal(hkt.hkt_attention(q, k, v, w, sliding_window=np.int64(9)), want)
    assert torch.equal(reference(q, k, v, w, sliding_window=np.int32(9)), reference(q, k, v, w, sliding_window=9))


def test_windows_with_a_band_refused_by_name():
    q, k, v, w = inputs(H=2, T=40, S=40, L=2)
    with pytest.raises(NotImplementedError, match="^sliding_window: not taken together with windows"):
        hkt.hkt_attention(q, k, v, w, windows=[4, None], sliding_window=8)
    # no level with a window: the dense kernels with the band
    assert torch.equal(hkt.hkt_attention(q, k, v, w, windows=[None, None], sliding_window=8),
                       hkt.hkt_attention(q, k, v, w, sliding_window=8))


def test_meta_tensors_give_shapes():
    q, k, v, w = inputs(H=2, T=9, S=7, L=2)
    meta = [[x.to("meta") for x in q], [x.to("meta") for x in k], v.to("meta"), w.to("meta")]
    out = hkt.hkt_attention(*meta, sliding_window=3)
    assert out.is_meta and out.shape == (1, 2, 9, 4)


# ---- decoding ----

@pytest.mark.parametrize("W", [1, 17, 64, 300])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_decode_matches_the_full_forward(W, cap):
    # positions n .. n + Tn - 1 against the cache, every chunk boundary of a
    # long cache crossed (chunks of 256 keys and more), grouped kv heads
    B, H, Hk, Tf, D, L, Tn = 2, 4, 2, 600, 8, 3, 5
    q, k, v, w = sample_inputs(B, H, Tf, Tf, D, 4, L, kv_heads=Hk)
    want = grouped_reference(q, k, v, w, is_causal=True, sliding_window=W, softcap=cap)
    for n in (0, 300, Tf - Tn):
        kc = [x.clone() for x in k]
        qn = [x[:, :, [(n + i) >> l for i in range(Tn)]] for l, x in enumerate(q)]
        with torch.no_grad():
            out = hkt.hkt_attention_with_kvcache(qn, kc, v, w, n, softcap=cap, sliding_window=W)
        torch.testing.assert_close(out, want[:, :, n:n + Tn], rtol=1e-11, atol=1e-12)
    with torch.no_grad():  # the keys before the band are never read
        qn = [x[:, :, [(Tf - 1) >> l]] for l, x in enumerate(q)]
        kc, vc = [x.clone() for x in k], v.clone()
        kc[0][:, :, :Tf - W] = float("nan")
        vc[:, :, :Tf - W] = float("nan")
        out = hkt.hkt_attention_with_kvcache(qn, kc, vc, w, Tf - 1, softcap=cap, sliding_window=W)
        torch.testing.assert_close(out[:, :, 0], want[:, :, -1], rtol=1e-11, atol=1e-12)


def test_decode_without_a_band_unchanged():
    q, k, v, w = sample_inputs(1, 2, 40, 40, 8, 4, 2)
    qn = [x[:, :, [39 >> l]] for l, x in enumerate(q)]
    with torch.no_grad():
        a = hkt.hkt_attention_with_kvcache(qn, k, v, w, 39)
        assert torch.equal(a, hkt.hkt_attention_with_kvcache(qn, k, v, w, 39, sliding_window=None))
        assert torch.equal(a, hkt.hkt_attention_with_kvcache(qn, k, v, w, 39, sliding_window=40))


# ---- the ops ----

def test_opcheck_with_a_band():
    q, k, v, w = sample_inputs(1, 2, 70, 66, 3, 4, 2, requires_grad=True)
    seed = torch.tensor(0)
    fmask = torch.randn(1, 2, 70, 66, dtype=F64, requires_grad=True)
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, None, True, 0.0, 0.5, seed, 0.0, 9))
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, fmask, False, 0.0, 0.5, seed, 1.5, 9))
    out, lse = ops.attention_forward([*q], [*k], v, w, None, True, 0.0, 0.5, seed, 0.0, 9)
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    torch.library.opcheck(ops.attention_backward, (torch.randn_like(out), [*q], [*k], v, w, out.detach(),
                                                   lse.detach(), None, True, 0.0, 0.5, seed, False, 0.0, 9))
    qd = [torch.randn(1, 2, 2, 3, dtype=F64) for _ in range(2)]
    kc = [torch.randn(1, 2, -(-9 >> l), 3, dtype=F64) for l in range(2)]
    vc = torch.randn(1, 2, 9, 4, dtype=F64)
    torch.library.opcheck(decode_op.decode, (qd, kc, vc, w, None, 5, None, 0.0, 3))


def test_torch_compile_fullgraph_equals_eager():
    q, k, v, w = sample_inputs(1, 2, 90, 90, 4, 3, 3)
    mask = make_mask("float", 1, 2, 90, 90, F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)

    def f(q0, q1, q2, k0, k1, k2, v, w, mask):
        return hkt.hkt_attention([q0, q1, q2], [k0, k1, k2], v, w, attn_mask=mask, is_causal=True,
                                 sliding_window=20)
    args = (*q, *k, v, w, mask)
    eager = f(*args)
    g_eager = torch.autograd.grad(eager.sum(), args)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    g_out = torch.autograd.grad(out.sum(), args)
    assert torch.equal(out, eager)
    for a, b in zip(g_out, g_eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad,exc,message", [b for b in BAD if isinstance(b[0], (bool, str, float))])
def test_bad_sliding_window_under_compile_is_refused(bad, exc, message):
    q, k, v, w = sample_inputs(1, 2, 12, 12, 4, 3, 2)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(exc, match="^" + re.escape(message)):
        torch.compile(lambda W: hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=W),
                      backend="eager")(bad)


# ---- every instruction-set build ----

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import hkt
from hkt.reference import hkt_attention_reference as reference
from hkt._core.kernels import dropout_keep_mask
from hkt import ops
from helpers import make_mask, sample_inputs, with_threads

res = {"kernels": hkt._C.cpu_kernels(), "errors": {}, "same_bits": True}
for dtype in (torch.float32, torch.float64):
    for (B, H, T, S, D, Dv, L, kv, causal, W, mask_kind, cap) in [
            (1, 4, 197, 170, 13, 7, 3, 2, False, 30, "bool", None), (1, 2, 200, 200, 64, 64, 3, 1, True, 65, None, 1.5),
            (1, 3, 150, 150, 5, 3, 4, None, True, 1, "float", None)]:
        q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=dtype, requires_grad=True, kv_heads=kv)
        mask = make_mask(mask_kind, B, H, T, S, dtype)
        g = torch.randn(B, H, T, Dv, generator=torch.Generator().manual_seed(1), dtype=dtype)
        leaves = [*q, *k, v, w]

        def run():
            out = hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=causal, sliding_window=W, softcap=cap)
            return [out, *torch.autograd.grad(out, leaves, g)]

        got = run()
        r = H // k[0].shape[1]
        l64 = [x.detach().double().requires_grad_() for x in leaves]
        m64 = None if mask is None else mask.double() if mask.is_floating_point() else mask
        out64 = reference(l64[:L], [x.repeat_interleave(r, 1) for x in l64[L:2 * L]],
                          l64[2 * L].repeat_interleave(r, 1), l64[2 * L + 1], attn_mask=m64, is_causal=causal,
                          sliding_window=W, softcap=cap)
        want = [out64, *torch.autograd.grad(out64, l64, g.double())]
        err = max(((a.double() - b).abs().max() / (1 + b.abs().max())).item() for a, b in zip(got, want))
        res["errors"][f"{dtype} T={T} W={W}"] = err
        for n in (1, 3):
            res["same_bits"] &= all(torch.equal(a, b) for a, b in zip(with_threads(n, run), got))
    # dropout through the op, against the reference with the kernels' decisions
    q, k, v, w = sample_inputs(1, 2, 130, 130, 8, 4, 2, dtype=dtype)
    out, _ = ops.attention_forward(q, k, v, w, None, True, 0.25, 0.4, torch.tensor(99), 0.0, 40)
    want = reference([x.double() for x in q], [x.double() for x in k], v.double(), w.double(), is_causal=True,
                     dropout_p=0.25, scale=0.4, dropout_mask=dropout_keep_mask(99, 0.25, 1, 2, 130, 130),
                     sliding_window=40)
    res["errors"][f"{dtype} dropout"] = (out.double() - want).abs().max().item()
    # decoding: the last rows of a cache against the banded forward
    q, k, v, w = sample_inputs(1, 4, 700, 700, 16, 8, 3, dtype=dtype, kv_heads=2)
    full = hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=300)
    with torch.no_grad():
        last = hkt.hkt_attention_with_kvcache([x[:, :, [(697 + i) >> l for i in range(3)]] for l, x in enumerate(q)],
                                              k, v, w, 697, sliding_window=300)
    res["errors"][f"{dtype} decode"] = (last - full[:, :, 697:]).abs().max().item()
print(json.dumps(res))
"""


@pytest.mark.parametrize("kernels", ["avx512f", "avx2", "default"])
def test_every_build_matches_the_reference(kernels):
    assert_build_matches(run_on_kernels(SCRIPT, kernels), kernels)


# ---- the work: T * W ----

def test_work_grows_as_t_times_w():
    # the kernels' own walk of tiles (hkt.analysis mirrors it): past the first
    # W rows the band's score work is affine in T at a fixed W (each doubling
    # of T adds twice what the one before added), where the causal call's
    # quadruples
    from hkt.analysis import count_score_macs
    for causal in (True, False):
        band = [count_score_macs(1, 8, T, T, 64, 3, is_causal=causal, sliding_window=1024)
                for T in (4096, 8192, 16384)]
        assert band[2] - band[1] == 2 * (band[1] - band[0]) and band[2] / band[1] < 2.1
        full = count_score_macs(1, 8, 16384, 16384, 64, 3, is_causal=causal)
        assert band[2] < full / 6
        # a band past the sequence visits every tile the call without one visits
        assert count_score_macs(1, 8, 300, 200, 64, 3, is_causal=causal, sliding_window=300) == \
            count_score_macs(1, 8, 300, 200, 64, 3, is_causal=causal)
    with pytest.raises(ValueError, match="^sliding_window: expected an int >= 1, got 0"):
        count_score_macs(1, 1, 10, 10, 4, 1, sliding_window=0)
