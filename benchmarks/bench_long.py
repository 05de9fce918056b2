"""Long context: forward+backward of windowed HKT (docs/contract.md section 1.11)
against torch SDPA and unwindowed HKT, T = 16,384 to 262,144 (issue 43).

    python benchmarks/bench_long.py                 # the full table (SDPA capped)
    python benchmarks/bench_long.py --quick         # T = 4096 and 8192 only
    python benchmarks/bench_long.py --cap 120       # skip an unwindowed hkt run expected to take longer (s)
    python benchmarks/bench_long.py --sdpa-cap 300  # the same for SDPA
    python benchmarks/bench_long.py --sizes 262144  # these T again, the other rows kept

Causal, B=1, D=64, float32, 2 threads.  Windows W_l = 256 * 2^l on every level
but the top one, which is global; H=4, L=6 up to T=65,536, then H=2, L=8.
Each measurement runs in a fresh process, so its peak resident memory (above
what the process held once its inputs existed) is its own.  A baseline whose
time, extrapolated (as H T^2) from the one before, would pass --cap is
skipped (--cap, --sdpa-cap) and its extrapolation recorded as such.  The machine's load average is
recorded with every run: on a shared machine the wall times carry it; CPU time
(all threads) is recorded too.  Writes benchmarks/results/<cpu>/long.json.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt  # noqa: E402
from hkt.reference import hkt_attention_reference  # noqa: E402
from research.timing import describe_machine, machine_info, make_inputs, report_targets, results_dir  # noqa: E402

D, THREADS = 64, 2
KINDS = ("windowed", "hkt", "sdpa")


def shape_of(T):
    return (4, 6) if T <= 65536 else (2, 8)


def windows_of(L):
    return [256 << l for l in range(L - 1)] + [None]


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(kind, T, H, L):
    """One forward+backward in this process: wall and CPU seconds, peak memory above the inputs."""
    torch.set_num_threads(THREADS)
    if T > 1024:  # a small call first: thread start-up, first-touch costs and lazy imports are not the run's
        one(kind, 1024, H, L)
    q, k, v, w = make_inputs(1, H, T, T, D, L if kind != "sdpa" else 1)
    base = rss_bytes()
    c0, t0 = time.process_time(), time.perf_counter()
    if kind == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(q[0], k[0], v, is_causal=True)
    else:
        out = hkt.hkt_attention(q, k, v, w, is_causal=True, windows=windows_of(L) if kind == "windowed" else None)
    out.backward(torch.ones_like(out))
    t1, c1 = time.perf_counter(), time.process_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": t1 - t0, "cpu_seconds": c1 - c0, "peak_extra_bytes": max(peak - base, 0),
            "load_average": os.getloadavg()[0]}


def run_one(kind, T, H, L, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", kind, str(T), str(H), str(L)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"ran past {timeout:.0f} s"}
    if res.returncode != 0:
        raise SystemExit(f"{kind} T={T} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def check_correctness():
    """The windowed kernels against the dense definition, float64, with this benchmark's kind of windows."""
    q, k, v, w = make_inputs(1, 2, 300, 300, 16, 4, dtype=torch.float64)
    win = [8, 16, 32, None]
    out = hkt.hkt_attention(q, k, v, w, is_causal=True, windows=win)
    ref = hkt_attention_reference(q, k, v, w, is_causal=True, windows=win)
    g = torch.randn_like(out)
    err = (out - ref).abs().max().item()
    for a, b in zip(torch.autograd.grad(out, [*q, *k, v, w], g), torch.autograd.grad(ref, [*q, *k, v, w], g)):
        err = max(err, (a - b).abs().max().item())
    if err > 1e-9:
        raise SystemExit(f"windowed kernels disagree with the reference: {err:.2e}")
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cap", type=float, default=150.0, help="seconds unwindowed hkt may be expected to take")
    ap.add_argument("--sdpa-cap", type=float, default=600.0, help="seconds SDPA may be expected to take")
    ap.add_argument("--sizes", type=int, nargs="+", help="only these T, kept with the other rows of long.json")
    ap.add_argument("--one", nargs=4, metavar=("KIND", "T", "H", "L"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        kind, T, H, L = args.one[0], *map(int, args.one[1:])
        print(json.dumps(one(kind, T, H, L)))
        return
    torch.set_num_threads(THREADS)
    info = machine_info()
    print(describe_machine(info))
    print(f"windowed vs float64 reference: max error {check_correctness():.1e}")
    Ts = [4096, 8192] if args.quick else args.sizes or [16384, 32768, 65536, 131072, 262144]
    rows, last = [], {}
    if args.sizes:  # the rows of other sizes from the last run, and its measurements to extrapolate from
        try:
            with open(os.path.join(results_dir(info), "long.json")) as f:
                kept = [r for r in json.load(f)["rows"] if r["T"] not in Ts]
        except (OSError, ValueError, KeyError):
            kept = []
        for r in kept:
            for kind in KINDS:
                if "seconds" in r.get(kind, {}):
                    last[kind] = (r["T"], r["H"], r[kind]["seconds"])
        rows = kept
    for T in Ts:
        H, L = shape_of(T)
        row = {"T": T, "H": H, "L": L, "windows": windows_of(L)}
        for kind in KINDS:
            prev = last.get(kind)  # (T, H, seconds): a baseline's cost grows as H T^2
            guess = prev[2] * (H / prev[1]) * (T / prev[0]) ** 2 if prev else 0.0
            cap = args.sdpa_cap if kind == "sdpa" else args.cap
            if kind != "windowed" and guess > cap:
                row[kind] = {"skipped": f"expected {guess:.0f} s (H T^2 from T={prev[0]}, H={prev[1]}), past --cap",
                             "extrapolated_seconds": guess}
            else:
                row[kind] = run_one(kind, T, H, L, timeout=max(2 * cap, 60))
                if "seconds" in row[kind]:
                    last[kind] = (T, H, row[kind]["seconds"])
            r = row[kind]
            if "seconds" in r:
                print(f"T={T:7d} H={H} L={L} {kind:9s} {r['seconds']:8.2f} s  cpu {r['cpu_seconds']:8.2f} s  "
                      f"peak +{r['peak_extra_bytes'] / 2**20:8.1f} MiB  load {r['load_average']:.1f}", flush=True)
            else:
                print(f"T={T:7d} H={H} L={L} {kind:9s} skipped: {r['skipped']}", flush=True)
        rows.append(row)
        rows.sort(key=lambda r: r["T"])
        save(args, info, rows, [])  # as it goes: a run stopped later keeps what it measured
    targets = []
    by_T = {r["T"]: r for r in rows}
    if 65536 in by_T:
        r = by_T[65536]
        sd = r["sdpa"].get("seconds", r["sdpa"].get("extrapolated_seconds"))
        why = None if "seconds" in r["sdpa"] else "SDPA skipped: its time is extrapolated"
        targets.append(("T=65536 H=4 L=6: SDPA fwd+bwd / windowed fwd+bwd", sd / r["windowed"]["seconds"], ">=",
                        10.0, why))
    if 262144 in by_T:
        targets.append(("T=262144 H=2 L=8: windowed fwd+bwd seconds", by_T[262144]["windowed"]["seconds"], "<=",
                        60.0))
    save(args, info, rows, report_targets([t if len(t) == 5 and t[4] else t[:4] for t in targets]))


def save(args, info, rows, targets):
    if args.quick:
        return
    out = results_dir(info)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "long.json"), "w") as f:
        json.dump({"machine": info, "shape": dict(B=1, D=D, causal=True, dtype="float32", threads=THREADS),
                   "rows": rows, "targets": targets}, f, indent=1)


if __name__ == "__main__":
    main()
