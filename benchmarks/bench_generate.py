"""Text generation with the byte-level language model: with the attention cache
(``MultiheadHKT.init_cache`` / ``decode``) against recomputing the whole sequence
for every new byte.

    python benchmarks/bench_generate.py --threads 1          # results/bytelm.pt if present, else random weights
    python benchmarks/bench_generate.py --quick              # a smoke run

Measures, greedy decoding, B = 1:

- tokens per second at 1k and 4k context: ``--new`` bytes generated after a
  prompt that brings the sequence to the context length; with the cache the
  prompt's one prefill call and the one-byte steps after it are timed apart;
- issue 13's target: 512 new bytes after a 512-byte prompt, the cache against
  recomputing, >= 20x faster with identical greedy tokens, for the trained
  model (d=128, 4 heads) and for a randomly initialised one in the decoding
  configuration of the issue's first target (8 heads of dimension 64, L=3,
  d=512, 2 layers).  With a small model the per-call overhead of a decoding
  step (Python, small matrix-vector products) is most of its time, so the
  speed-up grows with the model.

Every time is the minimum of ``--repeats`` runs (the least disturbed one: other
work on the machine, e.g. a training run on another core, only ever adds time).
Prompts are real text: the start of the corpus's validation split.  The speed
does not depend on the weights, so without a checkpoint a randomly initialised
model of the default size is timed (its greedy tokens are still compared).
Writes benchmarks/results/<cpu>/generate.json (not with ``--quick``).
"""
import argparse
import json
import os
import time

import torch

import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

from research.bytelm import ByteLM, build_bytelm, generate, has_decode_api, load_checkpoint
from research.stdlib_bytes import load_corpus
from research.timing import results_dir, describe_machine, machine_info, report_targets

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CKPT = os.path.join(HERE, os.pardir, "results", "bytelm.pt")


def best_time(fn, repeats):
    """(minimum seconds over ``repeats`` calls, the last call's result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def cached_rates(model: ByteLM, prompt: bytes, n: int, total: int, repeats: int):
    """(prefill seconds, greedy one-byte decoding steps per second after it), each
    the best of ``repeats``: generate's cached loop, its two phases timed apart."""
    x = torch.tensor([list(prompt)])
    best_pre, best_dec = float("inf"), float("inf")
    for _ in range(repeats):
        with torch.inference_mode():
            cache = model.init_cache(1, total)
            t0 = time.perf_counter()
            tok = model.decode(x, cache)[:, -1].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            for _ in range(n - 1):
                tok = model.decode(tok, cache)[:, -1].argmax(-1, keepdim=True)
            t2 = time.perf_counter()
        best_pre, best_dec = min(best_pre, t1 - t0), min(best_dec, t2 - t1)
    return best_pre, (n - 1) / best_dec


def context_sweep(model, text, contexts, n_new, repeats):
    """Tokens per second near each context length: ``n_new`` bytes after a
    prompt of ``context - n_new``, recomputing (one full forward per byte) and
    with the cache (prefill, then one-byte steps)."""
    rows = []
    for ctx in contexts:
        prompt = text[:ctx - n_new]
        t_nc, toks_nc = best_time(lambda: generate(model, prompt, n_new, greedy=True, use_cache=False), repeats)
        toks_c = generate(model, prompt, n_new, greedy=True, use_cache=True)
        pre, rate = cached_rates(model, prompt, n_new, ctx, repeats)
        row = {"context": ctx, "new": n_new, "no_cache_tokens_per_s": n_new / t_nc, "prefill_s": pre,
               "cache_decode_tokens_per_s": rate, "identical": toks_c == toks_nc}
        rows.append(row)
        print(f"  context {ctx:5d}: without cache {row['no_cache_tokens_per_s']:7.1f} tokens/s | with cache "
              f"{rate:7.1f} tokens/s after a prefill of {ctx - n_new} bytes in {1e3 * pre:.0f} ms "
              f"({(ctx - n_new) / pre:.0f} bytes/s) | greedy tokens identical: {row['identical']}", flush=True)
    return rows


def target_run(model, prompt, n, repeats):
    """``n`` new bytes after ``prompt``, greedy: recomputing against the cache."""
    t_nc, toks_nc = best_time(lambda: generate(model, prompt, n, greedy=True, use_cache=False), repeats)
    t_c, toks_c = best_time(lambda: generate(model, prompt, n, greedy=True, use_cache=True), repeats)
    print(f"  without cache {t_nc:7.2f} s ({n / t_nc:7.1f} tokens/s); with cache {t_c:6.2f} s ({n / t_c:7.1f} "
          f"tokens/s): {t_nc / t_c:.1f}x faster; greedy tokens identical: {toks_c == toks_nc}", flush=True)
    return {"prompt": len(prompt), "new": n, "no_cache_s": t_nc, "cache_s": t_c, "speedup": t_nc / t_c,
            "identical": toks_c == toks_nc}


def describe(model, source):
    c = model.config
    return (f"ByteLM levels={c['levels']} d={c['d_model']} heads={c['n_heads']} (head dim "
            f"{c['d_model'] // c['n_heads']}) layers={c['n_layers']}, {sum(p.numel() for p in model.parameters())} "
            f"parameters, {source}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="a ByteLM checkpoint (default: results/bytelm.pt if present)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; the minimum is reported")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--new", type=int, default=16, help="bytes generated per context of the sweep")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--target-new", type=int, default=512)
    ap.add_argument("--large-repeats", type=int, default=2, help="repeats of the d=512 model's target run")
    ap.add_argument("--no-large", action="store_true", help="skip the d=512, 8-head model")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat, nothing written")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<cpu>/)")
    args = ap.parse_args(argv)
    args.out = args.out or results_dir(machine_info())
    if args.quick:
        args.contexts, args.new, args.prompt_len, args.target_new = [256], 8, 64, 64
        args.repeats = args.large_repeats = 1
    torch.set_num_threads(args.threads)
    if not has_decode_api():
        raise SystemExit("MultiheadHKT.init_cache / MultiheadHKT.decode do not exist in this hkt: nothing to compare")
    max_len = max(max(args.contexts), args.prompt_len + args.target_new)
    ckpt = args.checkpoint or (DEFAULT_CKPT if os.path.exists(DEFAULT_CKPT) else None)
    if ckpt:
        model, source = load_checkpoint(ckpt, max_len=max_len), os.path.relpath(ckpt)
    else:
        model, source = build_bytelm(0, max_len=max_len).eval(), "random weights (no checkpoint)"
    text = bytes(load_corpus().val[:max_len].tolist())
    prompt, n = text[:args.prompt_len], args.target_new

    print(f"machine: {describe_machine(machine_info())}")
    print(f"float32, B=1, greedy; each time the minimum of {args.repeats} runs (timings are noisy while other work "
          f"shares the machine)")
    print(f"\n{describe(model, source)}")
    print(f"tokens per second, {args.new} new bytes ending at each context:")
    sweep = context_sweep(model, text, args.contexts, args.new, args.repeats)
    print(f"{n} new bytes after a {args.prompt_len}-byte prompt:")
    runs = {"trained": target_run(model, prompt, n, args.repeats)}
    rows = [(f"{n} new after {args.prompt_len}, d={model.d_model} model: cache speed-up over recomputing",
             runs["trained"]["speedup"], ">=", 20.0)]
    large = None
    if not args.no_large:
        # the decoding configuration of issue 13's first target (H=8, D=64, L=3); speed does not depend on weights
        large = build_bytelm(0, d_model=512, n_heads=8, n_layers=2, levels=3, max_len=max_len).eval()
        print(f"\n{describe(large, 'random weights')}, minimum of {args.large_repeats} runs")
        runs["h8_d64"] = target_run(large, prompt, n, args.large_repeats)
        rows.append((f"{n} new after {args.prompt_len}, d=512 H=8 model: cache speed-up over recomputing",
                     runs["h8_d64"]["speedup"], ">=", 20.0))
    rows.append(("  ... greedy tokens identical in every run (1 = yes)",
                 float(all(r["identical"] for r in [*runs.values(), *sweep])), ">=", 1.0))
    targets = report_targets(rows)
    result = {"machine": machine_info(), "threads": args.threads, "repeats": args.repeats,
              "large_repeats": args.large_repeats, "timing": "minimum over repeats",
              "model": {**model.config, "source": source}, "large_model": None if large is None else large.config,
              "sweep": sweep, "target_runs": runs, "targets": targets}
    if args.quick:  # a smoke run's figures are not results
        return result
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "generate.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.relpath(path)}")
    return result


if __name__ == "__main__":
    main()
