"""Several seeds of HKT and standard attention on one task, summarised in one JSON.

    python -m research.reproduce --task listops --seeds 0 1 2 --out results/listops.json

Runs alternate (seed 0 standard, seed 0 HKT, seed 1 standard, ...) so that a
change in machine load hits both attentions alike; all runs share one dataset.
The output holds {"hkt": [accuracy per seed], "standard": [...], "config",
"time_per_step": {"hkt", "standard", "overhead"}, "summary", "runs"}.
"""
import argparse
import statistics
import sys
from typing import Dict, Sequence


from . import cli
from .train import (add_training_args, check_model_args, load_task, load_task_or_exit, train_classifier,
                    training_kwargs, write_json)

__all__ = ["reproduce", "summarise", "main"]


def summarise(runs: Sequence[Dict]) -> Dict:
    """Aggregates train_classifier results (any mix of attentions and seeds)."""
    out = {"hkt": [], "standard": []}
    tps = {"hkt": [], "standard": []}
    for r in sorted(runs, key=lambda r: r["seed"]):
        out[r["attention"]].append(r["accuracy"])
        tps[r["attention"]].append(r["time_per_step"])
    summary = {}
    for a in ("hkt", "standard"):
        accs = out[a]
        if accs:
            summary[a] = {"mean": statistics.mean(accs), "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                          "n": len(accs)}
    time_per_step = {a: statistics.median(v) for a, v in tps.items() if v}
    if "hkt" in time_per_step and "standard" in time_per_step:
        time_per_step["overhead"] = time_per_step["hkt"] / time_per_step["standard"]
    out["time_per_step"] = time_per_step
    out["summary"] = summary
    return out


def reproduce(task: str = "listops", seeds: Sequence[int] = (0, 1, 2), attentions=("standard", "hkt"),
              data=None, **kw) -> Dict:
    """Trains every (seed, attention) pair with :func:`train_classifier` and
    summarises; ``data`` as :func:`load_task` gives it, or None to load it.
    ValueError for a repeated seed (one run would count twice)."""
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: repeated values in {list(seeds)}")
    if data is None:
        data = load_task(task, seq_len=kw.get("seq_len"), n_train=kw.get("n_train"), n_test=kw.get("n_test"),
                         data_dir=kw.get("data_dir", "data"))
    runs = []
    for seed in seeds:
        for att in attentions:
            r = train_classifier(task, att, seed=seed, data=data, **kw)
            print(f"{task} {att:8s} seed {seed}: accuracy {r['accuracy']:.4f}, "
                  f"{1e3 * r['time_per_step']:.1f} ms/step", file=sys.stderr, flush=True)
            runs.append(r)
    res = summarise(runs)
    config = dict(runs[0]["config"])
    for k in ("attention", "seed", "levels"):
        config.pop(k, None)
    config["hkt_levels"] = kw.get("levels", 3)
    config["seeds"] = list(seeds)
    res["config"] = config
    res["runs"] = [{k: v for k, v in r.items() if k != "config"} for r in runs]
    return res


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(prog="python -m research.reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(ap)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--attentions", nargs="+", choices=["standard", "hkt"], default=["standard", "hkt"],
                    help="e.g. only standard, for a parameter-matched control with a larger --ff")
    ap.add_argument("--out", required=True, help="summary JSON path")
    args = ap.parse_args(argv)
    cli.check_unique(ap, args.seeds, "--seeds")
    cli.check_unique(ap, args.attentions, "--attentions")
    check_model_args(ap, args)
    cli.check_writable(ap, args.out)
    cli.set_threads(args.threads)
    res = reproduce(args.task, args.seeds, attentions=args.attentions, data=load_task_or_exit(ap, args),
                    **training_kwargs(args))
    write_json(res, args.out)
    for a, s in res["summary"].items():
        print(f"{a:8s} {100 * s['mean']:.2f} +- {100 * s['std']:.2f} (n={s['n']})", file=sys.stderr)
    if "overhead" in res["time_per_step"]:
        print(f"HKT time per step: {res['time_per_step']['overhead']:.2f}x standard", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
