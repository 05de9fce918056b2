"""One decoding step at long context: MultiheadHKT.decode with windowed levels
(docs/contract.md section 1.11, hkt.decoding.windowed) against the same module
without windows (the C decoding kernel, which reads every cached key) and
against torch SDPA of one query over the same number of keys.  The two module
figures are whole steps (projections, downsampling state, attention, output
projection); SDPA's is the attention alone, a floor for a standard layer's.

    python benchmarks/bench_window_decode.py           # S = 4096 .. 262,144
    python benchmarks/bench_window_decode.py --quick   # S = 4096 and 16,384

E = 256, H = 4 (head size 64), L = 6, windows W_l = 256 * 2^l but a global top
level, float32, 2 threads, B = 1: the shape of benchmarks/bench_long.py's
windowed rows.  The cache is filled directly (random keys, values and their
block sums at length S - 1), since prefilling it is not what is being
timed; the step then decodes token S.  The caches' sizes are recorded too:
the windowed module's keeps rings for its windowed levels.  Before timing, the windowed
step's output is checked against the module's causal forward at a small S.
Reports the median and the minimum of N steps each, interleaved.  Writes
benchmarks/results/<cpu>/window_decode.json.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt  # noqa: E402
from research.timing import machine_info, results_dir, time_rounds  # noqa: E402

E, H, L, THREADS = 256, 4, 6, 2
WINDOWS = [256 << l for l in range(L - 1)] + [None]


def modules():
    torch.manual_seed(0)
    win = hkt.MultiheadHKT(E, H, levels=L, batch_first=True, windows=WINDOWS).eval()
    plain = hkt.MultiheadHKT(E, H, levels=L, batch_first=True).eval()
    plain.load_state_dict(win.state_dict())
    return win, plain


def check(win):
    """The windowed decode against the windowed forward, at S = 700 (two
    windows of level 0 and into level 1's)."""
    x = torch.randn(1, 700, E)
    with torch.no_grad():
        want = win(x, x, x, is_causal=True, need_weights=False)[0]
        cache = win.init_cache(1, 700)
        win.decode(x[:, :600], cache)
        got = torch.cat([win.decode(x[:, t:t + 1], cache) for t in range(600, 700)], dim=1)
    err = (got - want[:, 600:]).abs().max().item()
    assert err < 1e-4, err
    return err


def filled(mod, S):
    """mod's cache at length S - 1 with random contents (what a step reads costs
    the same whatever the numbers; check() tests the results)."""
    g = torch.Generator().manual_seed(1)
    cache = mod.init_cache(1, S)
    for x in [*cache.k, cache.v, *(cache.v_sums or [])]:
        x.copy_(torch.randn(x.shape, generator=g))
    cache.length = S - 1
    return cache


def cache_bytes(cache):
    return sum(x.numel() * x.element_size() for x in [*cache.k, cache.v, *(cache.v_sums or [])])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    win, plain = modules()
    err = check(win)
    sizes = [4096, 16384] if args.quick else [4096, 16384, 65536, 262144]
    rows = []
    x = torch.randn(1, 1, E)
    for S in sizes:
        cw, cp = filled(win, S), filled(plain, S)
        q = torch.randn(1, H, 1, E // H)
        k, v = torch.randn(1, H, S, E // H), torch.randn(1, H, S, E // H)

        def step(mod, cache):
            cache.length = S - 1
            mod.decode(x, cache)

        fns = {"windowed": lambda: step(win, cw), "hkt": lambda: step(plain, cp),
               "sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
        with torch.inference_mode():
            times = time_rounds(fns, repeats=args.repeats, warmup=1)
        res = {name: (statistics.median(t), min(t)) for name, t in times.items()}
        row = {"S": S, **{f"{n}_ms": round(m * 1e3, 3) for n, (m, _) in res.items()},
               **{f"{n}_min_ms": round(lo * 1e3, 3) for n, (_, lo) in res.items()},
               "windowed_cache_mib": round(cache_bytes(cw) / 2**20, 2), "hkt_cache_mib": round(cache_bytes(cp) / 2**20, 2)}
        rows.append(row)
        print(f"S={S:>7}: windowed {row['windowed_ms']:8.3f} ms  hkt {row['hkt_ms']:8.3f} ms  "
              f"sdpa {row['sdpa_ms']:8.3f} ms  (medians of {args.repeats}); caches {row['windowed_cache_mib']} "
              f"and {row['hkt_cache_mib']} MiB", flush=True)
    info = machine_info()
    out = os.path.join(args.out or results_dir(info), "window_decode.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"machine": info, "threads": THREADS, "E": E, "heads": H,
                   "levels": L, "windows": WINDOWS, "dtype": "float32", "check_max_abs_err": err, "rows": rows},
                  f, indent=1)
    print("wrote", os.path.relpath(out))


if __name__ == "__main__":
    main()
