"""Grouped-query and multi-query attention: k and v with H_kv heads, H_kv
dividing H, query head h reading kv head h // (H // H_kv), in the kernels
(forward and backward, no copies), the sdpa backend and MultiheadHKT."""
import pytest
import torch

import hkt
from hkt._core import kernels as _kernels
from hkt.reference import hkt_attention_reference, repeat_kv
from helpers import assert_within_lowp_error, make_mask, sample_inputs, with_threads

# (B, H, H_kv, T, S, D, Dv, L): several groups per batch, MQA, one group, odd lengths
SHAPES = [
    (2, 8, 2, 100, 130, 16, 8, 3),
    (1, 4, 1, 200, 200, 8, 8, 2),
    (2, 6, 3, 70, 70, 5, 7, 1),
    (1, 8, 2, 300, 300, 16, 16, 4),
    (3, 2, 2, 65, 33, 4, 4, 2),
]


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_matches_reference_float64(shape, causal, mask):
    B, H, Hk, T, S, D, Dv, L = shape
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, kv_heads=Hk, requires_grad=True, seed=sum(shape))
    am = make_mask(mask, B, H, T, S, torch.float64)
    if mask == "float":
        am.requires_grad_(True)
    inputs = q + k + [v, w] + ([am] if mask == "float" else [])
    out = hkt.hkt_attention(q, k, v, w, is_causal=causal, attn_mask=am)
    ref = hkt_attention_reference(q, k, v, w, is_causal=causal, attn_mask=am)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    for got, want in zip(_grads(out, inputs, dout), _grads(ref, inputs, dout)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "x".join(map(str, s)))
def test_same_as_repeated_heads(shape):
    """GQA is the kernel run on kv heads repeated H // H_kv times: the forward
    bitwise (same arithmetic), dk and dv the repeated heads' gradients summed."""
    B, H, Hk, T, S, D, Dv, L = shape
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, kv_heads=Hk, requires_grad=True, seed=3)
    kr = [repeat_kv(x.detach(), H).requires_grad_(True) for x in k]
    vr = repeat_kv(v.detach(), H).requires_grad_(True)
    out = hkt.hkt_attention(q, k, v, w, is_causal=True)
    outr = hkt.hkt_attention(q, kr, vr, w, is_causal=True)
    assert torch.equal(out, outr)
    dout = torch.randn_like(out)
    g = _grads(out, k + [v], dout)
    gr = _grads(outr, kr + [vr], dout)
    for got, rep in zip(g, gr):
        summed = rep.reshape(rep.shape[0], got.shape[1], H // got.shape[1], *rep.shape[2:]).sum(2)
        torch.testing.assert_close(got, summed, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(1, 8, 2, 200, 200, 16, 16, 3), (2, 4, 1, 130, 150, 8, 8, 2),
                                   (1, 4, 2, 700, 700, 8, 8, 8)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_same_for_any_thread_count(shape, causal):
    """The shared kv heads' gradients are summed in one fixed order: 1 thread
    (one task per (b, kv head)) and 2-3 threads (when B * H_kv < threads: key
    chunks and query chunks) give the same bits.  L = 8 makes a chunk span
    several key tiles."""
    B, H, Hk, T, S, D, Dv, L = shape
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, kv_heads=Hk, requires_grad=True, seed=11)
    dout = torch.randn(B, H, T, Dv, dtype=torch.float64)

    def run():
        out = hkt.hkt_attention(q, k, v, w, is_causal=causal)
        return [out, *_grads(out, q + k + [v, w], dout)]

    first = with_threads(1, run)
    for n in (2, 3):
        again = with_threads(n, run)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{n} threads differ from 1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_bfloat16(dtype):
    q, k, v, w = sample_inputs(2, 8, 90, 90, 16, 16, 3, kv_heads=2, seed=5)
    assert_within_lowp_error(hkt.hkt_attention, hkt_attention_reference, q, k, v, w, dtype, is_causal=True)


def test_dropout_matches_reference():
    B, H, Hk, T, S, L, p = 2, 4, 2, 40, 50, 2, 0.3
    q, k, v, w = sample_inputs(B, H, T, S, 8, 8, L, kv_heads=Hk, requires_grad=True, seed=9)
    seed = 1234
    out, _ = _kernels._forward(q, k, v, w, None, False, p, None, seed)
    keep = _kernels.dropout_keep_mask(seed, p, B, H, T, S)
    ref = hkt_attention_reference(q, k, v, w, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_sdpa_backend():
    q, k, v, w = sample_inputs(2, 8, 50, 60, 16, 8, 3, kv_heads=2, requires_grad=True, seed=2)
    am = make_mask("bool", 2, 8, 50, 60, torch.float64)
    for causal in (False, True):
        out = hkt.hkt_attention(q, k, v, w, is_causal=causal, attn_mask=am, backend="sdpa")
        ref = hkt_attention_reference(q, k, v, w, is_causal=causal, attn_mask=am)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        dout = torch.randn_like(out)
        for got, want in zip(_grads(out, q + k + [v, w], dout), _grads(ref, q + k + [v, w], dout)):
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_double_backward():
    q, k, v, w = sample_inputs(1, 4, 9, 11, 3, 3, 2, kv_heads=2, requires_grad=True, seed=4)
    assert torch.autograd.gradgradcheck(lambda *a: hkt.hkt_attention(list(a[:2]), list(a[2:4]), a[4], a[5],
                                                                     is_causal=True), (*q, *k, v, w))


def test_compiled_custom_op():
    q, k, v, w = sample_inputs(1, 4, 20, 20, 8, 8, 2, kv_heads=1, dtype=torch.float32, seed=6)
    from torch.library import opcheck
    opcheck(torch.ops.hkt.attention_forward.default,
            (q, k, v, w, None, True, 0.0, 0.35, torch.zeros((), dtype=torch.int64)))


@pytest.mark.parametrize("backend", ["kernels", "sdpa"])
@pytest.mark.parametrize("bad, match", [
    (dict(kv_heads=3), r"k\[0\]: its 3 heads \(H_kv\) must divide q\[0\]'s 8 heads"),
    (dict(v_heads=4), r"^v: "),
    (dict(k1_heads=4), r"^k\[1\]: "),
])
def test_bad_head_counts_name_the_argument(backend, bad, match):
    q, k, v, w = sample_inputs(1, 8, 10, 10, 4, 4, 2, kv_heads=bad.get("kv_heads", 2))
    if "v_heads" in bad:
        v = torch.randn(1, bad["v_heads"], 10, 4, dtype=torch.float64)
    if "k1_heads" in bad:
        k[1] = torch.randn(1, bad["k1_heads"], 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        hkt.hkt_attention(q, k, v, w, backend=backend)


# ---- MultiheadHKT(num_kv_heads=...)

def test_module_num_kv_heads_shapes_and_reference():
    torch.manual_seed(0)
    E, H, Hk = 32, 8, 2
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=3, num_kv_heads=Hk, dtype=torch.float64)
    assert m.in_proj_weight.shape == (E + 2 * E // 4, E)
    assert m.coarse_k_proj_weight.shape == (2, E // 4, E)
    assert "num_kv_heads=2" in repr(m)
    x = torch.randn(2, 37, E, dtype=torch.float64, requires_grad=True)
    out, weights = m(x, x, x, is_causal=True, need_weights=True, average_attn_weights=False)
    assert out.shape == (2, 37, E) and weights.shape == (2, H, 37, 37)
    # the same module with the kv projections' heads repeated computes the same thing
    full = hkt.MultiheadHKT(E, H, batch_first=True, levels=3, dtype=torch.float64)
    with torch.no_grad():
        hd, G = E // H, H // Hk
        rep = lambda wgt: wgt.reshape(Hk, hd, *wgt.shape[1:]).repeat_interleave(G, 0).reshape(E, *wgt.shape[1:])
        wq, wk, wv = m.in_proj_weight.split([E, E // G, E // G])
        bq, bk, bv = m.in_proj_bias.split([E, E // G, E // G])
        full.in_proj_weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        full.in_proj_bias.copy_(torch.cat([bq, rep(bk), rep(bv)]))
        full.out_proj.load_state_dict(m.out_proj.state_dict())
        for name in ("q_downsample", "k_downsample", "coarse_q_proj_weight", "coarse_q_proj_bias", "level_logits"):
            getattr(full, name).copy_(getattr(m, name))
        full.coarse_k_proj_weight.copy_(torch.stack([rep(x) for x in m.coarse_k_proj_weight]))
        full.coarse_k_proj_bias.copy_(torch.stack([rep(x) for x in m.coarse_k_proj_bias]))
    want, _ = full(x, x, x, is_causal=True, need_weights=False)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert m.in_proj_weight.grad is not None and m.coarse_k_proj_weight.grad.abs().sum() > 0


def test_module_num_kv_heads_options_and_script():
    m = hkt.MultiheadHKT(16, 4, num_kv_heads=1, add_bias_kv=True, kdim=8, vdim=6, levels=2)
    q, kv_k, kv_v = torch.randn(5, 2, 16), torch.randn(7, 2, 8), torch.randn(7, 2, 6)
    out, w = m(q, kv_k, kv_v)
    assert out.shape == (5, 2, 16) and w.shape == (2, 5, 8)
    assert m.k_proj_weight.shape == (4, 8) and m.bias_k.shape == (1, 1, 4)
    s = torch.jit.script(hkt.MultiheadHKT(16, 4, num_kv_heads=2, batch_first=True))
    x = torch.randn(2, 9, 16)
    assert s(x, x, x, need_weights=False)[0].shape == (2, 9, 16)


@pytest.mark.parametrize("bad", [0, 3, -1, 2.0, True])
def test_module_bad_num_kv_heads(bad):
    with pytest.raises(ValueError, match="num_kv_heads"):
        hkt.MultiheadHKT(16, 4, num_kv_heads=bad)
