"""Packed variable-length batches: hkt.hkt_attention_varlen against the same
batch padded to the longest length with a key padding mask.

8 sequences of lengths uniform in [64, 2048] (fixed seed), H=8, D=64, L=3,
float32, 2 threads.  The padded call is hkt.hkt_attention on (8, H, 2048, D)
with a bool attn_mask hiding the padded keys; the varlen call computes only the
real tokens.  Both are checked first (outputs and gradients on the real tokens),
then timed round-robin.  Timings are the MINIMUM of N runs: another process may
occupy a core (a training run on a 2-core machine), and the minimum is the
least disturbed run.

    python benchmarks/bench_varlen.py            # the issue's target
    python benchmarks/bench_varlen.py --quick    # a smoke run

Writes benchmarks/results/<cpu>/varlen.json.
"""
import argparse
import json
import os
import time

import torch

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt
from research.timing import results_dir, describe_machine, machine_info, report_targets

HERE = os.path.dirname(os.path.abspath(__file__))


def make_batch(lens, T, H, D, L, seed):
    """Inputs padded to T rows (B, H, ceil(T / 2^l), D), random in the real rows
    and in the padding; the packed inputs made from them (hkt.pack_levels); which
    tokens are real (B, T); the offsets."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    q = [torch.randn(B, H, -(-T // 2**l), D, generator=g) for l in range(L)]
    k = [torch.randn(B, H, -(-T // 2**l), D, generator=g) for l in range(L)]
    v = torch.randn(B, H, T, D, generator=g)
    w = torch.softmax(torch.randn(H, L, generator=g), -1)
    lengths = torch.tensor(lens)
    real = torch.arange(T)[None] < lengths[:, None]  # (B, T)
    packed = (hkt.pack_levels(q, lengths), hkt.pack_levels(k, lengths), hkt.pack_levels([v], lengths)[0], w)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), [1, 0]).to(torch.int32)
    return (q, k, v, w), packed, real, cu


def leaves_of(q, k, v, w):
    return [x.detach().requires_grad_() for x in (*q, *k, v, w)]


def runners(padded, packed, real, cu, causal, backward):
    """(padded call, varlen call), each forward or forward+backward, returning
    the output (and the gradients) on the real tokens, in the packed layout."""
    L = len(padded[0])
    mask = real[:, None, None, :]  # (B, 1, 1, S): True = may attend
    T = real.shape[1]
    dout_packed = torch.randn(int(cu[-1]), padded[2].shape[1], padded[2].shape[3],
                              generator=torch.Generator().manual_seed(1))
    dout_padded = torch.zeros(real.shape[0], T, *dout_packed.shape[1:])
    dout_padded[real] = dout_packed
    dout_padded = dout_padded.transpose(1, 2)  # (B, H, T, Dv), zero on the padding

    def run_padded():
        xs = leaves_of(*padded) if backward else [*padded[0], *padded[1], padded[2], padded[3]]
        with torch.set_grad_enabled(backward):
            out = hkt.hkt_attention(xs[:L], xs[L:2 * L], xs[2 * L], xs[2 * L + 1], attn_mask=mask, is_causal=causal)
            if backward:
                out.backward(dout_padded)
        res = [out.detach().transpose(1, 2)[real]]
        if backward:
            lengths = real.sum(1)
            res += hkt.pack_levels([x.grad for x in xs[:L]], lengths)  # dq, dk on the real rows
            res += hkt.pack_levels([x.grad for x in xs[L:2 * L]], lengths)
            res += [hkt.pack_levels([xs[2 * L].grad], lengths)[0], xs[2 * L + 1].grad]
        return res

    def run_varlen():
        xs = leaves_of(*packed) if backward else [*packed[0], *packed[1], packed[2], packed[3]]
        with torch.set_grad_enabled(backward):
            out = hkt.hkt_attention_varlen(xs[:L], xs[L:2 * L], xs[2 * L], xs[2 * L + 1], cu, cu, is_causal=causal)
            if backward:
                out.backward(dout_packed)
        return [out.detach()] + ([x.grad for x in xs] if backward else [])

    return run_padded, run_varlen


def compare(a, b):
    """(largest relative difference over the tensors, whether all are bitwise equal)."""
    worst = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))
    return worst, all(torch.equal(x, y) for x, y in zip(a, b))


def min_times(fns, repeats):
    """Minimum seconds of each callable over `repeats` round-robin runs (one warm-up)."""
    for f in fns.values():
        f()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nseq", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="lengths up to 512, 2 repeats")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<cpu>/)")
    args = ap.parse_args(argv)
    args.out = args.out or results_dir(machine_info())
    if args.quick:
        args.max_len, args.repeats = 512, 2
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.nseq,), generator=g).tolist()
    # padded to the longest length the batch may have, as a fixed-shape pipeline pads
    lens_padded_to = args.max_len
    machine = machine_info()
    print(f"machine: {describe_machine(machine)}")
    print(f"float32, H={args.heads} D={args.dim} L={args.levels}, {args.threads} threads; lengths {lens} "
          f"(sum {sum(lens)}), padded to {lens_padded_to} ({args.nseq * lens_padded_to} rows)")
    print(f"times: minimum of {args.repeats} runs (the machine may be shared: min-of-N is the least disturbed)")
    padded, packed, real, cu = make_batch(lens, lens_padded_to, args.heads, args.dim, args.levels, args.seed)
    rows = []
    print(f"\n{'pass':8s} {'causal':6s} | {'padded ms':>10s} {'varlen ms':>10s} {'speed-up':>9s} | "
          f"{'max rel diff on real tokens':>28s}")
    for causal in (False, True):
        for backward in (False, True):
            run_padded, run_varlen = runners(padded, packed, real, cu, causal, backward)
            diff, bitwise = compare(run_varlen(), run_padded())
            if diff > 1e-4:
                raise SystemExit(f"varlen and padded disagree on the real tokens: {diff:.2e}")
            t = min_times({"padded": run_padded, "varlen": run_varlen}, args.repeats)
            p = "fwd+bwd" if backward else "forward"
            rows.append({"pass": p, "causal": causal, "padded_ms": t["padded"] * 1e3, "varlen_ms": t["varlen"] * 1e3,
                         "speedup": t["padded"] / t["varlen"], "max_rel_diff": diff, "bitwise_equal": bitwise})
            print(f"{p:8s} {str(causal):6s} | {t['padded'] * 1e3:10.1f} {t['varlen'] * 1e3:10.1f} "
                  f"{t['padded'] / t['varlen']:8.2f}x | {diff:20.2e} {'(bitwise)' if bitwise else ''}")
    ideal = args.nseq * lens_padded_to ** 2 / sum(n * n for n in lens)
    print(f"\nquery-key pairs padded / varlen: {ideal:.2f}x (the work ratio the speed-up approaches)")
    targets = report_targets([
        (f"varlen vs padded to {lens_padded_to}, {p}, causal={c}: speed-up (min of {args.repeats})",
         r["speedup"], ">=", 2.0)
        for r in rows for p, c in [(r["pass"], r["causal"])]])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "varlen.json"), "w") as f:
        json.dump({"machine": machine, "lengths": lens, "padded_to": lens_padded_to, "heads": args.heads,
                   "dim": args.dim, "levels": args.levels, "threads": args.threads, "repeats": args.repeats,
                   "timing": "min of repeats", "rows": rows, "pair_ratio": ideal, "targets": targets}, f, indent=1)
    print(f"wrote {args.out}/varlen.json")


if __name__ == "__main__":
    main()
