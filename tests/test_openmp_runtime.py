"""One OpenMP runtime per process: hkt._C links libgomp.so.1 (the wheel does
not vendor one: `make wheel` excludes it), and torch ships its own.  Two
runtimes in one process would each keep a thread pool of a core's count, and
oversubscribe the cores.  Whatever the import order, the process must map one
libgomp / libiomp / libomp file, after both have run a parallel region."""
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# after the imports: a call large enough for hkt's OpenMP region (above
# HKT_PARALLEL_MIN_FLOPS) and a matrix product that runs on torch's threads
SCRIPT = r"""
import os, re, sys
for name in sys.argv[1].split(","):
    __import__(name)
import torch, hkt
torch.set_num_threads(2)
q = [torch.randn(2, 4, 256, 32), torch.randn(2, 4, 128, 32)]
k = [torch.randn(2, 4, 256, 32), torch.randn(2, 4, 128, 32)]
hkt.hkt_attention(q, k, torch.randn(2, 4, 256, 32), torch.ones(2))
(torch.randn(512, 512) @ torch.randn(512, 512)).sum()
runtimes = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and re.match(r"lib(gomp|iomp5|omp)\b", os.path.basename(parts[5].strip())):
            runtimes.add(parts[5].strip())
print(repr(sorted(runtimes)))
"""


def openmp_runtimes(order):
    """The OpenMP runtime files mapped in a fresh interpreter that imported the
    modules of order (comma-separated) in that order, then ran both."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", SCRIPT, order], cwd=HERE, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return eval(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
@pytest.mark.parametrize("order", ["torch,hkt", "hkt,torch"])
def test_one_openmp_runtime_in_the_process(order):
    runtimes = openmp_runtimes(order)
    assert len(runtimes) == 1, f"import {order}: {len(runtimes)} OpenMP runtimes mapped: {runtimes}"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_the_runtime_is_the_one_torch_ships_when_it_ships_one():
    """torch's own copy serves hkt too (hkt/__init__.py imports torch before
    hkt._C): the runtime torch was built and tested with."""
    import torch
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    shipped = [f for f in os.listdir(lib) if re.match(r"lib(gomp|iomp5|omp)\b", f)]
    if not shipped:
        pytest.skip("this torch ships no OpenMP runtime of its own")
    for order in ("torch,hkt", "hkt,torch"):
        (runtime,) = openmp_runtimes(order)
        assert os.path.realpath(os.path.dirname(runtime)) == os.path.realpath(lib), (order, runtime)
