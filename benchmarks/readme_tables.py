"""Rewrites the README's measured-performance block from the benchmarks' results.

    python benchmarks/readme_tables.py          # after bench_attention.py and bench_module.py

Reads benchmarks/results/attention.json and module.json, then those of every
other CPU measured, each in a folder of its own under benchmarks/results/ (the
benchmarks' --out), and replaces what lies between the README's
``<!-- perf:begin -->`` and ``<!-- perf:end -->`` lines, so every figure there
comes from a run and names the CPU it ran on.
"""
import json
import os
import re

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

from research.timing import isa_limits_text

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def machine_line(m, threads):
    bf16 = f", bfloat16 {m['hkt_bf16']}" if "hkt_bf16" in m else ""
    commit = f", hkt at {m['hkt_commit']}" if m.get("hkt_commit") else ""
    return (f"{m['cpu']} (family {m['family']}, model {m['model']}; {', '.join(m['flags'])}), "
            f"hkt kernels built for `{m['hkt_cpu_kernels']}`{bf16}, {threads} threads, torch {m['torch']}{commit}"
            f"{isa_limits_text(m, quote='`')}")


def attention_block(a):
    rows = {(r["name"], r["T"], r["causal"], r["pass"]): r for r in a["rows"]}
    Ts = sorted({r["T"] for r in a["rows"]})
    vs = a.get("forward_vs_sgemm")
    inter = f" (best of 5, alone; {vs['sgemm_gflops']:.0f}, median, timed round-robin with the forward)" if vs else ""
    out = [f"Measured on {machine_line(a['machine'], a['config']['threads'])}; sgemm "
           f"(torch.mm 2048³) {a['sgemm_gflops']:.0f} GFLOP/s{inter}. float32, B=1, H={a['config']['heads']}, "
           f"D={a['config']['dim']}; medians of interleaved runs, ratios to SDPA in the same process"
           + (" (each the median of the rounds' own ratios)" if a["config"].get("ratios") == "paired" else "")
           + ".", "",
           "| T | causal | HKT L=1 fwd | HKT L=3 fwd | HKT L=1 fwd+bwd | HKT L=3 fwd+bwd | SDPA fwd+bwd |",
           "|---|---|---|---|---|---|---|"]
    for causal in (False, True):
        for T in Ts:
            cells = [f"{rows[(n, T, causal, p)]['x_sdpa']:.2f}x" for p in ("fwd", "fwd+bwd")
                     for n in ("hkt L=1", "hkt L=3")]
            cells = [cells[0], cells[1], cells[2], cells[3]]
            out.append(f"| {T} | {'yes' if causal else 'no'} | " + " | ".join(cells)
                       + f" | {rows[('sdpa', T, causal, 'fwd+bwd')]['ms']:.1f} ms |")
    return out


def targets_block(targets):
    out = ["| measure | target | measured | |", "|---|---|---|---|"]
    for t in targets:
        verdict = f"n/a: {t['not_applicable']}" if t["met"] is None else "met" if t["met"] else "**not met**"
        out.append(f"| {t['measure']} | {t['target']} | {t['value']:.3g} | {verdict} |")
    return out


def load(folder):
    """A run's (attention.json, module.json)."""
    with open(os.path.join(folder, "attention.json")) as f:
        a = json.load(f)
    with open(os.path.join(folder, "module.json")) as f:
        return a, json.load(f)


def machine_block(a, m):
    lines = attention_block(a)
    lines += ["", "Every target of the benchmarks, as they printed it (attention, then the module's training "
              "step against `nn.MultiheadAttention`):", ""]
    lines += targets_block(a["targets"] + m.get("targets", []))
    small = a["small_call_seconds"]
    lines += ["", f"One small call (T=16, B=1, H=4, D=32, L=3): forward under no_grad "
              f"{small['hkt fwd'] * 1e6:.0f} µs (SDPA {small['sdpa fwd'] * 1e6:.0f} µs), forward+backward "
              f"{small['hkt fwd+bwd'] * 1e6:.0f} µs (SDPA {small['sdpa fwd+bwd'] * 1e6:.0f} µs)."]
    scaling = a.get("thread_speedup", {})
    if "sgemm" in scaling:
        lines += ["", f"2 threads / 1 thread at T=2048: HKT L=3 forward {scaling['fwd']:.2f}x, forward+backward "
                  f"{scaling['fwd+bwd']:.2f}x; on the same machine SDPA forward+backward "
                  f"{scaling['sdpa fwd+bwd']:.2f}x and sgemm {scaling['sgemm']:.2f}x."]
    return lines


def main():
    results = os.path.join(HERE, "results")
    lines = machine_block(*load(results))
    others = [(d, load(os.path.join(results, d))) for d in os.listdir(results)
              if os.path.isfile(os.path.join(results, d, "attention.json"))]
    # other CPUs first, then runs of a CPU held to fewer instruction sets
    for d, run in sorted(others, key=lambda x: (bool(x[1][0]["machine"].get("isa_limits")), x[0])):
        m = run[0]["machine"]
        title = (f"{m['cpu']} with its instruction sets restricted, a stand-in for a CPU without the rest"
                 if m.get("isa_limits") else f"Another CPU: {m['cpu']}, family {m['family']} model {m['model']}")
        lines += ["", f"**{title}** (`benchmarks/results/{d}/`)", ""] + machine_block(*run)
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    block = "<!-- perf:begin -->\n" + "\n".join(lines) + "\n<!-- perf:end -->"
    new, n = re.subn(r"<!-- perf:begin -->.*?<!-- perf:end -->", lambda _: block, text, flags=re.S)
    if n != 1:
        raise SystemExit("README.md: no <!-- perf:begin --> ... <!-- perf:end --> block")
    with open(path, "w") as f:
        f.write(new)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
