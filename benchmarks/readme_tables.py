"""Writes the performance figures users read, from the benchmarks' results only.

    python benchmarks/readme_tables.py           # after make bench (on any CPU)
    python benchmarks/readme_tables.py --check   # exit 1 if either file is out of date

Each CPU measured has a folder benchmarks/results/<cpu>/ (research.timing.machine_slug)
with attention.json and module.json (bench_attention.py, bench_module.py), and
optionally notes.md (the profile behind a target missed there, by hand) and the
other benchmarks' JSON. From them this writes:

- README.md, between ``<!-- perf:begin -->`` and ``<!-- perf:end -->``: one table, a
  row per CPU, and one plot (benchmarks/results/cpus.png);
- docs/performance.md, whole: the method (benchmarks/notes/method.md), per CPU its
  tables, the commit and date it ran at, its plot and notes; the other benchmarks;
  restructures of the Python layer held to the same bits and speed
  (benchmarks/notes/python_layer.md); the windowed kernels held to 0.2.0's bits
  (benchmarks/notes/window_bits.md); the measurements behind the kernels'
  constants (benchmarks/notes/constants.md);
  what was tried and not kept (benchmarks/notes/tried.md).
"""
import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

from research.timing import isa_limits_text  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
NOTES = os.path.join(HERE, "notes")
PLOT = os.path.join(RESULTS, "cpus.png")

# the README's columns: (heading, the start of the target's measure in the results)
SUMMARY = [("L=3 forward", "forward, L=3 / SDPA"),
           ("L=3 fwd+bwd", "forward+backward, L=3 / SDPA, not causal"),
           ("L=3 fwd+bwd, causal", "forward+backward, L=3 / SDPA, causal"),
           ("bfloat16 L=3 fwd+bwd", "bfloat16 L=3 forward+backward / SDPA bfloat16"),
           ("MultiheadHKT step", "MultiheadHKT(levels=3) step / MHA, T=1024")]


def machine_line(m, threads):
    bf16 = f", bfloat16 {m['hkt_bf16']}" if "hkt_bf16" in m else ""
    return (f"{m['cpu']} (family {m['family']}, model {m['model']}; {', '.join(m['flags'])}), "
            f"hkt kernels built for `{m['hkt_cpu_kernels']}`{bf16}, {threads} threads, torch {m['torch']}"
            f"{isa_limits_text(m, quote='`')}")


def cpu_title(m):
    name = " ".join(m["cpu"].replace("(R)", "").replace("(TM)", "").replace(" Processor", "").split())
    title = f"{name} (family {m['family']} model {m['model']})"
    return title + (" held to AVX2" if m.get("isa_limits") else "")


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
            out.append(f"| {T} | {'yes' if causal else 'no'} | " + " | ".join(cells)
                       + f" | {rows[('sdpa', T, causal, 'fwd+bwd')]['ms']:.1f} ms |")
    return out


def targets_block(targets):
    out = ["| measure | target | measured | |", "|---|---|---|---|"]
    for t in targets:
        verdict = f"n/a: {t['not_applicable']}" if t["met"] is None else "met" if t["met"] else "**not met**"
        out.append(f"| {t['measure']} | {t['target']} | {t['value']:.3g} | {verdict} |")
    return out


def _read(path):
    with open(path) as f:
        return f.read()


def load(folder):
    """A CPU's (attention.json, module.json)."""
    return (json.loads(_read(os.path.join(folder, "attention.json"))),
            json.loads(_read(os.path.join(folder, "module.json"))))


def cpus():
    """[(folder name, attention, module)]: other CPUs by name, then runs held to
    fewer instruction sets."""
    found = [(d, *load(os.path.join(RESULTS, d))) for d in sorted(os.listdir(RESULTS))
             if os.path.isfile(os.path.join(RESULTS, d, "attention.json"))
             and os.path.isfile(os.path.join(RESULTS, d, "module.json"))]
    return sorted(found, key=lambda x: (bool(x[1]["machine"].get("isa_limits")), x[0]))


def run_date(folder, machine):
    """The day a run was taken: the results' own record, else the day its file
    was committed (runs from before the benchmarks recorded it)."""
    if machine.get("date"):
        return machine["date"]
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", os.path.join(folder, "attention.json")],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "an unrecorded day"
    except (OSError, subprocess.SubprocessError):
        return "an unrecorded day"


def find_target(targets, prefix):
    return next((t for t in targets if t["measure"].startswith(prefix)), None)


def kernels_text(m):
    """Which of hkt's kernels ran: 'avx512f, bfloat16 on AMX'."""
    bf16 = m.get("hkt_bf16", "")
    how = "upcast" if not bf16.startswith("native") else "on " + bf16.split(", ", 1)[-1]
    return f"{m['hkt_cpu_kernels']}, bfloat16 {how}"


def summary_table(runs):
    """One row per CPU: the worst ratio over T of each headline measure."""
    head = "| CPU | kernels | " + " | ".join(h for h, _ in SUMMARY) + " | targets met |"
    out = [head, "|" + "---|" * (len(SUMMARY) + 3)]
    for _, a, m in runs:
        targets = a["targets"] + m.get("targets", [])
        cells = []
        for _, prefix in SUMMARY:
            t = find_target(targets, prefix)
            cells.append("–" if t is None else f"{t['value']:.2f}x" + ("" if t["met"] is not False else " ✗"))
        judged = [t for t in targets if t["met"] is not None]
        out.append(f"| {cpu_title(a['machine'])} | {kernels_text(a['machine'])} | " + " | ".join(cells)
                   + f" | {sum(t['met'] for t in judged)} of {len(judged)} |")
    return out


def plot(runs, path):
    """L=3 forward+backward time over SDPA's against T, a line per CPU."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, causal in zip(axes, (False, True)):
        for _, a, _ in runs:
            rows = sorted((r for r in a["rows"] if r["name"] == "hkt L=3" and r["pass"] == "fwd+bwd"
                           and r["causal"] == causal), key=lambda r: r["T"])
            ax.plot([r["T"] for r in rows], [r["x_sdpa"] for r in rows], marker="o", label=cpu_title(a["machine"]))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"HKT L=3 forward+backward / SDPA, {'causal' if causal else 'not causal'}")
        ax.set_xlabel("sequence length T")
    axes[0].set_ylabel("time ratio (lower is faster)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def readme_block(runs):
    return (["One row per CPU measured: each figure is HKT's time over torch SDPA's (flash, CPU) in the same "
             "process, the worst over T = 512–4096 (B=1, H=8, D=64, float32 but for the bfloat16 column, "
             "2 threads); the module step is `MultiheadHKT(levels=3)` over `nn.MultiheadAttention` "
             "(T=1024, E=256, B=8). ✗ marks a target not met. Per-CPU tables, the method and the "
             "profiles: [docs/performance.md](docs/performance.md). Run `make bench` on yours.", ""]
            + summary_table(runs)
            + ["", "![HKT L=3 forward+backward over SDPA, by CPU](benchmarks/results/cpus.png)"])


def _other_benchmarks(folder):
    """Lines for decode / gqa / varlen / generate results in a CPU's folder."""
    out = []
    for name, what in (("decode", "one decoding step against SDPA on the same cache (bench_decode.py)"),
                       ("gqa", "grouped-query heads against full heads (bench_gqa.py)"),
                       ("varlen", "packed sequences against the padded, masked batch (bench_varlen.py)"),
                       ("generate", "text generation with the cache against recomputing (bench_generate.py)")):
        path = os.path.join(folder, f"{name}.json")
        if not os.path.isfile(path):
            continue
        targets = json.loads(_read(path)).get("targets") or []
        if targets:
            out += ["", f"{what[0].upper()}{what[1:]}:", ""] + targets_block(targets)
    return out


def long_context(folder, d):
    """bench_long.py's rows (windowed against unwindowed hkt and SDPA) as a
    table, with a plot of time against T written beside the results."""
    path = os.path.join(folder, "long.json")
    if not os.path.isfile(path):
        return []
    a = json.loads(_read(path))

    def cell(r, name):
        x = r.get(name)
        if not x:
            return "not run"
        if "seconds" not in x:
            return f"skipped (about {x['extrapolated_seconds']:.0f} s by H·T²)" if "extrapolated_seconds" in x else "skipped"
        return f"{x['seconds']:.1f} s ({x['cpu_seconds']:.1f} s CPU), +{x['peak_extra_bytes'] / 2**20:.0f} MiB"
    out = ["", "Long context (`bench_long.py`: causal forward+backward, B=1, D=64, float32, windows 256·2^l with a "
           "global top level; wall time, CPU time and peak memory above the inputs; the load average of the machine "
           "is recorded with each figure in `long.json`):", "",
           "| T | H, L | windowed | hkt, no windows | SDPA |", "|---|---|---|---|---|"]
    for r in a["rows"]:
        out.append(f"| {r['T']} | {r['H']}, {r['L']} | {cell(r, 'windowed')} | {cell(r, 'hkt')} | {cell(r, 'sdpa')} |")
    out += [""] + targets_block(a.get("targets") or [])
    png = os.path.join(folder, "long.png")
    _long_plot(a["rows"], png)
    return out + ["", f"![windowed HKT against SDPA by sequence length](../benchmarks/results/{d}/long.png)"]


def window_decoding(folder):
    """bench_window_decode.py's rows: one decoding step of a windowed module
    against the same module without windows and SDPA's attention alone."""
    path = os.path.join(folder, "window_decode.json")
    if not os.path.isfile(path):
        return []
    a = json.loads(_read(path))
    out = ["", f"Decoding one token at long context (`bench_window_decode.py`: MultiheadHKT E={a['E']}, "
           f"{a['heads']} heads, L={a['levels']}, windows {a['windows'][:-1]} and a global top level, float32, B=1; "
           f"the module's whole step, projections included, against the same module without windows (the decoding "
           f"kernel) and SDPA's attention alone over the same keys; medians):", "",
           "| cached tokens S | windowed step | step without windows | SDPA attention | caches (windowed, without) |",
           "|---|---|---|---|---|"]
    for r in a["rows"]:
        sizes = (f"{r['windowed_cache_mib']:.1f} MiB, {r['hkt_cache_mib']:.1f} MiB" if "hkt_cache_mib" in r
                 else "not recorded")
        out.append(f"| {r['S']} | {r['windowed_ms']:.2f} ms | {r['hkt_ms']:.2f} ms | {r['sdpa_ms']:.2f} ms | {sizes} |")
    return out


def window_masks(folder):
    """bench_window_masks.py's rows: what each way of masking costs the
    windowed kernels, against the same call unmasked."""
    path = os.path.join(folder, "window_masks.json")
    if not os.path.isfile(path):
        return []
    a = json.loads(_read(path))
    names = list(a["rows"][0]["seconds"])
    out = ["", f"Masks and dropout with windows (`bench_window_masks.py`: causal forward+backward, B={a['B']}, "
           f"H={a['heads']}, L={a['levels']}, D={a['D']}, float32, windows 256·2^l with a global top level; key "
           f"padding hides the last eighth of the keys, the query mask 10% of the entries at random; medians of "
           f"{a['repeats']} interleaved rounds):", "",
           "| T | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in a["rows"]:
        cells = [f"{r['seconds'][n]:.2f} s" if n in r["seconds"] else "not run" for n in names]
        out.append(f"| {r['T']} | " + " | ".join(cells) + " |")
    return out


def converted_long_context():
    """convert_windows.py's rows, from every CPU folder that has them: a
    converted Llama-style model's forward against the original on SDPA."""
    out = []
    for d, a in _cpu_results("convert_windows.json"):
        m = a["model"]

        def cell(r, name):
            x = r.get(name) or {}
            if "seconds" not in x:
                return "skipped: " + x.get("skipped", "not run")
            return f"{x['seconds']:.2f} s ({x['cpu_seconds']:.2f} s CPU)"
        out += ["", f"### {cpu_title(a['machine'])}, {a['threads']} threads", "",
                f"`benchmarks/convert_windows.py`, `benchmarks/results/{d}/convert_windows.json`: a "
                f"{m['family'].capitalize()}-style decoder from a config (random weights; hidden {m['hidden_size']}, "
                f"{m['num_attention_heads']} heads of {m['head_dim']}, {m['num_hidden_layers']} layers, MLP "
                f"{m['intermediate_size']}, vocab {m['vocab_size']}, {m['dtype']}, B={m['batch']}), its forward "
                f"without gradients or cache: the original on SDPA, converted with levels={a['levels']}, and "
                f"converted with levels={a['levels']} and windows {a['windows']}; median of up to 5 calls "
                f"(1 where a call took over 10 s), the three taking turns, after an untimed one; the machine's load "
                f"average beside each row; wall time, and the CPU time of both threads:", "",
                "| T | original, SDPA | converted, dense | converted, windows | SDPA / windows | load |",
                "|---|---|---|---|---|---|"]
        for r in a["rows"]:
            sdpa, win = (r.get(k) or {} for k in ("sdpa", "windows"))
            ratio = (f"{sdpa['seconds'] / win['seconds']:.2f}x" if "seconds" in sdpa and "seconds" in win else "")
            out.append(f"| {r['T']} | {cell(r, 'sdpa')} | {cell(r, 'dense')} | {cell(r, 'windows')} | {ratio} | "
                       f"{r['load_average']:.1f} |")
        notes = os.path.join(RESULTS, d, "convert_windows.md")
        if os.path.isfile(notes):
            out += ["", _read(notes).rstrip()]
        out += converted_decoding(d)
    return ["", "## Long context for a converted model"] + out if out else []


def _cpu_results(name):
    """(folder, its results) of every CPU folder that has results file ``name``."""
    for d in sorted(os.listdir(RESULTS)):
        path = os.path.join(RESULTS, d, name)
        if os.path.isfile(path):
            yield d, json.loads(_read(path))


def converted_models():
    """bench_convert.py's rows, from every CPU folder that has them: a
    converted mid-size Llama and a sliding-window Mistral against the
    originals on SDPA (prefill, training step, generated token)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_convert", os.path.join(os.path.dirname(__file__),
                                                                               "bench_convert.py"))
    bench_convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_convert)
    table = bench_convert.table
    out = []
    for d, a in _cpu_results("bench_convert.json"):
        loads = [r["load_average"] for r in a["rows"] if "load_average" in r]
        out += ["", f"### {cpu_title(a['machine'])}, {a['threads']} threads", "",
                f"`benchmarks/bench_convert.py`, `benchmarks/results/{d}/bench_convert.json`: time over the "
                f"original's in the same process, the kinds taking turns call by call, median over each row's "
                f"rounds (2 or 3); issue 58's target in brackets, ✗ where missed. The machine's load average at "
                f"the end of a row was {min(loads):.1f} to {max(loads):.1f}.", "",
                table([r for r in a["rows"] if "ratio" in r or "skipped" in r])]
        notes = os.path.join(RESULTS, d, "bench_convert.md")
        if os.path.isfile(notes):
            out += ["", _read(notes).rstrip()]
    return ["", "## Converted models against the originals"] + out if out else []


def converted_decoding(d):
    """generate_windows.py's rows in CPU folder d: a converted windowed model's
    cached steps on the rings against recomputing, and the original's."""
    path = os.path.join(RESULTS, d, "generate_windows.json")
    if not os.path.isfile(path):
        return []
    a = json.loads(_read(path))
    out = ["", "#### Decoding with the cache", "",
           f"`benchmarks/generate_windows.py`, `benchmarks/results/{d}/generate_windows.json`: the same model "
           f"converted with levels={a['levels']} and windows {a['windows']}, one cached step (one new token, B=1, "
           f"the whole model's call) after a prompt of S tokens, mean of the steps: on the rings (the windowed "
           f"decoding kernel, CPU float32/float64 without gradients), recomputing the windowed op over the sequence "
           f"(the path of bfloat16, CUDA and grad mode), and the original on SDPA with its own cache; the "
           f"machine's load average beside each row; {a['threads']} thread{'s' if a['threads'] > 1 else ''}, wall time "
           f"and CPU time:", "",
           "| S | rings | recomputing | original, SDPA | recomputing / rings | load |", "|---|---|---|---|---|---|"]
    for r in a["rows"]:
        cells = [f"{r[k]['ms_per_token']:.1f} ms ({r[k]['cpu_ms_per_token']:.1f} ms CPU)"
                 for k in ("ring", "recompute", "sdpa")]
        ratio = r["recompute"]["ms_per_token"] / r["ring"]["ms_per_token"]
        out.append(f"| {r['S']} | " + " | ".join(cells) + f" | {ratio:.1f}x | {r['load_average']:.1f} |")
    notes = os.path.join(RESULTS, d, "generate_windows.md")
    if os.path.isfile(notes):
        out += ["", _read(notes).rstrip()]
    return out


def _long_plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, label in (("windowed", "HKT, windowed levels"), ("hkt", "HKT, no windows"), ("sdpa", "SDPA")):
        pts = [(r["T"], r[name]["seconds"]) for r in rows if "seconds" in (r.get(name) or {})]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("forward+backward, s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def performance_page(runs):
    def note(*parts):
        path = os.path.join(*parts)
        return [_read(path).rstrip()] if os.path.isfile(path) else []

    lines = ["# Performance", "",
             "<!-- written by benchmarks/readme_tables.py from benchmarks/results/: edit those, not this -->", "",
             "## Method", ""] + note(NOTES, "method.md")
    lines += ["", "## Summary", ""] + readme_block(runs)[2:-1]
    lines += ["", "![HKT L=3 forward+backward over SDPA, by CPU](../benchmarks/results/cpus.png)"]
    for d, a, m in runs:
        folder = os.path.join(RESULTS, d)
        commit = a["machine"].get("hkt_commit") or "an unrecorded commit"
        lines += ["", f"## {cpu_title(a['machine'])}", "",
                  f"`benchmarks/results/{d}/`: hkt at {commit}, run on {run_date(folder, a['machine'])}.", ""]
        lines += attention_block(a)
        lines += ["", "Every target, as the benchmarks printed it (attention, then the module's training step "
                  "against `nn.MultiheadAttention`):", ""] + targets_block(a["targets"] + m.get("targets", []))
        small = a["small_call_seconds"]
        lines += ["", f"One small call (T=16, B=1, H=4, D=32, L=3): forward under no_grad "
                  f"{small['hkt fwd'] * 1e6:.0f} µs (SDPA {small['sdpa fwd'] * 1e6:.0f} µs), forward+backward "
                  f"{small['hkt fwd+bwd'] * 1e6:.0f} µs (SDPA {small['sdpa fwd+bwd'] * 1e6:.0f} µs)."]
        scaling = a.get("thread_speedup", {})
        if "sgemm" in scaling:
            lines += ["", f"2 threads / 1 thread at T=2048: HKT L=3 forward {scaling['fwd']:.2f}x, forward+backward "
                      f"{scaling['fwd+bwd']:.2f}x; on the same machine SDPA forward+backward "
                      f"{scaling['sdpa fwd+bwd']:.2f}x and sgemm {scaling['sgemm']:.2f}x."]
        lines += _other_benchmarks(folder)
        lines += long_context(folder, d)
        lines += window_decoding(folder)
        lines += window_masks(folder)
        if os.path.isfile(os.path.join(folder, "attention.png")):
            lines += ["", f"![{cpu_title(a['machine'])}](../benchmarks/results/{d}/attention.png)"]
        notes = note(folder, "notes.md")
        if notes:
            lines += ["", "### Where the time goes", ""] + notes
    lines += converted_models()
    lines += converted_long_context()
    for title, name in (("Other benchmarks", "other_benchmarks.md"),
                        ("Other builds: the 16-byte kernels, clang", "builds.md"),
                        ("The Python layer: restructures held to the same bits and speed", "python_layer.md"),
                        ("The windowed kernels: 0.2.0's bits, summed in a fixed order", "window_bits.md"),
                        ("Constants and the measurements behind them", "constants.md"),
                        ("Tried and not kept", "tried.md")):
        body = note(NOTES, name)
        if body:
            lines += ["", f"## {title}", ""] + body
    return "\n".join(lines) + "\n"


def readme_text(runs):
    text = _read(os.path.join(ROOT, "README.md"))
    block = "<!-- perf:begin -->\n" + "\n".join(readme_block(runs)) + "\n<!-- perf:end -->"
    new, n = re.subn(r"<!-- perf:begin -->.*?<!-- perf:end -->", lambda _: block, text, flags=re.S)
    if n != 1:
        raise SystemExit("README.md: no <!-- perf:begin --> ... <!-- perf:end --> block")
    return new


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only say whether README.md and docs/performance.md "
                    "are what the results give (exit 1 if not); writes nothing")
    args = ap.parse_args(argv)
    runs = cpus()
    want = {os.path.join(ROOT, "README.md"): readme_text(runs),
            os.path.join(ROOT, "docs", "performance.md"): performance_page(runs)}
    stale = [p for p, text in want.items() if not os.path.isfile(p) or _read(p) != text]
    if args.check:
        for p in stale:
            print(f"{os.path.relpath(p, ROOT)} is not what benchmarks/readme_tables.py writes: run it")
        return 1 if stale else 0
    for p, text in want.items():
        with open(p, "w") as f:
            f.write(text)
    plot(runs, PLOT)
    print("wrote README.md's table, docs/performance.md and " + os.path.relpath(PLOT, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
