"""The softmax's vector exp in each instruction-set build (exp_nonpos_vec in
csrc/cpu/hkt_real.h: AVX-512's with vscalefps, AVX2's with 2^n built from the
rounding's bits) gives the bits of the scalar exp_nonpos of the same build, which
the kernels use for tails, on float bit patterns of every class; so does its
unclamped form (exp_nonpos_vec_le0, the forward's) on every pattern <= 0 or NaN.
A small C program (tests/c/exp_lanes.c) built with the extension's flags, by
GCC and by clang where it is installed, runs the sweep: every 61st bit pattern
here, all 2^32 by hand (`exp_lanes 1`)."""
import os
import platform
import shutil
import subprocess

import pytest

from research.timing import machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "..", "..", "csrc")
# the extension's own flags (setup.py) that can change a computed value: none of
# -ffast-math's; the exp's products are fused by name (madd, the intrinsics)
FLAGS = ["-std=gnu11", "-O3", "-fno-trapping-math", "-ffp-contract=fast"]


def compiler(name):
    cc = shutil.which(name)
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"needs {name} on x86-64 (the instruction-set builds are GCC's and clang's)")
    if not os.path.isfile(os.path.join(CSRC, "cpu", "hkt_real.h")):
        pytest.skip("needs the extension's sources (csrc/) beside tests/")
    return cc


# clang: the first on PATH of its plain name and the versioned ones Debian installs
CLANG = next((c for c in ("clang", "clang-14", "clang-15", "clang-16") if shutil.which(c)), "clang")


@pytest.mark.parametrize("cc_name", ["gcc", CLANG])
@pytest.mark.parametrize("isa,flag", [("AVX2", "avx2"), ("AVX512", "avx512f")])
def test_vector_exp_has_the_scalar_bits(isa, flag, cc_name, tmp_path):
    cc = compiler(cc_name)
    if flag not in machine_info()["flags"]:
        pytest.skip(f"this CPU has no {flag}")
    exe = tmp_path / f"exp_lanes_{isa}"
    subprocess.run([cc, *FLAGS, f"-I{CSRC}", f"-I{os.path.join(CSRC, 'cpu')}", f"-DHKT_ISA_{isa}", os.path.join(HERE, "..", "c", "exp_lanes.c"), "-o",
                    str(exe), "-lm"], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe), "61"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    checked = int(out.stdout.split()[-4])
    assert checked > (1 << 32) // 61, out.stdout  # the sweep ran (and the special values)
