"""benchmarks/bench_convert.py: every kind and measure is timed against the original, and issue 58's targets are read right."""
import json

import pytest

from helpers import load_benchmark

pytest.importorskip("transformers")


def _load():
    return load_benchmark("bench_convert")


def test_targets_by_length():
    bc = _load()
    assert bc.target("llama", "windows", "prefill", 1024) == 0.95
    assert bc.target("llama", "windows", "prefill", 16384) == 0.6
    assert bc.target("llama", "windows", "prefill", 4096) is None
    assert bc.target("llama", "levels=3", "token", 4096) == 1.05
    assert bc.target("mistral", "levels=3", "token", 512) is None


def test_quick_run(tmp_path):
    bc = _load()
    out = tmp_path / "bc.json"
    rows = bc.main(["--quick", "--threads", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    seen = {(r["model"], r["measure"]) for r in rows}
    assert seen == {(m, w) for m in ("llama", "mistral") for w in ("prefill", "train", "token")}
    for r in rows:
        assert set(r["ratio"]) == set(bc.KINDS[r["model"]]) - {"original"}
        assert all(v > 0 for v in r["ratio"].values()) and r["seconds"]["original"] > 0
        assert r["missed"] == [k for k, v in r["ratio"].items()
                               if bc.target(r["model"], k, r["measure"], r["length"]) is not None
                               and v > bc.target(r["model"], k, r["measure"], r["length"])]
    assert "| llama | prefill | 64 |" in bc.table(rows)
