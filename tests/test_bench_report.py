"""How the benchmarks report a run: targets met, not met, or not applicable on
the machine (bfloat16's where the CPU has no native bfloat16), and a run whose
instruction sets were narrowed by environment variables says so, in the results
and in the README block built from them."""
import importlib.util
import os

from hkt import timing

HERE = os.path.dirname(os.path.abspath(__file__))


def readme_tables():
    path = os.path.join(HERE, "..", "benchmarks", "readme_tables.py")
    spec = importlib.util.spec_from_file_location("readme_tables", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
