"""Another source tree of hkt against this one, through the public API: the same
speed after a restructure of the Python layer?

compare_builds.py holds two builds of hkt._C to the same bits and speed through
the raw binding; this one times what a user calls, `hkt.hkt_attention`, so the
Python layer between the call and the kernel is in the measurement.  Each round
runs the held calls (the L=3 forward+backward at T=2048, B=1, H=8, D=64,
float32, and a small call, T=16, L=2, forward+backward x200 and its forward
under no_grad x200) once in a fresh interpreter on each tree, alternating which
goes first, and prints each round's new/old ratio, the median and the spread.

    python tools/compare_trees.py /tmp/old [--rounds N]

The other tree needs its extension built in place (`python setup.py build_ext
--inplace` there).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# run in a child whose sys.path starts with the tree under test
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, hkt
torch.set_num_threads(int(sys.argv[2]))
assert hkt.__file__.startswith(sys.argv[1]), hkt.__file__
sys.path.insert(0, sys.argv[1] + "/tests")
from helpers import sample_inputs

def best(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)

def fwd_bwd(args):
    q, k, v, w = args
    out = hkt.hkt_attention(q, k, v, w, is_causal=True)
    out.sum().backward()

big = sample_inputs(1, 8, 2048, 2048, 64, 64, 3, dtype=torch.float32, requires_grad=True, seed=1)
small = sample_inputs(1, 2, 16, 16, 16, 16, 2, dtype=torch.float32, requires_grad=True, seed=2)
def fwd(args):
    with torch.no_grad():
        hkt.hkt_attention(*args, is_causal=True)

res = {"T=2048, L=3 fwd+bwd": best(lambda: fwd_bwd(big), 3),
       "T=16, L=2 fwd+bwd x200": best(lambda: [fwd_bwd(small) for _ in range(200)], 3),
       "T=16, L=2 fwd no_grad x200": best(lambda: [fwd(small) for _ in range(200)], 3)}
print(json.dumps(res))
"""


def run(tree, threads):
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree), str(threads)], capture_output=True,
                         text=True, check=True, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the other source tree, its extension built in place")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ratios = {}
    for r in range(a.rounds):
        first_new = r % 2 == 0
        got = {}
        for which in (["new", "old"] if first_new else ["old", "new"]):
            got[which] = run(ROOT if which == "new" else a.old, a.threads)
        for name in got["new"]:
            ratios.setdefault(name, []).append(got["new"][name] / got["old"][name])
            print(f"round {r}: {name}: new {got['new'][name]:.4f} s, old {got['old'][name]:.4f} s, "
                  f"ratio {ratios[name][-1]:.3f}", flush=True)
    for name, rs in ratios.items():
        print(f"{name}: median new/old {statistics.median(rs):.3f}, spread {min(rs):.3f}-{max(rs):.3f} "
              f"({len(rs)} rounds)")


if __name__ == "__main__":
    main()
