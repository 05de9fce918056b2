"""A converted transformers model against the original: prefill, a training
step and a generated token, as time ratios measured in one process.

    python benchmarks/bench_convert.py                       # every measure of issue 58 (hours)
    python benchmarks/bench_convert.py --measures token --lengths 512
    python benchmarks/bench_convert.py --quick               # a tiny model, seconds (the test suite)

Models (random weights from a config, float32, batch 1):

- ``llama``: a mid-size Llama-style decoder: hidden 1024, 16 heads, 4
  key-value heads, 4 layers, MLP 2816, vocabulary 32,000;
- ``mistral``: the same shape as a Mistral with ``sliding_window=1024``.

Kinds: the original on SDPA; ``convert(levels=1)``; ``convert(levels=3)``;
``convert(levels=6, windows=[64, 128, 256, 512, 1024, None])`` (Llama only;
Mistral's are the original and levels=3).

Measures:

- ``prefill``: the forward of T tokens without gradients (the last
  position's logits only), T in --prefill-lengths;
- ``train``: forward, backward and an AdamW step on T tokens with every
  position's loss, T in --train-lengths;
- ``token``: one generated token with the cache, after a prompt of S (the
  prompt untimed; --token-steps steps timed, the first left out).

The kinds take turns call by call over --rounds rounds, so a change in the
machine's load falls on all of them; each ratio is the median over rounds of
a kind's time over the original's in the same round.  Ratios are checked
against issue 58's targets (a ✗ marks one missed).  A cell whose time,
extrapolated from the length before, passes --cap seconds is skipped and
recorded as such.  Writes benchmarks/results/<cpu>/bench_convert.json and,
``python benchmarks/readme_tables.py`` then writes the table into
docs/performance.md ("Converted models against the originals").
"""
import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

from research.timing import describe_machine, machine_info, results_dir  # noqa: E402

LLAMA = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=4,
             intermediate_size=2816, vocab_size=32000)
QUICK = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=256, vocab_size=512)
WINDOWS = [64, 128, 256, 512, 1024, None]
QUICK_WINDOWS = [16, 32, None]
KINDS = {"llama": ("original", "levels=1", "levels=3", "windows"), "mistral": ("original", "levels=3")}

# issue 58's targets: (model, kind, measure) -> [(largest length it covers, most the ratio may be)]
TARGETS = {
    ("llama", "levels=1", "prefill"): [(None, 1.0)], ("llama", "levels=1", "train"): [(None, 1.0)],
    ("llama", "levels=1", "token"): [(None, 1.0)],
    ("llama", "levels=3", "prefill"): [(None, 1.0)], ("llama", "levels=3", "train"): [(None, 1.05)],
    ("llama", "levels=3", "token"): [(None, 1.05)],
    ("llama", "windows", "prefill"): [(1024, 0.95), (16384, 0.6), (32768, 0.5)],
    ("llama", "windows", "train"): [(16384, 0.6)],
    ("llama", "windows", "token"): [(512, 1.05), (16384, 0.7)],
    ("mistral", "levels=3", "prefill"): [(16384, 0.6)], ("mistral", "levels=3", "train"): [(16384, 0.6)],
}


def target(model: str, kind: str, measure: str, T: int) -> Optional[float]:
    """The most ``kind``'s ratio may be at length T, or None where issue 58 sets none."""
    for upto, most in TARGETS.get((model, kind, measure), []):
        if upto is None or T == upto:
            return most
    return None


def build(model: str, kind: str, max_len: int, quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    import hkt.integrations.transformers as ht
    shape = QUICK if quick else LLAMA
    if model == "llama":
        config = LlamaConfig(**shape, max_position_embeddings=max_len, attn_implementation="sdpa")
        cls = LlamaForCausalLM
    else:
        config = MistralConfig(**shape, max_position_embeddings=max_len, attn_implementation="sdpa",
                               sliding_window=64 if quick else 1024)
        cls = MistralForCausalLM
    torch.manual_seed(0)
    m = cls(config)
    if kind == "levels=1":
        ht.convert(m, levels=1)
    elif kind == "levels=3":
        ht.convert(m, levels=3)
    elif kind == "windows":
        w = QUICK_WINDOWS if quick else WINDOWS
        ht.convert(m, levels=len(w), windows=w)
    return m


def prefill(m, T: int, g: torch.Generator):
    x = torch.randint(0, m.config.vocab_size, (1, T), generator=g)
    m.eval()

    def call():
        with torch.no_grad():
            m(x, use_cache=False, logits_to_keep=1)
    return call


def train(m, T: int, g: torch.Generator):
    x = torch.randint(0, m.config.vocab_size, (1, T), generator=g)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)

    def call():
        loss = m(x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return call


def token(m, S: int, g: torch.Generator, steps: int):
    """A callable that runs the prompt untimed, then returns the seconds of each timed step."""
    from transformers import DynamicCache
    prompt = torch.randint(0, m.config.vocab_size, (1, S), generator=g)
    nxt = torch.randint(0, m.config.vocab_size, (1, steps + 1), generator=g)
    m.eval()

    def call():
        with torch.no_grad():
            cache = DynamicCache(config=m.config)
            m(prompt, cache=cache, use_cache=True, logits_to_keep=1)
            ts = []
            for i in range(steps + 1):
                t0 = time.perf_counter()
                m(nxt[:, i:i + 1], cache=cache, use_cache=True)
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])
    return call


def measure(models: Dict[str, object], name: str, kinds, what: str, T: int, rounds: int, steps: int
            ) -> Dict[str, object]:
    """Times every kind at length T over ``rounds`` interleaved rounds; returns seconds and ratios."""
    calls = {}
    for kind in kinds:
        g = torch.Generator().manual_seed(T)
        m = models[kind]
        calls[kind] = token(m, T, g, steps) if what == "token" else (prefill if what == "prefill" else train)(m, T, g)
    for call in calls.values():  # untimed: first touch, allocation, optimiser state
        call()
    times = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind, call in calls.items():
            t0 = time.perf_counter()
            r = call()
            times[kind].append(r if what == "token" else time.perf_counter() - t0)
    row = {"model": name, "measure": what, "length": T, "seconds": {k: statistics.median(v) for k, v in times.items()},
           "ratio": {k: statistics.median(a / b for a, b in zip(times[k], times["original"]))
                     for k in kinds if k != "original"},
           "rounds": rounds, "load_average": os.getloadavg()[0]}
    row["missed"] = [k for k, r in row["ratio"].items()
                     if target(name, k, what, T) is not None and r > target(name, k, what, T)]
    return row


def table(rows: List[Dict]) -> str:
    lines = ["| model | measure | T | " + " | ".join(["levels=1", "levels=3", "windows"]) + " | original (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for k in ("levels=1", "levels=3", "windows"):
            if k in r.get("ratio", {}):
                t = target(r["model"], k, r["measure"], r["length"])
                mark = " ✗" if k in r["missed"] else ""
                cells.append(f"{r['ratio'][k]:.2f}{mark}" + (f" (≤ {t})" if t is not None else ""))
            elif "skipped" in r:
                cells.append("skipped")
            else:
                cells.append("")
        orig = r.get("seconds", {}).get("original")
        lines.append(f"| {r['model']} | {r['measure']} | {r['length']} | " + " | ".join(cells)
                     + (f" | {orig:.3g} |" if orig is not None else " | — |"))
    return "\n".join(lines)


def main(argv=None) -> List[Dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model at short lengths (seconds)")
    ap.add_argument("--models", nargs="+", choices=sorted(KINDS), default=["llama", "mistral"])
    ap.add_argument("--measures", nargs="+", choices=["prefill", "train", "token"],
                    default=["prefill", "train", "token"])
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--train-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--token-lengths", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--token-steps", type=int, default=16)
    ap.add_argument("--cap", type=float, default=120.0, help="seconds one call may be expected to take")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default benchmarks/results/<cpu>/bench_convert.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prefill_lengths, args.train_lengths, args.token_lengths = [64, 128], [64], [64]
        args.rounds, args.token_steps = 2, 2
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(describe_machine(info), flush=True)
    lengths = {"prefill": args.prefill_lengths, "train": args.train_lengths, "token": args.token_lengths}
    max_len = max(max(v) for v in lengths.values()) + args.token_steps + 2
    rows = []
    for name in args.models:
        kinds = KINDS[name]
        models = {k: build(name, k, max_len, args.quick) for k in kinds}
        for what in args.measures:
            last = None
            for T in lengths[what]:
                if last is not None:  # quadratic growth at worst
                    guess = max(last[1]["seconds"].values()) * (T / last[0]) ** 2
                    if guess > args.cap:
                        rows.append({"model": name, "measure": what, "length": T,
                                     "skipped": f"expected over {args.cap:.0f} s a call"})
                        continue
                row = measure(models, name, kinds, what, T, args.rounds, args.token_steps)
                rows.append(row)
                last = (T, row)
                print(name, what, T, {k: round(v, 3) for k, v in row["ratio"].items()},
                      "missed: " + ", ".join(row["missed"]) if row["missed"] else "", flush=True)
    out = args.out or os.path.join(results_dir(info), "bench_convert.json")
    if not args.quick or args.out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"machine": info, "threads": args.threads, "llama": LLAMA, "windows": WINDOWS, "rows": rows},
                      f, indent=1)
            f.write("\n")
    text = table([r for r in rows if "ratio" in r or "skipped" in r])
    print(text)
    return rows


if __name__ == "__main__":
    main()
