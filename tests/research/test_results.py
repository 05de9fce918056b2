"""The committed results of the long runs parse and hold at least 3 finished seeds per arm.

Structure only, not the numbers: the figures are what the runs measured, and the
README quotes them.  A results file is added to RESULTS once its runs have all
finished (a run still in progress holds fewer seeds and would fail here).
"""
import json
import math
import pathlib

import pytest

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[2] / "results"
MIN_SEEDS = 3

# file -> the final metric each finished run records
RESULTS = {
    "listops512.json": "accuracy",
    "lm1024.json": "val_bpb",
    "lm1024_time.json": "val_bpb",
}


def _load(name):
    with open(RESULTS_DIR / name) as f:
        return json.load(f)


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_results_file_has_three_finished_seeds_per_arm(name):
    metric = RESULTS[name]
    data = _load(name)
    arms = data["arms"]
    assert len(arms) >= 2, f"{name}: a comparison needs at least two arms"
    for arm in arms:
        done = [r for r in data["runs"] if r["arm"] == arm and r["finished"]]
        seeds = {r["seed"] for r in done}
        assert len(seeds) >= MIN_SEEDS, f"{name}: arm {arm} has finished seeds {sorted(seeds)}"
        for r in done:
            assert r["step"] == r["steps"] > 0, f"{name}: {arm} seed {r['seed']} finished at {r['step']}"
            assert math.isfinite(r[metric]), f"{name}: {arm} seed {r['seed']}: {metric} {r[metric]}"
            assert r["history"], f"{name}: {arm} seed {r['seed']} has no curve"
        # the summary counts every finished seed
        assert data["summary"][arm]["n"] == len(done), f"{name}: summary of {arm}"


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_results_file_has_time_per_step_for_every_arm(name):
    data = _load(name)
    for arm in data["arms"]:
        assert data["time_per_step"][arm] > 0, f"{name}: time per step of {arm}"
