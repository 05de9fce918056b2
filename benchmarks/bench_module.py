"""MultiheadHKT against nn.MultiheadAttention: one training step (forward, backward,
AdamW step), self-attention, need_weights=False for both.

Checks first that levels=1 reproduces nn.MultiheadAttention and that from_mha
keeps the output, then times the candidates interleaved (medians).

    python benchmarks/bench_module.py            # T=1024, E=256, 4 heads, batch 8
    python benchmarks/bench_module.py --quick

Writes benchmarks/results/<cpu>/module.json.
"""
import argparse
import json
import os
import statistics

import torch
from torch import nn

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt
from research.timing import results_dir, describe_machine, machine_info, paired_ratio, report_targets, time_rounds

HERE = os.path.dirname(os.path.abspath(__file__))


def check(E, H):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 37, E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(37, dtype=torch.float64)
    ref = mha(x, x, x, attn_mask=mask, need_weights=False)[0]
    errs = {}
    for L in (1, 2, 3):
        m = hkt.MultiheadHKT.from_mha(mha, levels=L)
        errs[f"from_mha levels={L}"] = (m(x, x, x, attn_mask=mask, need_weights=False)[0] - ref).abs().max().item()
    if max(errs.values()) > 1e-10:
        raise SystemExit(f"MultiheadHKT disagrees with nn.MultiheadAttention: {errs}")
    return errs


def step_fn(module, x, causal):
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    T = x.shape[1]
    mask = nn.Transformer.generate_square_subsequent_mask(T) if causal else None

    def step():
        out = module(x, x, x, attn_mask=mask, need_weights=False, is_causal=causal)[0]
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--embed", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    # a step's time drifts over a run with the machine's own phases, so fewer
    # rounds let where the median is cut move the ratio (docs/performance.md,
    # bench_module --repeats)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<cpu>/)")
    args = ap.parse_args(argv)
    args.out = args.out or results_dir(machine_info())
    if args.quick:
        args.T, args.batch, args.repeats = 256, 2, 3
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    errs = check(args.embed, args.heads)
    print("check: " + ", ".join(f"{k} max |diff| {v:.1e}" for k, v in errs.items()))
    machine = machine_info()
    print(f"machine: {describe_machine(machine)}")
    # ratios: each the median of the rounds' own (research.timing.paired_ratio)
    result = {"config": {**{k: v for k, v in vars(args).items() if k != "out"}, "ratios": "paired"},
              "machine": machine, "check": errs,
              "rows": []}
    # the size asked for, and the ListOps classifier's attention (T=128, E=64, 4 heads, batch 32)
    configs = [("main", args.T, args.embed, args.heads, args.batch)]
    if not args.quick:
        configs.append(("listops", 128, 64, 4, 32))
    for tag, T, E, H, B in configs:
        print(f"training step (fwd+bwd+AdamW), self-attention, T={T} E={E} heads={H} batch={B}, float32, "
              f"{args.threads} threads")
        for causal in (False, True):
            torch.manual_seed(0)
            x = torch.randn(B, T, E)
            mods = {"nn.MultiheadAttention": nn.MultiheadAttention(E, H, batch_first=True)}
            for L in (1, 2, 3):
                mods[f"MultiheadHKT levels={L}"] = hkt.MultiheadHKT(E, H, batch_first=True, levels=L)
            times = time_rounds({n: step_fn(m, x, causal) for n, m in mods.items()},
                                repeats=args.repeats if tag == "main" else 3 * args.repeats)
            for name, ts in times.items():
                sec, ratio = statistics.median(ts), paired_ratio(times, name, "nn.MultiheadAttention")
                print(f"  causal={str(causal):5s} {name:24s} {sec * 1e3:8.2f} ms  {ratio:5.2f}x")
                result["rows"].append({"config": tag, "T": T, "E": E, "heads": H, "batch": B, "name": name,
                                       "causal": causal, "ms": sec * 1e3, "x_mha": ratio})

    def worst(tag):
        return max(r["x_mha"] for r in result["rows"] if r["config"] == tag and r["name"] == "MultiheadHKT levels=3")
    targets = [(f"MultiheadHKT(levels=3) step / MHA, T={args.T} E={args.embed} (worst of causal and not)",
                worst("main"), "<=", 1.00)]
    if len(configs) > 1:
        targets.append(("MultiheadHKT(levels=3) step / MHA, ListOps config T=128 E=64 (worst)", worst("listops"),
                        "<=", 1.15))
    result["targets"] = report_targets(targets)
    with open(os.path.join(args.out, "module.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}/module.json")
    return result


if __name__ == "__main__":
    main()
