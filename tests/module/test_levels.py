"""hkt.Levels owns the levels above level 0 and hkt.LevelCache their decoding
state (issue 47, item 4): MultiheadHKT is a Levels with level 0, its levels'
parameters keep their names, decoding state lives in the cache, and
modules.py stays a thin shell."""
import ast
import pathlib

import pytest
import torch

import hkt
import hkt.kvcache
import hkt.decoding.level_cache

ROOT = pathlib.Path(__file__).resolve().parents[2]
F64 = torch.float64


def test_multihead_is_levels_with_its_parameter_names():
    m = hkt.MultiheadHKT(16, 4, num_kv_heads=2, levels=3, dtype=F64)
    assert isinstance(m, hkt.Levels)
    # 0.2.0's names in 0.2.0's order (which optimiser state follows): level 0's
    # own, then the levels', then out_proj's
    assert [n for n, _ in m.named_parameters()] == [
        "in_proj_weight", "in_proj_bias", "q_downsample", "k_downsample", "coarse_q_proj_weight",
        "coarse_k_proj_weight", "coarse_q_proj_bias", "coarse_k_proj_bias", "level_logits", "out_proj.weight",
        "out_proj.bias"]
    other = hkt.MultiheadHKT(16, 4, kdim=8, vdim=8, add_bias_kv=True, levels=2, bias=False)
    assert [n for n, _ in other.named_parameters()] == [
        "q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k", "bias_v", "q_downsample", "k_downsample",
        "coarse_q_proj_weight", "coarse_k_proj_weight", "level_logits", "out_proj.weight"]
    assert m.coarse_k_proj_weight.shape == (2, 8, 16) and m.level_logits.shape == (4, 3)
    one = hkt.MultiheadHKT(16, 4, levels=1)
    assert one.level_logits is None and one.coarse_projections() == []
    assert torch.equal(one.level_weights(), torch.ones(4, 1))


def test_coarse_projections_are_the_levels_of_level_projections():
    m = hkt.MultiheadHKT(16, 2, levels=4, bias=False)
    coarse, every = m.coarse_projections(), m.level_projections()
    assert len(coarse) == 3 and len(every) == 4
    for (a, b) in zip(coarse, every[1:]):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))
    assert coarse[0][1] is None  # bias=False


def test_coarse_heads_match_the_definition():
    """MHALevels.coarse_levels: downsample each stream with its taps, project
    with each level's projection, split into heads (the reference's route)."""
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(12, 3, levels=3, batch_first=True, dtype=F64)
    with torch.no_grad():
        m.q_downsample.normal_()
        m.k_downsample.normal_()
    x = torch.randn(2, 9, 12, dtype=F64)
    qs, ks = m.coarse_levels(x, x)
    def downsample(x, taps):  # x_l[p] = sum_r taps[r] x[2p - r], zero before the start, as a gather
        idx = 2 * torch.arange((x.shape[1] + 1) // 2)[:, None] - torch.arange(taps.shape[0])[None, :]
        return (x[:, idx.clamp(min=0)] * (idx >= 0)[None, :, :, None].to(x.dtype) * taps).sum(2)

    xq, xk = x, x
    for l in range(1, 3):
        xq, xk = downsample(xq, m.q_downsample[l - 1]), downsample(xk, m.k_downsample[l - 1])
        want_q = torch.nn.functional.linear(xq, m.coarse_q_proj_weight[l - 1], m.coarse_q_proj_bias[l - 1])
        want_k = torch.nn.functional.linear(xk, m.coarse_k_proj_weight[l - 1], m.coarse_k_proj_bias[l - 1])
        n = -(-9 // 2**l)
        assert qs[l - 1].shape == (2, 3, n, 4)
        torch.testing.assert_close(qs[l - 1], want_q.view(2, n, 3, 4).transpose(1, 2), rtol=0, atol=1e-12)
        torch.testing.assert_close(ks[l - 1], want_k.view(2, n, 3, 4).transpose(1, 2), rtol=0, atol=1e-12)


def test_the_cache_is_a_level_cache_and_holds_the_state():
    m = hkt.MultiheadHKT(16, 2, levels=3, batch_first=True).eval()
    cache = m.init_cache(2, 20)
    assert type(cache) is hkt.LevelCache and repr(cache).startswith("LevelCache(batch_size=2, length=0,")
    assert cache.length == 0 and len(cache.k) == 3 and len(cache.inputs) == 2
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        m.decode(x[:, :5], cache)
        m.decode(x[:, 5:6], cache)
        want = m(x[:, :6], x[:, :6], x[:, :6], is_causal=True, need_weights=False)[0]
        got = m.decode(x[:, 6:7], cache)
    assert cache.length == 7
    full = m(x, x, x, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, full[:, 6:7], rtol=1e-5, atol=1e-6)
    assert want.shape == (2, 6, 16)
    with pytest.raises(TypeError, match="cache: expected the LevelCache of mha.init_cache"):
        m.decode(x[:, :1], object())
    with pytest.raises(ValueError, match="batch_size: must be at least 1"):
        m.init_cache(0, 4)


def test_kvcache_keeps_only_the_functional():
    assert hkt.kvcache.__all__ == ["hkt_attention_with_kvcache"]
    tree = ast.parse((ROOT / "hkt" / "kvcache.py").read_text())
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert top <= {"hkt_attention_with_kvcache", "_any_requires_grad", "_check_decode_inputs", "_decode_op"}, top


def test_modules_is_a_thin_shell():
    text = (ROOT / "hkt" / "nn" / "modules.py").read_text()
    assert len(text.splitlines()) <= 600
    (cls,) = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "MultiheadHKT"]
    assert cls.end_lineno - cls.lineno + 1 <= 450


def test_converted_layers_hold_levels():
    ht = pytest.importorskip("hkt.integrations.transformers", reason="transformers is not installed",
                             exc_type=ImportError)
    lv = ht.HKTLevels(4, 2, 8, 3, 2, 0.5)
    assert isinstance(lv, hkt.Levels)
    assert [n for n, _ in lv.named_parameters()] == ["q_downsample", "k_downsample", "coarse_q_proj",
                                                     "coarse_k_proj", "level_logits"]
    x = torch.randn(1, 4, 11, 8)
    coarse = lv.coarse_heads(x, "q")
    assert [c.shape for c in coarse] == [(1, 4, 6, 8), (1, 4, 3, 8)]
    q0 = torch.randn(1, 4, 11, 8)
    k0 = torch.randn(1, 2, 11, 8)
    assert torch.allclose(lv.level_weights(), torch.tensor([[0.5, 0.25, 0.25]] * 4))  # convex, as every Levels'
    w = lv.scaled_level_weights()
    assert torch.allclose(w, torch.tensor([[0.5 / 0.5, 0.25 / 0.5, 0.25 / 0.5]] * 4))  # level 0's starts at 1
    assert torch.equal(ht.HKTLevels(4, 2, 8, 1, 2, 0.5).level_weights(), torch.ones(4, 1))  # Levels' signature
    with torch.no_grad():
        lv.prefill(q0, k0, k0, w, None, None, 0.0, True)
    assert isinstance(lv.decode_state, ht.decoding.HeadLevelCache) and lv.decode_state.length == 11
