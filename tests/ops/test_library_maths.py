"""The library's plain-torch maths (hkt/_core/maths.py) and its window rule
(hkt/_core/checks.py) against hkt.reference's own copies, on random input: the two
are written apart so that no differential test has the library's maths on both
of its sides, and they must give the same answers.  Also: a window past what
the kernels take is refused by name (that no library module imports the
reference: tests/packaging/test_import_graph.py)."""
import pytest
import torch

import hkt
from hkt._core import checks as _checks, maths as _maths
from hkt import reference as ref
from helpers import sample_inputs

def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("src,dst", [(torch.float64, torch.float32), (torch.float32, torch.float64),
                                     (torch.float32, torch.bfloat16), (torch.float64, torch.float64)])
def test_float_mask_conversion(src, dst):
    g = torch.Generator().manual_seed(1)
    m = torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 300, (3, 5, 7),
                                                                                           generator=g)
    m[0, 0, :3] = torch.tensor([float("-inf"), float("inf"), float("nan")], dtype=torch.float64)
    m[1, 1, 0] = torch.finfo(torch.float64).min
    m = m.to(src)
    _same(_maths.float_mask_in(m, dst), ref.float_mask_in(m, dst))
    mg = m.clone().requires_grad_()
    a, b = _maths.float_mask_in(mg, dst), ref.float_mask_in(mg, dst)
    up = torch.randn(a.shape, generator=g, dtype=torch.float64).to(dst)
    _same(torch.autograd.grad(a, mg, up)[0], torch.autograd.grad(b, mg, up)[0])


@pytest.mark.parametrize("H,Hk", [(4, 4), (4, 2), (6, 1)])
def test_repeat_kv(H, Hk):
    x = torch.randn(2, Hk, 5, 3, dtype=torch.float64)
    _same(_maths.repeat_kv(x, H), ref.repeat_kv(x, H))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [0.125, -3.0, 0.0, 1e-30, 1e-300])
def test_level_factor(dtype, scale):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 3, generator=g, dtype=torch.float64)
    w = (w * 10.0 ** torch.randint(-320, 2, w.shape, generator=g)).to(dtype)  # products that underflow
    w[0, 0], w[1, 1] = 0.0, -0.0
    w.requires_grad_()
    a, b = _maths.level_factor(scale, w), ref.level_factor(scale, w)
    _same(a, b)
    up = torch.randn(a.shape, generator=g, dtype=dtype)
    _same(torch.autograd.grad(a, w, up)[0], torch.autograd.grad(b, w, up)[0])


CASES = [  # B, H, Hk, T, S, D, Dv, L
    (2, 3, 3, 9, 9, 4, 5, 3),
    (1, 4, 2, 13, 7, 3, 3, 2),
    (2, 2, 1, 1, 17, 5, 2, 4),
]


@pytest.mark.parametrize("B,H,Hk,T,S,D,Dv,L", CASES)
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_dense_attention_and_its_gradients(B, H, Hk, T, S, D, Dv, L, mask, causal, per_head):
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, per_head=per_head, requires_grad=True, kv_heads=Hk,
                               seed=T * S + L)
    g = torch.Generator().manual_seed(T + S)
    m = None
    if mask == "bool":
        m = torch.rand(B, 1, T, S, generator=g) > 0.3
    elif mask == "float":
        m = torch.randn(1, H, T, S, generator=g, dtype=torch.float64)
        m[..., 0] = float("-inf")
        m.requires_grad_()
    scale = 0.7 if per_head else None
    a = _maths.dense_attention(q, k, v, w, m, causal, scale)
    b = ref.hkt_attention_reference(q, k, v, w, attn_mask=m, is_causal=causal, scale=scale)
    _same(a, b)
    leaves = [*q, *k, v, w] + ([m] if mask == "float" else [])
    up = torch.randn(a.shape, generator=g, dtype=a.dtype)
    for x, y in zip(torch.autograd.grad(a, leaves, up), torch.autograd.grad(b, leaves, up)):
        _same(x, y)
    _same(_maths.masked_probs(q, k, w, m, causal, scale), ref.masked_probs(q, k, w, m, causal, scale))


@pytest.mark.parametrize("p", [0.3, 1.0])
def test_dense_attention_with_dropout(p):
    q, k, v, w = sample_inputs(2, 2, 11, 11, 4, 4, 3, seed=5)
    keep = torch.rand(2, 2, 11, 11, generator=torch.Generator().manual_seed(5)) > p / 2
    a = _maths.dense_attention(q, k, v, w, None, True, None, p, keep)
    b = ref.hkt_attention_reference(q, k, v, w, is_causal=True, dropout_p=p, dropout_mask=keep)
    _same(a, b)


@pytest.mark.parametrize("windows", [[2, 4, 8], [3, None, None], [6, 12, 24], [None, 2, None]])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_windowed_scores_and_probs(windows, mask):
    q, k, v, w = sample_inputs(2, 2, 19, 19, 3, 3, 3, seed=7)
    g = torch.Generator().manual_seed(7)
    m = None if mask is None else (torch.rand(1, 1, 19, 19, generator=g) > 0.2 if mask == "bool"
                                   else torch.randn(2, 1, 1, 19, generator=g, dtype=torch.float64))
    sa, seen_a = _maths.windowed_scores(q, k, w, windows)
    sb, seen_b = ref.windowed_scores(q, k, w, windows)
    _same(sa, sb)
    assert torch.equal(seen_a, seen_b)
    for causal in (False, True):
        _same(_maths.probs_of_scores(sa, seen_a, m, causal), ref.probs_of_scores(sb, seen_b, m, causal))


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return type(e), str(e)


WINDOWS = [None, [None, None], (4, 8), [4, None], [None, 4], [4, 4], [8, 4], [3, 6], [0, 4], [-2, None],
           [True, None], [2.0, None], [4], "4, 8", [torch.tensor(4), None], [4, 6], [2, 4, 8]]


@pytest.mark.parametrize("windows", WINDOWS, ids=repr)
@pytest.mark.parametrize("growing", [False, True])
def test_the_window_rule_is_the_references(windows, growing):
    """Every answer of the reference's window rule, for windows the kernels can take."""
    assert _outcome(_checks.check_windows, windows, 2, growing=growing) == _outcome(
        ref.check_windows, windows, 2, growing=growing)


def test_random_windows_get_the_references_answers():
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        L = int(torch.randint(1, 5, (), generator=g))
        windows = [None if torch.rand((), generator=g) < 0.3 else int(torch.randint(-2, 40, (), generator=g))
                   for _ in range(L)]
        for growing in (False, True):
            assert _outcome(_checks.check_windows, windows, L, growing=growing) == _outcome(
                ref.check_windows, windows, L, growing=growing), windows


@pytest.mark.parametrize("windows,bad", [([2**63, 2**64, None], 0), ([4, 2**63, None], 1),
                                          ([2**62, 2**63, None], 1), ([None, None, 2**66], 2)])
def test_a_window_past_the_kernels_is_refused_by_name(windows, bad):
    """A window too large for the kernels' int64 arithmetic: a ValueError naming
    the entry, from the call and from the module (it used to pass the checks and
    fail inside the custom op with a schema error)."""
    q, k, v, w = sample_inputs(1, 2, 8, 8, 4, 4, 3)
    with pytest.raises(ValueError, match=rf"^windows\[{bad}\]: at most 2\^62 tokens"):
        hkt.hkt_attention(q, k, v, w, windows=windows)
    with pytest.raises(ValueError, match=rf"^windows\[{bad}\]: at most 2\^62 tokens"):
        hkt.MultiheadHKT(8, 2, levels=3, windows=windows)


@pytest.mark.parametrize("windows", [[2**61, 2**62, None], [2**62, None, None]])
def test_the_largest_windows_see_every_key(windows):
    q, k, v, w = sample_inputs(2, 2, 21, 21, 4, 4, 3, requires_grad=True, seed=11)
    for causal in (False, True):
        a = hkt.hkt_attention(q, k, v, w, is_causal=causal, windows=windows)
        b = hkt.hkt_attention(q, k, v, w, is_causal=causal)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        ga = torch.autograd.grad(a.sum(), [*q, *k, v, w])
        gb = torch.autograd.grad(b.sum(), [*q, *k, v, w])
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
