"""Every CPU kernel family called from C alone (tests/c/kernels.c, through
csrc/hkt.h and csrc/hkt_window.h, no Python; built with the sources of
csrc/cpu/): the build this machine picks
(its widest instruction set) writes its float64 results, and the portable
16-byte kernels, the ones an AArch64 build runs, are checked against them in
float64 and float32.  `make test-aarch64` runs the same driver built for
AArch64 under qemu against this machine's results."""
import os
import re
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(ROOT, "csrc")
DRIVER = os.path.join(ROOT, "tests", "c", "kernels.c")
# the extension's flags that can change a computed value (setup.py); -O1, not
# -O3, to build in a third of the time: the suite checks the -O3 build itself
FLAGS = ["-std=gnu11", "-O1", "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp"]
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None or not os.path.isfile(DRIVER) or not os.path.isdir(CSRC):
        pytest.skip("needs a C compiler and the sources (csrc/, tests/c/)")
    out = tmp_path_factory.mktemp("c_kernels")
    exe = out / "kernels"
    cpu = os.path.join(CSRC, "cpu")
    sources = sorted(os.path.join(cpu, f) for f in os.listdir(cpu) if f.endswith(".c"))
    build = subprocess.run([cc, *FLAGS, f"-I{CSRC}", DRIVER, *sources, "-o", str(exe), "-lm"], capture_output=True,
                           text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    expected = out / "expected.txt"
    wrote = subprocess.run([str(exe), "--write", str(expected)], capture_output=True, text=True, timeout=300)
    assert wrote.returncode == 0, wrote.stdout + wrote.stderr
    return exe, expected


def run_check(exe, expected):
    env = dict(os.environ, HKT_CPU_KERNELS="default")
    res = subprocess.run([str(exe), "--check", str(expected)], capture_output=True, text=True, env=env, timeout=300)
    lines = res.stdout.strip().splitlines()
    assert lines and SUMMARY.match(lines[-1]), res.stdout + res.stderr
    passed, failed = map(int, SUMMARY.match(lines[-1]).groups())
    return res, passed, failed


def test_portable_kernels_match_the_host_build(driver):
    exe, expected = driver
    res, passed, failed = run_check(exe, expected)
    assert "kernels: default" in res.stdout
    # every family in both dtypes: 142 named results each
    assert (passed, failed) == (284, 0), res.stdout
    assert res.returncode == 0


def test_a_wrong_expected_value_fails(driver, tmp_path):
    """The check can fail: one float64 entry of dense/causal/dv moved by 1e-3
    fails that result in both dtypes (float32 too: its tolerance is 1e-5), and
    nothing else."""
    exe, expected = driver
    lines = expected.read_text().splitlines()
    at = lines.index(next(line for line in lines if line.startswith("dense/causal/dv ")))
    lines[at + 5] = (float.fromhex(lines[at + 5]) + 1e-3).hex()
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("\n".join(lines) + "\n")
    res, passed, failed = run_check(exe, wrong)
    assert (passed, failed) == (282, 2), res.stdout
    assert res.stdout.count("FAIL dense/causal/dv (") == 2, res.stdout
    assert res.returncode == 1
