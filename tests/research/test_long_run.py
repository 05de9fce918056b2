"""research.long_run: a checkpointed run resumes exactly; the results JSON has its structure."""
import json

import pytest
import torch

import hkt
import research.data
from research import long_run
from research.train import load_task
from helpers import one_thread  # noqa: F401  (autouse fixture: one torch thread)

CFG = dict(task="listops", seq_len=32, seeds=[0, 1], steps=6, warmup=2, batch_size=8, d_model=16, heads=2,
           layers=1, ff=32, matched_ff=40, n_train=20, n_test=16, eval_every=2, chunk=2)


def _cfg(**kw):
    return {**long_run.ARM_DEFAULTS, **CFG, **kw}


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arm", ["hkt", "standard", "standard_ff40"])
def test_resume_matches_uninterrupted(tmp_path, arm):
    cfg = _cfg()
    data = load_task("listops", seq_len=32, n_train=20, n_test=16)  # 20 examples: a new permutation every 2 steps
    full = long_run.new_run(cfg, arm, 0, 20)
    long_run.train_steps(full, cfg, data, 6)
    part = long_run.new_run(cfg, arm, 0, 20)
    long_run.train_steps(part, cfg, data, 3)
    path = str(tmp_path / "ck.pt")
    long_run.save_run(part, path, cfg)
    del part  # "crash"
    torch.manual_seed(12345)  # disturb the global RNG: the checkpoint restores it
    resumed = long_run.load_run(path, cfg, arm, 0, 20)
    assert resumed["step"] == 3
    long_run.train_steps(resumed, cfg, data, 3)
    assert resumed["step"] == full["step"] == 6
    a, b = _weights(full["model"]), _weights(resumed["model"])
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    assert resumed["history"] == full["history"]
    assert resumed["final"] == full["final"]
    with pytest.raises(ValueError, match="another configuration"):
        long_run.load_run(path, _cfg(lr=0.5), arm, 0, 20)


def test_run_all_resumes_and_skips_finished(tmp_path):
    cfg = _cfg()
    ref = long_run.run_all(cfg, str(tmp_path / "a"), str(tmp_path / "a.json"), progress=False)
    # interrupted twice mid-chunk (5 and 7 steps of 36), then run to the end
    long_run.run_all(cfg, str(tmp_path / "b"), str(tmp_path / "b.json"), progress=False, max_steps=5)
    mid = json.loads((tmp_path / "b.json").read_text())
    assert mid["progress"]["steps_done"] == 5 and mid["progress"]["runs_finished"] == 0
    long_run.run_all(cfg, str(tmp_path / "b"), str(tmp_path / "b.json"), progress=False, max_steps=7)
    res = long_run.run_all(cfg, str(tmp_path / "b"), str(tmp_path / "b.json"), progress=False)
    assert res["progress"]["runs_finished"] == 6
    for f in sorted((tmp_path / "a").glob("*.pt")):
        x = torch.load(f, weights_only=False)
        y = torch.load(tmp_path / "b" / f.name, weights_only=False)
        assert y["step"] == x["step"] == 6
        for k in x["model"]:
            torch.testing.assert_close(y["model"][k], x["model"][k], rtol=0, atol=1e-6)
    assert [r["history"] for r in res["runs"]] == [r["history"] for r in ref["runs"]]
    # finished runs are skipped: a further call trains nothing
    again = long_run.run_all(cfg, str(tmp_path / "b"), None, progress=False)
    assert again["progress"]["steps_done"] == 36 and [r["history"] for r in again["runs"]] == \
        [r["history"] for r in ref["runs"]]


def test_results_json_structure(tmp_path):
    out = tmp_path / "r.json"
    long_run.main(["--seq-len", "32", "--seeds", "0", "1", "--steps", "4", "--warmup", "1", "--batch-size", "8",
                   "--d-model", "16", "--heads", "2", "--layers", "1", "--ff", "32", "--matched-ff", "40",
                   "--n-train", "16", "--n-test", "8", "--eval-every", "2", "--chunk", "2", "--max-steps", "10",
                   "--ckpt-dir", str(tmp_path / "ck"), "--out", str(out), "--no-progress", "--threads", "1"])
    res = json.loads(out.read_text())
    assert set(res) == {"config", "arms", "progress", "time_per_step", "summary", "runs"}
    assert set(res["arms"]) == {"hkt", "standard", "standard_ff40"}
    assert res["arms"]["hkt"]["levels"] == 3 and res["arms"]["standard"]["levels"] == 1
    assert res["arms"]["standard_ff40"]["ff"] == 40
    assert all(isinstance(a["params"], int) for a in res["arms"].values())
    assert res["config"]["seq_len"] == 32 and res["config"]["seeds"] == [0, 1]
    p = res["progress"]
    assert p["steps_done"] == 10 and p["steps_total"] == 24 and p["runs"] == 6
    assert len(res["runs"]) == 6
    assert [(r["arm"], r["seed"]) for r in res["runs"]] == [(a, s) for s in (0, 1)
                                                            for a in ("hkt", "standard", "standard_ff40")]
    for r in res["runs"]:
        assert {"arm", "seed", "step", "steps", "finished", "time_per_step", "history"} <= set(r)
        for h in r["history"]:
            assert set(h) == {"step", "loss", "accuracy"} and h["step"] % 2 == 0 and 0 <= h["accuracy"] <= 1
        if r["finished"]:
            assert {"accuracy", "train_accuracy", "final_loss"} <= set(r) and r["step"] == 4
    # seed 0 first, its arms in turns: 4 + 4 + 2 steps
    assert [r["step"] for r in res["runs"]] == [4, 4, 2, 0, 0, 0]
    assert set(res["summary"]) == {"hkt", "standard"} and res["summary"]["hkt"]["n"] == 1
    assert {"hkt", "standard", "standard_ff40", "hkt_over_standard"} == set(res["time_per_step"])
    try:
        import matplotlib  # noqa: F401  (optional: without it, no plot)
        assert (tmp_path / "r.png").stat().st_size > 0
    except ImportError:
        pass


def test_standard_arm_is_mha():
    """The standard arm's MultiheadHKT(levels=1) computes what nn.MultiheadAttention does."""
    cfg = _cfg()
    fast = long_run.make_arm_model(cfg, "standard", 0)
    mha = long_run.make_arm_model(_cfg(standard_impl="mha"), "standard", 0)
    assert sum(isinstance(m, hkt.MultiheadHKT) for m in fast.modules()) == 1
    assert not any(isinstance(m, hkt.MultiheadHKT) for m in mha.modules())
    x, _ = research.data.generate_listops(4, 32, seed=0)
    for mode in (True, False):
        fast.train(mode)
        mha.train(mode)
        torch.testing.assert_close(fast(x), mha(x), rtol=1e-4, atol=1e-5)


def _final_weights(ckpt_dir):
    return {f.name: torch.load(f, weights_only=False) for f in sorted(ckpt_dir.glob("*.pt"))}


def test_dropout_run_resumed_in_pieces_is_bitwise_the_uninterrupted_one(tmp_path):
    # dropout draws from torch's global RNG; the runs take turns, and a resumed call's turns differ
    cfg = _cfg(seeds=[0], dropout=0.1, n_train=32)
    long_run.run_all(cfg, str(tmp_path / "full"), None, progress=False)
    for _ in range(6):  # stops mid-chunk (3 of 2-step chunks), as --max-steps 3 six times
        long_run.run_all(cfg, str(tmp_path / "part"), None, progress=False, max_steps=3)
    full, part = _final_weights(tmp_path / "full"), _final_weights(tmp_path / "part")
    assert sorted(full) == sorted(part) and len(full) == 3
    for name in full:
        assert part[name]["step"] == full[name]["step"] == 6
        for k, v in full[name]["model"].items():
            assert torch.equal(part[name]["model"][k], v), (name, k)
        assert part[name]["history"] == full[name]["history"]


def test_damaged_or_foreign_checkpoints_name_the_file(tmp_path):
    cfg = _cfg(seeds=[0])
    good = tmp_path / "good.pt"
    long_run.save_run(long_run.new_run(cfg, "hkt", 0, 20), str(good), cfg)
    blob = good.read_bytes()
    cases = {"truncated.pt": blob[:len(blob) // 2], "empty.pt": b"", "random.pt": bytes(range(256)) * 8}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    torch.save({"model": {}, "model_config": {}}, tmp_path / "bytelm.pt")  # another tool's checkpoint
    for name in [*cases, "bytelm.pt"]:
        path = str(tmp_path / name)
        with pytest.raises(ValueError, match="checkpoint of research.long_run") as e:
            long_run.load_run(path, cfg, "hkt", 0, 20)
        assert path in str(e.value)
        assert name == "bytelm.pt" or e.value.__cause__ is not None  # the original error kept
    # in the command: a parser error naming --ckpt-dir and the file, before any training
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "hkt_seed0.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        long_run.main(["--seq-len", "32", "--seeds", "0", "--steps", "2", "--d-model", "16", "--heads", "2",
                       "--layers", "1", "--ff", "16", "--n-train", "16", "--n-test", "8", "--no-progress",
                       "--ckpt-dir", str(ck), "--out", str(tmp_path / "o.json")])
    assert e.value.code == 2


def test_long_run_reads_cifar_from_data_dir(tmp_path):
    from data_fixtures import write_fake_cifar
    write_fake_cifar(str(tmp_path / "data"), per_batch=2, n_test=2)
    argv = ["--task", "cifar", "--data-dir", str(tmp_path / "data"), "--seeds", "0", "--steps", "1",
            "--batch-size", "2", "--d-model", "8", "--heads", "2", "--layers", "1", "--ff", "8", "--matched-ff", "12",
            "--levels", "2", "--no-progress", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o.json")]
    res = long_run.main(argv)  # --seq-len defaults to CIFAR's 1024
    assert res["config"]["seq_len"] == 1024 and res["config"]["data_dir"] == str(tmp_path / "data")
    assert res["progress"]["runs_finished"] == 3
    # the checkpoints are of that folder: another one is refused, naming it
    write_fake_cifar(str(tmp_path / "other"), per_batch=2, n_test=2, seed=1)
    with pytest.raises(SystemExit) as e:
        long_run.main([a if a != str(tmp_path / "data") else str(tmp_path / "other") for a in argv])
    assert e.value.code == 2
