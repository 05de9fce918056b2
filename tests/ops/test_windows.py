"""hkt_attention(..., windows=...): the windowed kernels against the dense
definition in hkt.reference (docs/contract.md section 1.11), in float64."""
import pytest
import torch

import hkt
from hkt.reference import check_windows, hkt_attention_reference as reference

from helpers import with_threads
from window_cases import TOL, assert_matches, leaves, module_matches_reference, names, results

CASES = [
    # T, S, L, windows, H, Hk
    (37, 37, 3, [4, 8, None], 2, 2),        # a global top level, T odd
    (64, 64, 3, [8, 16, 32], 2, 1),         # windows that divide T, top level windowed, multi-query
    (45, 45, 4, [6, 12, 24, None], 4, 2),   # windows that do not divide T, GQA
    (50, 29, 3, [2, 8, 16], 2, 2),          # T > S: rows past the keys see fewer (some none)
    (29, 50, 4, [6, 16, 24, None], 2, 2),   # T < S
    (33, 33, 3, [2, 4, 8], 3, 3),           # the smallest growing windows: half blocks everywhere
    (40, 40, 1, [6], 2, 2),                 # one level: sliding-window attention
    (70, 70, 2, [10, None], 1, 1),          # level 1 global
    (130, 130, 5, [4, 8, 16, 32, None], 2, 1),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,S,L,windows,H,Hk", CASES)
def test_forward_and_every_gradient_match_the_reference(T, S, L, windows, H, Hk, causal):
    q, k, v, w = leaves(2, H, T, S, 5, 3, L, Hk=Hk, seed=T + S)
    assert_matches(q, k, v, w, windows, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_shared_level_w_and_scale(causal):
    q, k, v, w = leaves(1, 2, 41, 41, 4, 6, 3, seed=3, per_head=False)
    assert w.dim() == 1
    assert_matches(q, k, v, w, [4, 12, None], causal, scale=0.7)


def test_windows_wider_than_the_sequence_are_the_unwindowed_op():
    q, k, v, w = leaves(1, 2, 23, 23, 4, 4, 3, seed=1)
    dout = torch.randn(1, 2, 23, 4, dtype=torch.float64)
    got = results(hkt.hkt_attention, q, k, v, w, dout, is_causal=True, windows=[64, 128, 256])
    want = results(hkt.hkt_attention, q, k, v, w, dout, is_causal=True)
    for name, a, b in zip(names(3), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def test_the_reference_sees_only_the_window():
    """One level, window W: a key farther than W - 1 from its query has no weight."""
    q, k, v, w = leaves(1, 1, 20, 20, 3, 2, 1, seed=2)
    _, P = reference(q, k, v, w, windows=[4], return_probs=True)
    i, j = torch.meshgrid(torch.arange(20), torch.arange(20), indexing="ij")
    assert (P[0, 0][(i - j).abs() >= 4] == 0).all()
    assert (P[0, 0][(i - j).abs() < 4] > 0).all()
    torch.testing.assert_close(P.sum(-1), torch.ones(1, 1, 20, dtype=torch.float64))


def test_the_reference_takes_windows_the_kernels_do_not():
    """The definition holds for any windows; only the kernels need them growing."""
    q, k, v, w = leaves(1, 1, 16, 16, 3, 2, 2, seed=4)
    reference(q, k, v, w, windows=[4, 4])
    with pytest.raises(ValueError, match=r"windows\[1\]: the kernels need each window larger"):
        hkt.hkt_attention(q, k, v, w, windows=[4, 4])


def test_gradcheck_small():
    q, k, v, w = leaves(1, 2, 9, 11, 3, 2, 3, Hk=1, seed=6)
    for causal in (False, True):
        def fn(*xs):
            return hkt.hkt_attention(list(xs[:3]), list(xs[3:6]), xs[6], xs[7], is_causal=causal,
                                     windows=[2, 4, None])
        assert torch.autograd.gradcheck(fn, (*q, *k, v, w), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("windows", [None, [None, None, None], (None, None, None)])
def test_no_window_is_todays_op_bit_for_bit(windows):
    q, k, v, w = leaves(2, 2, 33, 33, 4, 4, 3, seed=7)
    dout = torch.randn(2, 2, 33, 4, dtype=torch.float64)
    mask = torch.rand(33, 33, generator=torch.Generator().manual_seed(1)) > 0.3
    for kw in (dict(is_causal=True), dict(attn_mask=mask)):
        got = results(hkt.hkt_attention, q, k, v, w, dout, windows=windows, **kw)
        want = results(hkt.hkt_attention, q, k, v, w, dout, **kw)
        for name, a, b in zip(names(3), got, want):
            assert torch.equal(a, b), name
        got = results(reference, q, k, v, w, dout, windows=windows, **kw)
        want = results(reference, q, k, v, w, dout, **kw)
        for name, a, b in zip(names(3), got, want):
            assert torch.equal(a, b), name


def test_rows_that_see_nothing_are_zero():
    q, k, v, w = leaves(1, 1, 40, 8, 3, 2, 2, seed=8)
    out = hkt.hkt_attention(q, k, v, w, windows=[2, 4])
    assert (out[0, 0, 12:] == 0).all() and (out[0, 0, :8] != 0).any()
    assert_matches(q, k, v, w, [2, 4], False)


@pytest.mark.parametrize("T,S,Dv", [(300, 6, 3), (40, 40, 0), (40, 0, 3), (0, 40, 3)])
def test_far_past_the_keys_and_empty_sizes(T, S, Dv):
    # Query blocks whose window starts past the last key, and empty value, key or
    # query axes: the kernels must neither read past the keys nor write to arrays
    # that hold no memory (make sanitize runs this under ASan and UBSan).
    q, k, v, w = leaves(1, 2, T, S, 4, Dv, 3, seed=12)
    assert_matches(q, k, v, w, [2, 4, 8], False)
    assert_matches(q, k, v, w, [2, 8, None], True)

def test_bitwise_the_same_on_one_and_two_threads():
    for dtype in (torch.float64, torch.float32):
        q, k, v, w = leaves(2, 4, 150, 150, 8, 8, 4, Hk=2, seed=9, dtype=dtype)
        dout = torch.randn(2, 4, 150, 8, dtype=dtype)
        kw = dict(is_causal=True, windows=[8, 24, 64, None])
        one = with_threads(1, lambda: results(hkt.hkt_attention, q, k, v, w, dout, **kw))
        two = with_threads(2, lambda: results(hkt.hkt_attention, q, k, v, w, dout, **kw))
        for name, a, b in zip(names(4), one, two):
            assert torch.equal(a, b), (dtype, name)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_close_to_float64(causal):
    q, k, v, w = leaves(1, 2, 300, 300, 16, 16, 4, seed=10)
    q32, k32 = [x.detach().float().requires_grad_() for x in q], [x.detach().float().requires_grad_() for x in k]
    v32, w32 = v.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    assert_matches(q32, k32, v32, w32, [16, 48, 128, None], causal, tol=dict(rtol=2e-4, atol=2e-5))


def test_bfloat16_is_computed_in_float32():
    q, k, v, w = leaves(1, 2, 64, 64, 8, 8, 3, seed=11, dtype=torch.float32)
    bf = [x.detach().bfloat16() for x in (*q, *k, v, w)]
    got = hkt.hkt_attention(bf[:3], bf[3:6], bf[6], bf[7], is_causal=True, windows=[4, 16, None])
    want = hkt.hkt_attention([x.float() for x in bf[:3]], [x.float() for x in bf[3:6]], bf[6].float(),
                             bf[7].float(), is_causal=True, windows=[4, 16, None])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())


def test_large_scores_keep_the_shared_backward_exact():
    """Rows whose lse spread far within a block take the per-query backward."""
    q, k, v, w = leaves(1, 1, 64, 64, 4, 4, 4, seed=12)
    with torch.no_grad():
        q[0][0, 0, ::3] *= 2000.0  # some rows with huge scores next to ordinary ones
    assert_matches(q, k, v, w, [2, 8, 16, None], True, tol=dict(rtol=1e-8, atol=1e-8))


# ------------------------------------------------------------------ errors -----

@pytest.mark.parametrize("windows,err,msg", [
    ([4, 3, None], ValueError, r"windows\[1\]: expected None or a positive multiple of 2 \(2\^1\) tokens, got 3"),
    ([4, 8, 6], ValueError, r"windows\[2\]: expected None or a positive multiple of 4"),
    ([0, 8, None], ValueError, r"windows\[0\]: expected None or a positive multiple of 1"),
    ([-2, 8, None], ValueError, r"windows\[0\]"),
    ([True, 8, None], ValueError, r"windows\[0\]"),
    ([4.0, 8, None], ValueError, r"windows\[0\]"),
    ([4, 8], ValueError, r"windows: expected one entry per level, 3, got 2"),
    (8, TypeError, r"windows: expected None or a list of 3 entries"),
    ([8, 8, None], ValueError, r"windows\[1\]: the kernels need each window larger than the one below it"),
    ([8, 4, None], ValueError, r"windows\[1\]: the kernels need each window larger"),
    ([None, 8, None], ValueError, r"windows\[1\]: the kernels need no window above a level without one"),
])
def test_bad_windows_are_named(windows, err, msg):
    q, k, v, w = leaves(1, 2, 16, 16, 4, 4, 3)
    with pytest.raises(err, match=msg):
        hkt.hkt_attention(q, k, v, w, windows=windows)


def test_what_windows_refuse_is_named_and_trace_records():
    q, k, v, w = leaves(1, 2, 16, 16, 4, 4, 3)
    win = [4, 8, None]
    with pytest.raises(ValueError, match=r"attn_mask: shape \(16, 15\) does not broadcast"):
        hkt.hkt_attention(q, k, v, w, windows=win, attn_mask=torch.ones(16, 15, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask: dtype must be bool or floating point"):
        hkt.hkt_attention(q, k, v, w, windows=win, attn_mask=torch.ones(16, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\]"):
        hkt.hkt_attention(q, k, v, w, windows=win, dropout_p=1.5)
    with pytest.raises(ValueError, match="backend: 'sdpa' does not take windows"):
        hkt.hkt_attention(q, k, v, w, windows=win, backend="sdpa")
    with pytest.raises(ValueError, match=r"q\[1\]"):  # the other arguments are checked as always
        hkt.hkt_attention([q[0], q[0], q[2]], k, v, w, windows=win)
    plain = [x.detach() for x in (*q, *k, v, w)]

    def call(*xs):
        return hkt.hkt_attention(list(xs[:3]), list(xs[3:6]), xs[6], xs[7], windows=win)
    traced = torch.jit.trace(call, tuple(plain))  # the windowed op is recorded, and replays on new values
    q2, k2, v2, w2 = leaves(1, 2, 16, 16, 4, 4, 3, seed=5)
    fresh = [x.detach() for x in (*q2, *k2, v2, w2)]
    assert torch.equal(traced(*fresh), call(*fresh))
    with pytest.raises(NotImplementedError, match="windows: the windowed kernels do not run under torch.func"):
        torch.func.vmap(call)(*[x[None] for x in plain])


def test_varlen_takes_no_windows_and_names_the_argument():
    q, k, v, w = leaves(1, 2, 16, 16, 4, 4, 2)
    cu = torch.tensor([0, 16])
    packed = [x[0].transpose(0, 1) for x in q], [x[0].transpose(0, 1) for x in k]
    with pytest.raises(TypeError, match="windows"):
        hkt.hkt_attention_varlen(*packed, v[0].transpose(0, 1), w, cu, cu, windows=[4, None])


def test_check_windows_normalises():
    assert check_windows(None, 3) is None
    assert check_windows([None, None], 2) is None
    assert check_windows([4, None], 2) == (4, None)
    assert check_windows((4, 8), 2, growing=True) == (4, 8)


# ------------------------------------------------------------------ module -----

def test_module_with_windows_matches_the_reference_path(monkeypatch):
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(16, 4, levels=3, batch_first=True, num_kv_heads=2, windows=[4, 8, None]).double()
    x = torch.randn(2, 45, 16, dtype=torch.float64)
    got = module_matches_reference(m, x, monkeypatch, is_causal=True)
    # keys only the global top level sees share one weight per level-2 block: the windows did apply
    far = got[1][:, 30, :16].unflatten(-1, (4, 4))
    torch.testing.assert_close(far, far[..., :1].expand_as(far), rtol=1e-12, atol=0)
    assert not torch.allclose(got[1][:, 30, 26:30], got[1][:, 30, 26:27].expand(2, 4))


def test_module_wide_windows_are_the_unwindowed_module():
    torch.manual_seed(1)
    plain = hkt.MultiheadHKT(16, 2, levels=2, batch_first=True).double()
    wide = hkt.MultiheadHKT(16, 2, levels=2, batch_first=True, windows=[64, 128]).double()
    wide.load_state_dict(plain.state_dict())
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    torch.testing.assert_close(wide(x, x, x, is_causal=True)[0], plain(x, x, x, is_causal=True)[0], **TOL)


def test_swap_attention_takes_windows():
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).double()
    new = hkt.swap_attention(torch.nn.Sequential(mha), levels=3, windows=[4, 8, None])[0]
    assert new.windows == (4, 8, None) and "windows=[4, 8, None]" in repr(new)
    x = torch.randn(1, 20, 16, dtype=torch.float64)
    new(x, x, x, is_causal=True)


def test_module_refuses_by_name():
    with pytest.raises(ValueError, match=r"windows\[1\]: expected None or a positive multiple of 2"):
        hkt.MultiheadHKT(16, 2, levels=2, windows=[4, 3])
    m = hkt.MultiheadHKT(16, 2, levels=2, batch_first=True, windows=[4, None])
    x = torch.randn(2, 10, 16)
    m.pack_padding = True
    with pytest.raises(ValueError, match="pack_padding: not supported with windows"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 10, dtype=torch.bool))


def test_autocast_bfloat16_takes_windows():
    q, k, v, w = leaves(1, 2, 40, 40, 8, 8, 2, seed=13, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hkt.hkt_attention(q, k, v, w, is_causal=True, windows=[4, None])
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


DECODE_CASES = [
    # levels, windows, kv heads, split of the sequence into decode calls
    (3, [4, 8, None], 2, [1] * 37),            # a global top level, one token at a time
    (3, [4, 8, 16], 1, [5, 1, 1, 7, 1, 3, 19]),  # every level windowed, multi-query, chunks
    (4, [2, 8, 16, None], 2, [37]),            # one prompt
    (1, [6], 2, [3] * 12 + [1]),               # sliding-window attention
    (2, [10, None], 1, [1] * 5 + [32]),        # a prompt after single tokens
]


@pytest.mark.parametrize("levels,windows,kv,split", DECODE_CASES)
def test_windowed_decoding_is_the_causal_forward(levels, windows, kv, split):
    torch.manual_seed(3)
    m = hkt.MultiheadHKT(16, 2, levels=levels, batch_first=True, num_kv_heads=kv, windows=windows).double().eval()
    T = sum(split)
    x = torch.randn(2, T, 16, dtype=torch.float64)
    with torch.no_grad():
        want = m(x, x, x, is_causal=True, need_weights=False)[0]
        dense = hkt.MultiheadHKT(16, 2, levels=levels, batch_first=True, num_kv_heads=kv).double().eval()
        dense.load_state_dict(m.state_dict())
        cache, outs, t = m.init_cache(2, T + 3), [], 0
        for n in split:
            outs.append(m.decode(x[:, t:t + n], cache))
            t += n
    got = torch.cat(outs, dim=1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert cache.length == T and len(cache.v_sums) == levels - 1
    # the windows do change the result (else the test could not tell them from none)
    assert not torch.allclose(got, dense(x, x, x, is_causal=True, need_weights=False)[0].detach())


def test_windowed_block_sums_are_the_values_summed():
    m = hkt.MultiheadHKT(8, 1, levels=3, batch_first=True, windows=[2, 4, None]).double().eval()
    x = torch.randn(1, 13, 8, dtype=torch.float64)
    with torch.no_grad():
        cache = m.init_cache(1, 16)
        m.decode(x, cache)
    for l, s in enumerate(cache.v_sums, start=1):
        blocks = 13 >> l  # the complete ones
        want = cache.v[:, :, :blocks << l].reshape(1, 1, blocks, 1 << l, -1).sum(3)
        torch.testing.assert_close(s[:, :, :blocks], want, rtol=1e-12, atol=1e-12)


def test_windowed_decoding_refuses_another_modules_cache():
    m = hkt.MultiheadHKT(8, 1, levels=2, batch_first=True, windows=[2, None]).eval()
    plain = hkt.MultiheadHKT(8, 1, levels=2, batch_first=True).eval()
    x = torch.randn(1, 1, 8)
    with torch.no_grad():
        with pytest.raises(ValueError, match="cache: was made by a module without windows"):
            m.decode(x, plain.init_cache(1, 4))
        with pytest.raises(ValueError, match="cache: was made by a module with windows"):
            plain.decode(x, m.init_cache(1, 4))
        # the cache's rings are sized for its own module's windows: a step with others would read wrong rows
        other = hkt.MultiheadHKT(8, 1, levels=2, batch_first=True, windows=[4, None]).eval()
        with pytest.raises(ValueError, match="cache: was made by a module with other windows"):
            other.decode(x, m.init_cache(1, 4))


def test_window_ops_pass_opcheck():
    # torch.library's checks of the windowed ops: schema, fake kernel, autograd registration
    from hkt.ops.window import window_backward, window_forward
    q, k, v, w = leaves(1, 2, 21, 21, 4, 3, 3, seed=15)
    w2 = w.detach().clone().requires_grad_()
    seed = torch.tensor(77)
    masks = [None, torch.randn(1, 2, 21, 21, dtype=torch.float64, requires_grad=True),
             torch.rand(1, 1, 1, 21) > 0.3, torch.rand(1, 1, 21, 21) > 0.3]
    for mask, dropout_p in zip(masks + [None], [0.0, 0.0, 0.0, 0.0, 0.25]):
        args = (q, k, v, w2, mask, [4, 4, 0], True, 0.5, dropout_p, seed)
        torch.library.opcheck(window_forward, args)
        out, lse = window_forward(*args)
        dout = torch.randn_like(out)
        plain = mask.detach() if mask is not None else None
        torch.library.opcheck(window_backward, (dout, [x.detach() for x in q], [x.detach() for x in k], v.detach(),
                                                w2.detach(), plain, out.detach(), lse.detach(), [4, 4, 0], True,
                                                0.5, dropout_p, seed, plain is not None and plain.is_floating_point()))


class _Windowed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 24, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64))

    def forward(self, x):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        qs, ks = [q, q[:, :, ::2], q[:, :, ::4]], [k, k[:, :, ::2], k[:, :, ::4]]
        return hkt.hkt_attention(qs, ks, v, self.w, is_causal=True, windows=[4, 8, None])


def test_compile_fullgraph_takes_windows():
    model, x = _Windowed(), torch.randn(2, 29, 8, dtype=torch.float64)
    eager = model(x)
    eager.sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    out.sum().backward()
    assert torch.equal(out, eager)
    for a, p in zip(want, model.parameters()):
        assert torch.equal(p.grad, a)


def test_export_records_the_window_op():
    model, x = _Windowed().eval(), torch.randn(2, 29, 8, dtype=torch.float64)
    ep = torch.export.export(model, (x,))
    assert "hkt.window_forward" in str(ep.graph)
    assert torch.equal(ep.module()(x), model(x))


def test_double_backward_raises_by_name():
    q, k, v, w = leaves(1, 2, 20, 20, 4, 3, 2, seed=16)
    out = hkt.hkt_attention(q, k, v, w, is_causal=True, windows=[4, None])
    g = torch.autograd.grad(out.square().sum(), q[0], create_graph=True)[0]
    with pytest.raises(NotImplementedError, match="windows: the windowed kernels have no double backward"):
        g.sum().backward()


def test_meta_tensors_give_the_shapes():
    q, k, v, w = leaves(1, 2, 16, 16, 4, 3, 3)
    meta = lambda xs: [x.detach().to("meta") for x in xs]  # noqa: E731
    out = hkt.hkt_attention(meta(q), meta(k), v.detach().to("meta"), w.detach().to("meta"), windows=[4, 8, None])
    assert out.device.type == "meta" and out.shape == (1, 2, 16, 3)
