"""Decoding with the cache for a converted transformers model with per-level
windows (issue 48, item 5): the time of one cached step (one new token, B=1)
after a prompt of S = 512 to 8192 tokens, three ways:

* ``ring``: converted with levels=6 and windows [64, 128, 256, 512, 1024, None];
  each step runs the windowed decoding kernel over the rings its layer filled
  at the prompt (a cost bounded by the windows, the top level's S / 32 blocks);
* ``recompute``: the same model with the decoding kernels turned off
  (``hkt.integrations.transformers.decoding._DECODE_KERNEL = False``), the path of
  bfloat16, CUDA and grad mode: each step recomputes the windowed op over
  the whole sequence;
* ``sdpa``: the original model, attn_implementation="sdpa" (its own cache).

    python benchmarks/generate_windows.py                 # S = 512, 2048, 8192
    python benchmarks/generate_windows.py --sizes 512 2048
    python benchmarks/generate_windows.py --threads 1    # on a shared machine

The model is benchmarks/convert_windows.py's (hidden 256, 4 heads of 64, 2
layers, MLP 512, vocab 256, float32), 2 threads (--threads), no gradient.  After the
prompt (untimed) come --steps cached steps of fixed random tokens (fewer for
``recompute`` at S >= 4096, whose steps take long); each figure is the mean
of a kind's steps (a ring step that begins no coarse block costs less than
one that does), the whole model's call (projections, MLP, transformers'
cache append included), wall time and the CPU time of its threads (the
first step, untimed, left out).  The ring and recompute steps' logits are checked
to agree.  The machine's load average is recorded with every row.  Writes
benchmarks/results/<cpu>/generate_windows.json.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

from transformers import DynamicCache  # noqa: E402

import hkt.integrations.transformers as ht  # noqa: E402
from convert_windows import SHAPE, THREADS, build, write  # noqa: E402  the same model
from research.timing import describe_machine, machine_info  # noqa: E402

KINDS = ("ring", "recompute", "sdpa")


def steps(model, prompt, tokens, kind):
    """((wall, CPU) seconds of each cached step, their logits), after the prompt."""
    ht.decoding._DECODE_KERNEL = kind != "recompute"
    try:
        cache = DynamicCache(config=model.config)
        model(prompt, cache=cache, use_cache=True)
        times, logits = [], []
        for i in range(tokens.shape[1]):
            c0, t0 = time.process_time(), time.perf_counter()
            out = model(tokens[:, i:i + 1], cache=cache, use_cache=True)
            times.append((time.perf_counter() - t0, time.process_time() - c0))
            logits.append(out.logits)
        return times, torch.cat(logits, dim=1)
    finally:
        ht.decoding._DECODE_KERNEL = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="1 on a machine others share: two threads that wait on each other there time the waits")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(describe_machine(info))
    max_len = max(args.sizes) + args.steps + 1
    models = {"ring": build("windows", max_len), "sdpa": build("sdpa", max_len)}
    models["recompute"] = models["ring"]
    rows = []
    print(f"{'S':>6} " + " ".join(f"{k + ' (ms)':>15}" for k in KINDS) + f" {'recompute/ring':>15} {'load':>5}")
    with torch.no_grad():
        for S in args.sizes:
            g = torch.Generator().manual_seed(S)
            prompt = torch.randint(0, SHAPE["vocab_size"], (1, S), generator=g)
            tokens = torch.randint(0, SHAPE["vocab_size"], (1, args.steps), generator=g)
            row, logits = {"S": S}, {}
            for kind in KINDS:
                n = args.steps if kind != "recompute" or S < 4096 else max(4, args.steps // 8)
                times, logits[kind] = steps(models[kind], prompt, tokens[:, :n], kind)
                row[kind] = {"ms_per_token": 1e3 * statistics.mean(t for t, _ in times[1:]),
                             "cpu_ms_per_token": 1e3 * statistics.mean(c for _, c in times[1:]), "steps": n,
                             "ms": [1e3 * t for t, _ in times]}
            n = logits["recompute"].shape[1]
            err = ((logits["ring"][:, :n] - logits["recompute"]).abs().max()
                   / logits["recompute"].abs().max()).item()
            if err > 1e-4:
                raise SystemExit(f"the ring and recompute steps disagree at S={S}: {err:.2e}")
            row["ring_vs_recompute_rel_error"] = err
            row["load_average"] = os.getloadavg()[0]
            rows.append(row)
            ratio = row["recompute"]["ms_per_token"] / row["ring"]["ms_per_token"]
            print(f"{S:6d} " + " ".join(f"{row[k]['ms_per_token']:15.2f}" for k in KINDS)
                  + f" {ratio:15.1f} {row['load_average']:5.2f}", flush=True)
    write(info, rows, "generate_windows.json", args.threads)

if __name__ == "__main__":
    main()
