"""Soft-capping (docs/contract.md section 1.12): hkt_attention(..., softcap=c)
caps each combined score to c tanh(s / c) before the mask.  The kernels
against the float64 reference (forward and every gradient), the edge rows,
the argument rules (the binding's, reference.py's messages), the paths that
refuse a cap by name, and the ops under opcheck and torch.compile."""
import re

import pytest
import torch

import hkt
from hkt import ops
from hkt.ops import decode as decode_op
from hkt.reference import hkt_attention_reference as reference
from hkt._core.kernels import dropout_keep_mask
from helpers import grad_leaves as leaves, make_mask, outputs_and_grads, sample_inputs

F64, F32 = torch.float64, torch.float32
CAP = 1.5


def loud(B=2, H=4, T=70, S=67, D=5, Dv=4, L=3, dtype=F64, kv_heads=None, seed=0, gain=2.5):
    """Inputs whose scores reach well past CAP (the cap changes the result):
    70 x 67 crosses the kernels' 64-wide tiles, a diagonal tile included."""
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=dtype, seed=seed, kv_heads=kv_heads)
    q = [x * gain for x in q]
    return q, k, v, w


def repeat_kv(q, k, v):
    r = q[0].shape[1] // k[0].shape[1]
    return [x.repeat_interleave(r, 1) for x in k], v.repeat_interleave(r, 1)


# ---- against the reference ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "bool4d"])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_matches_reference_float64(causal, mask_kind, kv_heads):
    q, k, v, w = loud(kv_heads=kv_heads)
    mask = make_mask(mask_kind, 2, 4, 70, 67, F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)
    out, grads = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=causal, softcap=CAP,
                                   dropout_p=0.0)
    kr, vr = repeat_kv(q, k, v)
    want, _ = outputs_and_grads(reference, q, kr, vr, w, mask, is_causal=causal, softcap=CAP)
    # the reference's gradients of the repeated kv heads summed back by autograd
    want_grads = outputs_and_grads(lambda q, k, v, w, attn_mask, **kw: reference(q, *repeat_kv(q, k, v), w,
                                                                                    attn_mask=attn_mask, **kw),
                                   q, k, v, w, mask, is_causal=causal, softcap=CAP)[1]
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)
    # the cap matters here: without it the result is another one
    uncapped = hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=causal)
    assert (uncapped - out).abs().max() > 1e-2


def test_gradcheck_small():
    q, k, v, w = loud(B=1, H=2, T=5, S=6, D=3, Dv=2, L=2, gain=3.0)
    mask = torch.randn(1, 2, 5, 6, dtype=F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)

    def f(*xs):
        return hkt.hkt_attention(list(xs[:2]), list(xs[2:4]), xs[4], xs[5], attn_mask=xs[6], is_causal=True,
                                 softcap=0.7)
    assert torch.autograd.gradcheck(f, (*q, *k, v, w, mask))


def test_double_backward_small():
    q, k, v, w = loud(B=1, H=2, T=5, S=5, D=3, Dv=2, L=2, gain=3.0)
    q, k, v, w, _ = leaves(q, k, v, w)

    def f(*xs):
        return hkt.hkt_attention(list(xs[:2]), list(xs[2:4]), xs[4], xs[5], is_causal=True, softcap=0.7)
    assert torch.autograd.gradgradcheck(f, (*q, *k, v, w))


@pytest.mark.parametrize("mask_kind", [None, "float"])
def test_float32_within_tolerance(mask_kind):
    q, k, v, w = loud(dtype=F32, kv_heads=2)
    mask = make_mask(mask_kind, 2, 4, 70, 67, F32)
    q, k, v, w, mask = leaves(q, k, v, w, mask)
    out, grads = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=True, softcap=CAP)
    q64, k64, v64, w64, m64 = leaves([x.double() for x in q], [x.double() for x in k], v.double(), w.double(),
                                     None if mask is None else mask.double())
    want, want_grads = outputs_and_grads(
        lambda q, k, v, w, attn_mask, **kw: reference(q, *repeat_kv(q, k, v), w, attn_mask=attn_mask, **kw),
        q64, k64, v64, w64, m64, is_causal=True, softcap=CAP)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_bfloat16_within_tolerance():
    q, k, v, w = loud(dtype=F32)
    q, k, v, w = [x.bfloat16() for x in q], [x.bfloat16() for x in k], v.bfloat16(), w.bfloat16()
    q, k, v, w, _ = leaves(q, k, v, w)
    out, grads = outputs_and_grads(hkt.hkt_attention, q, k, v, w, None, is_causal=True, softcap=CAP)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    q64, k64, v64, w64, _ = leaves([x.double() for x in q], [x.double() for x in k], v.double(), w.double())
    want, want_grads = outputs_and_grads(reference, q64, k64, v64, w64, None, is_causal=True, softcap=CAP)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=5e-2, atol=5e-2)


def test_dropout_exact_against_reference():
    B, H, T, S, p = 1, 2, 70, 66, 0.3
    q, k, v, w = loud(B, H, T, S, 5, 4, 3)
    q, k, v, w, _ = leaves(q, k, v, w)
    out, _ = ops.attention_forward(list(q), list(k), v, w, None, True, p, 0.4, torch.tensor(1234), CAP)
    keep = dropout_keep_mask(1234, p, B, H, T, S)
    want = reference(q, k, v, w, is_causal=True, dropout_p=p, scale=0.4, dropout_mask=keep, softcap=CAP)
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [*q, *k, v, w], g), torch.autograd.grad(want, [*q, *k, v, w], g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


# ---- edge rows ----

def test_nan_in_gives_nan_out():
    q, k, v, w = loud(B=1, H=2, T=9, S=9)
    q[0][0, 1, 4, 2] = float("nan")
    out = hkt.hkt_attention(q, k, v, w, softcap=CAP)
    assert torch.isnan(out[0, 1, 4]).all()
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[0, 1, 4] = False
    assert not torch.isnan(out[others]).any()


def test_fully_masked_row_gives_zeros():
    q, k, v, w = loud(B=1, H=2, T=9, S=9)
    mask = torch.ones(9, 9, dtype=torch.bool)
    mask[3] = False
    q, k, v, w, _ = leaves(q, k, v, w)
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask, softcap=CAP)
    assert (out[:, :, 3] == 0).all()
    g = torch.zeros_like(out)
    g[:, :, 3] = 1
    dq = torch.autograd.grad(out, q[0], g)[0]
    assert (dq == 0).all()


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("huge", [1e30, float("inf")])
def test_huge_scores_are_capped_not_nan(dtype, huge):
    q, k, v, w = loud(B=1, H=2, T=9, S=9, dtype=dtype)
    # one feature of one query row huge: its scores +-huge (the keys' signs), capped to +-CAP
    q[0][0, 0, 2].zero_()
    q[0][0, 0, 2, 0] = huge
    out = hkt.hkt_attention(q, k, v, w, softcap=CAP)
    assert torch.isfinite(out).all()
    want = reference([x.double() for x in q], [x.double() for x in k], v.double(), w.double(), softcap=CAP)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# ---- arguments ----

BAD = [
    (True, TypeError, "softcap: expected None or a real number, got bool"),
    ("1", TypeError, "softcap: expected None or a real number, got str"),
    (-1.0, ValueError, "softcap: must be positive and finite (or None/0.0 for none), got -1.0"),
    (-2, ValueError, "softcap: must be positive and finite (or None/0.0 for none), got -2.0"),
    (float("inf"), ValueError, "softcap: must be positive and finite (or None/0.0 for none), got inf"),
    (float("nan"), ValueError, "softcap: must be positive and finite (or None/0.0 for none), got nan"),
]


@pytest.mark.parametrize("bad,exc,message", BAD)
def test_bad_softcap_named_as_the_reference_names_it(bad, exc, message):
    q, k, v, w = loud(B=1, H=2, T=5, S=5, L=2)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        reference(q, k, v, w, softcap=bad)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(q, k, v, w, softcap=bad)
    q, k, v, w, _ = leaves(q, k, v, w)  # the autograd path
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(q, k, v, w, softcap=bad)
    meta = [[x.detach().to("meta") for x in q], [x.detach().to("meta") for x in k], v.detach().to("meta"),
            w.detach().to("meta")]
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(*meta, softcap=bad)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        hkt.hkt_attention(*[[x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()],
                          softcap=bad, backend="sdpa")


def test_numpy_and_int_caps_taken():
    np = pytest.importorskip("numpy")
    q, k, v, w = loud(B=1, H=2, T=9, S=9)
    want = hkt.hkt_attention(q, k, v, w, softcap=2.0)
    assert torch.equal(hkt.hkt_attention(q, k, v, w, softcap=2), want)
    assert torch.equal(hkt.hkt_attention(q, k, v, w, softcap=np.float64(2.0)), want)


def test_zero_is_none_bitwise():
    q, k, v, w = loud(kv_heads=2)
    mask = make_mask("float", 2, 4, 70, 67, F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)
    a, ga = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=True)
    b, gb = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=True, softcap=0.0)
    c, gc = outputs_and_grads(hkt.hkt_attention, q, k, v, w, mask, is_causal=True, softcap=None)
    assert torch.equal(a, b) and torch.equal(a, c)
    for x, y, z in zip(ga, gb, gc):
        assert torch.equal(x, y) and torch.equal(x, z)
    with torch.no_grad():
        assert torch.equal(hkt.hkt_attention(q, k, v, w, softcap=0.0), hkt.hkt_attention(q, k, v, w))


def test_meta_tensors_give_shapes():
    q, k, v, w = loud(B=1, H=2, T=9, S=7, L=2)
    meta = [[x.to("meta") for x in q], [x.to("meta") for x in k], v.to("meta"), w.to("meta")]
    out = hkt.hkt_attention(*meta, softcap=CAP)
    assert out.is_meta and out.shape == (1, 2, 9, 4)


def test_sdpa_backend_refuses_a_cap_by_name():
    q, k, v, w = loud(B=1, H=2, T=9, S=9)
    with pytest.raises(NotImplementedError, match="^softcap:"):
        hkt.hkt_attention(q, k, v, w, softcap=CAP, backend="sdpa")
    # no cap: the "sdpa" backend as before
    torch.testing.assert_close(hkt.hkt_attention(q, k, v, w, softcap=0.0, backend="sdpa"),
                               hkt.hkt_attention(q, k, v, w), rtol=1e-10, atol=1e-12)


def test_func_transforms_refuse_a_cap_by_name():
    q, k, v, w = loud(B=1, H=2, T=9, S=9)
    with pytest.raises(NotImplementedError, match="^softcap:"):
        torch.func.vmap(lambda v: hkt.hkt_attention(q, k, v, w, softcap=CAP))(v.unsqueeze(0))


@pytest.mark.parametrize("causal", [False, True])
def test_windows_take_a_cap_through_hkt_attention(causal):
    # hkt_attention's windowed branch hands the cap to the windowed kernels:
    # forward and every gradient equal the reference's, and the cap matters
    q, k, v, w = loud(B=1, H=2, T=40, S=40, L=3)
    q, k, v, w, _ = leaves(q, k, v, w)
    windows = [4, 8, None]
    out, grads = outputs_and_grads(hkt.hkt_attention, q, k, v, w, None, is_causal=causal, windows=windows,
                                   softcap=CAP)
    ref, ref_grads = outputs_and_grads(reference, q, k, v, w, None, is_causal=causal, windows=windows, softcap=CAP)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    uncapped = hkt.hkt_attention(q, k, v, w, is_causal=causal, windows=windows)
    assert (out - uncapped).abs().max() > 1e-3
    with pytest.raises(ValueError, match="^softcap: must be positive"):
        hkt.hkt_attention(q, k, v, w, windows=windows, softcap=-1.0)


def test_varlen_refuses_a_cap_by_name():
    q = [torch.randn(5, 2, 3, dtype=F64), torch.randn(3, 2, 3, dtype=F64)]
    k = [torch.randn(5, 2, 3, dtype=F64), torch.randn(3, 2, 3, dtype=F64)]
    v, w, cu = torch.randn(5, 2, 3, dtype=F64), torch.ones(2, dtype=F64), torch.tensor([0, 5])
    with pytest.raises(NotImplementedError, match="^softcap:"):
        hkt.hkt_attention_varlen(q, k, v, w, cu, cu, softcap=CAP)
    hkt.hkt_attention_varlen(q, k, v, w, cu, cu, softcap=0.0)


def test_binding_refuses_native_bfloat16_by_name():
    # the Python layer computes a capped bfloat16 call in float32; the binding
    # itself names what its native bfloat16 kernels do not take
    from hkt import _C
    if not _C.cpu_has_bf16():
        pytest.skip("no native bfloat16 kernels on this CPU")
    from torch.utils.dlpack import to_dlpack
    q, k, v, w = loud(B=1, H=2, T=8, S=8, D=4, Dv=4, L=1, dtype=F32)
    q, k, v = [x.bfloat16() for x in q], [x.bfloat16() for x in k], v.bfloat16()
    out, lse = torch.empty(1, 2, 8, 4), torch.empty(1, 2, 8)
    with pytest.raises(NotImplementedError, match="^softcap: the native bfloat16 kernels"):
        _C.forward([to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v), to_dlpack(w),
                   to_dlpack(out), to_dlpack(lse), softcap=CAP)


# ---- decoding ----

def test_decode_matches_causal_reference():
    B, H, Hk, T, D, L, Tn = 2, 4, 2, 23, 5, 3, 3
    q, k, v, w = loud(B, H, T, T, D, 4, L, kv_heads=Hk)
    kr, vr = repeat_kv(q, k, v)
    want = reference(q, kr, vr, w, is_causal=True, softcap=CAP)
    n = T - Tn  # cached positions; rows n .. T-1 new
    kc = [x.clone() for x in k]
    qn = [x[:, :, [(n + i) >> l for i in range(Tn)]] for l, x in enumerate(q)]
    with torch.no_grad():
        out = hkt.hkt_attention_with_kvcache(qn, kc, v, w, n, softcap=CAP)
        none = hkt.hkt_attention_with_kvcache(qn, kc, v, w, n, softcap=0.0)
        assert torch.equal(none, hkt.hkt_attention_with_kvcache(qn, kc, v, w, n))
    torch.testing.assert_close(out, want[:, :, n:], rtol=1e-11, atol=1e-12)
    assert (none - out).abs().max() > 1e-2
    with pytest.raises(ValueError, match="^softcap: must be positive"):
        hkt.hkt_attention_with_kvcache(qn, kc, v, w, n, softcap=-1.0)


# ---- the ops ----

def test_opcheck_with_softcap():
    q, k, v, w = sample_inputs(1, 2, 7, 6, 3, 4, 2, requires_grad=True)
    seed = torch.tensor(0)
    fmask = torch.randn(1, 2, 7, 6, dtype=F64, requires_grad=True)
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, None, True, 0.0, 0.5, seed, CAP))
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, fmask, False, 0.0, 0.5, seed, CAP))
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, fmask, False, 0.0, 0.5, seed, 0.0))
    out, lse = ops.attention_forward([*q], [*k], v, w, None, True, 0.0, 0.5, seed, CAP)
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    torch.library.opcheck(ops.attention_backward, (torch.randn_like(out), [*q], [*k], v, w, out.detach(),
                                                   lse.detach(), None, True, 0.0, 0.5, seed, False, CAP))
    torch.library.opcheck(ops.attention_backward, (torch.randn_like(out), [*q], [*k], v, w, out.detach(),
                                                   lse.detach(), fmask.detach(), False, 0.0, 0.5, seed, True, CAP))
    qd = [torch.randn(1, 2, 2, 3, dtype=F64) for _ in range(2)]
    kc = [torch.randn(1, 2, -(-9 >> l), 3, dtype=F64) for l in range(2)]
    vc = torch.randn(1, 2, 9, 4, dtype=F64)
    torch.library.opcheck(decode_op.decode, (qd, kc, vc, w, None, 5, None, CAP))


def test_torch_compile_fullgraph_equals_eager():
    q, k, v, w = loud(B=1, H=2, T=21, S=21, L=3)
    mask = make_mask("float", 1, 2, 21, 21, F64)
    q, k, v, w, mask = leaves(q, k, v, w, mask)

    def f(q0, q1, q2, k0, k1, k2, v, w, mask):
        return hkt.hkt_attention([q0, q1, q2], [k0, k1, k2], v, w, attn_mask=mask, is_causal=True, softcap=CAP)
    args = (*q, *k, v, w, mask)
    eager = f(*args)
    g_eager = torch.autograd.grad(eager.sum(), args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    g_out = torch.autograd.grad(out.sum(), args)
    assert torch.equal(out, eager)
    for a, b in zip(g_out, g_eager):
        assert torch.equal(a, b)


def _compiled_calls():
    """hkt_attention (dense and windowed) and the decoding call, each taking
    the cap as an argument, for torch.compile."""
    q, k, v, w = loud(B=1, H=2, T=12, S=12, L=2, dtype=F32)
    kc = [x.clone() for x in k]
    qn = [x[:, :, -1:] for x in q]
    return {
        "dense": (lambda c: hkt.hkt_attention(q, k, v, w, is_causal=True, softcap=c)),
        "windows": (lambda c: hkt.hkt_attention(q, k, v, w, is_causal=True, windows=[4, None], softcap=c)),
        "decode": (lambda c: hkt.hkt_attention_with_kvcache(qn, kc, v, w, 11, softcap=c)),
    }


@pytest.mark.parametrize("call", ["dense", "windows", "decode"])
@pytest.mark.parametrize("bad,exc,message", [b for b in BAD if isinstance(b[0], (bool, str))])
def test_bad_softcap_under_compile_is_refused(call, bad, exc, message):
    """A cap dynamo holds as a constant that is not a number (a bool, which
    the ops' float would take as 1.0, or a string) is checked by the
    extension at trace time: without fullgraph the compiled call raises the
    eager call's error; with fullgraph it stops at the graph break, never
    computing with a cap the caller did not mean."""
    fn = _compiled_calls()[call]
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(exc, match="^" + re.escape(message)):
        torch.compile(fn, backend="eager")(bad)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(fn, fullgraph=True, backend="eager")(bad)
    torch._dynamo.reset()
    with torch.no_grad():  # a good cap still compiles in one graph, and equals eager
        assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(CAP), fn(CAP))


@pytest.mark.parametrize("call", ["dense", "windows", "decode"])
def test_numpy_cap_compiles_in_one_graph(call):
    """A NumPy integer cap, a real number as eager takes it, goes on to the op
    under torch.compile(fullgraph=True) as a float would (no graph break)."""
    np = pytest.importorskip("numpy")
    fn = _compiled_calls()[call]
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(fn, fullgraph=True, backend="eager")(np.int64(2)), fn(2.0))


@pytest.mark.parametrize("bad,exc,message", [b for b in BAD if isinstance(b[0], (bool, str))])
def test_bad_softcap_under_jit_trace_is_refused(bad, exc, message):
    """torch.jit.trace records the op, but runs the Python around it: the
    extension checks the cap there, as in eager."""
    q, k, v, w = loud(B=1, H=2, T=12, S=12, L=2, dtype=F32)
    with pytest.raises(exc, match="^" + re.escape(message)):
        torch.jit.trace(lambda q0: hkt.hkt_attention([q0, q[1]], k, v, w, is_causal=True, softcap=bad), (q[0],),
                        check_trace=False)
