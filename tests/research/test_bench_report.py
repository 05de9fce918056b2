"""How the benchmarks report a run: targets met, not met, or not applicable on
the machine (bfloat16's where the CPU has no native bfloat16), and a run whose
instruction sets were narrowed by environment variables says so, in the results
and in the README block built from them."""
import statistics

from research import timing
from helpers import load_benchmark



def readme_tables():
    return load_benchmark("readme_tables")


def test_targets_met_not_met_and_not_applicable(capsys):
    rows = timing.report_targets([("a", 0.9, "<=", 1.0), ("b", 1.1, "<=", 1.0), ("c", 1.2, ">=", 1.5),
                                  ("d", 1.0, ">=", 1.5, "no native bfloat16 here"), ("e", 2.0, ">=", 1.5, None)])
    assert [r["met"] for r in rows] == [True, False, False, None, True]
    assert rows[3]["not_applicable"] == "no native bfloat16 here" and "not_applicable" not in rows[4]
    printed = capsys.readouterr().out
    assert "n/a" in printed and printed.count("NOT MET") == 2
    table = "\n".join(readme_tables().targets_block(rows))
    assert "| d | >= 1.5 | 1 | n/a: no native bfloat16 here |" in table
    assert table.count("**not met**") == 2


def test_a_restricted_run_says_so(monkeypatch):
    for k in timing.ISA_LIMITS:
        monkeypatch.delenv(k, raising=False)
    plain = timing.machine_info()
    assert plain["isa_limits"] == {} and "restricted" not in timing.describe_machine(plain)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("HKT_CPU_KERNELS", "avx2")
    info = timing.machine_info()
    assert info["isa_limits"] == {"HKT_CPU_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert "restricted by HKT_CPU_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2" in timing.describe_machine(info)
    line = readme_tables().machine_line(info, 2)
    assert line.endswith("instruction sets restricted by `HKT_CPU_KERNELS=avx2` `ATEN_CPU_CAPABILITY=avx2`")


def test_ratios_are_taken_round_by_round():
    # a's call takes half of b's on a machine that runs at full speed, then at
    # half speed: each round's ratio is 0.5 (but for one whose slowing came
    # between a's call and b's); the two medians, one taken in a fast round
    # and the other in a slow one, give 0.25 or 1.0 by where the phases fall
    times = {"a": [1.0, 1.0, 1.0, 2.0, 2.0], "b": [2.0, 2.0, 4.0, 4.0, 4.0]}
    assert timing.paired_ratio(times, "a", "b") == 0.5
    assert statistics.median(times["a"]) / statistics.median(times["b"]) == 0.25
    times = {"a": [1.0, 1.0, 2.0, 2.0, 2.0], "b": [2.0, 2.0, 2.0, 4.0, 4.0]}
    assert timing.paired_ratio(times, "a", "b") == 0.5
    assert statistics.median(times["a"]) / statistics.median(times["b"]) == 1.0
    calls = []
    rounds = timing.time_rounds({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, repeats=3, warmup=1)
    assert calls == ["x", "y"] + ["x", "y"] * 3  # warm-up, then round-robin
    assert [len(v) for v in rounds.values()] == [3, 3] and all(t >= 0 for v in rounds.values() for t in v)
