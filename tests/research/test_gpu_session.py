"""The GPU session (benchmarks/gpu_session.sh and its parts) where there is no GPU:
its dry run, what the GPU machine would be sent, the bounded test runner, the
timing harness (a setting holds through the backward), the pick of the fastest
"sdpa" variant, and the build for a setuptools older than pyproject.toml asks for."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from hkt._core import kernels as _kernels
from hkt.ops import sdpa as _sdpa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the GPU machine receives at most 64 MiB of working tree; this keeps a margin
TREE_LIMIT = 60 * 2**20
# what comes back from the GPU machine's $OUT: at most 8 files, $OUT/a/b/file deep
OUT_FILES, OUT_DEPTH = 8, 3


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def out_files(out):
    files = [os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs]
    assert len(files) <= OUT_FILES, files
    for f in files:
        parts = f.split(os.sep)
        assert len(parts) <= OUT_DEPTH and all(re.fullmatch(r"[A-Za-z0-9._-]+", p) for p in parts), f
    return sorted(files)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what happens without a GPU")
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash, timeout")
def test_dry_run_ends_within_a_minute_with_its_probe(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    t = time.monotonic()
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    took = time.monotonic() - t
    assert r.returncode == 3, r.stdout + r.stderr
    assert took < 60
    assert "DRY RUN" in r.stdout
    assert out_files(out) == ["probe.json", "session.log"]
    log = (out / "session.log").read_text().splitlines()
    assert "DRY RUN" in log[-2] and "results in" in log[-1]  # the last lines too: tee is waited for
    probe = json.loads((out / "probe.json").read_text())
    assert probe["gpu"] is False and probe["build_blockers"] == []
    assert probe["packages"]["torch"] == torch.__version__
    assert probe["packages"]["cuda_available"] is False
    assert probe["build"]["python_h"].endswith("Python.h") and probe["build"]["omp_h"] == "ok"
    assert probe["machine"]["python"] == sys.executable
    if shutil.which("nvcc"):  # setup.py's own search found the static runtime
        assert probe["build"]["libcudart_static"].endswith("libcudart_static.a")


def what_travels():
    """Tracked files and untracked ones git does not ignore: what the device tool
    copies to the GPU machine (with shared/)."""
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    return list(filter(None, names))


def copy_what_travels(to):
    for n in what_travels():
        if os.path.isfile(os.path.join(ROOT, n)):
            os.makedirs(to / os.path.dirname(n), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, n), to / n)


def test_what_travels_to_the_gpu_machine_fits():
    """What the device tool copies to the GPU machine, which takes at most 64 MiB."""
    sizes = {}
    for n in what_travels():
        p = os.path.join(ROOT, n)
        if os.path.lexists(p):  # a tracked file deleted in the worktree does not travel
            sizes[n] = os.lstat(p).st_size
    shared = os.path.join(ROOT, "shared")
    for d, _, fs in os.walk(shared):
        for f in fs:
            sizes[os.path.relpath(os.path.join(d, f), ROOT)] = os.lstat(os.path.join(d, f)).st_size
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda x: -x[1])[:10]
    assert total < TREE_LIMIT, f"{total / 2**20:.1f} MiB would travel; the largest: {largest}"


# ---- the timing harness (benchmarks/gpu_check.py)

class _Recording(torch.autograd.Function):
    """A stand-in for hkt_attention that records which settings hold in its
    forward and in its backward."""
    seen = []

    @staticmethod
    def forward(ctx, x):
        _Recording.seen.append(("forward", _kernels.cuda_tensor_cores, _sdpa.variant))
        return x * 2

    @staticmethod
    def backward(ctx, g):
        _Recording.seen.append(("backward", _kernels.cuda_tensor_cores, _sdpa.variant))
        return g * 2


@pytest.fixture
def gpu_check(monkeypatch):
    mod = load("benchmarks/gpu_check.py", "gpu_check_under_test")
    monkeypatch.setattr(_kernels, "cuda_tensor_cores", False)
    monkeypatch.setattr(_sdpa, "variant", "auto")
    return mod


def test_a_candidates_setting_holds_through_its_backward(gpu_check, monkeypatch):
    """"tensor cores, forward+backward" must time the tensor-core backward too, and
    each "sdpa" variant its own backward: the setting is left only after
    .backward() has run (the harness once left it before)."""
    monkeypatch.setattr(gpu_check, "_tensor_cores_apply", lambda q, v, device: True)
    monkeypatch.setattr(gpu_check.hkt, "hkt_attention", lambda q, *a, **kw: _Recording.apply(q[0]))
    q, k, v, w = (x for x in gpu_check.inputs(1, 1, 8, 8, 4, 4, 2, torch.float32, torch.device("cpu")))
    gout = torch.ones(1, 1, 8, 4)
    cands = gpu_check.candidates(q, k, v, w, torch.device("cpu"), causal=True)
    want = {"hkt kernels, tensor cores": (True, "auto"), "hkt kernels": (False, "auto"),
            **{f"hkt sdpa, {n}": (False, n) for n in _sdpa.VARIANTS}}
    assert set(want) <= set(cands)
    for name, (tc, variant) in want.items():
        for mode in ("forward", "forward+backward"):
            _Recording.seen = []
            gpu_check.timed_call(cands[name], mode, gout)()
            phases = ["forward"] + (["backward"] if mode == "forward+backward" else [])
            assert _Recording.seen == [(p, tc, variant) for p in phases], (name, mode)
            assert (_kernels.cuda_tensor_cores, _sdpa.variant) == (False, "auto")  # restored after


def test_fastest_variant_per_mode(gpu_check):
    def t(s):
        return {"median_s": s}

    results = {"hkt sdpa, concat": {"causal, forward": t(1.0), "not causal, forward": t(1.0),
                                    "causal, forward+backward": t(3.0), "not causal, forward+backward": t(5.0)},
               "hkt sdpa, pad_v": {"causal, forward": t(0.5), "not causal, forward": t(1.6),
                                   "causal, forward+backward": t(2.0),
                                   "not causal, forward+backward": "skipped: out of time"}}
    got = gpu_check.fastest_variants(results, torch.device("cpu"))
    # forward: 2.0 against 2.1 in all; forward+backward: pad_v has no time for one case
    assert got == {"cpu bfloat16 forward": "concat"}


def test_measured_fastest_is_what_a_committed_gpu_run_recorded():
    """hkt.ops.sdpa.MEASURED_FASTEST ("auto"'s table) holds what a committed GPU
    session measured, and nothing else."""
    path = os.path.join(ROOT, "benchmarks", "results", "gpu_session", "gpu.json")
    recorded = {}
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f).get("sdpa_fastest_variant", {})
    assert _sdpa.MEASURED_FASTEST == recorded
    assert set(recorded.values()) <= set(_sdpa.VARIANTS)


def test_gpu_check_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.py end to end at its small size on the CPU: every step
    writes its part of the report."""
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--device", "cpu",
                        "--quick", "--deadline", "30", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["kernels_bitwise_repeatable"]
    assert max(rep["correctness_float64"]["max_rel_err"].values()) < 1e-9
    assert {f"sdpa, {n} mask=float causal=True" for n in _sdpa.VARIANTS} <= set(rep["correctness_float64"]
                                                                                ["max_rel_err"])
    times = rep["timing"]["results"]
    assert {"SDPA, plain attention (q[0], k[0], v)", "hkt kernels", "hkt sdpa, concat", "hkt sdpa, pad_v"} <= set(times)
    for name in times:
        assert set(times[name]) == {f"{c}, {m}" for c in ("causal", "not causal") for m in ("forward",
                                                                                            "forward+backward")}
    assert set(rep["sdpa_fastest_variant"].values()) <= set(_sdpa.VARIANTS)


# ---- the bounded test runner (benchmarks/gpu_tests.py)

SYNTHETIC_TESTS = '''
import os
import pytest

def test_compiled_goes_last():
    pass

def test_a_pass():
    pass

def test_b_first_failure():
    assert 1 == 2, "the one that matters"

@pytest.mark.skip(reason="needs a CUDA GPU and hkt built with HKT_CUDA=1")
def test_c_skipped_for_want_of_a_gpu():
    pass

def test_d_dies():
    os._exit(7)

def test_e_sticky():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_f_after_the_sticky_error():
    pass
'''


def test_runner_goes_on_after_a_death_and_a_sticky_error(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(SYNTHETIC_TESTS)
    p = {n: str(tmp_path / n) for n in ("progress.jsonl", "summary.json", "log.txt")}
    env = dict(os.environ, HKT_GPU_TESTS_FAKE_STICKY="test_e_sticky")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_tests.py"), "--budget", "200",
                        "--progress", p["progress.jsonl"], "--summary", p["summary.json"], "--log", p["log.txt"],
                        "--", "test_synthetic.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    n = "test_synthetic.py::"
    assert s["first_failure"]["nodeid"] == n + "test_b_first_failure"
    assert "the one that matters" in s["first_failure"]["message"]
    assert "FIRST FAILURE (the one that matters): " + n + "test_b_first_failure" in r.stdout
    assert s["died_in"] == [n + "test_d_dies"]
    assert s["sticky_cuda_errors_after"] == [n + "test_e_sticky"]
    assert s["failed_tests"] == [n + "test_b_first_failure", n + "test_d_dies", n + "test_e_sticky"]
    assert (s["collected"], s["passed"], s["failed"], s["skipped"], s["gpu_skipped"], s["not_run"]) == \
        (7, 3, 2, 1, 1, [])
    assert s["pytest_processes"] == 3  # one died inside a test, one stopped after the sticky error
    assert not s["ok"]
    events = [json.loads(x) for x in open(p["progress.jsonl"])]
    ran = [e["nodeid"] for e in events if e["event"] == "result"]
    assert ran[-1] == n + "test_compiled_goes_last" and ran[-2] == n + "test_f_after_the_sticky_error"


def test_runner_passes_a_clean_run(tmp_path, gpu_check):
    (tmp_path / "test_clean.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n\n"
                                            "def test_left_out():\n    assert False\n")
    p = [str(tmp_path / n) for n in ("progress.jsonl", "summary.json", "log.txt")]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_tests.py"), "--budget", "100",
                        "--progress", p[0], "--summary", p[1], "--log", p[2], "--", "test_clean.py",
                        "--deselect", "test_clean.py::test_left_out"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(open(p[1]).read())
    assert (s["ok"], s["collected"], s["passed"], s["first_failure"], s["pytest_processes"], s["not_run"]) == \
        (True, 2, 2, None, 1, [])
    assert gpu_check.failures_in_tests(s) == []


def test_what_fails_the_check_in_the_test_summary(gpu_check):
    clean = {"collected": 3, "passed": 3, "failed": 0, "error": 0, "skipped": 0, "died": 0, "gpu_skipped": 0,
             "not_run": [], "failed_tests": [], "first_failure": None}
    assert gpu_check.failures_in_tests(clean) == []
    for change, says in (({"passed": 0}, "no test passed"), ({"gpu_skipped": 2, "skipped": 2}, "2 GPU tests skipped"),
                         ({"failed_tests": ["t::a"], "first_failure": {"nodeid": "t::a"}}, "the first: t::a"),
                         ({"not_run": ["t::b"]}, "1 tests not run"), ({"unreadable": "OSError"}, "no test results")):
        got = gpu_check.failures_in_tests({**clean, **change})
        assert len(got) == 1 and says in got[0], (change, got)


# ---- building with an older setuptools (tools/build_inplace.py)

def test_older_pyproject_keeps_everything_but_the_licence_form():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    build = load("tools/build_inplace.py", "build_inplace_under_test")
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    new, old = tomllib.loads(build.older_pyproject(text)), tomllib.loads(text)
    assert isinstance(old["project"]["license"], str), "pyproject.toml's licence is no longer the PEP 639 string"
    assert new["project"]["license"] == {"text": old["project"]["license"]}
    assert "license-files" not in new["project"]
    assert all(not r.startswith("setuptools>") for r in new["build-system"]["requires"])
    for table in (new, old):
        table["project"].pop("license"), table["project"].pop("license-files", None)
        table.pop("build-system")
    assert new == old
    with pytest.raises(ValueError, match="license"):
        build.older_pyproject(build.older_pyproject(text))


@pytest.mark.skipif(not os.environ.get("HKT_TEST_OLD_SETUPTOOLS_PYTHON"),
                    reason="opt-in: HKT_TEST_OLD_SETUPTOOLS_PYTHON=/path/to/python with setuptools < 77 (~2 min)")
def test_build_with_an_older_setuptools(tmp_path):
    """The extension builds with the interpreter named, in a copy of the tree (as
    the GPU machine gets it), and imports."""
    py = os.environ["HKT_TEST_OLD_SETUPTOOLS_PYTHON"]
    copy_what_travels(tmp_path)
    v = subprocess.run([py, "-c", "import setuptools; print(setuptools.__version__)"], capture_output=True,
                       text=True, check=True).stdout
    assert int(v.split(".")[0]) < 77, f"{py} has setuptools {v}: this test is for an older one"
    plain = subprocess.run([py, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, capture_output=True, text=True)
    assert plain.returncode != 0  # why the tool exists: that setuptools rejects pyproject.toml
    subprocess.run([py, "tools/build_inplace.py"], cwd=tmp_path, check=True, capture_output=True)
    r = subprocess.run([sys.executable, "-c", "import hkt; print(hkt._C.__file__)"], cwd=tmp_path,
                       capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert r.stdout.strip().startswith(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("pytest_timeout") is None, reason="needs pytest-timeout")
def test_runner_limits_each_test(tmp_path):
    """A test past its limit (a kernel that never returns, say) ends its process;
    the tests after it run in the next."""
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_a_hangs():\n    time.sleep(60)\n\n"
                                           "def test_b_after():\n    pass\n")
    p = [str(tmp_path / n) for n in ("progress.jsonl", "summary.json", "log.txt")]
    t = time.monotonic()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_tests.py"), "--budget", "100",
                        "--per-test", "3", "--progress", p[0], "--summary", p[1], "--log", p[2], "--", "test_slow.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert r.returncode == 1 and time.monotonic() - t < 50, r.stdout + r.stderr
    s = json.loads(open(p[1]).read())
    assert (s["died_in"], s["passed"], s["not_run"]) == (["test_slow.py::test_a_hangs"], 1, [])
    assert "Timeout" in open(p[2]).read()  # pytest-timeout's report, with the stacks, is in the log


@pytest.mark.skipif(os.environ.get("HKT_TEST_GPU_SESSION_REHEARSAL") != "1",
                    reason="opt-in: HKT_TEST_GPU_SESSION_REHEARSAL=1 (~3 min: it builds hkt._C in a copy)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a rehearsal is what runs without a GPU")
def test_rehearsal_runs_every_step_on_the_cpu(tmp_path):
    """GPU_SESSION_REHEARSAL=1: every step of the session on the CPU, in a copy of
    what travels; it fails only for the GPU tests that skipped."""
    tree, out = tmp_path / "tree", tmp_path / "out"
    copy_what_travels(tree)
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_SESSION_REHEARSAL="1")
    r = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=700)
    assert r.returncode == 1, r.stdout + r.stderr
    assert out_files(out) == ["build.log", "gpu.json", "probe.json", "session.log", "tests.json", "tests.jsonl",
                              "tests.log"]
    rep = json.loads((out / "gpu.json").read_text())
    assert len(rep["failures"]) == 1 and "GPU tests skipped" in rep["failures"][0], rep["failures"]
    assert rep["machine"]["hkt_extension"].startswith(str(tree))
    assert rep["tests_test_cuda"]["passed"] > 0 and rep["tests_test_cuda"]["not_run"] == []
    assert "sdpa_fastest_variant" in rep
