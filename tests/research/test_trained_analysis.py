"""research.trained_analysis on tiny checkpoints in the formats the
training scripts write (long_run for ListOps, bytelm for the language model)."""
import copy
import json
import math

import pytest
import torch

from hkt import analysis as A
from research import long_run
from research import trained_analysis as TA
from hkt import MultiheadHKT

CFG = dict(long_run.ARM_DEFAULTS, seq_len=32, d_model=16, heads=2, layers=2, ff=32, n_train=8, n_test=6, steps=10)


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()  # main() sets its --threads
    yield
    torch.set_num_threads(n)


def _as_if_trained(model, seed=0):
    """Random coarse levels and weights (from_mha starts them switched off),
    different taps in layer 0; layer 1 made to satisfy Prop 3.1 exactly
    (symmetric W W^T forms on shared taps, no biases, convex weights)."""
    g = torch.Generator().manual_seed(seed)
    mods = [m for m in model.modules() if isinstance(m, MultiheadHKT)]
    with torch.no_grad():
        for p in mods[0].parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        m = mods[1]
        E = m.embed_dim
        for p in (m.in_proj_weight, m.coarse_q_proj_weight, m.q_downsample, m.level_logits):
            p.copy_(torch.randn(p.shape, generator=g))
        m.in_proj_weight[E:2 * E] = m.in_proj_weight[:E]
        m.coarse_k_proj_weight.copy_(m.coarse_q_proj_weight)
        m.k_downsample.copy_(m.q_downsample)
        m.in_proj_bias.zero_()
        m.coarse_q_proj_bias.zero_()
        m.coarse_k_proj_bias.zero_()
    return mods


def _listops_checkpoint(tmp_path):
    run = long_run.new_run(CFG, "hkt", 0, CFG["n_train"])
    mods = _as_if_trained(run["model"])
    run["step"] = 3
    run["history"] = [{"step": 3, "loss": 2.0, "accuracy": 0.25}]
    path = str(tmp_path / "hkt_seed0.pt")
    long_run.save_run(run, path, CFG)
    return path, run["model"], mods


def _nested_shape(v):
    shape = []
    while isinstance(v, list):
        shape.append(len(v))
        v = v[0]
    return tuple(shape)


def test_listops_checkpoint_every_section(tmp_path):
    path, model, mods = _listops_checkpoint(tmp_path)
    out = tmp_path / "out"
    res = TA.main(["--checkpoint", path, "--out", str(out), "--examples", "3", "--curve-examples", "2",
                   "--max-levels", "3", "--sweeps", "2", "--crop", "16"])
    on_disk = json.loads((out / "analysis.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert on_disk["summary"] == json.loads(json.dumps(res["summary"]))
    assert res["checkpoint"]["kind"] == "listops" and res["checkpoint"]["step"] == 3
    assert res["checkpoint"]["last_eval"]["accuracy"] == 0.25
    assert len(res["data"]["lengths"]) == 3 and all(8 <= n <= 32 for n in res["data"]["lengths"])
    for p in res["plots"]:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(res["plots"]) == sorted(["weights_psd.png", "maps_layer0.png", "maps_layer1.png",
                                           "approximation_error.png"])
    layers = on_disk["layers"]
    assert [lay["name"] for lay in layers] == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    L, H = 3, 2
    for lay, m in zip(layers, mods):
        assert (lay["levels"], lay["heads"], lay["head_dim"]) == (L, H, 8)
        assert _nested_shape(lay["level_weights"]) == (H, L)
        torch.testing.assert_close(torch.tensor(lay["level_weights"]), torch.softmax(m.level_logits, -1))
        psd, maps = lay["psd"], lay["maps"]
        for key in ("forms_psd", "forms_psd_without_bias", "min_eigenvalue", "relative_min_eigenvalue"):
            assert _nested_shape(psd[key]) == (L, H), key
        for key in ("level_share", "symmetric_fraction", "antisymmetric_fraction"):
            assert _nested_shape(maps[key]) == (L, H), key
        assert _nested_shape(maps["kernel_negative_eigenvalue_fraction"]) == (H,)
        # Props 3.5-3.6: the split is orthogonal, so the energy fractions add up to 1,
        # and sym + anti gives back each level's map
        frac = torch.tensor(maps["symmetric_fraction"]) + torch.tensor(maps["antisymmetric_fraction"])
        torch.testing.assert_close(frac, torch.ones(L, H, dtype=frac.dtype))
        assert maps["reconstruction_error"] < 1e-12
        torch.testing.assert_close(torch.tensor(maps["level_share"]).sum(0), torch.ones(H))
        # Prop 3.1: recomputed independently from the weights
        forms = A.bilinear_forms(copy.deepcopy(m).double())
        mins = torch.linalg.eigvalsh((forms + forms.transpose(-1, -2)) / 2)[..., 0]
        torch.testing.assert_close(torch.tensor(psd["min_eigenvalue"], dtype=torch.float64), mins)
        assert psd["holds"] == (all(all(r) for r in psd["forms_psd"]) and psd["weights_convex"]
                                and psd["shared_downsampling"])
        ap = lay["approximation"]
        assert ap["levels"] == [1, 2, 3] and ap["rank"] == 8 and len(ap["error_per_kernel"]) == 2
        assert all(0 <= e <= 1 for e in ap["error"]) and len(ap["shuffled_positions"]["error"]) == 3
        # level 0 alone does not see positions: shuffling them leaves its error unchanged
        assert ap["shuffled_positions"]["error"][0] == pytest.approx(ap["error"][0], rel=1e-9)
        init = lay["at_init"]  # hkt.swap_attention starts the coarse levels switched off
        assert init["maps"]["level_share"][1] == [0.0, 0.0] and init["maps"]["symmetric_fraction"][2] == [None, None]
        assert init["psd"]["shared_downsampling"]
    # the random layer breaks the condition (taps differ), the constructed one satisfies it
    assert layers[0]["psd"]["holds"] is False and not layers[0]["psd"]["shared_downsampling"]
    assert layers[1]["psd"]["holds"] is True
    assert on_disk["summary"]["psd_holds"] == [False, True]


def test_maps_split_reconstructs_and_is_symmetric(tmp_path):
    _, model, mods = _listops_checkpoint(tmp_path)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(1))
    stats, (lv, sym, anti) = TA._maps_section(mods[0], [x])
    torch.testing.assert_close(sym + anti, lv)
    torch.testing.assert_close(sym, sym.transpose(-1, -2))
    torch.testing.assert_close(anti, -anti.transpose(-1, -2))
    torch.testing.assert_close(lv, A.level_scores(mods[0], x).levels[:, 0].double())
    assert anti.abs().max() > 1e-3  # trained-like forms are not symmetric
    # taps shared and forms symmetric (layer 1): the split of the scores is the scores of the split forms
    assert TA._maps_section(mods[1], [x])[0]["split_of_forms_error"] < 1e-5
    assert stats["split_of_forms_error"] > 1e-3


def test_bytelm_checkpoint(tmp_path):
    from research.bytelm import build_bytelm
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):  # a small corpus; split seed chosen so validation is not empty
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20)
    model = build_bytelm(0, d_model=16, n_layers=1, n_heads=2, levels=2, max_len=64)
    path = str(tmp_path / "lm.pt")
    torch.save({"model": model.state_dict(), "model_config": model.config, "history": [{"step": 5, "val_bpb": 7.0}],
                "corpus": {"python_version": "x", "seed": 0, "val_fraction": 0.3},
                "train_config": {"steps": 5, "seq_len": 24, "seed": 0}}, path)
    res = TA.main(["--checkpoint", path, "--kind", "bytelm", "--out", str(tmp_path / "o"), "--data-root", str(src),
                   "--examples", "2", "--curve-examples", "1", "--max-levels", "2", "--sweeps", "1", "--no-plots"])
    assert res["checkpoint"]["kind"] == "bytelm" and res["data"]["lengths"] == [24, 24]
    (lay,) = res["layers"]
    assert lay["name"] == "blocks.0.attn" and _nested_shape(lay["level_weights"]) == (2, 2)
    assert _nested_shape(lay["maps"]["symmetric_fraction"]) == (2, 2)
    assert res["plots"] == []
    # the untrained reference is the run's own seeded initialisation
    torch.testing.assert_close(torch.tensor(lay["at_init"]["level_weights"]), model.blocks[0].attn.level_weights())


def test_errors(tmp_path):
    path, _, _ = _listops_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="kind"):
        TA.load_trained(path, "bytelm")
    with pytest.raises(ValueError, match="checkpoint"):
        TA.load_trained(str(tmp_path / "missing.pt"))
    torch.save({"foo": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="checkpoint"):
        TA.load_trained(str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="curve_examples"):
        TA.main(["--checkpoint", path, "--out", str(tmp_path / "o"), "--examples", "2", "--curve-examples", "3"])
    with pytest.raises(TypeError, match="module"):
        TA.analyse_layer(torch.nn.Linear(2, 2), [torch.zeros(3, 2)])
    with pytest.raises(ValueError, match="MultiheadHKT"):
        TA.capture_attention_inputs(torch.nn.Embedding(4, 2), torch.zeros(1, 3, dtype=torch.long))
    assert math.isfinite(TA.load_trained(path)[2]["step"])
