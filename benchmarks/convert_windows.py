"""Long context for a converted transformers model (issue 48, item 5): the
forward of a Llama-style decoder, random weights from a config, at
T = 1024 to 32,768, three ways:

* ``sdpa``: the original model, attn_implementation="sdpa";
* ``dense``: converted with ``hkt.integrations.transformers.convert(levels=6)``;
* ``windows``: converted with levels=6 and windows [64, 128, 256, 512, 1024, None].

    python benchmarks/convert_windows.py                  # T = 1024 .. 32768
    python benchmarks/convert_windows.py --sizes 1024 4096
    python benchmarks/convert_windows.py --cap 60         # skip a call expected to take longer (s)

The model: hidden 256, 4 heads of 64 (no grouping), 2 layers, MLP 512, vocab
256, float32; B=1, no padding, no cache, no gradient, 2 threads.  Each time is
the median of --runs calls (one call where a call takes over 10 s) after one
untimed call at that length, the three kinds taking turns call by call; the
CPU time of all threads is recorded beside it (on a shared machine it moves
less than the wall time).  A kind whose call, extrapolated from the length
before (as T^2 for SDPA and dense, T^1.3 with windows), would pass --cap is skipped
and recorded as such.  The machine's load average is recorded with every row:
on a shared machine the wall times carry it.  Writes
benchmarks/results/<cpu>/convert_windows.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import hkt.integrations.transformers as ht  # noqa: E402
from research.timing import describe_machine, machine_info, results_dir  # noqa: E402

THREADS = 2
LEVELS = 6
WINDOWS = [64, 128, 256, 512, 1024, None]
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64, num_hidden_layers=2,
             intermediate_size=512, vocab_size=256)
KINDS = ("sdpa", "dense", "windows")
# how a call's time grows with T, for the skip rule: quadratic without windows
GROWTH = {"sdpa": 2.0, "dense": 2.0, "windows": 1.3}


def build(kind, max_len):
    config = LlamaConfig(**SHAPE, max_position_embeddings=max_len, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    if kind == "dense":
        ht.convert(model, levels=LEVELS)
    elif kind == "windows":
        ht.convert(model, levels=LEVELS, windows=WINDOWS)
    return model


def seconds(model, x):
    """Wall and CPU seconds (all threads) of one forward."""
    c0, t0 = time.process_time(), time.perf_counter()
    model(x, use_cache=False)
    return time.perf_counter() - t0, time.process_time() - c0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--cap", type=float, default=60.0, help="seconds one call may be expected to take")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    info = machine_info()
    print(describe_machine(info))
    models = {kind: build(kind, max(args.sizes)) for kind in KINDS}
    with torch.no_grad():  # the three agree at conversion where the windows cover every key
        x = torch.randint(0, SHAPE["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(1))
        want = models["sdpa"](x, use_cache=False).logits
        for kind in ("dense", "windows"):
            err = ((models[kind](x, use_cache=False).logits - want).abs().max() / want.abs().max()).item()
            if err > 2e-4:
                raise SystemExit(f"{kind} disagrees with the original at T=48: {err:.2e}")
    rows, last = [], {}
    print(f"{'T':>6} " + " ".join(f"{k + ' (s)':>12}" for k in KINDS) + f" {'sdpa/windows':>13} {'load':>5}"
          "  (wall; CPU seconds of the two threads in brackets)")
    with torch.no_grad():
        for T in args.sizes:
            x = torch.randint(0, SHAPE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T))
            row, wanted, times = {"T": T}, {}, {}
            for kind in KINDS:
                expected = last[kind] * (T / last[kind + "_T"]) ** GROWTH[kind] if kind in last else 0.0
                if expected > args.cap:
                    row[kind] = {"skipped": f"expected over {args.cap:.0f} s (about {expected:.0f} s)"}
                    last[kind], last[kind + "_T"] = expected, T
                    continue
                first = seconds(models[kind], x)[0]  # untimed: first-touch and allocation costs
                wanted[kind], times[kind] = 1 if first > 10 else args.runs, []
            # the kinds take turns, call by call, so that a change in the machine's load falls on all of them
            for turn in range(max(wanted.values(), default=0)):
                for kind in wanted:
                    if turn < wanted[kind]:
                        times[kind].append(seconds(models[kind], x))
            for kind, ts in times.items():
                row[kind] = {"seconds": statistics.median(t for t, _ in ts),
                             "cpu_seconds": statistics.median(c for _, c in ts), "runs": [t for t, _ in ts]}
                last[kind], last[kind + "_T"] = row[kind]["seconds"], T
            row["load_average"] = os.getloadavg()[0]
            rows.append(row)
            cells = [f"{row[k]['seconds']:6.3f} ({row[k]['cpu_seconds']:.2f})" if "seconds" in row[k]
                     else f"{'skipped':>12}" for k in KINDS]
            ratio = (row["sdpa"]["seconds"] / row["windows"]["seconds"]
                     if "seconds" in row["sdpa"] and "seconds" in row["windows"] else float("nan"))
            print(f"{T:6d} " + " ".join(cells) + f" {ratio:13.2f} {row['load_average']:5.2f}", flush=True)
    write(info, rows, "convert_windows.json")


def write(info, rows, name, threads=THREADS):
    """benchmarks/results/<cpu>/name: the machine, the model, its levels and windows, and the rows."""
    out = results_dir(info)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump({"machine": info, "model": dict(SHAPE, family="llama", dtype="float32", batch=1),
                   "levels": LEVELS, "windows": WINDOWS, "threads": threads, "rows": rows}, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(os.path.join(out, name))}")


if __name__ == "__main__":
    main()
