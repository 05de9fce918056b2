"""hkt.hkt_attention_varlen (packed variable-length batches) and MultiheadHKT's
pack_padding: every sequence must get exactly what it gets alone."""
import pytest
import torch

import hkt
from helpers import level_len, randomize, requiring_grad, with_threads
from hkt.reference import hkt_attention_reference

F64, F32 = torch.float64, torch.float32

# lengths with 1, 0, exact and non-multiples of 2^l, and more than one 64-row tile
LENS = [5, 1, 0, 64, 70, 3, 130, 2]


def cu_of(lens, dtype=torch.int32):
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=dtype)


def packed_inputs(lens_q, lens_k, H, D, Dv, L, *, H_kv=None, dtype=F64, per_head=True, seed=0, requires_grad=False):
    """Random packed q, k (level l: each sequence's ceil(len / 2^l) rows), v, w."""
    g = torch.Generator().manual_seed(seed)
    H_kv = H if H_kv is None else H_kv

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)

    q = [rnd(sum(level_len(n, l) for n in lens_q), H, D) for l in range(L)]
    k = [rnd(sum(level_len(n, l) for n in lens_k), H_kv, D) for l in range(L)]
    v = rnd(sum(lens_k), H_kv, Dv)
    w = rnd(H, L) if per_head else rnd(L)
    return q, k, v, w


def one_sequence(xs, offsets, s):
    """Sequence s's rows of packed per-level tensors, as (1, H, n, D) views."""
    return [x[int(o[s]):int(o[s + 1])].transpose(0, 1).unsqueeze(0) for x, o in zip(xs, offsets)]


def run_alone(q, k, v, w, lens_q, lens_k, is_causal, attention=hkt.hkt_attention):
    """Each sequence through `attention` on its own, packed back: (total_q, H, Dv)."""
    L = len(q)
    oq, ok = hkt.varlen_level_offsets(cu_of(lens_q), L), hkt.varlen_level_offsets(cu_of(lens_k), L)
    outs = []
    for s in range(len(lens_q)):
        if lens_q[s] == 0:
            continue
        vs = v[int(ok[0][s]):int(ok[0][s + 1])].transpose(0, 1).unsqueeze(0)
        out = attention(one_sequence(q, oq, s), one_sequence(k, ok, s), vs, w, is_causal=is_causal)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q[0].new_zeros(0, q[0].shape[1], v.shape[-1])


def varlen(q, k, v, w, lens_q, lens_k, is_causal, **kw):
    return hkt.hkt_attention_varlen(q, k, v, w, cu_of(lens_q), cu_of(lens_k), is_causal=is_causal, **kw)


# ---- the helpers ----

def test_level_offsets():
    cu = cu_of([5, 1, 0, 4], torch.int64)
    offs = hkt.varlen_level_offsets(cu, 4)
    assert [o.tolist() for o in offs] == [[0, 5, 6, 6, 10], [0, 3, 4, 4, 6], [0, 2, 3, 3, 4], [0, 1, 2, 2, 3]]
    assert all(o.dtype == torch.int64 for o in offs)
    assert hkt.varlen_level_offsets(cu.int(), 2)[1].dtype == torch.int32


def test_pack_levels_takes_each_sequences_first_rows():
    lengths = torch.tensor([3, 0, 5])
    x = torch.arange(3 * 2 * 5 * 1, dtype=F64).reshape(3, 2, 5, 1)  # (B, H, n, D)
    x1 = x[:, :, :3]  # level 1 of n = 5
    p0, p1 = hkt.pack_levels([x, x1], lengths)
    assert torch.equal(p0, torch.cat([x[0, :, :3], x[2, :, :5]], dim=1).transpose(0, 1))
    assert torch.equal(p1, torch.cat([x1[0, :, :2], x1[2, :, :3]], dim=1).transpose(0, 1))


# ---- forward and backward against each sequence alone ----

@pytest.mark.parametrize("L", [1, 2, 3, 5])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_forward_is_each_sequence_alone(L, is_causal, dtype):
    q, k, v, w = packed_inputs(LENS, LENS, 3, 8, 5, L, dtype=dtype, seed=L)
    got = varlen(q, k, v, w, LENS, LENS, is_causal)
    assert got.shape == (sum(LENS), 3, 5) and got.dtype == dtype
    # the same kernels on the same views: bitwise
    assert torch.equal(got, run_alone(q, k, v, w, LENS, LENS, is_causal))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_forward_matches_reference(is_causal, per_head):
    lens_q, lens_k = [7, 1, 66, 0, 4], [7, 3, 65, 2, 0]  # T_s != S_s as well
    q, k, v, w = packed_inputs(lens_q, lens_k, 2, 6, 4, 3, per_head=per_head, seed=3)
    got = varlen(q, k, v, w, lens_q, lens_k, is_causal)
    want = run_alone(q, k, v, w, lens_q, lens_k, is_causal, attention=hkt_attention_reference)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # a sequence with queries but no keys sees nothing: zeros
    assert torch.equal(got[-4:], torch.zeros_like(got[-4:]))


def grads_of(fn, inputs, dout):
    for x in inputs:
        x.grad = None
    (fn() * dout).sum().backward()
    return [x.grad.clone() for x in inputs]


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_backward_is_each_sequence_alone(L, is_causal, dtype):
    q, k, v, w = packed_inputs(LENS, LENS, 2, 8, 6, L, dtype=dtype, seed=7, requires_grad=True)
    leaves = [*q, *k, v, w]
    dout = torch.randn(sum(LENS), 2, 6, generator=torch.Generator().manual_seed(1), dtype=dtype)
    got = grads_of(lambda: varlen(q, k, v, w, LENS, LENS, is_causal), leaves, dout)
    want = grads_of(lambda: run_alone(q, k, v, w, LENS, LENS, is_causal), leaves, dout)
    for g, r in zip(got[:-1], want[:-1]):  # dq, dk, dv: each row from its own sequence's kernel
        assert torch.equal(g, r)
    # dw: the same per-sequence terms, summed in another order
    tol = 1e-12 if dtype == F64 else 1e-4
    torch.testing.assert_close(got[-1], want[-1], rtol=tol, atol=tol)


def test_backward_matches_reference():
    lens_q, lens_k = [9, 1, 70, 0], [9, 2, 67, 3]
    q, k, v, w = packed_inputs(lens_q, lens_k, 2, 5, 3, 3, seed=11, requires_grad=True)
    leaves = [*q, *k, v, w]
    dout = torch.randn(sum(lens_q), 2, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    got = grads_of(lambda: varlen(q, k, v, w, lens_q, lens_k, False), leaves, dout)
    want = grads_of(lambda: run_alone(q, k, v, w, lens_q, lens_k, False, attention=hkt_attention_reference),
                    leaves, dout)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck(is_causal):
    lens = [3, 1, 6]
    q, k, v, w = packed_inputs(lens, lens, 2, 3, 2, 2, seed=5, requires_grad=True)
    cu = cu_of(lens, torch.int64)
    L = len(q)

    def f(*xs):
        return hkt.hkt_attention_varlen(list(xs[:L]), list(xs[L:2 * L]), xs[2 * L], xs[2 * L + 1], cu, cu,
                                        is_causal=is_causal)

    assert torch.autograd.gradcheck(f, (*q, *k, v, w))


def test_grouped_query_heads():
    lens = [4, 1, 67, 0, 10]
    q, k, v, w = packed_inputs(lens, lens, 4, 6, 5, 3, H_kv=2, seed=9, requires_grad=True)
    leaves = [*q, *k, v, w]
    dout = torch.randn(sum(lens), 4, 5, generator=torch.Generator().manual_seed(4), dtype=F64)
    got = grads_of(lambda: varlen(q, k, v, w, lens, lens, True), leaves, dout)
    want = grads_of(lambda: run_alone(q, k, v, w, lens, lens, True, attention=hkt_attention_reference), leaves, dout)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-11, atol=1e-11)


def test_bfloat16_computes_in_float32_off_the_native_path(monkeypatch):
    """Where bfloat16 does not run natively (no AVX512_BF16, or HKT_BF16=upcast), it
    is computed in float32 and rounded (tests/kernels/test_bf16_native.py: the native path)."""
    monkeypatch.setattr(hkt._core.kernels, "native_bf16", False)
    q, k, v, w = packed_inputs(LENS, LENS, 2, 8, 4, 3, dtype=torch.bfloat16, seed=1)
    got = varlen(q, k, v, w, LENS, LENS, True)
    assert got.dtype == torch.bfloat16
    want = varlen([x.float() for x in q], [x.float() for x in k], v.float(), w.float(), LENS, LENS, True)
    assert torch.equal(got, want.bfloat16())


@pytest.mark.parametrize("which", ["k", "v", "w"])
def test_mixed_dtypes_named_with_float32_queries(which):
    """bfloat16 next to float32 queries: refused by name, as hkt_attention refuses it
    (the extension sees bfloat16 upcast, so it cannot tell)."""
    q, k, v, w = packed_inputs(LENS, LENS, 2, 8, 4, 3, dtype=F32, seed=3)
    name = {"k": "k[0]", "v": "v", "w": "w"}[which]
    if which == "k":
        k = [x.bfloat16() for x in k]
    elif which == "v":
        v = v.bfloat16()
    else:
        w = w.bfloat16()
    with pytest.raises(TypeError, match="^" + name.replace("[", r"\[").replace("]", r"\]") + ": dtype torch.bfloat16"):
        varlen(q, k, v, w, LENS, LENS, False)


def test_int64_offsets_and_max_seqlen():
    q, k, v, w = packed_inputs(LENS, LENS, 2, 4, 4, 2, seed=2)
    cu = cu_of(LENS, torch.int64)
    a = hkt.hkt_attention_varlen(q, k, v, w, cu, cu, max(LENS), max(LENS) + 5)
    assert torch.equal(a, varlen(q, k, v, w, LENS, LENS, False))


def test_non_contiguous_inputs():
    q, k, v, w = packed_inputs(LENS, LENS, 2, 4, 4, 2, seed=6)
    # (total, H, D) views of (H, total, D) storage: row stride D, head stride total * D
    qt = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in q]
    assert not qt[0].is_contiguous()
    assert torch.equal(varlen(qt, k, v, w, LENS, LENS, True), varlen(q, k, v, w, LENS, LENS, True))


# ---- determinism ----

@pytest.mark.parametrize("H", [1, 3])
def test_bitwise_same_for_any_thread_count(H):
    # H = 1 with short sequences runs them side by side, one thread each; long
    # ones run on every thread
    lens = [1, 40, 300, 64, 0, 5, 129, 17, 2, 90]
    q, k, v, w = packed_inputs(lens, lens, H, 8, 8, 3, dtype=F32, seed=4, requires_grad=True)
    leaves = [*q, *k, v, w]
    dout = torch.randn(sum(lens), H, 8, generator=torch.Generator().manual_seed(3))

    def run():
        out = varlen(q, k, v, w, lens, lens, True)
        return [out.detach().clone()] + grads_of(lambda: varlen(q, k, v, w, lens, lens, True), leaves, dout)

    first = with_threads(1, run)
    for n in (2, 3, 4):
        for a, b in zip(first, with_threads(n, run)):
            assert torch.equal(a, b), n


# ---- bad input ----

def bad_varlen_cases():
    lens = [3, 5, 2]
    q, k, v, w = packed_inputs(lens, lens, 4, 4, 3, 3)
    cu = cu_of(lens)
    yield "not-increasing", ValueError, "cu_seqlens_q: offsets not increasing", dict(
        cu_seqlens_q=torch.tensor([0, 5, 3, 10], dtype=torch.int32))
    yield "not-increasing-k", ValueError, "cu_seqlens_k: offsets not increasing", dict(
        cu_seqlens_k=torch.tensor([0, 3, 8, 7], dtype=torch.int64))
    yield "start", ValueError, "cu_seqlens_q: must start at 0", dict(cu_seqlens_q=cu + 1)
    yield "total", ValueError, "cu_seqlens_q: the last offset", dict(
        cu_seqlens_q=torch.tensor([0, 3, 8, 9], dtype=torch.int32))
    yield "total-k", ValueError, "cu_seqlens_k: the last offset", dict(
        cu_seqlens_k=torch.tensor([0, 3, 8, 11], dtype=torch.int32))
    yield "nseq-k", ValueError, "cu_seqlens_k: expected shape (4,)", dict(
        cu_seqlens_k=torch.tensor([0, 8, 10], dtype=torch.int32))
    yield "float-offsets", TypeError, "cu_seqlens_q: dtype must be int32 or int64", dict(cu_seqlens_q=cu.float())
    yield "int16-offsets", TypeError, "cu_seqlens_k: dtype must be int32 or int64", dict(
        cu_seqlens_k=cu.to(torch.int16))
    yield "2d-offsets", ValueError, "cu_seqlens_q: expected a 1-D", dict(cu_seqlens_q=cu[None])
    yield "empty-offsets", ValueError, "cu_seqlens_q: expected a 1-D", dict(cu_seqlens_q=cu[:0])
    yield "list-offsets", TypeError, "cu_seqlens_q", dict(cu_seqlens_q=[0, 3, 8, 10])
    yield "max-seqlen", ValueError, "max_seqlen_q: 4 is less than the longest sequence", dict(max_seqlen_q=4)
    yield "max-seqlen-type", TypeError, "max_seqlen_k", dict(max_seqlen_k=5.0)
    yield "level-rows", ValueError, "q[1]: expected shape (6, 4, 4)", dict(q=[q[0], q[0][:5], q[2]])
    yield "level-rows-k", ValueError, "k[2]", dict(k=[k[0], k[1], k[2][:-1]])
    yield "rank", ValueError, "q[0]: expected 3 dimensions", dict(q=[q[0][None], q[1], q[2]])
    yield "int", TypeError, "q[0]: dtype must be float32", dict(q=[x.long() for x in q])
    yield "mixed-dtype", TypeError, "k[1]", dict(k=[k[0], k[1].float(), k[2]])
    yield "kv-heads", ValueError, "k[0]: its 3 heads (H_kv) must divide", dict(
        k=[x[:, :3] for x in k], v=v[:, :3])
    yield "v-rows", ValueError, "v", dict(v=v[:-1])
    yield "v-heads", ValueError, "v", dict(v=v[:, :2])
    yield "w", ValueError, "w", dict(w=w[:, :2])
    yield "levels", ValueError, "k: expected 3 levels", dict(k=k[:2])
    yield "more-levels", ValueError, "k: expected 3 levels", dict(k=[*k, k[2][:2]])
    yield "scale", ValueError, "scale", dict(scale=float("nan"))
    yield "causal-type", TypeError, "is_causal", dict(is_causal="yes")
    yield "q-type", TypeError, "q", dict(q=q[0])


BAD = list(bad_varlen_cases())


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_the_argument(case, grad):
    """Each case without and with its tensors requiring grad (the autograd
    Function flattens them: k with fewer levels than q must still be named k)."""
    _, exc, start, override = case
    lens = [3, 5, 2]
    q, k, v, w = packed_inputs(lens, lens, 4, 4, 3, 3)
    args = dict(q=q, k=k, v=v, w=w, cu_seqlens_q=cu_of(lens), cu_seqlens_k=cu_of(lens))
    args.update(override)
    if grad:
        args = {key: requiring_grad(val) for key, val in args.items()}
    with pytest.raises(exc) as info:
        hkt.hkt_attention_varlen(**args)
    assert str(info.value).startswith(start), str(info.value)


def test_bad_cases_are_bad_only_in_what_they_change():
    lens = [3, 5, 2]
    q, k, v, w = packed_inputs(lens, lens, 4, 4, 3, 3)
    hkt.hkt_attention_varlen(q, k, v, w, cu_of(lens), cu_of(lens), 5, 5)  # the base call is valid


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("H_kv", [2, 1])
def test_double_backward(is_causal, H_kv):
    """Second derivatives (create_graph=True): gradgradcheck in float64, with a
    sequence without keys, one without queries, T_s != S_s and grouped heads."""
    q, k, v, w = packed_inputs([3, 0, 4, 2], [5, 2, 0, 3], 2, 3, 2, 2, H_kv=H_kv, requires_grad=True)
    cu_q, cu_k = cu_of([3, 0, 4, 2]), cu_of([5, 2, 0, 3])

    def f(*xs):
        return hkt.hkt_attention_varlen(list(xs[:2]), list(xs[2:4]), xs[4], xs[5], cu_q, cu_k, is_causal=is_causal)
    assert torch.autograd.gradgradcheck(f, (*q, *k, v, w))


# ---- MultiheadHKT(pack_padding=True) ----

def randomized(module, seed=0):
    return randomize(module, seed, scale=0.3)


MOD_LENS = [5, 12, 1, 9, 12]


def padded_batch(E, lens, dtype=F64, batch_first=True, float_mask=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lens)
    x = torch.randn(len(lens), T, E, generator=g, dtype=dtype)
    kpm = torch.arange(T)[None] >= torch.tensor(lens)[:, None]  # True = padding
    if float_mask:
        kpm = torch.zeros(kpm.shape, dtype=dtype).masked_fill(kpm, float("-inf"))
    return (x if batch_first else x.transpose(0, 1)), kpm


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("float_mask", [False, True])
def test_module_equals_padded_call_on_real_tokens(is_causal, batch_first, float_mask):
    E, H = 16, 4
    packed = randomized(hkt.MultiheadHKT(E, H, batch_first=batch_first, levels=3, pack_padding=True).double())
    plain = randomized(hkt.MultiheadHKT(E, H, batch_first=batch_first, levels=3).double())
    x, kpm = padded_batch(E, MOD_LENS, batch_first=batch_first, float_mask=float_mask)
    xp = x.clone().requires_grad_()
    xq = x.clone().requires_grad_()
    got, gw = packed(xp, xp, xp, key_padding_mask=kpm, is_causal=is_causal)
    want, ww = plain(xq, xq, xq, key_padding_mask=kpm, is_causal=is_causal)
    if not batch_first:
        got, want = got.transpose(0, 1), want.transpose(0, 1)
    real = torch.arange(max(MOD_LENS))[None] < torch.tensor(MOD_LENS)[:, None]
    torch.testing.assert_close(got[real], want[real], rtol=1e-12, atol=1e-12)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))  # padded queries: zeros
    torch.testing.assert_close(gw[real], ww[real], rtol=1e-12, atol=1e-12)
    assert torch.equal(gw[~real], torch.zeros_like(gw[~real]))
    # gradients, with a loss on the real tokens only
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=F64) * real[..., None]
    (got * dout).sum().backward()
    (want * dout).sum().backward()
    for (n, a), b in zip(packed.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10, msg=n)
    torch.testing.assert_close(xp.grad, xq.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("is_causal", [False, True])
def test_module_float_mask_that_requires_grad_gets_it(is_causal):
    """A float key_padding_mask that requires grad gets its gradient with
    pack_padding (the packed call never reads the mask, so the padded one runs):
    the gradient of the documented result, MHA-style attention with the padded
    query rows' outputs set to 0."""
    E, H = 16, 4
    packed = randomized(hkt.MultiheadHKT(E, H, batch_first=True, levels=3, pack_padding=True).double())
    plain = randomized(hkt.MultiheadHKT(E, H, batch_first=True, levels=3).double())
    x, kpm = padded_batch(E, MOD_LENS, float_mask=True)
    real = torch.isfinite(kpm)
    m1, m2 = kpm.clone().requires_grad_(), kpm.clone().requires_grad_()
    got, _ = packed(x, x, x, key_padding_mask=m1, is_causal=is_causal, need_weights=False)
    want, _ = plain(x, x, x, key_padding_mask=m2, is_causal=is_causal, need_weights=False)
    want = want.masked_fill(~real[..., None], 0.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    g1, = torch.autograd.grad(got, m1, dout)
    g2, = torch.autograd.grad(want, m2, dout)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    # (a length-1 sequence's one key gets 0 up to rounding: its softmax is 1 whatever
    # the mask, and delta = dout . out is dout . v summed in another order)
    assert int((g1[real].abs() > 1e-12).sum()) == int(real.sum()) - 1
    assert torch.equal(g1[~real], torch.zeros_like(g1[~real]))


def test_module_second_order_gradients_as_padded():
    """A gradient penalty through the packed call (its backward differentiated
    again) equals the padded call's, for a trainable and a frozen module; the
    first-order gradient w.r.t. the input must itself require grad."""
    E = 16
    x0, kpm = padded_batch(E, MOD_LENS)
    real = ~kpm
    c = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2), dtype=F64) * real[..., None]
    for frozen in (False, True):
        grads = []
        for pack in (False, True):
            m = randomized(hkt.MultiheadHKT(E, 4, batch_first=True, levels=3, pack_padding=pack).double())
            m.requires_grad_(not frozen)
            enc = torch.nn.Linear(E, E, dtype=F64)
            torch.nn.init.eye_(enc.weight)
            torch.nn.init.zeros_(enc.bias)
            x = enc(x0.clone().requires_grad_())
            out, _ = m(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)
            g, = torch.autograd.grad((out * c).sum(), x, create_graph=True)
            assert g.requires_grad
            g.square().sum().backward()
            grads.append([p.grad for p in (*enc.parameters(), *m.parameters()) if p.requires_grad])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_module_takes_the_packed_path(monkeypatch):
    """The packed call really runs (not the padded one with zeroed rows)."""
    import hkt.nn._mha_inputs as modules  # MultiheadHKT's packed call
    calls = []
    real_varlen = modules.hkt_attention_varlen
    monkeypatch.setattr(modules, "hkt_attention_varlen", lambda *a, **kw: calls.append(1) or real_varlen(*a, **kw))
    m = randomized(hkt.MultiheadHKT(8, 2, batch_first=True, pack_padding=True).double())
    x, kpm = padded_batch(8, MOD_LENS)
    m(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert calls == [1]
    m.pack_padding = False
    m(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert calls == [1]


def test_module_each_sequence_alone():
    E, H = 12, 3
    m = randomized(hkt.MultiheadHKT(E, H, batch_first=True, levels=4, pack_padding=True).double(), seed=2)
    x, kpm = padded_batch(E, MOD_LENS, seed=3)
    out, _ = m(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)
    for b, n in enumerate(MOD_LENS):
        xs = x[b:b + 1, :n]
        alone, _ = m(xs, xs, xs, is_causal=True, need_weights=False)
        torch.testing.assert_close(out[b, :n], alone[0], rtol=1e-12, atol=1e-12)


def test_module_padding_not_at_the_end():
    m = hkt.MultiheadHKT(8, 2, batch_first=True, pack_padding=True).double()
    x, kpm = padded_batch(8, MOD_LENS)
    kpm[0] = kpm[0].flip(0)  # padding first
    with pytest.raises(ValueError, match="^key_padding_mask: with pack_padding the padding must be at the end"):
        m(x, x, x, key_padding_mask=kpm)
    fm = torch.zeros(kpm.shape, dtype=F64)
    fm[0, 1] = -1.0  # a float mask that is more than padding
    with pytest.raises(ValueError, match="^key_padding_mask: with pack_padding a float mask"):
        m(x, x, x, key_padding_mask=fm)


def test_module_fallbacks_keep_the_zeros():
    """Where the packed call cannot run (an attn_mask, cross-attention), the
    padded call runs: with an attn_mask the padded queries still give zeros;
    cross-attention ignores pack_padding."""
    E = 8
    m = randomized(hkt.MultiheadHKT(E, 2, batch_first=True, pack_padding=True).double())
    x, kpm = padded_batch(E, MOD_LENS)
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    a, _ = m(x, x, x, key_padding_mask=kpm, attn_mask=causal)
    b, _ = m(x, x, x, key_padding_mask=kpm, is_causal=True)
    real = ~kpm
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(a[~real], torch.zeros_like(a[~real]))
    y = x.clone()
    m.pack_padding = False
    want, _ = m(x, y, y, key_padding_mask=kpm)
    m.pack_padding = True
    got, _ = m(x, y, y, key_padding_mask=kpm)
    assert torch.equal(got, want)


def test_module_self_attention_survives_checkpoint_and_hooks():
    """A reentrant checkpoint recomputes the forward on each argument detached
    on its own, and a full backward hook passes each through an identity
    Function: three objects for one tensor.  pack_padding still treats the call
    as self-attention (before, the recomputed forward let padded queries attend,
    so their loss leaked into every gradient, 0.6 off in dx; the hooked one
    returned nonzero padded rows)."""
    E = 8
    m = randomized(hkt.MultiheadHKT(E, 2, batch_first=True, levels=3, pack_padding=True).double())
    x, kpm = padded_batch(E, MOD_LENS)
    x.requires_grad_()
    params = list(m.parameters())

    def grads(call):  # .backward(): a reentrant checkpoint refuses autograd.grad
        for t in [x, *params]:
            t.grad = None
        out = call()
        (out * out).sum().backward()
        return out, [t.grad for t in [x, *params]]

    want, want_grads = grads(lambda: m(x, x, x, key_padding_mask=kpm)[0])
    got, got_grads = grads(lambda: torch.utils.checkpoint.checkpoint(m, x, x, x, kpm, False, use_reentrant=True)[0])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # three projections, not one fused
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    m.register_full_backward_hook(lambda mod, gin, gout: None)
    hooked, hooked_grads = grads(lambda: m(x, x, x, key_padding_mask=kpm)[0])
    assert torch.equal(hooked[kpm], torch.zeros_like(hooked[kpm]))
    torch.testing.assert_close(hooked, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(hooked_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_module_scripted_gives_the_same():
    m = randomized(hkt.MultiheadHKT(8, 2, batch_first=True, pack_padding=True).double())
    scripted = torch.jit.script(m)
    x, kpm = padded_batch(8, MOD_LENS)
    for causal in (False, True):
        want, ww = m(x, x, x, key_padding_mask=kpm, is_causal=causal)
        got, gw = scripted(x, x, x, key_padding_mask=kpm, is_causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, ww, rtol=1e-12, atol=1e-12)
    bad = kpm.clone()
    bad[0] = bad[0].flip(0)
    with pytest.raises(torch.jit.Error, match="key_padding_mask: with pack_padding"):
        scripted(x, x, x, key_padding_mask=bad)


def test_module_exports_with_the_same_zeros():
    """torch.export traces the padded call (no data-dependent packing) and keeps
    pack_padding's zeros."""
    m = randomized(hkt.MultiheadHKT(8, 2, batch_first=True, pack_padding=True).double()).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x, kpm):
            return self.m(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    x, kpm = padded_batch(8, MOD_LENS)
    exported = torch.export.export(Wrap(), (x, kpm))
    torch.testing.assert_close(exported.module()(x, kpm), Wrap()(x, kpm), rtol=1e-12, atol=1e-12)


def test_empty_batches():
    q, k, v, w = packed_inputs([], [], 2, 4, 3, 3, requires_grad=True)
    cu = torch.zeros(1, dtype=torch.int64)
    out = hkt.hkt_attention_varlen(q, k, v, w, cu, cu)
    assert out.shape == (0, 2, 3)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    # sequences of length 0 only, keys without queries: zero gradients
    q, k, v, w = packed_inputs([0, 0], [3, 0], 2, 4, 3, 3, requires_grad=True)
    out = hkt.hkt_attention_varlen(q, k, v, w, cu_of([0, 0]), cu_of([3, 0]))
    out.sum().backward()  # the kernels must write the zeros (the gradients start uninitialised)
    for x in (*k, v, w):
        assert torch.equal(x.grad, torch.zeros_like(x))


def test_module_grouped_query_heads():
    m = randomized(hkt.MultiheadHKT(16, 4, batch_first=True, num_kv_heads=2, pack_padding=True).double(), seed=5)
    x, kpm = padded_batch(16, MOD_LENS, seed=6)
    out, _ = m(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)
    m.pack_padding = False
    want, _ = m(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)
    real = ~kpm
    torch.testing.assert_close(out[real], want[real], rtol=1e-12, atol=1e-12)
