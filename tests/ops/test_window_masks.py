"""Masks and dropout with windows (docs/contract.md section 1.11): the
windowed kernels against the dense reference in float64, the key-only masks'
block-sharing path against the per-key one, dropout against the kernels'
own draws, and what a hidden key or a row with nothing visible gives."""
import pytest
import torch

import hkt
import hkt.ops.window as window_mod  # the windowed kernels are called there
from hkt._core.kernels import dropout_keep_mask
from hkt.ops.window import window_forward
from hkt.reference import hkt_attention_reference as reference

from helpers import with_threads
from window_cases import TOL, assert_matches, assert_op_matches, leaves, module_matches_reference, names, results


def gen(seed):
    return torch.Generator().manual_seed(seed)


def make_mask(kind, B, H, T, S, seed=0):
    """A mask of one of the shapes and dtypes users pass."""
    g = gen(seed)
    if kind == "bool":           # one (T, S) pattern for every batch and head
        return torch.rand(T, S, generator=g) > 0.3
    if kind == "bool-bh":        # one per batch and head
        return torch.rand(B, H, T, S, generator=g) > 0.4
    if kind == "float":          # added to the scores, per batch
        return torch.randn(B, 1, T, S, generator=g, dtype=torch.float64)
    if kind == "key":            # key padding: the same for every query
        return torch.rand(B, 1, 1, S, generator=g) > 0.3
    if kind == "key-h":          # key padding per query head (over grouped kv heads below)
        return torch.rand(B, H, 1, S, generator=g) > 0.3
    if kind == "key-float":      # a float mask the same for every query
        return torch.randn(B, 1, 1, S, generator=g, dtype=torch.float64)
    raise ValueError(kind)


MASKS = ["bool", "bool-bh", "float", "key", "key-h", "key-float"]
CASES = [
    # T, S, L, windows, H, Hk
    (37, 37, 3, [4, 8, None], 2, 2),        # a global top level, T odd
    (45, 45, 4, [6, 12, 24, None], 4, 2),   # windows that do not divide T, GQA
    (50, 29, 3, [2, 8, 16], 2, 1),          # T > S, multi-query, every level windowed
    (29, 50, 4, [6, 16, 24, None], 2, 2),   # T < S
    (150, 150, 6, [2, 4, 8, 16, 32, None], 2, 1),  # levels whose queries share units in groups of up to 16
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("T,S,L,windows,H,Hk", CASES)
def test_masks_match_the_reference(T, S, L, windows, H, Hk, kind, causal):
    q, k, v, w = leaves(2, H, T, S, 5, 3, L, Hk=Hk, seed=T + S)
    mask = make_mask(kind, 2, H, T, S, seed=T)
    got = assert_matches(q, k, v, w, windows, causal, attn_mask=mask)
    plain = results(hkt.hkt_attention, q, k, v, w, torch.ones_like(got[0]), is_causal=causal, windows=windows)
    assert not torch.allclose(got[0], plain[0])  # the mask did change the result


@pytest.mark.parametrize("shape", [(2, 2, 41, 37), (1, 1, 41, 37), (2, 1, 1, 37), (41, 37), (37,)])
@pytest.mark.parametrize("causal", [False, True])
def test_a_float_masks_gradient_is_the_references(shape, causal):
    q, k, v, w = leaves(2, 2, 41, 37, 4, 3, 3, seed=3)
    mask = torch.randn(*shape, dtype=torch.float64, generator=gen(4)).requires_grad_()
    dout = torch.randn(2, 2, 41, 3, dtype=torch.float64, generator=gen(5))
    kw = dict(is_causal=causal, windows=[4, 8, None], attn_mask=mask)
    got = torch.autograd.grad(hkt.hkt_attention(q, k, v, w, **kw), [mask, v], dout)
    want = torch.autograd.grad(reference(q, k, v, w, **kw), [mask, v], dout)
    assert got[0].shape == mask.shape
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)


def test_gradcheck_with_a_float_mask_and_a_key_mask():
    q, k, v, w = leaves(1, 2, 9, 11, 3, 2, 3, Hk=1, seed=6)
    fmask = torch.randn(9, 11, dtype=torch.float64, generator=gen(1)).requires_grad_()
    kmask = torch.tensor([True, False, True, True, False, False, True, True, True, False, True])
    for causal in (False, True):
        def fn(*xs):
            return hkt.hkt_attention(list(xs[:3]), list(xs[3:6]), xs[6], xs[7], is_causal=causal,
                                     windows=[2, 4, None], attn_mask=xs[8])
        assert torch.autograd.gradcheck(fn, (*q, *k, v, w, fmask), eps=1e-6, atol=1e-7)

        def fk(*xs):
            return hkt.hkt_attention(list(xs[:3]), list(xs[3:6]), xs[6], xs[7], is_causal=causal,
                                     windows=[2, 4, None], attn_mask=kmask)
        assert torch.autograd.gradcheck(fk, (*q, *k, v, w), eps=1e-6, atol=1e-7)


def _routes(monkeypatch):
    """Records, per kernel call, whether the key-only path (counts) or the
    per-key one (a mask handed to the kernels) ran."""
    seen = []
    real = window_mod.window_kernels

    def spy(*args, **kw):
        seen.append("counts" if kw.get("counts") is not None else "mask" if kw.get("attn_mask") is not None
                    else "none")
        return real(*args, **kw)
    monkeypatch.setattr(window_mod, "window_kernels", spy)
    return seen


def test_a_key_only_bool_mask_keeps_the_block_sharing(monkeypatch):
    """The same key padding given once per query (a general mask) and once for
    every query (a key mask): the second takes the counts path, the first the
    per-key one, and both give the reference's values."""
    q, k, v, w = leaves(2, 4, 45, 45, 4, 3, 4, Hk=2, seed=8)
    key = make_mask("key", 2, 4, 45, 45, seed=2)
    seen = _routes(monkeypatch)
    fast = assert_matches(q, k, v, w, [4, 8, 16, None], True, attn_mask=key)
    slow = assert_matches(q, k, v, w, [4, 8, 16, None], True, attn_mask=key.expand(2, 1, 45, 45))
    assert seen == ["counts", "counts", "mask", "mask"]  # forward and backward of each
    for name, a, b in zip(names(4), fast, slow):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def test_a_key_mask_per_query_head_over_grouped_kv_heads(monkeypatch):
    q, k, v, w = leaves(2, 4, 33, 33, 4, 3, 3, Hk=1, seed=9)
    seen = _routes(monkeypatch)
    assert_matches(q, k, v, w, [4, 8, None], False, attn_mask=make_mask("key-h", 2, 4, 33, 33, seed=3))
    assert seen == ["counts", "counts"]
    assert k[0].grad is None  # assert_matches takes gradients with autograd.grad, leaving .grad alone


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", [None, "bool", "key", "float"])
def test_dropout_is_the_kernels_draw(kind, causal):
    """Dropout drops the entries the unwindowed kernels drop for the same seed
    (hkt._C.dropout_mask), on what the windows and the mask leave visible."""
    B, H, T, S, p = 2, 4, 41, 37, 0.3
    q, k, v, w = leaves(B, H, T, S, 5, 4, 3, Hk=2, seed=11)
    mask = make_mask(kind, B, H, T, S, seed=5) if kind else None
    mask4 = mask.reshape((1,) * (4 - mask.dim()) + mask.shape) if kind else None  # the op takes it 4-D
    got = window_forward(q, k, v, w, mask4, [4, 4, 0], causal, 0.4, p, torch.tensor(1234))[0]
    keep = dropout_keep_mask(1234, p, B, H, T, S)
    want = reference(q, k, v, w, attn_mask=mask, is_causal=causal, scale=0.4, dropout_p=p, dropout_mask=keep,
                     windows=[4, 8, None])
    assert_op_matches(got, want, q, k, v, w)


def test_dropout_one_gives_zeros_and_the_same_seed_the_same_result():
    q, k, v, w = leaves(1, 2, 30, 30, 4, 3, 2, seed=12)
    out = hkt.hkt_attention(q, k, v, w, windows=[4, None], dropout_p=1.0, is_causal=True)
    assert torch.equal(out, torch.zeros_like(out))

    def run(seed):
        torch.manual_seed(seed)
        out = hkt.hkt_attention(q, k, v, w, windows=[4, None], dropout_p=0.5, is_causal=True)
        return [out, *torch.autograd.grad(out.sum(), [q[0], v])]
    a, b, c = run(7), run(7), run(8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


def test_dropout_keeps_the_expectation():
    """Averaged over many seeds, dropout's output is the output without it."""
    q, k, v, w = leaves(1, 1, 24, 24, 4, 3, 2, seed=13)
    plain = hkt.hkt_attention(q, k, v, w, windows=[4, None]).detach()
    mean = torch.zeros_like(plain)
    n = 400
    for s in range(n):
        mean += window_forward(q, k, v, w, None, [4, 0], False, 0.5, 0.25, torch.tensor(s))[0].detach() / n
    assert (mean - plain).abs().max() < 0.12 * plain.abs().max()
    assert (mean - plain).abs().mean() < 0.02 * plain.abs().max() + 0.01


def test_rows_and_batches_that_see_nothing_are_zero():
    q, k, v, w = leaves(2, 2, 30, 30, 4, 3, 3, seed=14)
    key = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    key[1] = False                       # batch 1 sees no key at all
    rows = torch.ones(30, 30, dtype=torch.bool)
    rows[5] = False                      # query 5 sees no key
    for mask in (key, rows, torch.where(rows, 0.0, float("-inf")).double()):
        out = assert_matches(q, k, v, w, [4, 8, None], True, attn_mask=mask)
        if mask is key:
            assert torch.equal(out[0][1], torch.zeros_like(out[0][1]))
        else:
            assert torch.equal(out[0][:, :, 5], torch.zeros_like(out[0][:, :, 5]))


def test_a_hidden_keys_nan_stays_out():
    """NaN in the key and value of a key the mask hides: the results of the
    same call with that key's numbers finite (the reference multiplies the
    hidden key's value by 0, so it would pass the NaN on)."""
    q, k, v, w = leaves(1, 2, 30, 30, 4, 3, 3, seed=15)
    key = torch.ones(30, dtype=torch.bool)
    key[7] = False
    dout = torch.randn(1, 2, 30, 3, dtype=torch.float64, generator=gen(12))
    kw = dict(windows=[4, 8, None], is_causal=False)
    nan_k, nan_v = [x.detach().clone() for x in k], v.detach().clone()
    nan_k[0][0, :, 7] = float("nan")
    nan_v[0, :, 7] = float("nan")
    for mask in (key, key.expand(30, 30)):  # the key path and the per-key path
        got = results(hkt.hkt_attention, q, [x.requires_grad_() for x in nan_k], nan_v.requires_grad_(), w, dout,
                      attn_mask=mask, **kw)
        want = results(reference, q, k, v, w, dout, attn_mask=mask, **kw)
        assert all(x.isfinite().all() for x in got)
        for name, a, b in zip(names(3), got, want):
            if name in ("dk[0]", "dv"):  # the hidden key's own gradient is 0 either way
                a, b = a[:, :, torch.arange(30) != 7], b[:, :, torch.arange(30) != 7]
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def test_nan_in_a_visible_score_poisons_only_its_row():
    q, k, v, w = leaves(1, 1, 30, 30, 4, 3, 3, seed=16)
    with torch.no_grad():
        q[0][0, 0, 9] = float("nan")
    mask = torch.rand(30, 30, generator=gen(6)) > 0.2
    out = hkt.hkt_attention(q, k, v, w, windows=[4, 8, None], attn_mask=mask)
    want = reference(q, k, v, w, windows=[4, 8, None], attn_mask=mask)
    assert out[0, 0, 9].isnan().all() and want[0, 0, 9].isnan().all()
    assert not out[0, 0, :9].isnan().any() and not out[0, 0, 10:].isnan().any()


def test_a_padding_row_of_the_smallest_float_is_the_uniform_average():
    """A float32 mask of finfo.min over a whole row: every visible key the same
    weight, and gradients that are the reference's (the row's lse has lost
    log(sum) to rounding, so the backward takes its max and sum again)."""
    q, k, v, w = leaves(1, 2, 40, 40, 8, 4, 3, seed=17, dtype=torch.float32)
    mask = torch.zeros(40, 40)
    mask[3] = torch.finfo(torch.float32).min
    mask[20:, 30:] = torch.finfo(torch.float32).min
    got = assert_matches(q, k, v, w, [4, 8, None], False, attn_mask=mask, tol=dict(rtol=2e-4, atol=2e-5))
    _, P = reference(q, k, v, w, windows=[4, 8, None], attn_mask=mask, return_probs=True)
    torch.testing.assert_close(P[0, :, 3], torch.full_like(P[0, :, 3], 1 / 40))
    assert got[0][0, :, 3].isfinite().all()


def test_bitwise_the_same_on_one_and_two_threads():
    q, k, v, w = leaves(2, 4, 90, 90, 8, 8, 4, Hk=2, seed=18)
    dout = torch.randn(2, 4, 90, 8, dtype=torch.float64)
    fmask = torch.randn(2, 1, 90, 90, dtype=torch.float64, generator=gen(7))
    for extra in (dict(attn_mask=fmask), dict(attn_mask=make_mask("key", 2, 4, 90, 90))):
        kw = dict(is_causal=True, windows=[8, 24, 64, None], **extra)
        one = with_threads(1, lambda: results(hkt.hkt_attention, q, k, v, w, dout, **kw))
        two = with_threads(2, lambda: results(hkt.hkt_attention, q, k, v, w, dout, **kw))
        for name, a, b in zip(names(4), one, two):
            assert torch.equal(a, b), name
    seed = torch.tensor(5)

    def dropped():
        out = window_forward(q, k, v, w, None, [8, 12, 16, 0], True, 0.3, 0.2, seed)[0]
        return [out, *torch.autograd.grad(out, [*q, *k, v, w], dout)]
    for a, b in zip(with_threads(1, dropped), with_threads(2, dropped)):
        assert torch.equal(a, b)


def test_float32_and_bfloat16_with_a_mask():
    q, k, v, w = leaves(1, 2, 64, 64, 8, 8, 3, seed=19, dtype=torch.float32)
    mask = torch.rand(64, 64, generator=gen(8)) > 0.3
    assert_matches(q, k, v, w, [4, 16, None], True, attn_mask=mask, tol=dict(rtol=2e-4, atol=2e-5))
    bf = [x.detach().bfloat16() for x in (*q, *k, v, w)]
    fm = torch.randn(64, 64, generator=gen(9)).bfloat16()
    got = hkt.hkt_attention(bf[:3], bf[3:6], bf[6], bf[7], is_causal=True, windows=[4, 16, None], attn_mask=fm)
    want = hkt.hkt_attention([x.float() for x in bf[:3]], [x.float() for x in bf[3:6]], bf[6].float(),
                             bf[7].float(), is_causal=True, windows=[4, 16, None], attn_mask=fm.float())
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


class _Masked(torch.nn.Module):
    def __init__(self, dropout_p):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 24, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64))
        self.dropout_p = dropout_p

    def forward(self, x, mask):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        qs, ks = [q, q[:, :, ::2], q[:, :, ::4]], [k, k[:, :, ::2], k[:, :, ::4]]
        return hkt.hkt_attention(qs, ks, v, self.w, is_causal=True, windows=[4, 8, None], attn_mask=mask,
                                 dropout_p=self.dropout_p)


def test_compile_fullgraph_takes_masks_and_draws_dropout_anew():
    x = torch.randn(2, 29, 8, dtype=torch.float64)
    key = torch.rand(2, 1, 1, 29, generator=gen(10)) > 0.2
    model = _Masked(0.0)
    eager = model(x, key)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, key), eager)
    drop = _Masked(0.3)
    torch._dynamo.reset()
    compiled = torch.compile(drop, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    a = compiled(x, key)
    b = compiled(x, key)
    assert not torch.equal(a, b)  # each call draws its own dropout seed


# ----------------------------------------------------------------- module -----

def test_module_with_masks_and_dropout_matches_the_reference_path(monkeypatch):
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(16, 4, levels=3, batch_first=True, num_kv_heads=2, windows=[4, 8, None]).double()
    x = torch.randn(2, 45, 16, dtype=torch.float64)
    pad = torch.zeros(2, 45, dtype=torch.bool)
    pad[1, 40:] = True                   # True: a padding key, as nn.MultiheadAttention reads it
    amask = torch.rand(45, 45, generator=gen(11)) > 0.8  # True: not allowed to attend
    got = module_matches_reference(m, x, monkeypatch, key_padding_mask=pad, attn_mask=amask)
    assert (got[1][1, :, 40:] == 0).all()  # the padded keys have no weight
    got = module_matches_reference(m, x, monkeypatch, key_padding_mask=pad, is_causal=True)
    assert (got[1][1, :, 40:] == 0).all()


def test_module_dropout_with_windows_trains_and_evaluates_without_it():
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(16, 2, levels=2, batch_first=True, dropout=0.5, windows=[4, None]).double()
    x = torch.randn(1, 20, 16, dtype=torch.float64)
    m.train()
    torch.manual_seed(1)
    a = m(x, x, x, is_causal=True)[0]
    b = m(x, x, x, is_causal=True)[0]
    assert not torch.equal(a, b)
    a.sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
    m.eval()
    assert torch.equal(m(x, x, x, is_causal=True)[0], m(x, x, x, is_causal=True)[0])
