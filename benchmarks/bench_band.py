"""What the sliding-window band costs (docs/contract.md section 1.13): causal
hkt_attention(..., sliding_window=W) against the same call with the band as
a dense bool mask, forward and forward+backward.

    python benchmarks/bench_band.py              # T = 2048, 4096, 8192, 16,384
    python benchmarks/bench_band.py --quick      # T = 2048 and 4096

B=1, H=8, D=64, float32, 1 thread, W = 1024, levels 1 and 3.  The band skips
the key tiles outside it, so its time should grow as T * W (doubling with T);
the mask's (with is_causal=True, as the band's), which visits every key tile
a causal call visits, as T^2 / 2.
Per (T, L), interleaved rounds of the four calls; medians of --repeats
rounds.  The dense-mask rows run up to --dense-cap.  Before timing, the band
is checked against the float64 reference and against the mask (T = 300).
Writes benchmarks/results/<cpu>/bench_band.json.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt  # noqa: E402
from hkt.reference import hkt_attention_reference  # noqa: E402
from research.timing import machine_info, make_inputs, results_dir, time_rounds  # noqa: E402

H, D, W, THREADS = 8, 64, 1024, 1
LEVELS = (1, 3)


def band_mask(T, W):
    """The causal band as a (T, T) bool mask: key j seen from query i when 0 <= i - j < W."""
    d = torch.arange(T).unsqueeze(1) - torch.arange(T).unsqueeze(0)
    return (d >= 0) & (d < W)


def check():
    """The band against the float64 reference and against its own mask
    (T = 300, a band narrower than a tile and one wider), forward and
    gradients: the largest absolute difference."""
    worst = 0.0
    for L in LEVELS:
        for Wc in (37, 100):
            q, k, v, w = make_inputs(1, 2, 300, 300, 16, L, dtype=torch.float64)
            leaves = [*q, *k, v, w]
            got = hkt.hkt_attention(q, k, v, w, is_causal=True, sliding_window=Wc)
            g = torch.randn_like(got)
            for want in (hkt_attention_reference(q, k, v, w, is_causal=True, sliding_window=Wc),
                         hkt.hkt_attention(q, k, v, w, attn_mask=band_mask(300, Wc))):
                worst = max(worst, (got - want).abs().max().item())
                for a, b in zip(torch.autograd.grad(got, leaves, g, retain_graph=True),
                                torch.autograd.grad(want, leaves, g)):
                    worst = max(worst, (a - b).abs().max().item())
    assert worst < 1e-10, worst
    return worst


def calls(T, L, dense):
    """name -> one call of each way of applying the band, on fresh inputs."""
    q, k, v, w = make_inputs(1, H, T, T, D, L)
    mask = band_mask(T, W) if dense else None

    def call(backward, **kw):
        def run():
            if not backward:
                with torch.no_grad():
                    hkt.hkt_attention(q, k, v, w, **kw)
                return
            out = hkt.hkt_attention(q, k, v, w, **kw)
            out.backward(torch.ones_like(out))
        return run

    fns = {"band fwd": call(False, is_causal=True, sliding_window=W),
           "band fwd+bwd": call(True, is_causal=True, sliding_window=W)}
    if dense:
        fns.update({"mask fwd": call(False, is_causal=True, attn_mask=mask),
                    "mask fwd+bwd": call(True, is_causal=True, attn_mask=mask)})
    return fns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dense-cap", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    err = check()
    rows = []
    print(f"{'T':>6} {'L':>2} " + " ".join(f"{n:>13}" for n in ("band fwd", "band fwd+bwd", "mask fwd",
                                                                   "mask fwd+bwd")), flush=True)
    for T in [2048, 4096] if args.quick else [2048, 4096, 8192, 16384]:
        for L in LEVELS:
            times = time_rounds(calls(T, L, T <= args.dense_cap), repeats=args.repeats, warmup=1)
            row = {"T": T, "levels": L, "seconds": {n: round(statistics.median(t), 4) for n, t in times.items()}}
            rows.append(row)
            s = row["seconds"]
            print(f"{T:>6} {L:>2} " + " ".join(f"{s[n]:>11.3f} s" if n in s else f"{'-':>13}"
                                                for n in ("band fwd", "band fwd+bwd", "mask fwd", "mask fwd+bwd")),
                  flush=True)
    info = machine_info()
    out = os.path.join(args.out or results_dir(info), "bench_band.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": info, "threads": THREADS, "B": 1, "heads": H, "D": D, "sliding_window": W,
                   "dtype": "float32", "causal": True, "repeats": args.repeats, "dense_cap": args.dense_cap,
                   "check_max_abs_err": err, "rows": rows}, f, indent=1)
    print("wrote", os.path.relpath(out))


if __name__ == "__main__":
    main()
