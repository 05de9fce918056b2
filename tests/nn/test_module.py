"""hkt.MultiheadHKT, MultiheadHKT.from_mha and hkt.swap_attention.

levels=1 is checked against nn.MultiheadAttention, levels > 1 against a
construction written out here from docs/contract.md section 2.2 on top of the
plain-torch reference op; everything in float64 where values are compared.
"""
import copy
import io
import itertools

import pytest
import torch
from torch import nn
from torch.func import functional_call

import hkt
from hkt.downsample import causal_downsample
from hkt.reference import hkt_attention_reference

from helpers import randomize

F64 = torch.float64
NEG_INF = float("-inf")


# --------------------------------------------------------------------------- helpers

def downsample_loop(x, taps):
    """x_l[p, c] = sum_{r<K} a[r, c] x[2p - r, c], zero before the start; x (B, n, C).
    Written as an explicit gather over the indices 2p - r."""
    n, K = x.shape[1], taps.shape[0]
    idx = 2 * torch.arange((n + 1) // 2)[:, None] - torch.arange(K)[None, :]  # (m, K)
    g = x[:, idx.clamp(min=0)] * (idx >= 0)[None, :, :, None].to(x.dtype)  # (B, m, K, C)
    return (g * taps).sum(2)


def manual_hkt(m, query, key, value, key_padding_mask=None, attn_mask=None, is_causal=False):
    """MultiheadHKT's forward (eval, batch-first, batched) written out from
    docs/contract.md section 2.2 and the module docstring; returns (out (B, T, E),
    per-head probs (B, H, T, S'))."""
    B, T, E = query.shape
    S = key.shape[1]
    H, hd, L = m.num_heads, m.head_dim, m.levels
    if m.in_proj_weight is not None:
        wq, wk, wv = m.in_proj_weight.split(E)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    bq, bk, bv = m.in_proj_bias.split(E) if m.in_proj_bias is not None else (0, 0, 0)
    q0, k0, v = query @ wq.T + bq, key @ wk.T + bk, value @ wv.T + bv
    extra = []
    if m.bias_k is not None:
        extra.append((m.bias_k.reshape(1, 1, E).expand(B, 1, E), m.bias_v.reshape(1, 1, E).expand(B, 1, E)))
    if m.add_zero_attn:
        extra.append((torch.zeros(B, 1, E, dtype=F64), torch.zeros(B, 1, E, dtype=F64)))
    for ke, ve in extra:
        k0, v = torch.cat([k0, ke], 1), torch.cat([v, ve], 1)
    Sp = S + len(extra)

    def heads(x):
        return x.reshape(B, x.shape[1], H, hd).permute(0, 2, 1, 3)

    qs, ks = [heads(q0)], [heads(k0)]
    xq, xk = query, torch.cat([key, torch.zeros(B, len(extra), key.shape[2], dtype=F64)], 1)
    for l in range(1, L):
        xq = downsample_loop(xq, m.q_downsample[l - 1])
        xk = downsample_loop(xk, m.k_downsample[l - 1])
        assert xq.shape[1] == -(-T // 2**l) and xk.shape[1] == -(-Sp // 2**l)
        cq = m.coarse_q_proj_bias[l - 1] if m.coarse_q_proj_bias is not None else 0
        ck = m.coarse_k_proj_bias[l - 1] if m.coarse_k_proj_bias is not None else 0
        qs.append(heads(xq @ m.coarse_q_proj_weight[l - 1].T + cq))
        ks.append(heads(xk @ m.coarse_k_proj_weight[l - 1].T + ck))
    w = torch.softmax(m.level_logits, -1) if L > 1 else torch.ones(H, 1, dtype=F64)

    add = torch.zeros(B, H, T, Sp, dtype=F64)  # MHA conventions -> one additive mask
    if attn_mask is not None:
        am = attn_mask if attn_mask.dim() == 2 else attn_mask.reshape(B, H, T, S)
        am = torch.zeros(am.shape, dtype=F64).masked_fill(am, NEG_INF) if am.dtype == torch.bool else am
        add[..., :S] += am
    if key_padding_mask is not None:
        kp = key_padding_mask
        kp = torch.zeros(kp.shape, dtype=F64).masked_fill(kp, NEG_INF) if kp.dtype == torch.bool else kp
        add[..., :S] += kp[:, None, None, :]
    if is_causal:  # appended slots stay visible
        add[..., :S] += torch.zeros(T, S, dtype=F64).masked_fill(torch.ones(T, S).triu(1).bool(), NEG_INF)
    out, P = hkt_attention_reference(qs, ks, heads(v), w, attn_mask=add, return_probs=True)
    out = out.permute(0, 2, 1, 3).reshape(B, T, E) @ m.out_proj.weight.T
    if m.out_proj.bias is not None:
        out = out + m.out_proj.bias
    return out, P


CONFIGS = {  # constructor options besides embed_dim=8, num_heads=2
    "plain": dict(),
    "batch_first": dict(batch_first=True),
    "kdim_vdim": dict(kdim=5, vdim=3),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn": dict(add_zero_attn=True),
    "bias_kv_zero_attn_bf": dict(add_bias_kv=True, add_zero_attn=True, batch_first=True),
    "no_bias_kdim": dict(bias=False, kdim=6),
    "no_bias_bias_kv": dict(bias=False, add_bias_kv=True),
}
MASKS = ["none", "kpm_bool", "kpm_float", "am2_bool", "am2_float", "am3_bool", "am3_float", "am_and_kpm",
         "causal", "causal_kpm"]


def make_inputs(cfg, mask_kind, unbatched=False, seed=0, B=3, T=6, S=7, E=8, H=2):
    """(query, key, value, kwargs) in the module's layout, plus batch-first copies for manual_hkt."""
    g = torch.Generator().manual_seed(seed)
    kdim, vdim = cfg.get("kdim", E), cfg.get("vdim", E)
    self_attn = kdim == E and vdim == E and mask_kind.startswith("causal")
    if self_attn:
        S = T
    q = torch.randn(B, T, E, generator=g, dtype=F64)
    k = q if self_attn else torch.randn(B, S, kdim, generator=g, dtype=F64)
    v = q if self_attn else torch.randn(B, S, vdim, generator=g, dtype=F64)
    # Masks never hide key 0, so no row is empty (MHA would give NaN there).
    kpm_b = torch.zeros(B, S, dtype=torch.bool)
    kpm_b[0, -2:] = True
    kpm_b[-1, 3:] = True
    kpm_f = torch.randn(B, S, generator=g, dtype=F64).masked_fill(kpm_b, NEG_INF)
    am2_b = torch.rand(T, S, generator=g) < 0.3
    am2_b[:, 0] = False
    am3_b = torch.rand(B * H, T, S, generator=g) < 0.3
    am3_b[..., 0] = False
    causal = torch.ones(T, S, dtype=torch.bool).triu(1)
    kw = {
        "none": {},
        "kpm_bool": dict(key_padding_mask=kpm_b),
        "kpm_float": dict(key_padding_mask=kpm_f),
        "am2_bool": dict(attn_mask=am2_b),
        "am2_float": dict(attn_mask=torch.randn(T, S, generator=g, dtype=F64).masked_fill(am2_b, NEG_INF)),
        "am3_bool": dict(attn_mask=am3_b),
        "am3_float": dict(attn_mask=torch.randn(B * H, T, S, generator=g, dtype=F64)),
        "am_and_kpm": dict(attn_mask=am2_b, key_padding_mask=kpm_b),
        "causal": dict(attn_mask=causal, is_causal=True),
        "causal_kpm": dict(attn_mask=torch.zeros(T, S, dtype=F64).masked_fill(causal, NEG_INF),
                           key_padding_mask=torch.zeros(B, S, dtype=F64).masked_fill(kpm_b, NEG_INF), is_causal=True),
    }[mask_kind]
    bf = dict(query=q, key=k, value=v, **kw)
    if unbatched:
        q, k, v = q[0], k[0], v[0]
        kw = dict(kw)
        if "key_padding_mask" in kw:
            kw["key_padding_mask"] = kw["key_padding_mask"][0]
        if "attn_mask" in kw and kw["attn_mask"].dim() == 3:
            kw["attn_mask"] = kw["attn_mask"][:H]
        bf = dict(query=q[None], key=k[None], value=v[None],
                  **{n: (x[None] if n == "key_padding_mask" else x) for n, x in kw.items()})
    elif not cfg.get("batch_first", False):
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        if self_attn:
            k = v = q
    return q, k, v, kw, bf


def to_batch_first(out, cfg, unbatched):
    if unbatched:
        return out[None]
    return out if cfg.get("batch_first", False) else out.transpose(0, 1)


# --------------------------------------------------------------------------- downsampling

@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_causal_downsample_matches_definition(n, K):
    g = torch.Generator().manual_seed(n * 10 + K)
    x = torch.randn(2, n, 3, generator=g, dtype=F64)
    taps = torch.randn(K, 3, generator=g, dtype=F64)
    y = causal_downsample(x, taps)
    assert y.shape == (2, (n + 1) // 2, 3)
    torch.testing.assert_close(y, downsample_loop(x, taps), rtol=0, atol=1e-14)


# The extension computes causal_downsample on the CPU in float32/float64 (hkt._C.downsample_forward /
# _backward); the torch expression (hkt.downsample._downsample_expr) runs everywhere else.  The forward
# must be the expression's bits, the gradients the expression's within rounding (the taps' sums are
# taken in another order), and everything bitwise the same for any thread count.

DS_SHAPES = [(2, 1, 3, 1), (2, 5, 3, 2), (3, 8, 17, 3), (1, 13, 40, 4), (32, 128, 64, 2), (4, 301, 100, 5),
             (2, 0, 3, 2), (0, 4, 3, 2), (1, 6, 1, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("B,n,C,K", DS_SHAPES)
def test_downsample_extension_matches_expression(dtype, B, n, C, K):
    from hkt.downsample import _downsample_expr
    g = torch.Generator().manual_seed(B * 1000 + n * 10 + K)
    x = torch.randn(B, n, C, generator=g, dtype=dtype, requires_grad=True)
    taps = torch.randn(K, C, generator=g, dtype=dtype, requires_grad=True)
    y = causal_downsample(x, taps)
    assert y.grad_fn is not None and "Downsample" in type(y.grad_fn).__name__  # the extension's node
    x2, t2 = x.detach().clone().requires_grad_(), taps.detach().clone().requires_grad_()
    y2 = _downsample_expr(x2, t2)
    assert torch.equal(y, y2)
    with torch.no_grad():
        assert torch.equal(causal_downsample(x, taps), y2)
    dy = torch.randn(y.shape, generator=g, dtype=dtype)
    y.backward(dy)
    y2.backward(dy)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    torch.testing.assert_close(taps.grad, t2.grad, **tol)


def test_downsample_extension_is_the_same_bits_for_any_thread_count():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 1000, 48, generator=g, requires_grad=True)  # large enough to run threaded
    taps = torch.randn(3, 48, generator=g, requires_grad=True)
    dy = torch.randn(8, 500, 48, generator=g)
    before, results = torch.get_num_threads(), []
    try:
        for nt in (1, 2, 3, 5):
            torch.set_num_threads(nt)
            x.grad = taps.grad = None
            y = causal_downsample(x, taps)
            y.backward(dy)
            results.append((y, x.grad, taps.grad))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, results[0]))


def test_downsample_extension_gradcheck_and_inputs_it_takes():
    from hkt.downsample import _downsample_expr
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 3, generator=g, dtype=F64, requires_grad=True)
    taps = torch.randn(3, 3, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(causal_downsample, (x, taps))
    assert torch.autograd.gradgradcheck(causal_downsample, (x, taps))  # create_graph: the expression's graph
    # strided x (seq-first, transposed), a strided taps row: the same bits as the expression
    xt = torch.randn(9, 2, 5, generator=g).transpose(0, 1)
    tt = torch.randn(5, 2, generator=g).t()
    assert torch.equal(causal_downsample(xt, tt), _downsample_expr(xt, tt))
    # a NaN tap makes its channel NaN everywhere, the zero padding's rows included, as the expression does
    tn = torch.randn(2, 5, generator=g)
    tn[1, 2] = float("nan")
    yn = causal_downsample(xt, tn)
    assert yn[:, :, 2].isnan().all() and not yn[:, :, [0, 1, 3, 4]].isnan().any()
    # x without a gradient (a module's input data): the taps' alone, grad_x not computed
    xd = torch.randn(3, 10, 4, generator=g, dtype=F64)
    td, td2 = [torch.randn(2, 4, generator=torch.Generator().manual_seed(5), dtype=F64, requires_grad=True)
               for _ in range(2)]
    causal_downsample(xd, td).square().sum().backward()
    _downsample_expr(xd, td2).square().sum().backward()
    torch.testing.assert_close(td.grad, td2.grad, rtol=1e-12, atol=1e-12)
    gt = torch.empty(2, 4, dtype=F64)
    hkt._C.downsample_backward(torch.ones(3, 5, 4, dtype=F64), xd, td.detach(), None, gt)
    # with grad = 1: grad_taps[r] sums x[2p - r] over b and p (rows 0, 2, ..., 8 and 1, 3, 5, 7)
    want = torch.stack([xd[:, 0::2].sum((0, 1)), xd[:, 1:-1:2].sum((0, 1))])
    torch.testing.assert_close(gt, want, rtol=1e-12, atol=1e-12)
    # bfloat16 and mixed dtypes go to the expression
    xb = torch.randn(2, 6, 4, generator=g).bfloat16()
    tb = torch.randn(2, 4, generator=g).bfloat16()
    assert torch.equal(causal_downsample(xb, tb), _downsample_expr(xb, tb))
    assert causal_downsample(xb.float(), tb.double()).dtype == F64


def test_downsample_extension_names_bad_arguments():
    x, taps = torch.randn(2, 6, 4), torch.randn(2, 4)
    out = torch.empty(2, 3, 4)
    _C = hkt._C
    with pytest.raises(TypeError, match="^taps: dtype float64 does not match x's float32"):
        _C.downsample_forward(x, taps.double(), out)
    with pytest.raises(TypeError, match="^x: expected float32 or float64, got bfloat16"):
        _C.downsample_forward(x.bfloat16(), taps, out)
    with pytest.raises(ValueError, match="^taps: expected shape \\(K, 4\\)"):
        _C.downsample_forward(x, torch.randn(2, 5), out)
    with pytest.raises(ValueError, match="^x: expected 3 dimensions"):
        _C.downsample_forward(x[0], taps, out)
    with pytest.raises(ValueError, match="^out: expected shape \\(2, 3, 4\\)"):
        _C.downsample_forward(x, taps, torch.empty(2, 4, 4))
    with pytest.raises(ValueError, match="^out: output arrays must be C-contiguous"):
        _C.downsample_forward(x, taps, torch.empty(3, 2, 4).transpose(0, 1))
    buf = torch.randn(60)
    with pytest.raises(ValueError, match="^out: shares memory with the input x"):
        _C.downsample_forward(buf[:48].view(2, 6, 4), taps, buf[30:54].view(2, 3, 4))
    with pytest.raises(ValueError, match="^grad_taps: expected shape \\(2, 4\\)"):
        _C.downsample_backward(out, x, taps, torch.empty_like(x), torch.empty(3, 4))
    with pytest.raises(ValueError, match="^grad: expected shape \\(2, 3, 4\\)"):
        _C.downsample_backward(x, x, taps, torch.empty_like(x), torch.empty(2, 4))
    with pytest.raises(ValueError, match="^x: cannot be exported through DLPack"):
        _C.downsample_forward(x.requires_grad_(), taps, out)


# --------------------------------------------------------------------------- levels = 1 is MHA

@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("mask_kind", MASKS)
def test_levels1_equals_mha(cfg_name, mask_kind):
    cfg = CONFIGS[cfg_name]
    if mask_kind.startswith("causal") and ("kdim" in cfg or "vdim" in cfg):
        pytest.skip("causal cases are self-attention")
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.3, dtype=F64, **cfg).eval()  # eval: dropout must be off
    with torch.no_grad():  # nonzero biases everywhere, so a misplaced bias shows
        for p in mha.parameters():
            p.add_(0.1 * torch.randn_like(p))
    m = hkt.MultiheadHKT(8, 2, dropout=0.3, dtype=F64, levels=1, **cfg).eval()
    m.load_state_dict(mha.state_dict(), strict=True)
    for unbatched in (False, True):
        q, k, v, kw, _ = make_inputs(cfg, mask_kind, unbatched)
        # MHA's need_weights=True path uses the mask, which is the semantics followed here (its
        # need_weights=False path drops the mask for is_causal and hides appended slots).
        ref_out, ref_avg = mha(q, k, v, need_weights=True, **kw)
        _, ref_heads = mha(q, k, v, need_weights=True, average_attn_weights=False, **kw)
        out, avg = m(q, k, v, **kw)
        out_h, heads = m(q, k, v, average_attn_weights=False, **kw)
        out_n, none = m(q, k, v, need_weights=False, **kw)
        assert none is None
        for o in (out, out_h, out_n):
            assert o.shape == ref_out.shape
            torch.testing.assert_close(o, ref_out, rtol=1e-10, atol=1e-12)
        assert avg.shape == ref_avg.shape and heads.shape == ref_heads.shape
        torch.testing.assert_close(avg, ref_avg, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(heads, ref_heads, rtol=1e-10, atol=1e-12)


def test_levels1_has_exactly_mha_parameters():
    for cfg in CONFIGS.values():
        mha = nn.MultiheadAttention(8, 2, **cfg)
        m = hkt.MultiheadHKT(8, 2, levels=1, **cfg)
        assert {n: p.shape for n, p in m.named_parameters()} == {n: p.shape for n, p in mha.named_parameters()}


def test_is_causal_without_mask_equals_explicit_mask():
    torch.manual_seed(1)
    m = randomize(hkt.MultiheadHKT(8, 2, dtype=F64, add_bias_kv=True, batch_first=True)).eval()
    x = torch.randn(2, 9, 8, dtype=F64)
    a, wa = m(x, x, x, is_causal=True)
    b, wb = m(x, x, x, attn_mask=torch.ones(9, 9, dtype=torch.bool).triu(1), is_causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    torch.testing.assert_close(wa, wb, rtol=0, atol=1e-13)
    assert wa.shape == (2, 9, 10)
    # The bias_k slot (last column) is visible to every query, the future never.
    assert (wa[:, :, -1] > 0).all()
    assert (wa[:, :, :-1].triu(1) == 0).all()


# --------------------------------------------------------------------------- levels > 1

@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("levels", [2, 3])
def test_module_matches_spec_construction(cfg_name, levels):
    cfg = CONFIGS[cfg_name]
    m = randomize(hkt.MultiheadHKT(8, 2, dtype=F64, levels=levels, downsample_kernel=3, **cfg), seed=levels).eval()
    mask_kinds = ["none", "am_and_kpm", "am3_float", "kpm_float"]
    if "kdim" not in cfg and "vdim" not in cfg:
        mask_kinds += ["causal", "causal_kpm"]
    for mask_kind, unbatched in itertools.product(mask_kinds, (False, True)):
        q, k, v, kw, bf = make_inputs(cfg, mask_kind, unbatched, T=7, S=9)
        out, P = m(q, k, v, average_attn_weights=False, **kw)
        ref_out, ref_P = manual_hkt(m, **bf)
        torch.testing.assert_close(to_batch_first(out, cfg, unbatched), ref_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(P, ref_P[0] if unbatched else ref_P, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("levels", [2, 3])
def test_from_mha_equals_mha(cfg_name, levels):
    cfg = CONFIGS[cfg_name]
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(8, 2, dtype=F64, **cfg).eval()
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(0.1 * torch.randn_like(p))
    m = hkt.MultiheadHKT.from_mha(mha, levels=levels)
    assert not m.training and m.levels == levels and m.batch_first == mha.batch_first
    torch.testing.assert_close(m.level_weights()[:, 0], torch.full((2,), 0.5, dtype=F64))
    mask_kinds = ["none", "am_and_kpm", "am3_float"]
    if "kdim" not in cfg and "vdim" not in cfg:
        mask_kinds += ["causal_kpm"]
    for mask_kind in mask_kinds:
        q, k, v, kw, _ = make_inputs(cfg, mask_kind, T=13, S=11)
        ref_out, ref_w = mha(q, k, v, **kw)
        out, w = m(q, k, v, **kw)
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w, ref_w, rtol=1e-10, atol=1e-12)
    # The coarse levels are live: a coarse query changes the output.
    with torch.no_grad():
        m.coarse_q_proj_weight[-1].normal_()
    assert not torch.allclose(m(q, k, v, **kw)[0], ref_out, atol=1e-6)


def test_from_mha_level0_weight_and_errors():
    mha = nn.MultiheadAttention(8, 2)
    m = hkt.MultiheadHKT.from_mha(mha, levels=4, level0_weight=0.8)
    torch.testing.assert_close(m.level_weights(), torch.tensor([[0.8] + [0.2 / 3] * 3] * 2))
    with pytest.raises(ValueError, match="level0_weight"):
        hkt.MultiheadHKT.from_mha(mha, level0_weight=1.0)
    with pytest.raises(TypeError, match="mha"):
        hkt.MultiheadHKT.from_mha(nn.Linear(8, 8))


@pytest.mark.parametrize("T", [13, 37])
@pytest.mark.parametrize("how", ["is_causal", "float_mask", "bool_mask_and_is_causal"])
def test_causality(T, how):
    torch.manual_seed(T)
    m = randomize(hkt.MultiheadHKT(8, 2, dtype=F64, levels=3, downsample_kernel=3, batch_first=True), seed=T).eval()
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    kw = {"is_causal": dict(is_causal=True),
          "float_mask": dict(attn_mask=torch.zeros(T, T, dtype=F64).masked_fill(causal, NEG_INF)),
          "bool_mask_and_is_causal": dict(attn_mask=causal, is_causal=True)}[how]
    x = torch.randn(2, T, 8, dtype=F64)
    out = m(x, x, x, need_weights=False, **kw)[0]
    for t in sorted({0, 1, 4, 7, T // 2, T - 2}):
        y = x.clone()
        y[:, t + 1:] = torch.randn_like(y[:, t + 1:])
        out_y = m(y, y, y, need_weights=False, **kw)[0]
        torch.testing.assert_close(out_y[:, :t + 1], out[:, :t + 1], rtol=0, atol=1e-13)
        assert (out_y[:, t + 1:] - out[:, t + 1:]).abs().amax(-1).min() > 1e-6
    # Control: without the mask the future leaks into position 0.
    y = x.clone()
    y[:, -1] += 1.0
    assert not torch.allclose(m(y, y, y)[0][:, 0], m(x, x, x)[0][:, 0], atol=1e-6)


# --------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("case,fast", [("self_causal", False), ("cross_extras", True)])
def test_gradcheck(case, fast):
    torch.manual_seed(3)
    if case == "self_causal":
        m = hkt.MultiheadHKT(4, 2, dtype=F64, levels=3, batch_first=True)
        x = torch.randn(2, 5, 4, dtype=F64)
        inputs, kw = (x, x, x), dict(key_padding_mask=torch.tensor([[0.0, 0, 0, 0, -1.5], [0, 0, 0, NEG_INF, 0]],
                                                                    dtype=F64), is_causal=True)
    else:
        m = hkt.MultiheadHKT(4, 2, dtype=F64, levels=3, kdim=3, vdim=5, add_bias_kv=True, add_zero_attn=True)
        inputs = (torch.randn(5, 2, 4, dtype=F64), torch.randn(6, 2, 3, dtype=F64), torch.randn(6, 2, 5, dtype=F64))
        kw = dict(attn_mask=torch.rand(5, 6) < 0.3)
    randomize(m, seed=4)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    if case == "self_causal":
        inputs = inputs[:1]

    def f(*args):
        ps, xs = args[:len(params)], args[len(params):]
        xs = xs * 3 if len(xs) == 1 else xs
        return functional_call(m, dict(zip(names, ps)), tuple(xs), dict(kw, average_attn_weights=False))

    assert torch.autograd.gradcheck(f, (*params, *inputs), fast_mode=fast)


def _split_route(qkv, q, k, v, w, mask, causal, dropout_p):
    """The self-attention call as it was before qkv_attention: hkt_attention on
    the heads split off qkv (autograd concatenates their gradients)."""
    return hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)


NATIVE_BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not hkt._C.cpu_has_bf16(), reason="no native bfloat16 on this CPU"))


@pytest.mark.parametrize("dtype", [torch.float32, F64, NATIVE_BF16])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_self_attention_gradient_is_written_whole(dtype, kv_heads, monkeypatch):
    # Self-attention projects q, k and v in one product; the kernels write their gradients
    # straight into one tensor shaped like its output, where autograd would concatenate three
    # (a copy of the whole projection).  Same bits as that route, dropout and masks included.
    # bfloat16: where the kernels run it natively (they write its gradients in bfloat16).
    monkeypatch.setattr(hkt._core.kernels, "native_bf16", True)
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(16, 4, levels=3, dropout=0.2, batch_first=True, num_kv_heads=kv_heads, dtype=dtype)
    randomize(m, seed=1)
    x = torch.randn(2, 13, 16, dtype=dtype, requires_grad=True)
    am = torch.randn(13, 13, dtype=dtype, requires_grad=True)
    kpm = torch.zeros(2, 13, dtype=torch.bool)
    kpm[1, 9:] = True

    def step():
        for t in (x, am, *m.parameters()):
            t.grad = None
        torch.manual_seed(7)  # the dropout seed
        out = m(x, x, x, attn_mask=am, key_padding_mask=kpm, is_causal=True, need_weights=False)[0]
        with torch.profiler.profile() as prof:
            out.backward(torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(out.shape))
        cats = [e for e in prof.events() if e.name == "aten::cat"]
        return [out.detach(), x.grad, am.grad, *[p.grad for p in m.parameters()]], cats

    got, cats = step()
    assert not cats, "the q, k, v gradients were concatenated"
    monkeypatch.setattr(hkt.nn.modules, "qkv_attention", _split_route)
    want, cats = step()
    assert cats  # the split route does concatenate: the check above can fail
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _step_grads(m, x, **kw):
    """out, x's gradient and the parameters', and whether autograd concatenated q, k, v gradients."""
    for t in (x, *m.parameters()):
        t.grad = None
    out = m(x, x, x, need_weights=False, **kw)[0]
    with torch.profiler.profile() as prof:
        out.float().square().sum().backward()
    cats = any(e.name == "aten::cat" for e in prof.events())
    return [out.detach(), x.grad, *[p.grad for p in m.parameters()]], cats


@pytest.mark.skipif(not hkt._C.cpu_has_bf16(), reason="no native bfloat16 on this CPU")
def test_self_attention_whole_gradient_under_autocast(monkeypatch):
    """float32 parameters under bfloat16 autocast: the projection comes out in
    bfloat16 and the packed route takes it, with the level weights cast as
    hkt_attention casts them; the same bits as the split route."""
    monkeypatch.setattr(hkt._core.kernels, "native_bf16", True)
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(32, 4, levels=3, batch_first=True, num_kv_heads=2)
    randomize(m, seed=4)
    x = torch.randn(2, 37, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, cats = _step_grads(m, x, is_causal=True)
    assert not cats and got[0].dtype == torch.bfloat16
    monkeypatch.setattr(hkt.nn.modules, "qkv_attention", _split_route)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, cats = _step_grads(m, x, is_causal=True)
    assert cats
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(not hkt._C.cpu_has_bf16(), reason="no native bfloat16 on this CPU")
def test_self_attention_backward_follows_a_native_switch(monkeypatch):
    """hkt._core.kernels.native_bf16 switched off between a bfloat16 module's forward
    and its backward: the backward upcasts (as hkt_attention's does) and still
    gives the gradient, close to the native one."""
    monkeypatch.setattr(hkt._core.kernels, "native_bf16", True)
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(32, 4, levels=3, batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(2, 33, 32).to(torch.bfloat16).requires_grad_()
    native, _ = _step_grads(m, x)
    out = m(x, x, x, need_weights=False)[0]
    x.grad = None
    monkeypatch.setattr(hkt._core.kernels, "native_bf16", False)
    out.float().square().sum().backward()
    torch.testing.assert_close(x.grad, native[1], rtol=0.05, atol=0.05)


def test_self_attention_double_backward():
    torch.manual_seed(2)
    m = hkt.MultiheadHKT(4, 2, levels=2, batch_first=True, dtype=F64)
    randomize(m, seed=3)
    x = torch.randn(2, 5, 4, dtype=F64, requires_grad=True)
    f = lambda x: m(x, x, x, is_causal=True, need_weights=False)[0]  # noqa: E731
    g = torch.randn(2, 5, 4, dtype=F64)
    # the differentiable backward gives the first derivatives the kernels' backward gives
    plain = torch.autograd.grad(f(x), [x, *m.parameters()], g)
    graph = torch.autograd.grad(f(x), [x, *m.parameters()], g, create_graph=True)
    for a, b in zip(plain, graph):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradgradcheck(f, (x,))


def _loss(m, x, mem=None, **kw):
    mem = x if mem is None else mem
    out, w = m(x, mem, mem, **kw)
    return (out ** 2).mean() + (0.0 if w is None else (w * torch.linspace(0, 1, w.shape[-1])).sum())


def test_every_parameter_gets_a_finite_nonzero_gradient_from_scratch():
    torch.manual_seed(5)
    m = hkt.MultiheadHKT(8, 2, levels=3, add_bias_kv=True, kdim=6, vdim=6)
    x, mem = torch.randn(11, 2, 8), torch.randn(9, 2, 6)
    _loss(m, x, mem, need_weights=False, is_causal=True).backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n


def test_from_mha_parameters_all_learn_after_one_step():
    torch.manual_seed(6)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    m = hkt.MultiheadHKT.from_mha(mha, levels=3)
    x = torch.randn(2, 11, 8)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    _loss(m, x, need_weights=False).backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    # Documented: the coarse queries and level weights learn from the first step.
    assert m.coarse_q_proj_weight.grad.abs().sum((1, 2)).gt(0).all()
    assert (m.level_logits.grad != 0).all()
    opt.step()
    opt.zero_grad()
    _loss(m, x, need_weights=False).backward()
    for n, p in m.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        if n.endswith("downsample") or n.startswith("coarse"):
            for l in range(p.shape[0]):  # every level, not just one
                assert p.grad[l].abs().sum() > 0, (n, l)
        assert p.grad.abs().sum() > 0, n


# --------------------------------------------------------------------------- module plumbing

def test_dropout_random_in_training_off_in_eval():
    torch.manual_seed(7)
    m = hkt.MultiheadHKT(8, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 10, 8)
    torch.manual_seed(0)
    a = m(x, x, x, need_weights=False)[0]
    b = m(x, x, x, need_weights=False)[0]
    torch.manual_seed(0)
    c = m(x, x, x, need_weights=False)[0]
    assert not torch.allclose(a, b)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    m.eval()
    d, e = m(x, x, x)[0], m(x, x, x)[0]
    torch.testing.assert_close(d, e, rtol=0, atol=0)
    no_drop = copy.deepcopy(m)
    no_drop.dropout = 0.0
    torch.testing.assert_close(d, no_drop(x, x, x)[0], rtol=0, atol=0)
    m.train()
    assert not torch.allclose(m(x, x, x)[0], d)


def test_state_dict_round_trip():
    torch.manual_seed(8)
    m = randomize(hkt.MultiheadHKT(8, 2, levels=3, add_bias_kv=True, kdim=5, vdim=7)).eval()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    m2 = hkt.MultiheadHKT(8, 2, levels=3, add_bias_kv=True, kdim=5, vdim=7).eval()
    assert set(m2.state_dict()) == set(m.state_dict()) >= {
        "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj.weight",
        "q_downsample", "k_downsample", "coarse_q_proj_weight", "coarse_k_proj_weight", "level_logits"}
    q, k, v = torch.randn(6, 2, 8), torch.randn(9, 2, 5), torch.randn(9, 2, 7)
    assert not torch.allclose(m2(q, k, v)[0], m(q, k, v)[0])
    m2.load_state_dict(torch.load(buf), strict=True)
    for a, b in zip(m(q, k, v), m2(q, k, v)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_device_dtype_and_errors():
    m = hkt.MultiheadHKT(8, 2, dtype=F64, levels=3)
    assert all(p.dtype == F64 for p in m.parameters())
    assert all(p.device.type == "meta" for p in hkt.MultiheadHKT(8, 2, device="meta", kdim=4).parameters())
    x = torch.randn(5, 2, 8, dtype=F64)
    with pytest.raises(ValueError, match="query"):
        m(x[..., :6], x, x)
    with pytest.raises(ValueError, match="attn_mask"):
        m(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="levels"):
        hkt.MultiheadHKT(8, 2, levels=0)
    with pytest.raises(ValueError, match="divisible"):
        hkt.MultiheadHKT(8, 3)


@pytest.mark.skipif(not (torch.cuda.is_available() and hkt._core.kernels.has_cuda), reason="needs CUDA build and GPU")
def test_cuda_matches_cpu():
    torch.manual_seed(9)
    m = randomize(hkt.MultiheadHKT(8, 2, dtype=F64, levels=3)).eval()
    x = torch.randn(13, 2, 8, dtype=F64)
    ref = m(x, x, x, is_causal=True)
    mc = copy.deepcopy(m).cuda()
    out = mc(x.cuda(), x.cuda(), x.cuda(), is_causal=True)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- swap_attention

class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
        self.a = shared
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8, dtype=F64)), shared])
        self.deep = nn.Sequential(nn.Sequential(nn.MultiheadAttention(8, 4, kdim=3, vdim=3, dtype=F64)))

    def forward(self, x, mem):
        x = x + self.a(x, x, x)[0]
        x = x + self.blocks[1](self.blocks[0](x), x, x, need_weights=False)[0]
        t = x.transpose(0, 1)
        return t + self.deep[0][0](t, mem, mem)[0]


def test_swap_attention_replaces_all_and_keeps_output():
    torch.manual_seed(10)
    model = Toy().eval()
    model.deep.train()
    ref_model = copy.deepcopy(model)
    x, mem = torch.randn(2, 7, 8, dtype=F64), torch.randn(5, 2, 3, dtype=F64)
    assert hkt.swap_attention(model, levels=2, downsample_kernel=3) is model
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    assert sum(isinstance(m, hkt.MultiheadHKT) for m in model.modules()) == 2  # shared one stays shared
    assert model.a is model.blocks[1] and model.a.levels == 2 and model.a.downsample_kernel == 3
    assert not model.a.training and model.deep[0][0].training
    assert all(p.dtype == F64 for p in model.parameters())
    model.deep.eval()
    ref_model.deep.eval()
    torch.testing.assert_close(model(x, mem), ref_model(x, mem), rtol=1e-10, atol=1e-12)
    mha = nn.MultiheadAttention(8, 2)
    assert isinstance(hkt.swap_attention(mha), hkt.MultiheadHKT)


def test_swap_attention_shared_in_one_parent():
    """One attention held twice by the same parent (a ModuleList, or two
    attributes): both places get the one new module."""
    mha = nn.MultiheadAttention(8, 2)
    pair = hkt.swap_attention(nn.ModuleList([mha, mha]))
    assert isinstance(pair[0], hkt.MultiheadHKT) and pair[0] is pair[1]

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(8, 2)
            self.b = self.a
    tied = hkt.swap_attention(Tied())
    assert isinstance(tied.a, hkt.MultiheadHKT) and tied.a is tied.b


@pytest.mark.parametrize("levels", [1, 3])
def test_from_mha_keeps_what_trains(levels):
    """A frozen attention stays frozen (a fine-tune with a frozen backbone must
    not start training it); a partly frozen one keeps its frozen copies frozen,
    and hkt's own parameters train."""
    mha = nn.MultiheadAttention(8, 2, kdim=6, vdim=5)
    mha.requires_grad_(False)
    new = hkt.MultiheadHKT.from_mha(mha, levels)
    assert not any(p.requires_grad for p in new.parameters())
    mha.requires_grad_(True)
    mha.k_proj_weight.requires_grad_(False)
    mha.out_proj.bias.requires_grad_(False)
    new = hkt.MultiheadHKT.from_mha(mha, levels)
    frozen = {n for n, p in new.named_parameters() if not p.requires_grad}
    assert frozen == {"k_proj_weight", "out_proj.bias"}
    x, kv, v = torch.randn(2, 4, 8), torch.randn(2, 4, 6), torch.randn(2, 4, 5)
    new(x, kv, v)[0].sum().backward()
    assert new.k_proj_weight.grad is None and new.q_proj_weight.grad is not None


# --------------------------------------------------------------------------- inside nn.Transformer*

def _encoder(batch_first=True, seed=11):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


def test_swapped_encoder_trains():
    enc = hkt.swap_attention(_encoder(), levels=3)
    head = nn.Linear(32, 32)
    opt = torch.optim.Adam(list(enc.parameters()) + list(head.parameters()), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    T = 16
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    losses = []
    for step in range(30):
        x = torch.randn(8, T, 32, generator=g)
        target = x.cumsum(1) / torch.arange(1, T + 1)[:, None]  # running mean of the prefix
        loss = ((head(enc(x, mask=mask, is_causal=True)) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses


def _randomize_coarse(model):
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, hkt.MultiheadHKT):
                for p in (m.coarse_q_proj_weight, m.level_logits, m.q_downsample):
                    p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("batch_first", [True, False])
def test_swapped_encoder_eval_same_with_and_without_no_grad(batch_first):
    enc = _encoder(batch_first)
    hkt.swap_attention(enc, levels=3)
    _randomize_coarse(enc)
    enc.eval()
    x = torch.randn(3, 10, 32)
    if not batch_first:
        x = x.transpose(0, 1)
    kpm = torch.zeros(3, 10, dtype=torch.bool)
    kpm[1, 6:] = True
    mask = nn.Transformer.generate_square_subsequent_mask(10)
    for kw in (dict(), dict(src_key_padding_mask=kpm), dict(mask=mask, is_causal=True), dict(mask=mask)):
        with_grad = enc(x, **kw)
        with torch.no_grad():
            no_grad = enc(x, **kw)
        keep = ~kpm if "src_key_padding_mask" in kw else torch.ones_like(kpm)
        if not batch_first:
            with_grad, no_grad = with_grad.transpose(0, 1), no_grad.transpose(0, 1)
        torch.testing.assert_close(no_grad[keep], with_grad[keep], rtol=1e-5, atol=1e-5)


def test_hkt_runs_inside_encoder_layer_in_eval_no_grad(monkeypatch):
    """The fused fast path must not run: count calls to it and to hkt_attention,
    with an unswapped layer as the control that it would have run."""
    fused, nested, calls = [], [], []
    real_fused, real_nested = torch._transformer_encoder_layer_fwd, torch._nested_tensor_from_mask
    real_hkt, real_qkv = hkt.nn.modules.hkt_attention, hkt.nn.modules.qkv_attention
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: fused.append(1) or real_fused(*a))
    monkeypatch.setattr(torch, "_nested_tensor_from_mask",
                        lambda *a, **k: nested.append(1) or real_nested(*a, **k))
    # the module's two ways into the attention (self-attention takes qkv_attention)
    monkeypatch.setattr(hkt.nn.modules, "hkt_attention", lambda *a, **k: calls.append(1) or real_hkt(*a, **k))
    monkeypatch.setattr(hkt.nn.modules, "qkv_attention", lambda *a, **k: calls.append(1) or real_qkv(*a, **k))
    x = torch.randn(3, 10, 32)
    kpm = torch.zeros(3, 10, dtype=torch.bool)
    kpm[1, 6:] = True

    control = _encoder().eval()
    with torch.no_grad():
        control(x, src_key_padding_mask=kpm)
        control.layers[0](x)
    assert fused and nested and not calls, "control: the fast path should run for plain MHA"

    fused.clear(), nested.clear()
    enc = hkt.swap_attention(_encoder(), levels=3)
    _randomize_coarse(enc)
    enc.eval()
    layer = enc.layers[0]
    with torch.no_grad():
        out = layer(x)
        out_enc = enc(x, src_key_padding_mask=kpm)
        # The layer's slow path written out, with the HKT module's own forward.
        expect = layer.norm1(x + layer.self_attn(x, x, x, need_weights=False)[0])
        expect = layer.norm2(expect + layer.linear2(layer.activation(layer.linear1(expect))))
        as_mha = nn.MultiheadAttention(32, 4, batch_first=True)
        as_mha.load_state_dict({n: p for n, p in layer.self_attn.state_dict().items() if n in as_mha.state_dict()})
        mha_out = layer.norm1(x + as_mha.eval()(x, x, x, need_weights=False)[0])
    assert not fused and not nested
    assert len(calls) == 1 + 2 + 1
    assert torch.isfinite(out_enc).all()
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(layer.norm2(mha_out + layer.linear2(layer.activation(layer.linear1(mha_out)))),
                              out, atol=1e-3)


def test_swapped_decoder_forward_backward_and_eval():
    torch.manual_seed(13)
    layer = nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
    dec = nn.TransformerDecoder(layer, 2)
    ref = copy.deepcopy(dec).eval()
    hkt.swap_attention(dec, levels=3)
    assert sum(isinstance(m, hkt.MultiheadHKT) for m in dec.modules()) == 4  # self + cross, 2 layers
    tgt, mem = torch.randn(2, 11, 16), torch.randn(2, 7, 16)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(11)
    mem_kpm = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    kw = dict(tgt_mask=tgt_mask, tgt_is_causal=True, memory_key_padding_mask=mem_kpm)
    out = dec(tgt, mem, **kw)
    out.square().mean().backward()
    for n, p in dec.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    dec.eval()
    with torch.no_grad():
        torch.testing.assert_close(dec(tgt, mem, **kw), ref(tgt, mem, **kw), rtol=1e-5, atol=1e-5)
    _randomize_coarse(dec)
    with torch.no_grad():
        a = dec(tgt, mem, **kw)
    torch.testing.assert_close(dec(tgt, mem, **kw), a, rtol=1e-6, atol=1e-6)
    # Causal in the target: later target tokens do not change earlier outputs.
    tgt2 = tgt.clone()
    tgt2[:, 6:] += 1.0
    with torch.no_grad():
        torch.testing.assert_close(dec(tgt2, mem, **kw)[:, :6], a[:, :6], rtol=1e-6, atol=1e-6)


def test_dropout_seed_comes_from_the_cpu_whatever_the_default_device():
    """The dropout seed was drawn on torch's default device: inside
    ``with torch.device("meta")`` (a model built there, say) every call with
    dropout on CPU tensors raised 'Tensor.item() cannot be called on meta
    tensors', where SDPA and nn.MultiheadAttention run.  The same draws from
    the CPU generator now, inside or outside, so the same results."""
    m = hkt.MultiheadHKT(16, 2, batch_first=True, dropout=0.3, levels=3).double().train()
    x = torch.randn(2, 10, 16, dtype=torch.float64, requires_grad=True)
    q, k, v, w = [x[:1, None, :T, :8] for T in (10, 5, 3)], [x[1:, None, :T, 8:] for T in (10, 5, 3)], \
        x[:1, None, :, 8:], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)

    def run():
        torch.manual_seed(7)
        out = m(x, x, x)[0]
        att = hkt.hkt_attention(q, k, v, w, dropout_p=0.3)
        grads = torch.autograd.grad(out.sum() + att.sum(), [x, *m.parameters()], create_graph=True)
        return [out, att, *grads]

    want = run()
    with torch.device("meta"):
        got = run()
    for a, b in zip(got, want):
        assert a.device.type == "cpu" and torch.equal(a, b)


@pytest.mark.parametrize("call", ["functional", "self", "cross", "packed"])
def test_a_call_graph_is_freed_without_the_cycle_collector(call):
    """The eager Functions kept (out, lse, mask) on ctx, and out's grad_fn is
    that ctx: a reference cycle, so each call's graph, with the inputs it saved
    and everything upstream, waited for Python's cycle collector (a training
    loop of causal T=4096 calls held 0.5 GB more at its peak than SDPA's), or,
    with gc off, was never freed.  Every hkt node of a call must die with its
    output, gc off."""
    import gc
    import weakref
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(16, 2, batch_first=True, levels=3, pack_padding=(call == "packed"))
    x = torch.randn(2, 10, 16, requires_grad=True)
    q = [torch.randn(1, 2, n, 8, requires_grad=True) for n in (10, 5, 3)]
    run = {"functional": lambda: hkt.hkt_attention(q, q, q[0], torch.ones(3) / 3, is_causal=True),
           "self": lambda: m(x, x, x)[0],
           "cross": lambda: m(x, x[:, :7], x[:, :7])[0],
           "packed": lambda: m(x, x, x, key_padding_mask=torch.arange(10)[None] >= torch.tensor([10, 6])[:, None])[0]}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        out = run[call]()
        nodes, todo = [], [out.grad_fn]
        while todo:  # the graph's Python-defined nodes: hkt's autograd Functions
            f = todo.pop()
            if f is not None:
                if isinstance(f, torch.autograd.function.BackwardCFunction):
                    nodes.append(weakref.ref(f))
                todo.extend(n for n, _ in f.next_functions)
        assert nodes
        out.sum().backward()
        del out, f
        alive = [type(r()).__name__ for r in nodes if r() is not None]
        assert not alive, alive
    finally:
        if was_enabled:
            gc.enable()
