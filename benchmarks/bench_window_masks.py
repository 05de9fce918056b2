"""What masks and dropout cost windowed HKT (docs/contract.md section 1.11):
causal forward+backward, each way of masking against the same call without one.

    python benchmarks/bench_window_masks.py            # T = 4096, 16,384 and 65,536
    python benchmarks/bench_window_masks.py --quick    # T = 4096 only

B=1, H=4, L=6, D=64, float32, 2 threads, windows W_l = 256 * 2^l with a global
top level (bench_long.py's shape).  Per T, interleaved rounds of:

  windowed           no mask
  key padding        a bool (1, 1, 1, S) mask hiding the last eighth of the keys:
                     the kernels' counts path (the block sharing kept)
  query mask         a bool (T, S) mask hiding 10% of the entries at random:
                     the per-key path (every key the windows let through)
  dropout            dropout_p = 0.1, no mask: the per-key path
  hkt, query mask    the same mask without windows (the unwindowed kernels)
  SDPA, query mask   torch SDPA with the same mask (causality folded into it)

The rows whose work grows as T^2 (the last four) run up to --dense-cap (16,384).
Before timing, each windowed call is checked against the dense reference at
T = 300.  Medians of --repeats rounds.  Writes
benchmarks/results/<cpu>/window_masks.json.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt  # noqa: E402
from hkt.ops.window import _radius, window_forward  # noqa: E402
from hkt._core.kernels import dropout_keep_mask  # noqa: E402
from hkt.reference import hkt_attention_reference  # noqa: E402
from research.timing import machine_info, make_inputs, results_dir, time_rounds  # noqa: E402

H, L, D, THREADS = 4, 6, 64, 2
WINDOWS = [256 << l for l in range(L - 1)] + [None]
DENSE = ("query mask", "dropout", "hkt, query mask", "SDPA, query mask")


def masks(T):
    """The key padding mask and the query mask of a length-T call."""
    key = torch.ones(1, 1, 1, T, dtype=torch.bool)
    key[..., T - T // 8:] = False
    query = torch.rand(T, T, generator=torch.Generator().manual_seed(T)) > 0.1
    return key, query


def check():
    """Each windowed way of masking against the dense reference (float64, T = 300,
    windows scaled down so every level's window ends inside the sequence)."""
    T, win = 300, [8 << l for l in range(L - 1)] + [None]
    q, k, v, w = make_inputs(1, H, T, T, 16, L, dtype=torch.float64)
    key, query = masks(T)
    worst = 0.0
    for mask in (key, query):
        got = hkt.hkt_attention(q, k, v, w, is_causal=True, windows=win, attn_mask=mask)
        want = hkt_attention_reference(q, k, v, w, is_causal=True, windows=win, attn_mask=mask)
        worst = max(worst, (got - want).abs().max().item())
    got = window_forward(q, k, v, w, None, list(_radius(win)), True, 0.25, 0.1, torch.tensor(3))[0]
    want = hkt_attention_reference(q, k, v, w, is_causal=True, windows=win, scale=0.25, dropout_p=0.1,
                                   dropout_mask=dropout_keep_mask(3, 0.1, 1, H, T, T))
    worst = max(worst, (got - want).abs().max().item())
    assert worst < 1e-10, worst
    return worst


def calls(T, dense):
    """name -> a forward+backward of that way of masking, on fresh inputs."""
    q, k, v, w = make_inputs(1, H, T, T, D, L)
    q1, k1, v1 = [x.detach().clone().requires_grad_() for x in (q[0], k[0], v)]
    key, query = masks(T)

    def hkt_call(**kw):
        def run():
            out = hkt.hkt_attention(q, k, v, w, is_causal=True, **kw)
            out.backward(torch.ones_like(out))
        return run

    def sdpa():
        out = F.scaled_dot_product_attention(q1, k1, v1, attn_mask=query_causal)
        out.backward(torch.ones_like(out))

    fns = {"windowed": hkt_call(windows=WINDOWS), "key padding": hkt_call(windows=WINDOWS, attn_mask=key)}
    if dense:
        query_causal = query & torch.ones(T, T, dtype=torch.bool).tril()
        fns.update({"query mask": hkt_call(windows=WINDOWS, attn_mask=query),
                    "dropout": hkt_call(windows=WINDOWS, dropout_p=0.1),
                    "hkt, query mask": hkt_call(attn_mask=query),
                    "SDPA, query mask": sdpa})
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
    for T in [4096] if args.quick else [4096, 16384, 65536]:
        times = time_rounds(calls(T, T <= args.dense_cap), repeats=args.repeats, warmup=1)
        row = {"T": T, "seconds": {name: round(statistics.median(t), 4) for name, t in times.items()}}
        rows.append(row)
        print(f"T={T:>6}: " + "  ".join(f"{n} {s:.3f} s" for n, s in row["seconds"].items()), flush=True)
    info = machine_info()
    out = os.path.join(args.out or results_dir(info), "window_masks.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": info, "threads": THREADS, "B": 1, "heads": H, "levels": L, "D": D,
                   "windows": WINDOWS, "dtype": "float32", "causal": True, "repeats": args.repeats,
                   "check_max_abs_err": err, "rows": rows}, f, indent=1)
    print("wrote", os.path.relpath(out))


if __name__ == "__main__":
    main()
