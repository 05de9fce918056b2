"""research: tiny training runs that write JSON, on every task's loader."""
import json
import math

import pytest
import torch
from torch import nn

import hkt
import research.data
from research import build_model, load_task, train_classifier
from research import listops_compare, reproduce
from research import train as train_cli

from data_fixtures import write_fake_cifar, write_fake_imdb

TINY = ["--seq-len", "32", "--d-model", "16", "--heads", "2", "--layers", "1", "--ff", "32", "--n-train", "64",
        "--n-test", "32", "--no-progress", "--threads", "1"]
TINY_KW = dict(seq_len=32, d_model=16, heads=2, layers=1, ff=32, progress=False)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("attention", ["standard", "hkt"])
def test_train_cli_writes_json(tmp_path, attention):
    out = tmp_path / "sub" / "run.json"
    res = train_cli.main(["--task", "listops", "--attention", attention, "--seed", "1", "--steps", "4",
                          "--out", str(out)] + TINY)
    with open(out) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(res))
    assert saved["task"] == "listops" and saved["attention"] == attention and saved["seed"] == 1
    assert saved["steps"] == 4
    assert 0.0 <= saved["accuracy"] <= 1.0
    assert saved["accuracy"] * 32 == pytest.approx(round(saved["accuracy"] * 32))  # a fraction of 32 test examples
    assert saved["time_per_step"] > 0 and math.isfinite(saved["final_loss"])
    assert saved["config"]["levels"] == (3 if attention == "hkt" else 1)
    assert saved["config"]["n_train"] == 64 and saved["config"]["seq_len"] == 32


def test_models_differ_only_in_attention():
    std = build_model("listops", "standard", seq_len=32, seed=0, d_model=16, heads=2, layers=2, ff=32)
    hk = build_model("listops", "hkt", seq_len=32, seed=0, d_model=16, heads=2, layers=2, ff=32, levels=3)
    assert not any(isinstance(m, hkt.MultiheadHKT) for m in std.modules())
    assert sum(isinstance(m, hkt.MultiheadHKT) for m in hk.modules()) == 2
    assert not any(isinstance(m, nn.MultiheadAttention) for m in hk.modules())
    assert all(m.levels == 3 for m in hk.modules() if isinstance(m, hkt.MultiheadHKT))
    # the swap keeps the function: same logits before training, in train and eval mode
    x, _ = research.data.generate_listops(4, 32, seed=0)
    x[0, 20:] = 0  # some padding
    for mode in (True, False):
        std.train(mode)
        hk.train(mode)
        torch.testing.assert_close(hk(x), std(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="attention"):
        build_model("listops", "linear")


def test_training_learns_and_is_deterministic():
    data = load_task("listops", seq_len=32, n_train=64, n_test=32)
    kw = dict(steps=80, lr=3e-3, warmup=5, data=data, **TINY_KW)
    r1 = train_classifier("listops", "hkt", seed=0, **kw)
    r2 = train_classifier("listops", "hkt", seed=0, **kw)
    assert r1["final_loss"] == r2["final_loss"] and r1["accuracy"] == r2["accuracy"]
    assert r1["final_loss"] < 2.15  # from log(10) = 2.30 at the start
    assert r1["train_accuracy"] > 0.2  # fits some of its 64 examples; chance is 0.1


def test_cifar_and_imdb_tasks(tmp_path):
    write_fake_cifar(str(tmp_path))
    write_fake_imdb(str(tmp_path))
    xtr, ytr, xte, yte = load_task("cifar", data_dir=str(tmp_path))
    assert xtr.shape == (15, 1024) and xte.shape == (2, 1024)
    r = train_classifier("cifar", "hkt", steps=2, batch_size=4, data_dir=str(tmp_path), d_model=8, heads=2,
                         layers=1, ff=16, progress=False)
    assert r["config"]["seq_len"] == 1024 and 0 <= r["accuracy"] <= 1
    r = train_classifier("imdb", "standard", steps=2, batch_size=2, seq_len=64, data_dir=str(tmp_path),
                         d_model=8, heads=2, layers=1, ff=16, progress=False)
    assert r["config"]["n_train"] == 5 and r["config"]["n_test"] == 2
    with pytest.raises(FileNotFoundError, match="aclImdb"):
        load_task("imdb", data_dir=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="1024"):
        load_task("cifar", seq_len=512, data_dir=str(tmp_path))


def test_summarise():
    runs = [{"attention": a, "seed": s, "accuracy": acc, "time_per_step": t}
            for a, s, acc, t in [("hkt", 1, 0.5, 0.3), ("hkt", 0, 0.7, 0.2), ("standard", 0, 0.4, 0.1),
                                 ("standard", 1, 0.4, 0.2), ("hkt", 2, 0.6, 0.25), ("standard", 2, 0.4, 0.15)]]
    s = reproduce.summarise(runs)
    assert s["hkt"] == [0.7, 0.5, 0.6] and s["standard"] == [0.4, 0.4, 0.4]  # by seed
    assert s["summary"]["hkt"]["mean"] == pytest.approx(0.6)
    assert s["summary"]["hkt"]["std"] == pytest.approx(0.1)  # sample std
    assert s["summary"]["standard"]["std"] == 0.0
    assert s["time_per_step"]["hkt"] == 0.25 and s["time_per_step"]["standard"] == 0.15
    assert s["time_per_step"]["overhead"] == pytest.approx(0.25 / 0.15)


def test_reproduce_cli(tmp_path):
    out = tmp_path / "listops.json"
    reproduce.main(["--task", "listops", "--seeds", "0", "1", "--steps", "2", "--out", str(out)] + TINY)
    with open(out) as f:
        res = json.load(f)
    assert len(res["hkt"]) == 2 and len(res["standard"]) == 2
    assert res["config"]["seeds"] == [0, 1] and res["config"]["hkt_levels"] == 3
    assert set(res["time_per_step"]) == {"hkt", "standard", "overhead"}
    assert [r["attention"] for r in res["runs"]] == ["standard", "hkt", "standard", "hkt"]


def test_demo_prints_table(capsys):
    res = listops_compare.main(["--steps", "2"] + TINY)
    out = capsys.readouterr().out
    assert "standard" in out and "HKT (L=3)" in out and "1.3125" in out
    assert set(res) == {"standard", "hkt"}
    overhead = res["hkt"]["time_per_step"] / res["standard"]["time_per_step"]
    assert f"{overhead:.2f}x" in out


def test_no_steps_no_nan_in_json(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        train_classifier("listops", "hkt", steps=0, n_train=16, n_test=8, **TINY_KW)
    with pytest.raises(ValueError):  # NaN is not JSON: refused, never written
        train_cli.write_json({"x": float("nan")}, str(tmp_path / "nan.json"))
    res = train_classifier("listops", "hkt", steps=1, n_train=16, n_test=8, **TINY_KW)
    assert math.isfinite(res["time_per_step"])


def test_theory_one_level_writes_null_rate(tmp_path, monkeypatch):
    from hkt import analysis
    from research import theory
    monkeypatch.setattr(analysis, "measured_cost_ratio", lambda *a, **k: 1.0)  # the kernel count: not tested here
    theory.main(["--out", str(tmp_path), "--T", "16", "--max-levels", "1"])
    text = (tmp_path / "theory.json").read_text()
    assert "NaN" not in text
    curves = json.loads(text)["approximation_error"]
    assert all(c["rate"] is None and len(c["error"]) == 1 for c in curves.values())


def test_n_train_zero_is_refused_and_imdb_counts_are_exact(tmp_path):
    for kw in (dict(n_train=0), dict(n_test=0)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            load_task("listops", seq_len=32, **kw)
    write_fake_imdb(str(tmp_path))  # train: 3 positive, 2 negative reviews
    for n, labels in ((1, [0]), (3, [0, 0, 1]), (4, [0, 0, 1, 1])):
        xtr, ytr, _, _ = load_task("imdb", seq_len=16, n_train=n, data_dir=str(tmp_path))
        assert ytr.tolist() == labels and len(xtr) == n
