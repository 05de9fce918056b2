"""HKT attention against torch's SDPA (and the plain-PyTorch reference) on the CPU.

Checks every kernel against the float64 reference first (and stops if one is off),
then times forward and forward+backward at each T, interleaving the candidates so
they see the same machine state, and reports medians, ratios to SDPA, GFLOP/s, the
fitted exponent of time against T, and the extra peak memory of a long sequence.

    python benchmarks/bench_attention.py                 # the README table
    python benchmarks/bench_attention.py --quick         # a smoke run

Writes benchmarks/results/<cpu>/attention.json and attention.png.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt
from hkt import _C
from hkt._core import kernels as _kernels
from research.timing import (results_dir, attention_callables, describe_machine, machine_info, max_error, paired_ratio, report_targets,
                        score_flops, sgemm_gflops, time_rounds)

HERE = os.path.dirname(os.path.abspath(__file__))


def check_correctness():
    """Largest relative error of output and gradients against the float64 reference."""
    worst = {}
    for L in (1, 2, 3):
        for causal in (False, True):
            e64 = max_error(L, is_causal=causal, T=97, S=97, D=13)
            e32 = max_error(L, is_causal=causal, T=130, S=130, D=64, dtype=torch.float32)
            worst[f"L={L} causal={causal}"] = {"float64": e64, "float32": e32}
            if e64 > 1e-9 or e32 > 1e-3:
                raise SystemExit(f"kernel disagrees with the reference: L={L} causal={causal} "
                                 f"float64 {e64:.2e} float32 {e32:.2e}")
    return worst


MEMORY_SCRIPT = textwrap.dedent("""
    import sys, json, torch, hkt
    import torch.nn.functional as F
    from research.timing import make_inputs
    kind, T, H, D, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(int(sys.argv[6]))

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    q, k, v, w = make_inputs(1, H, T, T, D, L)
    run = ((lambda: F.scaled_dot_product_attention(q[0], k[0], v, is_causal=True)) if kind == "sdpa"
           else (lambda: hkt.hkt_attention(q, k, v, w, is_causal=True)))
    small = make_inputs(1, 1, 64, 64, D, L)
    hkt.hkt_attention(*small, is_causal=True).sum().backward()  # load everything once
    grad_out = torch.ones(1, H, T, D)  # the upstream gradient is the caller's, not ours
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    out = run()
    out.backward(grad_out)
    peak = rss("VmHWM:")
    leaves = [q[0], k[0], v] if kind == "sdpa" else [*q, *k, v, w]
    kept = out.numel() * out.element_size() + sum(x.grad.numel() * x.grad.element_size() for x in leaves)
    print(json.dumps({"peak_minus_before": peak - before, "outputs_and_grads": kept,
                      "extra": peak - before - kept}))
""")


def extra_memory(kind, T, H, D, L, threads):
    res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, kind, str(T), str(H), str(D), str(L), str(threads)],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def small_calls(repeats):
    """Seconds per call of one tiny attention (T=16, B=1, H=4, D=32, L=3), where
    per-call overhead is all there is: forward under no_grad, forward+backward."""
    out = {}
    for backward in (False, True):
        fns = attention_callables(1, 4, 16, 32, (3,), backward=backward)

        def batch(f):  # 200 calls per timing: one is too short for the clock
            return lambda: [f() for _ in range(200)]
        times = time_rounds({k: batch(f) for k, f in fns.items()}, repeats=max(repeats, 7), warmup=2)
        tag = "fwd+bwd" if backward else "fwd"
        out[f"sdpa {tag}"] = statistics.median(times["sdpa"]) / 200
        out[f"hkt {tag}"] = statistics.median(times["hkt L=3"]) / 200
        out[f"ratio {tag}"] = paired_ratio(times, "hkt L=3", "sdpa")
    return out


def thread_scaling(H, D, threads, repeats, T=2048):
    """Time with 1 thread over time with ``threads``: HKT L=3 at T, forward and
    forward+backward, and for scale what the machine itself gives two threads:
    SDPA's forward+backward and sgemm (torch.mm 2048^3).  A core's clock and
    the memory it shares differ with one or two cores busy, so no kernel can
    expect much more than sgemm's figure.  The thread counts take turns, call
    by call (each call sets its own), so that a change in the machine's load
    during the measure weighs on both sides of the ratio alike (what one
    after the other read: docs/performance.md, "Tried and not kept")."""
    def at(n, f):
        def g():
            torch.set_num_threads(n)
            return f()
        return g

    out = {}
    for backward in (False, True):
        fns = attention_callables(1, H, T, D, (3,), backward=backward)
        if not backward:
            del fns["sdpa"]
        times = time_rounds({f"{name}, {n} threads": at(n, f) for name, f in fns.items() for n in (1, threads)},
                            repeats=repeats)
        tag = "fwd+bwd" if backward else "fwd"
        out[tag] = paired_ratio(times, "hkt L=3, 1 threads", f"hkt L=3, {threads} threads")
        if backward:
            out[f"sdpa {tag}"] = paired_ratio(times, "sdpa, 1 threads", f"sdpa, {threads} threads")
    torch.set_num_threads(1)
    one = sgemm_gflops()
    torch.set_num_threads(threads)
    out["sgemm"] = sgemm_gflops() / one
    return out


def forward_vs_sgemm(H, D, threads, repeats, T=2048, n=2048):
    """HKT L=3's forward at T and torch.mm of two n x n float32 matrices, timed
    round-robin (medians, as every other figure here): GFLOP/s of each and their
    ratio.  The sgemm printed first (best of 5, alone, before anything else ran)
    describes the machine; this one shares the machine's state with the forward
    it is compared with (the clock of a VM's cores moved by up to a quarter
    between the benchmark's parts)."""
    torch.set_num_threads(threads)
    fwd = attention_callables(1, H, T, D, (3,))["hkt L=3"]
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = time_rounds({"hkt": fwd, "sgemm": lambda: torch.mm(a, b)}, repeats=repeats)
    hkt_gf = score_flops(1, H, T, D, 3) / statistics.median(times["hkt"]) / 1e9
    mm_gf = 2.0 * n ** 3 / statistics.median(times["sgemm"]) / 1e9
    # GFLOP/s over GFLOP/s, round by round: the flops' ratio times sgemm's time over hkt's
    ratio = score_flops(1, H, T, D, 3) / (2.0 * n ** 3) / paired_ratio(times, "hkt", "sgemm")
    return {"hkt_gflops": hkt_gf, "sgemm_gflops": mm_gf, "ratio": ratio}


def fit_exponent(Ts, times):
    xs = [math.log(t) for t in Ts]
    ys = [math.log(t) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--reference-max-T", type=int, default=2048, help="largest T the O(T^2)-memory reference runs at")
    ap.add_argument("--memory-T", type=int, default=16384)
    ap.add_argument("--bf16-T", type=int, nargs="*", default=[1024, 2048])
    ap.add_argument("--min-time", type=float, default=1.5,
                    help="seconds of rounds each cell of the main table runs at least")
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<cpu>/)")
    args = ap.parse_args(argv)
    args.out = args.out or results_dir(machine_info())
    if args.quick:
        args.T, args.repeats, args.memory_T, args.reference_max_T, args.bf16_T = [128, 512], 3, 2048, 512, [256]
        args.min_time = 0.0
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    H, D = args.heads, args.dim

    machine = machine_info()
    sgemm = sgemm_gflops()
    print(f"machine: {describe_machine(machine)}")
    print(f"sgemm (torch.mm 2048^3, {args.threads} threads): {sgemm:.0f} GFLOP/s, {sgemm / args.threads:.0f} per core")
    print(f"float32, B=1 H={H} D={D}")
    errors = check_correctness()
    print("correctness vs float64 reference (max relative error, output and all gradients): "
          + ", ".join(f"{k}: {v['float64']:.1e} (f64) {v['float32']:.1e} (f32)" for k, v in errors.items()))

    rows = []
    for causal in (False, True):
        for T in args.T:
            ref = T <= args.reference_max_T
            for backward in (False, True):
                fns = attention_callables(1, H, T, D, (1, 2, 3), is_causal=causal, backward=backward,
                                          include_reference=ref)
                # at least min_time of rounds: a call of a few ms is one a stall of the
                # VM's other core can double, and 7 rounds of T=512 last a third of a second
                times = time_rounds(fns, repeats=args.repeats, min_time=args.min_time)
                for name, ts in times.items():
                    L = 1 if name == "sdpa" else int(name.split("=")[1])
                    flops = score_flops(1, H, T, D, L, is_causal=causal, backward=backward)
                    sec = statistics.median(ts)
                    rows.append({"name": name, "T": T, "causal": causal, "pass": "fwd+bwd" if backward else "fwd",
                                 "ms": sec * 1e3, "x_sdpa": paired_ratio(times, name, "sdpa"),
                                 "gflops": flops / sec / 1e9})

    print()
    print(f"{'pass':8s} {'causal':6s} {'T':>5s} | " + " | ".join(f"{n:>22s}" for n in
                                                          ["sdpa", "hkt L=1", "hkt L=2", "hkt L=3", "reference L=3"]))
    print(f"{'':8s} {'':6s} {'':>5s} | " + " | ".join(f"{'ms  (x SDPA)  GF/s':>22s}" for _ in range(5)))
    for p in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            for T in args.T:
                cells = []
                for n in ["sdpa", "hkt L=1", "hkt L=2", "hkt L=3", "reference L=3"]:
                    r = [x for x in rows if x["name"] == n and x["T"] == T and x["causal"] == causal and x["pass"] == p]
                    cells.append(f"{r[0]['ms']:8.1f} ({r[0]['x_sdpa']:4.2f}) {r[0]['gflops']:5.0f}" if r else f"{'-':>22s}")
                print(f"{p:8s} {str(causal):6s} {T:5d} | " + " | ".join(cells))

    exponents = {}
    for n in ["sdpa", "hkt L=1", "hkt L=2", "hkt L=3"]:
        for causal in (False, True):
            pts = [(x["T"], x["ms"]) for x in rows if x["name"] == n and x["causal"] == causal and x["pass"] == "fwd+bwd"
                   and x["T"] >= 512]  # below, fixed per-call costs dominate
            if len(pts) >= 2:
                exponents[f"{n} causal={causal}"] = fit_exponent(*zip(*pts))
    print("\nfitted exponent of fwd+bwd time against T: " + ", ".join(f"{k}: {v:.2f}" for k, v in exponents.items()))

    bf16 = []
    for T in args.bf16_T:
        for backward in (False, True):
            fns = attention_callables(1, H, T, D, (1, 3), backward=backward, dtype=torch.bfloat16)
            # float32 HKT in the same round-robin: the speed-up over float32 is a ratio of
            # calls timed side by side, not of two blocks minutes apart
            fns["hkt L=3 float32"] = attention_callables(1, H, T, D, (3,), backward=backward)["hkt L=3"]
            times = time_rounds(fns, repeats=args.repeats)
            for name, ts in times.items():
                bf16.append({"name": name, "T": T, "pass": "fwd+bwd" if backward else "fwd",
                             "ms": statistics.median(ts) * 1e3, "x_sdpa": paired_ratio(times, name, "sdpa"),
                             "x_float32": paired_ratio(times, "hkt L=3 float32", name)})
    how = (("hkt native, AMX tiles" if _C.cpu_bf16_amx() else "hkt native, AVX512_BF16") if _kernels.native_bf16
           else "hkt upcasts to float32: " + ("this core runs vdpbf16ps at half rate" if _C.cpu_has_bf16()
                                               else "no AVX512_BF16 in the kernels in use"))
    print(f"\nbfloat16 inputs ({how}; SDPA in its bfloat16 kernel), not causal:")
    for r in bf16:
        print(f"  {r['pass']:8s} T={r['T']:5d} {r['name']:8s} {r['ms']:8.1f} ms  ({r['x_sdpa']:.2f}x SDPA bf16)")

    memory = {kind: extra_memory(kind, args.memory_T, H, D, 3, args.threads) for kind in ("hkt", "sdpa")}
    print(f"extra peak memory, causal fwd+bwd at T={args.memory_T} (beyond inputs, output, upstream and input gradients): "
          f"hkt L=3 {memory['hkt']['extra'] / 2**20:.1f} MB, sdpa {memory['sdpa']['extra'] / 2**20:.1f} MB")

    ref_ratio = {}
    for causal in (False, True):
        r = [x for x in rows if x["name"] == "reference L=3" and x["causal"] == causal and x["pass"] == "fwd+bwd"]
        h = [x for x in rows if x["name"] == "hkt L=3" and x["causal"] == causal and x["pass"] == "fwd+bwd"]
        for a in r:
            b = [x for x in h if x["T"] == a["T"]][0]
            ref_ratio[f"T={a['T']} causal={causal}"] = a["ms"] / b["ms"]
    print("reference / hkt L=3, fwd+bwd: " + ", ".join(f"{k}: {v:.1f}x" for k, v in ref_ratio.items()))

    small = small_calls(args.repeats)
    print("\none small call, T=16 B=1 H=4 D=32 L=3 (us, median): " + ", ".join(
        f"{k} {v * 1e6:.1f}" for k, v in small.items() if not k.startswith("ratio")))
    vs_sgemm = forward_vs_sgemm(H, D, args.threads, args.repeats)
    print(f"forward L=3 at T=2048 and sgemm, interleaved (medians): {vs_sgemm['hkt_gflops']:.0f} and "
          f"{vs_sgemm['sgemm_gflops']:.0f} GFLOP/s, ratio {vs_sgemm['ratio']:.3f}")
    # 11 rounds at least: its target is a ratio, with the machine's noise
    scaling = thread_scaling(H, D, args.threads, args.repeats if args.quick else max(11, args.repeats))
    print(f"{args.threads} threads / 1 thread speed-up, T=2048 L=3: " + ", ".join(
        f"{k} {v:.2f}x" for k, v in scaling.items()))

    def worst(name, p, causal=None, Ts=None):
        return max(x["x_sdpa"] for x in rows if x["name"] == name and x["pass"] == p
                   and (causal is None or x["causal"] == causal) and (Ts is None or x["T"] in Ts))

    def gflops_per_core(name, T):
        r = [x for x in rows if x["name"] == name and x["pass"] == "fwd" and not x["causal"] and x["T"] == T]
        return r[0]["gflops"] / args.threads if r else float("nan")

    big = [T for T in args.T if T >= 512]
    small_T = [T for T in args.T if T <= 128]
    bf = {(r["name"], r["pass"], r["T"]): r for r in bf16}
    bf_ratio = max((bf[("hkt L=3", "fwd+bwd", T)]["x_sdpa"] for T in args.bf16_T), default=float("nan"))
    bf_speedup = min((bf[("hkt L=3", "fwd+bwd", T)]["x_float32"] for T in args.bf16_T), default=float("nan"))
    bf_fwd_ratio = max((bf[("hkt L=3", "fwd", T)]["x_sdpa"] for T in args.bf16_T), default=float("nan"))
    bf_fwd_speedup = min((bf[("hkt L=3", "fwd", T)]["x_float32"] for T in args.bf16_T), default=float("nan"))
    print(f"bfloat16 L=3 forward alone (no target of its own): {bf_fwd_ratio:.2f}x SDPA bfloat16 (worst), "
          f"{bf_fwd_speedup:.2f}x faster than float32 (least)")
    # the bfloat16 targets are for bfloat16 computed natively, where the CPU can
    # (AVX512_BF16 at full rate, or AMX); elsewhere hkt upcasts, and they do not apply
    bf_na = None if _kernels.native_bf16 else "no native bfloat16 here: " + how.split(": ", 1)[-1]
    targets = report_targets([
        (f"forward, L=1 / SDPA, T={big[0]}-{big[-1]}, causal and not (worst)", worst("hkt L=1", "fwd", Ts=big), "<=", 1.00),
        ("forward, L=3 / SDPA (worst)", worst("hkt L=3", "fwd", Ts=big), "<=", 1.15),
        ("forward+backward, L=3 / SDPA, not causal (worst)", worst("hkt L=3", "fwd+bwd", False, big), "<=", 1.00),
        ("forward+backward, L=3 / SDPA, causal (worst)", worst("hkt L=3", "fwd+bwd", True, big), "<=", 0.85),
        ("forward L=3 GFLOP/s per core at T=2048 / sgemm per core (interleaved medians)", vs_sgemm["ratio"],
         ">=", 0.90),
        ("forward+backward at T=128, L=3 / SDPA (worst)", worst("hkt L=3", "fwd+bwd", Ts=small_T) if small_T
         else float("nan"), "<=", 1.2),
        ("bfloat16 L=3 forward+backward / SDPA bfloat16 (worst)", bf_ratio, "<=", 1.00, bf_na),
        ("bfloat16 speed-up over float32, HKT L=3 forward+backward (least)", bf_speedup, ">=", 1.5, bf_na),
        ("one small call: forward under no_grad / SDPA", small["ratio fwd"], "<=", 2.0),
        ("one small call: forward+backward / SDPA", small["ratio fwd+bwd"], "<=", 2.0),
        (f"{args.threads} threads / 1 thread speed-up, T=2048 L=3 forward+backward", scaling["fwd+bwd"], ">=", 1.85),
        (f"extra memory, causal forward+backward at T={args.memory_T}, L=3 (MB)", memory["hkt"]["extra"] / 2**20,
         "<=", 64),
    ])

    # "paired": every ratio is the median of per-round ratios (research.timing.paired_ratio)
    result = {"config": {"heads": H, "dim": D, "threads": args.threads, "T": args.T, "torch": torch.__version__,
                         "ratios": "paired"},
              "machine": machine, "sgemm_gflops": sgemm, "forward_vs_sgemm": vs_sgemm,
              "forward_vs_sgemm_alone": gflops_per_core("hkt L=3", 2048) / (sgemm / args.threads),
              "errors": errors, "rows": rows, "exponents": exponents, "memory": memory,
              "reference_over_hkt": ref_ratio, "bfloat16": bf16,
              "bfloat16_forward": {"native": bool(_kernels.native_bf16), "worst_x_sdpa": bf_fwd_ratio,
                                   "least_speedup_over_float32": bf_fwd_speedup}, "small_call_seconds": small,
              "thread_speedup": scaling, "targets": targets}
    if args.quick:  # a smoke run's figures are not results: keep the measured ones
        return result
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, causal in zip(axes, (False, True)):
            for n in ["sdpa", "hkt L=1", "hkt L=2", "hkt L=3", "reference L=3"]:
                pts = [(x["T"], x["ms"]) for x in rows if x["name"] == n and x["causal"] == causal and x["pass"] == "fwd+bwd"]
                if pts:
                    ax.loglog(*zip(*pts), marker="o", label=n, base=2)
            ax.set_title(f"forward+backward, causal={causal}")
            ax.set_xlabel("T")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("ms")
        axes[0].legend()
        fig.suptitle(f"HKT vs SDPA, B=1 H={H} D={D} float32, {args.threads} threads")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "attention.png"), dpi=110)
        print(f"wrote {args.out}/attention.json and attention.png")
    except ImportError:
        print(f"wrote {args.out}/attention.json (matplotlib missing: no plot)")
    return result


if __name__ == "__main__":
    main()
