"""What a user installing hkt from its sources meets: the source distribution is
whole, an unbuilt or outdated extension says so, the extension names the
libraries it uses, and benchmark records name hkt's own commit only."""
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

import hkt

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = pathlib.Path(hkt.__file__).resolve().parent
in_source_tree = pytest.mark.skipif(not (ROOT / "setup.py").is_file() or PKG != ROOT / "hkt",
                                    reason="needs the source tree hkt was built in")


@in_source_tree
def test_sdist_holds_what_builds_and_tests_it(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True)
    (archive,) = tmp_path.glob("hkt-*.tar.gz")
    with tarfile.open(archive) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    # every C source of every csrc/ folder (the CUDA ones too: HKT_CUDA=1 builds
    # from them), and the tests with the helpers they import
    sources = [p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*")
               if p.suffix in (".c", ".h", ".cu") and not p.name.startswith(".")]
    assert "csrc/cuda/hkt_attention_cuda.cu" in sources and "csrc/binding/module.c" in sources  # the walk sees them
    for path in [*sources, "tests/conftest.py",
                 "tests/helpers.py", "tests/hostile_cases.py", "tests/data_fixtures.py", "docs/contract.md",
                 "examples/quickstart.ipynb", "benchmarks/readme_tables.py", "results/listops512.json", "MANIFEST.in",
                 "research/timing.py"]:
        assert path in names, path
    assert not any(n.endswith(".pt") or "__pycache__" in n for n in names)  # no checkpoints, no bytecode


def _copy_package(dest, with_extension):
    shutil.copytree(PKG, dest / "hkt", ignore=shutil.ignore_patterns("__pycache__", *([] if with_extension else
                                                                                        ["_C*.so"])))


def _import(where, code="import hkt"):
    """code run in a child that imports hkt from where only: an editable
    install's import hook (after the path finder) would find the checkout's hkt._C."""
    only_there = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
                  "if 'Editable' not in getattr(f, '__name__', type(f).__name__)]; ")
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run([sys.executable, "-c", only_there + code], cwd=where, env=env, capture_output=True,
                          text=True, timeout=120)


def test_unbuilt_extension_says_how_to_build_it(tmp_path):
    _copy_package(tmp_path, with_extension=False)
    r = _import(tmp_path)
    assert r.returncode != 0
    assert "ImportError: hkt's C extension (hkt/_C*.so) is not built" in r.stderr, r.stderr
    assert "circular import" not in r.stderr.splitlines()[-1]


@in_source_tree
def test_extension_built_from_other_sources_warns(tmp_path):
    _copy_package(tmp_path, with_extension=True)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    code = "import warnings; warnings.simplefilter('error'); import hkt"
    assert _import(tmp_path, code).returncode == 0  # the sources it was built from: silent
    # what an editor or a user leaves there is no source: an Emacs lock file (a
    # dangling link), a folder named like one
    os.symlink("user@host.1234:1", tmp_path / "csrc" / ".#hkt_binding.c")
    (tmp_path / "csrc" / "old.c").mkdir()
    assert _import(tmp_path, code).returncode == 0
    with open(tmp_path / "csrc" / "hkt.h", "a") as f:
        f.write("/* edited, not rebuilt */\n")
    r = _import(tmp_path, code)
    assert r.returncode != 0 and "RuntimeWarning: hkt._C was built from other C sources" in r.stderr, r.stderr
    # the binding's files, in their own folder, are sources too
    shutil.rmtree(tmp_path / "csrc")
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    with open(tmp_path / "csrc" / "binding" / "module.c", "a") as f:
        f.write("/* edited, not rebuilt */\n")
    r = _import(tmp_path, code)
    assert r.returncode != 0 and "RuntimeWarning: hkt._C was built from other C sources" in r.stderr, r.stderr


def test_extension_names_libm():
    """It calls exp, log and sqrt: libm must be among its own dependencies, not
    borrowed from whatever process loads it."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf")
    out = subprocess.run([readelf, "-d", hkt._C.__file__], capture_output=True, text=True, check=True).stdout
    assert "[libm.so" in out, out


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_is_hkts_own_only(tmp_path):
    """An hkt inside another project's git checkout (a venv in it, say) must not
    report that project's commit as the code it measured."""
    project = tmp_path / "project"
    (project / "site").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-c", "user.name=u", "-c", "user.email=u@example.com", "commit", "-q", "--allow-empty",
                    "-m", "the project's"], cwd=project, check=True)
    _copy_package(project / "site", with_extension=True)
    shutil.copytree(ROOT / "research", project / "site" / "research", ignore=shutil.ignore_patterns("__pycache__"))
    r = _import(project / "site", "from research.timing import _commit; print(_commit())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None"
