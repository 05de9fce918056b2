"""A short ListOps run of HKT against standard attention (about 2-3 minutes on 2 cores).

    python -m research.listops_compare [--steps 800] [--seq-len 128] [--threads 1]

Trains the same small Transformer twice, from the same initialisation and
batches, once with ``nn.MultiheadAttention`` and once after
``hkt.swap_attention``, with progress bars, and ends with a table of test
accuracy and time per training step.  A few hundred steps show the mechanics,
not the paper's numbers (see ``python -m research.reproduce``).
"""
import argparse
import sys

import torch

from hkt.analysis import cost_ratio
from . import cli
from .train import add_training_args, check_model_args, load_task, train_classifier, training_kwargs

__all__ = ["main", "format_table"]


def format_table(results, levels: int) -> str:
    std = results["standard"]
    rows = [f"{'attention':12s} {'test acc':>9s} {'train acc':>10s} {'ms/step':>8s} {'overhead':>9s}"]
    for name, r in (("standard", std), (f"HKT (L={levels})", results["hkt"])):
        rows.append(f"{name:12s} {100 * r['accuracy']:8.2f}% {100 * r['train_accuracy']:9.2f}% "
                    f"{1e3 * r['time_per_step']:8.1f} {r['time_per_step'] / std['time_per_step']:8.2f}x")
    rows.append(f"score cost of L={levels} levels in theory: {cost_ratio(levels):.4f}x standard attention")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m research.listops_compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.set_defaults(steps=800, n_train=10000, n_test=1000, threads=1)
    args = ap.parse_args(argv)
    if args.task != "listops":
        ap.error("this comparison runs ListOps only (use research.train for the other tasks)")
    check_model_args(ap, args)
    cli.set_threads(args.threads)
    kw = training_kwargs(args)
    seq_len = args.seq_len or 128
    kw["seq_len"] = seq_len
    print(f"ListOps, T={seq_len}, {args.steps} steps of batch {args.batch_size}, d_model={args.d_model}, "
          f"{args.layers} layers, {args.heads} heads, {torch.get_num_threads()} thread(s)", flush=True)
    data = load_task("listops", seq_len=seq_len, n_train=args.n_train, n_test=args.n_test)
    results = {}
    for att in ("standard", "hkt"):
        results[att] = train_classifier("listops", att, seed=args.seed, data=data,
                                        desc=f"{att:8s}", **kw)
    sys.stderr.flush()
    print()
    print(format_table(results, args.levels), flush=True)
    return results


if __name__ == "__main__":
    main()
