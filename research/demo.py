"""``make demo``: the main job, in two parts.

1. HKT attention (L = 1, 2, 3) side by side with torch's SDPA on random data: the
   largest error against the plain-PyTorch reference (float64, output and
   gradients) and the time per call in float32.
2. A short ListOps run (``research.listops_compare``): the same small Transformer
   trained with standard attention and with HKT, ending in an accuracy and
   per-step overhead table.  ``--no-listops`` skips it.
"""
import argparse

import torch

from hkt import _C
from .timing import attention_callables, max_error, time_interleaved


def attention_table(B=1, H=8, T=1024, D=64, levels=(1, 2, 3), is_causal=False, repeats=5):
    print(f"HKT attention vs torch SDPA: B={B} H={H} T=S={T} D={D} float32, causal={is_causal}, "
          f"{torch.get_num_threads()} threads (hkt OpenMP default {_C.default_threads()})")
    # the check runs in float64 on a small ragged shape (the reference is O(T*S)),
    # not on the timed one; the line below says so
    check = dict(B=1, H=2, T=97, D=13)
    errs = {L: max_error(L, is_causal=is_causal, **check) for L in levels}
    print("max err: largest |hkt - hkt.reference| over the output and every gradient, float64, at "
          + " ".join(f"{n}={x}" for n, x in check.items()))
    fwd = time_interleaved(attention_callables(B, H, T, D, levels, is_causal=is_causal), repeats)
    fb = time_interleaved(attention_callables(B, H, T, D, levels, is_causal=is_causal, backward=True), repeats)
    print(f"{'':10s} {'max err':>21s} {'fwd ms':>9s} {'x SDPA':>7s} {'fwd+bwd ms':>11s} {'x SDPA':>7s}")
    for name in fwd:
        L = None if name == "sdpa" else int(name.split("=")[1])
        err = "-" if L is None else f"{errs[L]:.1e}"
        print(f"{name:10s} {err:>21s} {fwd[name] * 1e3:9.1f} {fwd[name] / fwd['sdpa']:7.2f} "
              f"{fb[name] * 1e3:11.1f} {fb[name] / fb['sdpa']:7.2f}")
    return fwd, fb


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--no-listops", action="store_true", help="only the attention table")
    ap.add_argument("--listops-steps", type=int, default=800)
    args = ap.parse_args(argv)
    attention_table(H=args.heads, T=args.T, D=args.dim, is_causal=args.causal)
    if not args.no_listops:
        from . import listops_compare
        print()
        listops_compare.main(["--steps", str(args.listops_steps)])


if __name__ == "__main__":
    main()
