"""The paper's theory as numbers and one plot (seconds on a CPU).

    python -m research.theory --out results/

Writes ``theory.json`` (score cost of L levels, by formula and as counted in the
CPU kernel's tiles; the L-level approximation error on multi-scale and smooth
data) and ``approximation_error.png``.
"""
import argparse
import os
import sys

import torch

from hkt import analysis
from . import cli
from .train import finite_or_none, write_json

__all__ = ["theory", "main"]


def theory(out_dir: str, *, T: int = 128, rank: int = 4, max_levels: int = 6, seeds=(0, 1, 2), sweeps: int = 30):
    os.makedirs(out_dir, exist_ok=True)
    cost = {L: {"formula": analysis.cost_ratio(L),
                "kernel_T4096": analysis.measured_cost_ratio(4096, 4096, L),
                "kernel_T4096_causal": analysis.measured_cost_ratio(4096, 4096, L, is_causal=True),
                "kernel_T1000": analysis.measured_cost_ratio(1000, 1000, L)} for L in range(1, 9)}
    curves = {
        "multi-scale (blockwise)": analysis.approximation_error_curve(T, rank=rank, max_levels=max_levels,
                                                                      seeds=seeds, sweeps=sweeps),
        "multi-scale (smooth)": analysis.approximation_error_curve(T, rank=rank, max_levels=max_levels, smooth=True,
                                                                   seeds=seeds, sweeps=sweeps),
    }
    png = analysis.plot_approximation_error(curves, os.path.join(out_dir, "approximation_error.png"))
    for c in curves.values():  # one level has no rate per level: null, not NaN (which is not JSON)
        c["rate"] = finite_or_none(c["rate"])
    res = {"cost_ratio": cost, "approximation_error": curves, "plot": png}
    write_json(res, os.path.join(out_dir, "theory.json"))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m research.theory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results")
    ap.add_argument("--T", type=cli.positive_int, default=128)
    ap.add_argument("--rank", type=cli.positive_int, default=4)
    ap.add_argument("--max-levels", type=cli.positive_int, default=6)
    ap.add_argument("--threads", type=cli.positive_int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = theory(args.out, T=args.T, rank=args.rank, max_levels=args.max_levels)
    for name, c in res["approximation_error"].items():
        errs = ", ".join(f"{e:.2e}" for e in c["error"])
        rate = "undefined" if c["rate"] is None else f"{c['rate']:.2f}"
        print(f"{name}: error for L = 1..{len(c['error'])}: {errs} (rate {rate} per level)", file=sys.stderr)
    print(f"wrote {res['plot']}", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
