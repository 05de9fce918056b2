"""research.longrange: the tasks ask what they hid, a run resumes exactly, --smoke writes its records."""
import json

import pytest
import torch

from research import longrange as lr
from research.resumable import Stop
from helpers import one_thread  # noqa: F401  (autouse fixture: one torch thread)

SMALL = dict(lr.DEFAULTS, train_len=64, window=8, d_model=16, heads=2, layers=1, ff=32, batch_size=2, steps=6,
             warmup=2, chunk=3, max_pos=256)


@pytest.mark.parametrize("T", [64, 301])
def test_passkey_queries_ask_for_the_hidden_digits(T):
    tok, tgt, facts = lr.make_batch("passkey", T, 4, torch.Generator().manual_seed(T))
    for b in range(4):
        needle = (tok[b, :, 1] >= lr.VALUE) & (tok[b, :, 1] < lr.VALUE + 10)
        assert int(needle.sum()) == lr.PASSKEY_DIGITS
        at = int(needle.nonzero()[0])
        assert facts["depth"][b] == at / T
        digit_of_slot = {int(tok[b, at + i, 0]): int(tok[b, at + i, 1]) - lr.VALUE for i in range(lr.PASSKEY_DIGITS)}
        asked = (tgt[b] != lr.IGNORE).nonzero().flatten()
        assert asked.tolist() == list(range(T - lr.PASSKEY_DIGITS, T))
        for i in asked:
            assert int(tok[b, i, 1]) == lr.QUERY
            assert int(tgt[b, i]) == digit_of_slot[int(tok[b, i, 0])]


@pytest.mark.parametrize("n_pairs", lr.MQAR_PAIRS)
def test_mqar_answers_are_the_keys_values(n_pairs):
    tok, tgt, facts = lr.make_batch("mqar", 128, 3, torch.Generator().manual_seed(n_pairs), n_pairs=n_pairs)
    for b in range(3):
        pairs = {int(k): int(v) - lr.VALUE for k, v in tok[b] if lr.VALUE <= int(v) < lr.NONE}
        assert len(pairs) == n_pairs == int(facts["n_pairs"][b])
        asked = (tgt[b] != lr.IGNORE).nonzero().flatten()
        assert len(asked) == min(n_pairs, lr.MQAR_QUERIES)
        for i in asked:
            assert int(tok[b, i, 1]) == lr.QUERY
            assert int(tgt[b, i]) == pairs[int(tok[b, i, 0])]


def test_flag_changes_the_answer():
    tok, tgt, _ = lr.make_batch("flag", 100, 8, torch.Generator().manual_seed(0))
    for b in range(8):
        flag = int(tok[b, (tok[b, :, 0] == lr.FLAG).nonzero()[0, 0], 1]) - lr.VALUE
        for i in (tgt[b] != lr.IGNORE).nonzero().flatten():
            x = int(tok[b, i, 1]) - lr.VALUE
            assert int(tgt[b, i]) == (x + 5 * flag) % 10


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="task"):
        lr.make_batch("copy", 64, 1, torch.Generator())


def test_arms_have_parameters_within_five_percent():
    counts = {arm: lr._params(arm, lr.DEFAULTS, lr.arm_ff(arm, lr.DEFAULTS)) for arm in lr.ARMS}
    assert max(counts.values()) / min(counts.values()) < 1.05, counts


def test_cost_grows_as_the_arm_says():
    cfg = lr.DEFAULTS
    f = {arm: [lr.attention_flops(arm, T, cfg) for T in (4096, 16384)] for arm in lr.ARMS}
    assert f["swa"][1] / f["swa"][0] == pytest.approx(4, rel=0.01)  # O(T W)
    assert f["full"][1] / f["full"][0] == pytest.approx(16, rel=0.01)  # O(T^2)
    assert f["swa"][1] < f["hkt_win"][1] < f["hkt"][1] and f["hkt_win"][1] < f["full"][1]
    # one more query adds its own visits: W single keys, W keys in blocks of 2, the rest in blocks of 4
    a, b = lr._visits("hkt_win", 8192, 64), lr._visits("hkt_win", 8193, 64)
    assert b[0] - a[0] == pytest.approx(3 * 64 + 2 * 64 / 2 + (8193 - 128) / 4)
    assert lr._visits("swa", 10, 64) == (55, 55)


def test_a_stopped_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    whole, _ = lr.train_run("passkey", "hkt_win", 0, SMALL, None)
    made = {"n": 0}
    real = lr.make_batch

    def stop_after_three(*a, **kw):
        made["n"] += 1
        if made["n"] == 3:
            Stop.requested = True
        return real(*a, **kw)

    monkeypatch.setattr(lr, "make_batch", stop_after_three)
    try:
        with pytest.raises(KeyboardInterrupt):
            lr.train_run("passkey", "hkt_win", 0, SMALL, str(tmp_path))
    finally:
        Stop.requested = False
    monkeypatch.setattr(lr, "make_batch", real)
    resumed, facts = lr.train_run("passkey", "hkt_win", 0, SMALL, str(tmp_path))
    assert facts["steps"] == 6
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(SystemExit, match="--ckpt-dir"):
        lr.train_run("passkey", "hkt_win", 0, dict(SMALL, lr=1e-2), str(tmp_path))


def test_smoke_end_to_end(tmp_path):
    out = tmp_path / "lr.json"
    lr.main(["--smoke", "--steps", "2", "--n-eval", "3", "--out", str(out), "--threads", "1"])
    results = json.loads(out.read_text())
    recs = results["records"]
    assert "cpu" in results["machine"] and "torch" in results["machine"]  # every figure names its machine
    assert {(r["task"], r["arm"]) for r in recs} == {(t, a) for t in ("passkey", "mqar") for a in lr.ARMS}
    for r in recs:
        assert r["length"] == r["train_length"] == 1024 and r["seed"] == 0 and r["steps"] == 2
        assert r["tokens"] == 2 * lr.DEFAULTS["batch_size"] * 1024
        assert r["seconds_per_step"] > 0 and r["flops_per_step"] > 0 and r["parameters"] > 0
        assert 0 <= r["accuracy"] <= 1 and r["metric"] == "accuracy" and len(r["by_depth"]) == lr.DEPTH_BINS
        assert ("by_n_pairs" in r) == (r["task"] == "mqar")
    # the table and the plot are written from the same file
    paper = tmp_path / "paper.md"
    paper.write_text("# Paper\n\n## Long-range recall\n\nold\n\n## Next\n\nkept\n")
    lr.main(["--table", "--out", str(out), "--paper", str(paper), "--plot", str(tmp_path / "lr.png")])
    text = paper.read_text()
    assert text.index("old") < text.index("| hkt_win |") < text.index("## Next\n\nkept")
    lr.main(["--table", "--out", str(out), "--paper", str(paper), "--plot", str(tmp_path / "lr.png")])
    assert paper.read_text() == text  # written again in place, not twice
    assert (tmp_path / "lr.png").stat().st_size > 0


def test_time_lengths_times_each_arm_and_skips_past_the_budget():
    rows = lr.time_lengths(SMALL, [64, 256], ["swa", "full"], budget_s=1e-9)
    assert [(r["arm"], r["length"]) for r in rows] == [("swa", 64), ("swa", 256), ("full", 64), ("full", 256)]
    assert all(r["seconds_per_step"] > 0 for r in rows if r["length"] == 64)
    assert all(r["seconds_per_step"] is None and "estimated" in r["why"] for r in rows if r["length"] == 256)
