"""hkt.hkt_attention against the plain-PyTorch reference (float64), SDPA, gradcheck,
compile and custom-op checks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hkt
from hkt import _C, ops
from hkt._core.kernels import dropout_keep_mask
from hkt.reference import hkt_attention_reference as reference

from helpers import MASKS, assert_within_lowp_error, make_mask, sample_inputs, with_threads

# (B, H, T, S, D, Dv, L): awkward lengths, S != T, D and Dv not multiples of 8
SIZES = [
    (1, 1, 1, 1, 3, 5, 1),
    (2, 3, 1, 7, 5, 3, 3),
    (1, 2, 7, 7, 4, 9, 2),
    (2, 2, 97, 130, 13, 7, 3),
    (1, 3, 130, 97, 9, 11, 5),
    (1, 1, 1025, 257, 5, 3, 4),
    (1, 2, 200, 200, 64, 64, 3),
]
def grads(out, tensors, seed=3):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, tensors, g)


def assert_matches(q, k, v, w, rtol, atol, **kw):
    out = hkt.hkt_attention(q, k, v, w, **kw)
    ref = reference(q, k, v, w, **kw)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    leaves = [*q, *k, v, w]
    for a, b in zip(grads(out, leaves), grads(ref, leaves)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    return out


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_grads_float64(size, mask, causal):
    B, H, T, S, D, Dv, L = size
    q, k, v, w = sample_inputs(*size, requires_grad=True, per_head=(T % 2 == 1))
    assert_matches(q, k, v, w, 1e-10, 1e-10, attn_mask=make_mask(mask, B, H, T, S, torch.float64),
                   is_causal=causal)


@pytest.mark.parametrize("size", SIZES[2:5], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_head", [False, True])
def test_float32(size, per_head):
    q, k, v, w = sample_inputs(*size, per_head=per_head)
    assert_within_lowp_error(hkt.hkt_attention, reference, q, k, v, w, torch.float32, is_causal=True, scale=0.3)


def test_scale_and_levels_matter():
    # guards against a kernel that ignores coarse levels or the scale
    q, k, v, w = sample_inputs(1, 2, 33, 33, 4, 4, 3)
    base = hkt.hkt_attention(q, k, v, w)
    w2 = w.clone()
    w2[:, 2] += 1
    assert (hkt.hkt_attention(q, k, v, w2) - base).abs().max() > 1e-3
    assert (hkt.hkt_attention(q, k, v, w, scale=0.01) - base).abs().max() > 1e-3


def test_gradcheck():
    q, k, v, w = sample_inputs(1, 2, 9, 6, 3, 2, 3, requires_grad=True)
    mask = make_mask("float", 1, 2, 9, 6, torch.float64)
    fn = lambda *a: hkt.hkt_attention(list(a[:3]), list(a[3:6]), a[6], a[7], attn_mask=mask, is_causal=True)
    assert torch.autograd.gradcheck(fn, (*q, *k, v, w))


@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_one_level_equals_sdpa(mask, causal):
    B, H, T, S = 2, 3, 37, 37 if causal else 50
    q, k, v, _ = sample_inputs(B, H, T, S, 6, 5, 1, requires_grad=True)
    w = torch.ones(1, dtype=torch.float64)
    am = make_mask(mask, B, H, T, S, torch.float64)
    if mask == "bool":
        am[:, 0] = True  # SDPA gives NaN for rows with nothing visible
    if mask == "float":
        am = am.nan_to_num(neginf=-1e4)
    if causal and am is not None:  # SDPA cannot take both: fold causality into the mask
        tri = torch.ones(T, S, dtype=torch.bool).tril()
        sd_mask = (am & tri) if am.dtype == torch.bool else am.masked_fill(~tri, float("-inf"))
    else:
        sd_mask = am
    out = hkt.hkt_attention(q, k, v, w, attn_mask=am, is_causal=causal)
    ref = F.scaled_dot_product_attention(q[0], k[0], v, attn_mask=sd_mask, is_causal=causal and am is None)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads(out, [q[0], k[0], v]), grads(ref, [q[0], k[0], v])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fully_masked_rows_give_zeros():
    B, H, T, S = 1, 2, 20, 30
    q, k, v, w = sample_inputs(B, H, T, S, 4, 3, 3, requires_grad=True)
    mask = torch.ones(T, S, dtype=torch.bool)
    mask[3] = False
    mask[11] = False
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert (out[:, :, [3, 11]] == 0).all()
    assert (out[:, :, 4].abs() > 0).any()
    fm = torch.zeros(T, S, dtype=torch.float64)
    fm[5] = float("-inf")
    out2 = hkt.hkt_attention(q, k, v, w, attn_mask=fm)
    assert (out2[:, :, 5] == 0).all()
    gq0, gv = torch.autograd.grad(out.sum() + out2.sum(), [q[0], v])
    assert torch.isfinite(gq0).all() and torch.isfinite(gv).all()
    # rows 3 and 11 see no key in either call, row 5 none in the second: no gradient
    gq0 = torch.autograd.grad(hkt.hkt_attention(q, k, v, w, attn_mask=mask).sum(), q[0])[0]
    assert (gq0[:, :, [3, 11]] == 0).all() and (gq0[:, :, 4] != 0).any()
    # no key at all
    q, k, v, w = sample_inputs(1, 1, 5, 0, 4, 3, 2, requires_grad=True)
    out = hkt.hkt_attention(q, k, v, w)
    assert out.shape == (1, 1, 5, 3) and (out == 0).all()


def test_non_contiguous_inputs():
    B, H, T, S, D, Dv, L = 2, 3, 29, 23, 6, 5, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L)
    # (B, T, H, D) storage viewed as (B, H, T, D), as a projection then view would give
    qt = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in q]
    kt = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in k]
    vt = torch.cat([v, v], dim=-1)[..., ::2].detach().requires_grad_()  # feature stride 2
    wt = w.t().contiguous().t().requires_grad_()
    assert not qt[1].is_contiguous() and not vt.is_contiguous() and not wt.is_contiguous()
    assert_matches(qt, kt, vt, wt, 1e-10, 1e-10, is_causal=True)


@pytest.mark.parametrize("which", ["q[0]", "k[0]", "v", "all"])
def test_overlapping_rows(which):
    """Inputs whose rows overlap in memory (sliding windows, Tensor.unfold) have
    unit feature stride, as the kernels need; the outputs and gradients made for
    them must too (torch's preserve_format may put another dimension innermost
    for such a layout), whichever input it is."""
    B, H, T, D, L = 2, 3, 19, 5, 3
    q, k, v, w = sample_inputs(B, H, T, T, D, D, L, requires_grad=True)

    def windows(seed):  # (B, H, T, D): head h is features h .. h + D - 1 of one (B, T, H + D - 1) tensor
        x = torch.randn(B, T, H + D - 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return x.requires_grad_().unfold(2, D, 1).transpose(1, 2)
    if which in ("q[0]", "all"):
        q[0] = windows(1)
    if which in ("k[0]", "all"):
        k[0] = windows(2)
    if which in ("v", "all"):
        v = windows(3)
    assert_matches(q, k, v, w, 1e-10, 1e-10, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B, H, Hk, threads", [
    (2, 3, 3, 2),  # backward: one task per (b, kv head), strided rows packed per query head
    (2, 4, 2, 2),  # the same with two query heads per kv head
    (1, 2, 1, 2),  # fewer kv heads than threads: the two-pass schedule
    (1, 2, 2, 1),
])
def test_outputs_and_grads_laid_out_like_the_inputs(dtype, B, H, Hk, threads):
    # Eager calls give out, dq, dk and dv the memory order of q[0], q, k, v (a module's heads,
    # (B, T, H, D) storage seen as (B, H, T, D), then reshape back for free); the values are the
    # same bits as with contiguous inputs, whatever the layout and the backward's schedule.
    T, S, D, L = 29, 23, 6, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, D, L, dtype=dtype, kv_heads=Hk)
    heads = [[x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in xs] for xs in (q, k, [v])]
    flat = [[x.detach().contiguous().requires_grad_() for x in xs] for xs in (q, k, [v])]
    dout = torch.randn(B, H, T, D, dtype=dtype)
    results = []
    for (qs, ks, (vs,)), d in ((heads, dout.transpose(1, 2).contiguous().transpose(1, 2)), (flat, dout)):
        wt = w.detach().clone().requires_grad_()

        def run():
            out = hkt.hkt_attention(qs, ks, vs, wt, is_causal=True)
            out.backward(d)
            return out
        out = with_threads(threads, run)
        results.append((out, [x.grad for x in qs + ks + [vs]], wt.grad))
    (out_h, grads_h, dw_h), (out_c, grads_c, dw_c) = results
    assert out_h.stride() == heads[0][0].stride() and out_c.is_contiguous()
    for g, x in zip(grads_h, heads[0] + heads[1] + heads[2]):
        assert g.stride() == x.stride()
    assert torch.equal(out_h, out_c) and torch.equal(dw_h, dw_c)
    assert all(torch.equal(a, b) for a, b in zip(grads_h, grads_c))
    with torch.no_grad():  # the no-grad path lays out out the same way
        assert hkt.hkt_attention(heads[0], heads[1], heads[2][0], w).stride() == heads[0][0].stride()


def test_numpy_through_extension():
    B, H, T, S, D, Dv, L = 1, 2, 19, 21, 3, 4, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L)
    out = np.empty((B, H, T, Dv))
    lse = np.empty((B, H, T))
    _C.forward([x.numpy() for x in q], [x.numpy() for x in k], v.numpy(), w.numpy(), out, lse, None, True)
    np.testing.assert_allclose(out, reference(q, k, v, w, is_causal=True).numpy(), rtol=1e-10, atol=1e-12)
    dout = np.ones((B, H, T, Dv))
    dq = [np.empty(x.shape) for x in q]
    dk = [np.empty(x.shape) for x in k]
    dv, dw = np.empty(v.shape), np.empty(w.shape)
    _C.backward(dout, [x.numpy() for x in q], [x.numpy() for x in k], v.numpy(), w.numpy(), out, lse,
                dq, dk, dv, dw, None, True)
    leaves = [x.clone().requires_grad_() for x in [*q, *k, v, w]]
    ref = torch.autograd.grad(reference(leaves[:L], leaves[L:2 * L], leaves[-2], leaves[-1], is_causal=True).sum(),
                              leaves)
    for a, b in zip([*dq, *dk, dv, dw], ref):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)
    # float32 arrays and a bool mask from NumPy
    out32 = np.empty((B, H, T, Dv), np.float32)
    mask = np.random.default_rng(0).random((B, H, T, S)) > 0.4
    _C.forward([x.numpy().astype(np.float32) for x in q], [x.numpy().astype(np.float32) for x in k],
               v.numpy().astype(np.float32), w.numpy().astype(np.float32), out32, np.empty((B, H, T), np.float32),
               mask)
    ref = reference(q, k, v, w, attn_mask=torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(out32, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T", [0, 5, 200])
def test_forward_without_lse_writes_the_same_out(dtype, threads, T):
    # lse=None (what a call under no_grad passes): the kernels keep it in their
    # workspace, and out is the same bits; T=200 runs on both threads
    B, H, S, D, Dv, L = 2, 3, 170, 16, 8, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L)
    q, k = [x.numpy().astype(dtype) for x in q], [x.numpy().astype(dtype) for x in k]
    v, w = v.numpy().astype(dtype), w.numpy().astype(dtype)
    want, lse = np.empty((B, H, T, Dv), dtype), np.empty((B, H, T), dtype)
    _C.forward(q, k, v, w, want, lse, None, True, num_threads=threads)
    got = np.full((B, H, T, Dv), np.nan, dtype)
    _C.forward(q, k, v, w, got, None, None, True, num_threads=threads)
    assert np.array_equal(got, want)
    assert np.isfinite(got).all()
    # the backward needs the forward's lse: None is refused by name
    with pytest.raises(TypeError, match="^lse: "):
        _C.backward(np.ones_like(want), q, k, v, w, want, None, [np.empty_like(x) for x in q],
                    [np.empty_like(x) for x in k], np.empty_like(v), np.empty_like(w), None, True)


def test_deterministic_and_thread_count_independent():
    q, k, v, w = sample_inputs(2, 3, 150, 140, 16, 8, 3, dtype=torch.float32, requires_grad=True)
    runs = []
    for threads in (1, 2, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = hkt.hkt_attention(q, k, v, w, is_causal=True)
            runs.append([out, *grads(out, [*q, *k, v, w])])
        finally:
            torch.set_num_threads(old)
    for a, b in zip(runs[1], runs[2]):
        assert torch.equal(a, b)  # bitwise run to run
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)  # per-(b, h) ownership: thread count does not change the order


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("D", [64, 13])
def test_causal_rows_are_the_same_bits_however_far_the_sequence_runs(L, dtype, D):
    """Under causality row i sees keys 0..i only, so its output, lse and level-0
    query gradient must not change, to the bit, when the sequence runs on past
    it.  The row then lands in other tile shapes: its keys fill a short last
    tile (leftover columns, done one by one) or part of a full one (vector
    tiles), and the causal diagonal's row blocks cover it differently.  Every
    path must round each entry alike: leftover columns that add unfused
    products where the vector tiles fuse them fail here."""
    T2 = 200
    q, k, v, w = sample_inputs(1, 2, T2, T2, D, D, L, dtype=dtype, seed=3)
    dout = torch.randn(1, 2, T2, D, dtype=dtype, generator=torch.Generator().manual_seed(4))

    def run(T):
        qs = [x[:, :, :(T - 1) // 2**l + 1].detach().requires_grad_() for l, x in enumerate(q)]
        ks = [x[:, :, :(T - 1) // 2**l + 1].detach().requires_grad_() for l, x in enumerate(k)]
        out = hkt.hkt_attention(qs, ks, v[:, :, :T].detach().requires_grad_(), w, is_causal=True)
        out.backward(dout[:, :, :T])
        return out.detach(), qs[0].grad

    out2, dq2 = run(T2)
    for T in (33, 81, 97, 150):  # short last tiles: 33, 17, 33 and 22 keys
        out, dq = run(T)
        assert torch.equal(out, out2[:, :, :T]), f"T={T}: out"
        assert torch.equal(dq, dq2[:, :, :T]), f"T={T}: dq[0]"


@pytest.mark.parametrize("needs_grad", ["all", "none", "v only", "q[0] and w", "float mask only"])
def test_opcheck(needs_grad):
    # torch.library's checks of the forward op (schema, fake kernel, autograd
    # registration) with every input, none, or only some of them requiring grad
    q, k, v, w = sample_inputs(1, 2, 11, 9, 3, 4, 2)
    wants = {"all": [*q, *k, v, w], "none": [], "v only": [v], "q[0] and w": [q[0], w],
             "float mask only": []}[needs_grad]
    for x in wants:
        x.requires_grad_()
    seed = torch.tensor(5)
    if needs_grad == "float mask only":
        fmask = torch.randn(1, 2, 11, 9, dtype=torch.float64, requires_grad=True)
        torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, fmask, True, 0.0, 0.5, seed))
        return
    mask = torch.rand(1, 2, 11, 9) > 0.2
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, mask, True, 0.0, 0.5, seed))
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, None, False, 0.0, 0.5, seed))


def test_torch_compile_fullgraph():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8 * 3)
            self.w = torch.nn.Parameter(torch.tensor([0.6, 0.3, 0.1]))

        def forward(self, x):
            q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
            qs = [q, q[:, :, ::2], q[:, :, ::4]]
            ks = [k, k[:, :, ::2], k[:, :, ::4]]
            return hkt.hkt_attention(qs, ks, v, self.w, is_causal=True)

    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 13, 8)
    eager = model(x)
    eager.sum().backward()
    g_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for a, p in zip(g_eager, model.parameters()):
        torch.testing.assert_close(p.grad, a)


def test_dropout_exact_against_reference():
    B, H, T, S, p = 1, 2, 70, 66, 0.3
    q, k, v, w = sample_inputs(B, H, T, S, 5, 4, 3, requires_grad=True)
    seed = torch.tensor(1234)
    out, _ = ops.attention_forward(list(q), list(k), v, w, None, True, p, 0.4, seed)
    keep = dropout_keep_mask(1234, p, B, H, T, S)
    frac = keep.float().mean().item()
    assert abs(frac - (1 - p)) < 0.02
    ref = reference(q, k, v, w, is_causal=True, dropout_p=p, scale=0.4, dropout_mask=keep)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads(out, [*q, *k, v, w]), grads(ref, [*q, *k, v, w])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_dropout_same_seed_same_result_and_expectation():
    q, k, v, w = sample_inputs(1, 2, 24, 24, 4, 3, 2, requires_grad=True)

    def run(seed):
        torch.manual_seed(seed)
        out = hkt.hkt_attention(q, k, v, w, dropout_p=0.5)
        return [out, *grads(out, [*q, v])]

    a, b, c = run(7), run(7), run(8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])
    plain = hkt.hkt_attention(q, k, v, w)
    torch.manual_seed(0)
    mean = torch.stack([hkt.hkt_attention(q, k, v, w, dropout_p=0.5) for _ in range(3000)]).mean(0)
    # the mean of 3000 draws sits within a few standard errors of the undropped output
    assert (mean - plain).abs().max() < 0.1
    assert (mean - plain).abs().mean() < 0.02


def test_dropout_one_drops_everything():
    q, k, v, w = sample_inputs(1, 1, 5, 5, 2, 2, 1)
    assert (hkt.hkt_attention(q, k, v, w, dropout_p=1.0) == 0).all()


def test_bfloat16_computes_in_float32():
    # computed in float32, rounded to bfloat16 once at the end: well inside the
    # error of plain PyTorch computing in bfloat16 throughout
    q, k, v, w = sample_inputs(1, 2, 45, 38, 8, 8, 3)
    q, k, v, w = [x.bfloat16().double() for x in q], [x.bfloat16().double() for x in k], v.bfloat16().double(), \
        w.bfloat16().double()  # inputs representable in bfloat16: the comparison sees only the arithmetic
    assert_within_lowp_error(hkt.hkt_attention, reference, q, k, v, w, torch.bfloat16, factor=1.0, is_causal=True)


def test_empty_query_length():
    q, k, v, w = sample_inputs(2, 3, 0, 9, 4, 5, 3, requires_grad=True)
    out = hkt.hkt_attention(q, k, v, w, is_causal=True)
    assert out.shape == (2, 3, 0, 5)
    out.sum().backward()
    assert (v.grad == 0).all() and (w.grad == 0).all()


def test_forward_without_key_cache():
    # past the key-cache budget the forward transposes keys per tile: same result
    q, k, v, w = sample_inputs(2, 2, 150, 200, 7, 5, 3, dtype=torch.float32)
    cached = hkt.hkt_attention(q, k, v, w, is_causal=True)
    runs = {}
    for budget in (-1, 0):
        out, lse = torch.empty(2, 2, 150, 5), torch.empty(2, 2, 150)
        hkt._C.forward(q, k, v, w, out, lse, None, True, key_cache_bytes=budget)
        runs[budget] = out
    assert torch.equal(runs[-1], cached) and torch.equal(runs[0], cached)
    q, k, v, w = sample_inputs(1, 2, 97, 130, 13, 7, 3)
    torch.testing.assert_close(hkt.hkt_attention(q, k, v, w), reference(q, k, v, w), rtol=1e-10, atol=1e-10)


def test_forward_packing_of_strided_rows_within_its_budget():
    # Strided rows (a module's heads) are packed: each task's query rows, and the values
    # with the key cache when keys and values fit its budget.  Every combination gives
    # the contiguous call's bits.
    q, k, v, w = sample_inputs(2, 2, 150, 200, 7, 5, 3, dtype=torch.float32)
    want = torch.empty(2, 2, 150, 5), torch.empty(2, 2, 150)
    hkt._C.forward(q, k, v, w, *want, None, True, num_threads=2)
    heads = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (*q, *k, v)]
    # per thread, level l's transposed keys take D * (ceil16(S_l) + 16) reals: 3024 here
    # for S = 200, 100, 50; the values 1008 more (S * Dv, rounded up to 16)
    keys, values = 7 * ((208 + 16) + (112 + 16) + (64 + 16)), 1008
    for budget in (-1, 0, 2 * 4 * keys, 2 * 4 * (keys + values)):  # 2 threads, 4-byte reals
        out = torch.empty(2, 2, 150, 5).transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.empty(2, 2, 150)
        hkt._C.forward(heads[:3], heads[3:6], heads[6], w, out, lse, None, True, num_threads=2,
                       key_cache_bytes=budget)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), budget


@pytest.mark.parametrize("L,causal,dropout", [(3, False, 0.0), (3, True, 0.2), (8, True, 0.0), (8, False, 0.3)])
def test_backward_schedules_agree_bitwise(L, causal, dropout):
    # one (b, h) and two threads: the two-pass schedule; one thread: the per-(b, h)
    # one.  Both add every gradient in the same order.
    q, k, v, w = sample_inputs(1, 1, 300, 333, 9, 6, L, dtype=torch.float32, requires_grad=True)
    seed = torch.tensor(99)
    runs = []
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, _ = ops.attention_forward(list(q), list(k), v, w, None, causal, dropout, 0.3, seed)
            runs.append([out, *grads(out, [*q, *k, v, w])])
        finally:
            torch.set_num_threads(old)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    q64, k64 = [[x.detach().double().requires_grad_() for x in xs] for xs in (q, k)]
    v64, w64 = [x.detach().double().requires_grad_() for x in (v, w)]
    keep = dropout_keep_mask(99, dropout, 1, 1, 300, 333) if dropout else None
    ref = reference(q64, k64, v64, w64, is_causal=causal, scale=0.3, dropout_p=dropout, dropout_mask=keep)
    for a, b in zip(runs[1], [ref, *grads(ref, [*q64, *k64, v64, w64])]):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
