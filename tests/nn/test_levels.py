"""hkt.Levels owns the levels above level 0 and hkt.LevelCache their decoding
state (issue 47, item 4): MultiheadHKT is a Levels with level 0, its levels'
parameters keep their names, decoding state lives in the cache, and
modules.py stays a thin shell.  Levels is one base with two layouts of the
coarse projections (issue 57, item 2), each giving the same three operations,
with state_dict keys in the order they have always had."""
import ast
import inspect
import io
import pathlib

import pytest
import torch

import hkt
import hkt.kvcache
import hkt.decoding.level_cache
import hkt.nn._mha_levels

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


# ------------------------------------------------ one base, two layouts -------

# state_dict keys in order, as the code before the layouts were split wrote them
MHA_KEYS = ["in_proj_weight", "in_proj_bias", "q_downsample", "k_downsample", "coarse_q_proj_weight",
            "coarse_k_proj_weight", "coarse_q_proj_bias", "coarse_k_proj_bias", "level_logits", "out_proj.weight",
            "out_proj.bias"]
MHA_KDIM_KEYS = ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v",
                 "q_downsample", "k_downsample", "coarse_q_proj_weight", "coarse_k_proj_weight", "coarse_q_proj_bias",
                 "coarse_k_proj_bias", "level_logits", "out_proj.weight", "out_proj.bias"]
LLAMA_LAYER_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight", "self_attn.hkt.q_downsample", "self_attn.hkt.k_downsample",
                    "self_attn.hkt.coarse_q_proj", "self_attn.hkt.coarse_k_proj", "self_attn.hkt.level_logits",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                    "post_attention_layernorm.weight"]


def test_state_dict_keys_keep_their_order_in_both_layouts():
    assert list(hkt.MultiheadHKT(16, 4, levels=3).state_dict()) == MHA_KEYS
    m = hkt.MultiheadHKT(16, 4, kdim=8, vdim=12, add_bias_kv=True, levels=3)
    assert list(m.state_dict()) == MHA_KDIM_KEYS == [n for n, _ in m.named_parameters()]
    assert list(hkt.MultiheadHKT(16, 4, levels=1).state_dict()) == [
        "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    ht = pytest.importorskip("hkt.integrations.transformers", reason="transformers is not installed",
                             exc_type=ImportError)
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = ht.convert(LlamaForCausalLM(config), levels=3)
    keys = list(model.state_dict())
    layers = [f"model.layers.{i}.{k}" for i in range(2) for k in LLAMA_LAYER_KEYS]
    assert keys == ["model.embed_tokens.weight"] + layers + ["model.norm.weight", "lm_head.weight"]
    assert [n for n, _ in model.named_parameters()] == keys


def _layouts():
    ht = pytest.importorskip("hkt.integrations.transformers", reason="transformers is not installed",
                             exc_type=ImportError)
    return [hkt.nn._mha_levels.MHALevels, ht.HKTLevels]


def test_each_layout_gives_the_base_operations_with_their_signatures():
    for name in ("_add_coarse_levels", "_reset_coarse_projections", "coarse_levels"):
        base = getattr(hkt.Levels, name)
        for layout in _layouts():
            assert issubclass(layout, hkt.Levels)
            mine = getattr(layout, name)
            assert mine is not base, f"{layout.__name__} does not give {name}"
            assert inspect.signature(mine) == inspect.signature(base), (layout.__name__, name)
    bare = hkt.Levels(4, 4, 4, 2, 2, None)
    with pytest.raises(NotImplementedError, match="a Levels layout makes its coarse levels"):
        bare.coarse_levels(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))


def test_both_layouts_make_levels_from_their_own_inputs():
    ht = pytest.importorskip("hkt.integrations.transformers", reason="transformers is not installed",
                             exc_type=ImportError)
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(12, 3, levels=3, num_kv_heads=1, batch_first=True, dtype=F64)
    qs, ks = m.coarse_levels(torch.randn(2, 9, 12, dtype=F64), torch.randn(2, 7, 12, dtype=F64))
    assert [x.shape for x in qs] == [(2, 3, 5, 4), (2, 3, 3, 4)] and [x.shape for x in ks] == [(2, 1, 4, 4),
                                                                                              (2, 1, 2, 4)]
    lv = ht.HKTLevels(4, 2, 8, 3, 2, 0.5, dtype=F64)
    q, k = torch.randn(1, 4, 11, 8, dtype=F64), torch.randn(1, 2, 11, 8, dtype=F64)
    qs, ks = lv.coarse_levels(q, k)
    for got, want in zip(qs + ks, lv.coarse_heads(q, "q") + lv.coarse_heads(k, "k")):
        assert torch.equal(got, want)
    assert [x.shape for x in ks] == [(1, 2, 6, 8), (1, 2, 3, 8)]
    assert ht.HKTLevels(4, 2, 8, 1, 2, 0.5).coarse_levels(q, k) == ([], [])
    assert hkt.MultiheadHKT(12, 3, levels=1).coarse_levels(torch.randn(1, 5, 12), torch.randn(1, 5, 12)) == ([], [])


def test_the_head_layout_starts_from_scratch_too():
    """Levels._reset_levels works for both layouts: taps 1/K, level_logits
    zero, and the layout's maps (each head's own xavier_uniform here)."""
    ht = pytest.importorskip("hkt.integrations.transformers", reason="transformers is not installed",
                             exc_type=ImportError)
    torch.manual_seed(0)
    lv = ht.HKTLevels(4, 2, 8, 3, 3, 0.5)
    lv._reset_levels()
    assert (lv.q_downsample == 1 / 3).all() and (lv.k_downsample == 1 / 3).all() and (lv.level_logits == 0).all()
    bound = (6 / (8 + 8)) ** 0.5
    for maps in (lv.coarse_q_proj, lv.coarse_k_proj):
        assert maps.abs().max() <= bound and (maps.flatten(2).std(-1) > 0.1).all()  # every map drawn
    assert torch.equal(lv.level_weights(), torch.full((4, 3), 1 / 3))


@pytest.mark.parametrize("levels", [1, 3])
def test_level_weights_follow_the_module_dtype(levels):
    """levels=1 has no level_logits: level_weights() are ones in the module's
    dtype and on its device, after .to() as at construction, in both layouts,
    and in a module pickled whole before they had a buffer to read."""
    ht = pytest.importorskip("hkt.integrations.transformers", reason="transformers is not installed",
                             exc_type=ImportError)
    for m in (hkt.MultiheadHKT(16, 4, levels=levels), ht.HKTLevels(4, 2, 8, levels, 2, 0.5)):
        assert m.level_weights().dtype == torch.float32 and m.level_weights().shape == (4, levels)
        m.to(F64)
        assert m.level_weights().dtype == F64
        assert "_weights_like" not in m.state_dict()
    old = hkt.MultiheadHKT(16, 4, levels=1, dtype=F64)
    del old._buffers["_weights_like"]
    buf = io.BytesIO()
    torch.save(old, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert torch.equal(back.level_weights(), torch.ones(4, 1, dtype=F64))
    fresh = hkt.MultiheadHKT(16, 4, levels=1, dtype=F64)
    fresh.load_state_dict(old.state_dict())
    x = torch.randn(3, 2, 16, dtype=F64)
    assert torch.equal(back(x, x, x)[0], fresh(x, x, x)[0])


def test_nothing_outside_the_decoding_state_assigns_its_fields():
    """A converted layer's decoding steps ask its HeadLevelCache to change
    (advance, write_blocks, keep_blocks, reorder); only that class assigns
    its fields or its store's."""
    folder = ROOT / "hkt" / "integrations" / "transformers"
    wrong = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        owner = {id(n): c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in ast.walk(c)}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    while isinstance(x, ast.Subscript):
                        x = x.value
                    if isinstance(x, ast.Attribute) and owner.get(id(node)) != "HeadLevelCache":
                        chain = ast.unparse(x.value)
                        if chain.split(".")[-1] in ("state", "decode_state", "store"):
                            wrong.append(f"{path.name}:{node.lineno}: {ast.unparse(t)}")
    assert wrong == []
