"""Another build of hkt._C against this one: the same bits, and the same speed?

For refactors of the kernels (issue 12: "behaviour and speed are unchanged"):
loads a second extension file (e.g. built from an older commit with
`git worktree add /tmp/old REV && cd /tmp/old && python setup.py build_ext --inplace`),
runs both on the same inputs through the raw binding (forward and backward),
with contiguous arrays and with the strided rows a module's heads have,
checks every output is bitwise identical, then times them interleaved (the two
see the same machine state) and prints the new/old time ratios.

    python benchmarks/compare_builds.py /tmp/old/hkt/_C.abi3.so [--quick]

Only calls both builds support (no grouped-query heads, which older builds lack).
bfloat16 inputs (native kernels, where both builds and the CPU have them) take
float32 outputs and gradients, which every build with them writes.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt._C as new
from research.timing import describe_machine, machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from helpers import sample_inputs  # noqa: E402


def load(path):
    spec = importlib.util.spec_from_file_location("hkt._C", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def heads_layout(x):
    """x (B, H, n, D) as a module's heads are: rows of a wider (B, n, 2, H, D)
    array (row stride 2 * H * D), the same values."""
    B, H, n, D = x.shape
    wide = torch.zeros(B, n, 2, H, D, dtype=x.dtype)
    wide[:, :, 0] = x.transpose(1, 2)
    return wide[:, :, 0].transpose(1, 2)


def run(mod, q, k, v, w, causal, dropout_p, threads, backward=True, strided=False):
    """Forward (and backward) through the raw binding; strided: every array
    with rows (inputs, out, dO and the gradients) in heads_layout."""
    B, H, T, _ = q[0].shape
    lay = heads_layout if strided else (lambda x: x)
    q, k, v = [lay(x) for x in q], [lay(x) for x in k], lay(v)
    real = torch.float32 if q[0].dtype == torch.bfloat16 else q[0].dtype  # bfloat16 computes in float32
    out = lay(torch.empty(B, H, T, v.shape[3], dtype=real))
    lse = torch.empty(B, H, T, dtype=real)
    mod.forward(q, k, v, w, out, lse, None, causal, None, dropout_p, 7, threads)
    if not backward:
        return [out, lse]
    dq, dk = [lay(torch.empty(x.shape, dtype=real)) for x in q], [lay(torch.empty(x.shape, dtype=real)) for x in k]
    dv, dw = lay(torch.empty(v.shape, dtype=real)), torch.empty_like(w)
    dout = lay(torch.ones(out.shape, dtype=q[0].dtype))
    mod.backward(dout, q, k, v, w, lay(out.to(q[0].dtype)), lse, dq, dk, dv, dw, None, causal, None, dropout_p, 7,
                 threads)
    return [out, lse, *dq, *dk, dv, dw]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", help="path of the other build's _C*.so")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    old = load(args.old)
    print(describe_machine(machine_info()))
    same = True
    for dtype in (torch.float32, torch.float64):
        for B, H, T, S, D, L in [(1, 2, 300, 300, 64, 3), (2, 3, 130, 70, 13, 2), (1, 1, 1000, 1000, 32, 4)]:
            for causal in (False, True):
                for dp in (0.0, 0.2):
                    for strided in (False, True):
                        q, k, v, w = sample_inputs(B, H, T, S, D, D, L, dtype=dtype)
                        a = run(old, q, k, v, w, causal, dp, 2, strided=strided)
                        b = run(new, q, k, v, w, causal, dp, 2, strided=strided)
                        same &= all(torch.equal(x, y) for x, y in zip(a, b))
    calls = 48
    if new.cpu_has_bf16() and old.cpu_has_bf16():
        # native bfloat16: both backward schedules (B * H >= threads, and one head)
        for B, H, T, D, L in [(1, 4, 300, 64, 3), (1, 1, 257, 32, 2)]:
            for causal in (False, True):
                for dp in (0.0, 0.2):
                    for strided in (False, True):
                        q, k, v, w = sample_inputs(B, H, T, T, D, D, L, dtype=torch.float32)
                        q, k, v = [x.to(torch.bfloat16) for x in q], [x.to(torch.bfloat16) for x in k], \
                            v.to(torch.bfloat16)
                        a = run(old, q, k, v, w, causal, dp, 2, strided=strided)
                        b = run(new, q, k, v, w, causal, dp, 2, strided=strided)
                        same &= all(torch.equal(x, y) for x, y in zip(a, b))
                        calls += 1
    print(f"bitwise identical outputs and gradients on {calls} calls (contiguous and strided rows): {same}")
    reps = 3 if args.quick else 9
    print(f"{'call':38s} {'old ms':>8s} {'new ms':>8s} {'new/old':>8s}   (medians of {reps}, interleaved)")
    Ts = [512] if args.quick else [512, 2048]
    for T in Ts:
        for L in (1, 3):
            for causal in (False, True):
                for backward in (False, True):
                    q, k, v, w = sample_inputs(1, 8, T, T, 64, 64, L, dtype=torch.float32)
                    times = {"old": [], "new": []}
                    for _ in range(reps):
                        for name, mod in (("old", old), ("new", new)):
                            t0 = time.perf_counter()
                            run(mod, q, k, v, w, causal, 0.0, args.threads, backward)
                            times[name].append(time.perf_counter() - t0)
                    o, n = statistics.median(times["old"]), statistics.median(times["new"])
                    label = f"T={T} L={L} {'causal' if causal else 'full'} {'fwd+bwd' if backward else 'fwd'}"
                    print(f"{label:38s} {o * 1e3:8.1f} {n * 1e3:8.1f} {n / o:8.3f}")
    # a module's heads: B=8, 4 heads, T=1024, rows of a wider array (MultiheadHKT's layout)
    for L in (1, 3):
        for backward in (False, True):
            q, k, v, w = sample_inputs(8, 4, 1024, 1024, 64, 64, L, dtype=torch.float32)
            times = {"old": [], "new": []}
            for _ in range(reps):
                for name, mod in (("old", old), ("new", new)):
                    t0 = time.perf_counter()
                    run(mod, q, k, v, w, False, 0.0, args.threads, backward, strided=True)
                    times[name].append(time.perf_counter() - t0)
            o, n = statistics.median(times["old"]), statistics.median(times["new"])
            label = f"heads layout B=8 H=4 T=1024 L={L} {'fwd+bwd' if backward else 'fwd'}"
            print(f"{label:38s} {o * 1e3:8.1f} {n * 1e3:8.1f} {n / o:8.3f}")
    if not same:
        raise SystemExit("the builds differ")


if __name__ == "__main__":
    main()
