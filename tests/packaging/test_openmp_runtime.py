"""One OpenMP runtime per process: hkt._C links libgomp.so.1 (the wheel does
not vendor one: `make wheel` excludes it), and torch ships its own.  Two
runtimes in one process would each keep a thread pool as large as the core
count, and oversubscribe the cores.  Whatever the import order, the process
must map one libgomp / libiomp / libomp file once both have run a parallel
region, and it is torch's own copy where torch ships one."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools")

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)"),
              pytest.mark.skipif(not os.path.isfile(os.path.join(TOOLS, "wheel_check.py")),
                                 reason="needs tools/wheel_check.py (the source tree)")]

# after the imports: a call large enough for hkt's OpenMP region (above
# HKT_PARALLEL_MIN_FLOPS) and a matrix product on torch's threads
SCRIPT = r"""
import sys
for name in sys.argv[1].split(","):
    __import__(name)
import torch, hkt
torch.set_num_threads(2)
q = [torch.randn(2, 4, 256, 32), torch.randn(2, 4, 128, 32)]
k = [torch.randn(2, 4, 256, 32), torch.randn(2, 4, 128, 32)]
hkt.hkt_attention(q, k, torch.randn(2, 4, 256, 32), torch.ones(2))
(torch.randn(512, 512) @ torch.randn(512, 512)).sum()
sys.path.insert(0, sys.argv[2])
from wheel_check import openmp_runtimes
print(repr(sorted(openmp_runtimes())))
"""


def openmp_runtimes_after(order):
    """The OpenMP runtime files mapped in a fresh interpreter that imported the
    modules of order (comma-separated) in that order, then ran both."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", SCRIPT, order, TOOLS], cwd=HERE, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return eval(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["torch,hkt", "hkt,torch"])
def test_one_openmp_runtime_in_the_process(order):
    runtimes = openmp_runtimes_after(order)
    assert len(runtimes) == 1, f"import {order}: {len(runtimes)} OpenMP runtimes mapped: {runtimes}"
    import torch
    lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    shipped = [f for f in os.listdir(lib) if f.startswith(("libgomp", "libiomp5", "libomp"))]
    if shipped:  # torch's own serves hkt too (hkt/__init__.py imports torch before hkt._C)
        assert os.path.dirname(os.path.realpath(runtimes[0])) == lib, (order, runtimes, shipped)


def test_the_maps_reader_finds_each_runtime_kind(tmp_path):
    """openmp_runtimes itself: each runtime's file names, each file once, and no
    library that merely has 'omp' in its name."""
    sys.path.insert(0, TOOLS)
    try:
        from wheel_check import openmp_runtimes
    finally:
        sys.path.remove(TOOLS)
    lines = ["7f0000000000-7f0000001000 r-xp 00000000 00:1f 11 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
             "7f0000001000-7f0000002000 r--p 00001000 00:1f 11 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
             "7f0000002000-7f0000003000 r-xp 00000000 00:1f 12 /venv/torch/lib/libgomp-a34b3233.so.1",
             "7f0000003000-7f0000004000 r-xp 00000000 00:1f 13 /opt/intel/lib/libiomp5.so",
             "7f0000004000-7f0000005000 r-xp 00000000 00:1f 14 /usr/lib/llvm/lib/libomp.so",
             "7f0000005000-7f0000006000 r-xp 00000000 00:1f 15 /usr/lib/libompitrace.so.0",
             "7f0000006000-7f0000007000 rw-p 00000000 00:00 0 ",
             "7f0000007000-7f0000008000 r-xp 00000000 00:1f 16 /work/my libgomp dir/libc.so.6"]
    maps = tmp_path / "maps"
    maps.write_text("\n".join(lines) + "\n")
    assert openmp_runtimes(str(maps)) == {"/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
                                         "/venv/torch/lib/libgomp-a34b3233.so.1", "/opt/intel/lib/libiomp5.so",
                                         "/usr/lib/llvm/lib/libomp.so"}
