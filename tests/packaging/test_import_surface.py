"""`import hkt` loads the library only, and the wheel holds the library only: the
experiments, their data loaders and the benchmarks' helpers live in research/ of
the source tree."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESEARCH = ("research", "hkt.experiments", "hkt.data", "hkt.analysis", "hkt.timing", "hkt.demo")
# heavy or research-only packages hkt itself must not pull in (torch may load some
# of them on its own: what counts is what `import hkt` adds to `import torch`)
THIRD_PARTY = ("matplotlib", "tqdm", "numpy.testing", "hypothesis", "transformers")


def _modules_after(code):
    out = subprocess.run([sys.executable, "-c", code + "; import json, sys; print(json.dumps(sorted(sys.modules)))"],
                         cwd=ROOT / "tests", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def _under(names, prefixes):
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


def test_import_hkt_loads_the_library_only():
    torch_only = _modules_after("import torch")
    with_hkt = _modules_after("import torch, hkt")
    assert {"hkt", "hkt.functional", "hkt.nn.modules", "hkt.kvcache", "hkt.varlen", "hkt.reference"} <= with_hkt
    assert _under(with_hkt, RESEARCH) == []
    assert _under(with_hkt - torch_only, THIRD_PARTY) == []


def test_analysis_is_there_when_asked_for():
    names = _modules_after("import hkt.analysis")
    assert "hkt.analysis" in names and _under(names, ("matplotlib", "research")) == []


def test_public_names_are_the_library():
    import hkt
    assert set(hkt.__all__) == {"hkt_attention", "hkt_attention_with_kvcache", "hkt_attention_varlen",
                                "varlen_level_offsets", "pack_levels", "MultiheadHKT", "swap_attention", "Levels",
                                "LevelCache", "reference"}
    for name in hkt.__all__:
        assert getattr(hkt, name) is not None, name


@pytest.mark.skipif(not (ROOT / "setup.py").is_file(), reason="needs the source tree")
def test_wheel_python_files_are_the_library_only(tmp_path):
    """What the wheel's Python part is: setuptools' build_py into a folder, the
    step `pip wheel` takes before it compiles (the .so is the only other file)."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files, "build_py copied nothing"
    assert all(f.startswith("hkt/") for f in files), files
    assert "hkt/functional.py" in files and "hkt/analysis.py" in files
    for gone in ("hkt/experiments", "hkt/data", "hkt/timing.py", "hkt/demo.py"):
        assert not any(f.startswith(gone) for f in files), (gone, files)
    assert not any(f.endswith((".pt", ".json", ".png")) for f in files), files
