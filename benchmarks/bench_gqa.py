"""Grouped-query attention on the CPU: forward+backward time with H_kv = H / 4
kv heads against H_kv = H (issue 13's target: at most 1.05x).

GQA does the same score and P @ V work as full multi-head attention (every
query head still scores every key); what changes is that four query heads share
one kv head's keys and values, whose gradients are summed over the group.  The
kernels load a key tile once per group, so GQA should cost no more.

    python benchmarks/bench_gqa.py            # B=1 H=8 D=64 L=3, T = 1024 and 2048
    python benchmarks/bench_gqa.py --quick

Checks the GQA kernels against the float64 reference first; writes
benchmarks/results/<cpu>/gqa.json.
"""
import argparse
import json
import os

import torch

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt
from hkt.reference import hkt_attention_reference
from research.timing import results_dir, describe_machine, machine_info, make_inputs, report_targets, time_interleaved

HERE = os.path.dirname(os.path.abspath(__file__))


def check_correctness():
    q, k, v, w = make_inputs(2, 8, 97, 97, 13, 3, dtype=torch.float64, kv_heads=2)
    out = hkt.hkt_attention(q, k, v, w, is_causal=True)
    ref = hkt_attention_reference(q, k, v, w, is_causal=True)
    g = torch.randn_like(out)
    err = (out - ref).abs().max().item()
    for a, b in zip(torch.autograd.grad(out, [*q, *k, v, w], g), torch.autograd.grad(ref, [*q, *k, v, w], g)):
        err = max(err, (a - b).abs().max().item())
    if err > 1e-9:
        raise SystemExit(f"GQA kernels disagree with the reference: {err:.2e}")
    return err


def fwd_bwd(B, H, Hk, T, D, L, causal):
    q, k, v, w = make_inputs(B, H, T, T, D, L, kv_heads=Hk)
    leaves = [*q, *k, v, w]

    def run():
        out = hkt.hkt_attention(q, k, v, w, is_causal=causal)
        out.backward(torch.ones_like(out))
        for x in leaves:
            x.grad = None
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(describe_machine(info))
    err = check_correctness()
    print(f"GQA vs float64 reference: max error {err:.1e}")
    B, H, D, L = 1, 8, 64, 3
    Ts = [256] if args.quick else [1024, 2048]
    rows, targets = [], []
    for T in Ts:
        for causal in (False, True):
            t = time_interleaved({"H_kv=H": fwd_bwd(B, H, H, T, D, L, causal),
                                  "H_kv=H/4": fwd_bwd(B, H, H // 4, T, D, L, causal)},
                                 repeats=3 if args.quick else 7)
            ratio = t["H_kv=H/4"] / t["H_kv=H"]
            rows.append({"T": T, "causal": causal, "seconds": t, "ratio": ratio})
            print(f"T={T:5d} causal={causal!s:5s}  H_kv=H {t['H_kv=H'] * 1e3:8.1f} ms   "
                  f"H_kv=H/4 {t['H_kv=H/4'] * 1e3:8.1f} ms   ratio {ratio:.3f}")
    targets.append((f"GQA H_kv=H/4 fwd+bwd / H_kv=H, worst over T and causal (L={L})",
                    max(r["ratio"] for r in rows), "<=", 1.05))
    met = report_targets(targets)
    if not args.quick:
        out = results_dir(info)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gqa.json"), "w") as f:
            json.dump({"machine": info, "shape": dict(B=B, H=H, D=D, L=L), "rows": rows, "targets": met}, f, indent=1)


if __name__ == "__main__":
    main()
