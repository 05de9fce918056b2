"""Resumable multi-seed, multi-arm ListOps runs (long runs on few CPU cores).

    python -m research.long_run --threads 1      # ListOps T=512, 3 seeds x 3 arms

One command trains every (seed, arm) pair.  Each run's full state (model,
AdamW, LR schedule, batch-order generator and permutation, its own RNG state, step,
loss average, step times and the eval curve so far) is saved to
``--ckpt-dir/<arm>_seed<s>.pt`` every ``--chunk`` steps and on SIGINT/SIGTERM;
the same command started again resumes every run from its checkpoint and skips
finished ones.  A resumed run continues bitwise as if it had never stopped
(dropout included: each run draws from its own RNG state, saved with it).

Arms (all from the same seeded :func:`~research.train.build_model`, so a
seed's arms share batches and, where shapes agree, initial weights):

- ``hkt``: ``hkt.swap_attention(model, levels=--levels)`` (L = 3), ff ``--ff``;
- ``standard``: ``hkt.swap_attention(model, levels=1)``, i.e. MultiheadHKT with
  one level, which computes exactly ``nn.MultiheadAttention`` (the same
  weights, the same function) on the fast kernels; ``--standard-impl mha``
  keeps ``nn.MultiheadAttention`` instead;
- ``standard_ff<N>``: the same standard attention with feed-forward width
  ``--matched-ff`` (default 260), the parameter-matched control.

Order: for each seed in turn, the arms take turns in chunks of ``--chunk``
steps (``--order all`` rotates over all seeds' runs instead), so partial
results always cover every arm.  ``--out`` is rewritten after every
evaluation (each ``--eval-every`` steps): config, arms, per-run eval curves,
time per training step per arm, and a summary of finished runs; ``--plot``
(default: ``--out`` with ``.png``) draws the test accuracy curves.

``--task cifar`` and ``--task imdb`` read their data from ``--data-dir`` (as
:mod:`research.train`; their ``--seq-len`` defaults to 1024, the
length sequential CIFAR-10 has) and their checkpoints record that folder.
"""
import argparse
import os
import statistics
import sys
from typing import Dict, List, Optional

import torch
from torch import nn

from . import cli, resumable
from .resumable import (CheckpointError, advance, lr_lambda, median_by_arm, open_runs, progress_bar, progress_info,
                        read_checkpoint, restore, run_state, save_atomic, time_per_step, train_in_turns, turn_groups)
from .train import (TASKS, build_model, check_model_args, evaluate, load_task, load_task_or_exit, training_step,
                    write_json)

__all__ = ["ARM_DEFAULTS", "make_arm_model", "new_run", "save_run", "load_run", "train_steps", "run_all",
           "plot_curves", "main"]

ARM_DEFAULTS = dict(task="listops", seq_len=512, seeds=[0, 1, 2], steps=5000, warmup=250, batch_size=32, lr=1e-3,
                    weight_decay=0.01, d_model=64, heads=4, layers=2, ff=128, matched_ff=260, dropout=0.0,
                    levels=3, n_train=20000, n_test=2000, eval_every=250, chunk=250, standard_impl="hkt1",
                    order="seed", data_dir="data")

_STATE_KEYS = ("task", "seq_len", "steps", "warmup", "batch_size", "lr", "weight_decay", "d_model", "heads",
               "layers", "dropout", "levels", "n_train", "n_test", "standard_impl")


def _data_id(cfg: Dict) -> Dict[str, str]:
    """The data a checkpoint must have been trained on, beyond the config:
    the folder read for CIFAR-10 or IMDB (ListOps is generated from the config)."""
    return {} if cfg["task"] == "listops" else {"data_dir": os.path.abspath(cfg["data_dir"])}


def arm_specs(cfg: Dict) -> Dict[str, Dict]:
    """{arm name: {"attention", "levels", "ff"}} for the three arms."""
    return {
        "hkt": {"attention": "hkt", "levels": cfg["levels"], "ff": cfg["ff"]},
        "standard": {"attention": "standard", "levels": 1, "ff": cfg["ff"]},
        f"standard_ff{cfg['matched_ff']}": {"attention": "standard", "levels": 1, "ff": cfg["matched_ff"]},
    }


def make_arm_model(cfg: Dict, arm: str, seed: int) -> nn.Module:
    """The seeded classifier of ``arm``: built with standard attention, then
    swapped to MultiheadHKT (levels L for ``hkt``, 1 for the standard arms
    unless ``standard_impl == "mha"``)."""
    spec = arm_specs(cfg)[arm]
    model = build_model(cfg["task"], "standard", seq_len=cfg["seq_len"], seed=seed, d_model=cfg["d_model"],
                        heads=cfg["heads"], layers=cfg["layers"], ff=spec["ff"], dropout=cfg["dropout"])
    if spec["attention"] == "hkt" or cfg["standard_impl"] == "hkt1":
        from hkt import swap_attention
        swap_attention(model, levels=spec["levels"])
    return model


def new_run(cfg: Dict, arm: str, seed: int, n_train: int) -> Dict:
    """Fresh run state: step 0, batches as in train_classifier (a generator
    seeded by ``seed`` drawing permutations of the training set)."""
    model = make_arm_model(cfg, arm, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg["steps"], cfg["warmup"]))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_train, generator=g)
    return {"arm": arm, "seed": seed, "model": model, "opt": opt, "sched": sched, "gen": g, "perm": perm, "pos": 0,
            "step": 0, "loss_ema": None, "times": [], "history": [], "final": None}


def save_run(run: Dict, path: str, cfg: Dict) -> None:
    """Writes the run's state atomically (temporary file, then rename)."""
    state = {
        "config": {k: cfg[k] for k in _STATE_KEYS}, "arm": run["arm"], "seed": run["seed"],
        "ff": arm_specs(cfg)[run["arm"]]["ff"], **_data_id(cfg), **run_state(run),
        "gen": run["gen"].get_state(), "perm": run["perm"], "pos": run["pos"],
    }
    save_atomic(state, path)


def load_run(path: str, cfg: Dict, arm: str, seed: int, n_train: int) -> Dict:
    """A run restored from ``path``; ValueError if it was made with another config."""
    state = read_checkpoint(path, {k: cfg[k] for k in _STATE_KEYS}, arm, seed, tool="research.long_run",
                            ff=arm_specs(cfg)[arm]["ff"], **_data_id(cfg))
    run = restore(new_run(cfg, arm, seed, n_train), state)
    run["gen"].set_state(state["gen"])
    run.update(perm=state["perm"], pos=state["pos"])
    return run


def train_steps(run: Dict, cfg: Dict, data, n: int, *, bar=None, on_eval=None) -> None:
    """Advances ``run`` by up to ``n`` steps (stops at ``cfg["steps"]`` or on
    SIGINT/SIGTERM), evaluating every ``eval_every`` steps and at the end."""
    xtr, ytr, xte, yte = data
    model, opt, sched, g = run["model"], run["opt"], run["sched"], run["gen"]
    bs, total, loss_fn = cfg["batch_size"], cfg["steps"], nn.CrossEntropyLoss()

    def batch():  # as train_classifier: slices of a permutation, a new one when it runs out
        if run["pos"] + bs > len(run["perm"]):
            run["perm"], run["pos"] = torch.randperm(len(xtr), generator=g), 0
        idx = run["perm"][run["pos"]:run["pos"] + bs]
        run["pos"] += bs
        return xtr[idx], ytr[idx]

    def record_eval():
        acc = evaluate(model, xte, yte)
        run["history"].append({"step": run["step"], "loss": run["loss_ema"], "accuracy": acc})
        if run["step"] == total:
            run["final"] = {"accuracy": acc, "train_accuracy": evaluate(model, xtr[:1000], ytr[:1000]),
                            "final_loss": run["loss_ema"]}

    model.train()
    advance(run, n, total, batch, lambda x, y: training_step(model, opt, sched, loss_fn, x, y), record_eval,
            cfg["eval_every"], bar=bar, on_eval=on_eval, postfix="loss {:.3f}")


def summarise_runs(cfg: Dict, runs: List[Dict], params: Dict[str, int]) -> Dict:
    """The results JSON: config, arms, per-run curves, time per step, summary of finished runs."""
    specs = arm_specs(cfg)
    out_runs, finished = [], {}
    for r in runs:
        entry = {"arm": r["arm"], "seed": r["seed"], "step": r["step"], "steps": cfg["steps"],
                 "finished": r["final"] is not None, "time_per_step": time_per_step(r["times"]),
                 "history": r["history"]}
        if r["final"] is not None:
            entry.update(r["final"])
            finished.setdefault(r["arm"], []).append(r["final"]["accuracy"])
        out_runs.append(entry)
    tps = median_by_arm(runs)
    if "hkt" in tps and "standard" in tps:
        tps["hkt_over_standard"] = tps["hkt"] / tps["standard"]
    summary = {a: {"mean": statistics.mean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}
               for a, v in finished.items()}
    standard_impl = ("MultiheadHKT(levels=1) via hkt.swap_attention: the same function as nn.MultiheadAttention, "
                     "on the HKT kernels") if cfg["standard_impl"] == "hkt1" else "nn.MultiheadAttention"
    return {
        "config": {**{k: cfg[k] for k in _STATE_KEYS}, **_data_id(cfg), "seeds": list(cfg["seeds"]),
                   "eval_every": cfg["eval_every"],
                   "chunk": cfg["chunk"], "order": cfg["order"], "torch_threads": torch.get_num_threads(),
                   "standard_attention": standard_impl},
        "arms": {a: {**s, "params": params.get(a)} for a, s in specs.items()},
        "progress": progress_info(runs, cfg["steps"] * len(runs)),
        "time_per_step": tps,
        "summary": summary,
        "runs": out_runs,
    }


def run_all(cfg: Dict, ckpt_dir: str, out: Optional[str], *, progress: bool = True, max_steps: Optional[int] = None,
            log=sys.stderr, data=None) -> Dict:
    """Trains (or resumes) every run of ``cfg``; returns the results dict.

    ``max_steps`` caps the training steps done by this call (all runs
    together), for tests and short sessions; the state is saved before
    returning.  ``data``: the task's (train_x, train_y, test_x, test_y) if
    already loaded (as :func:`~research.train.load_task` gives them).
    """
    cfg = {**ARM_DEFAULTS, **cfg}
    if data is None:
        data = load_task(cfg["task"], seq_len=cfg["seq_len"], n_train=cfg["n_train"], n_test=cfg["n_test"],
                         data_dir=cfg["data_dir"])
    n_train = len(data[0])
    arms = list(arm_specs(cfg))
    runs, paths, params = open_runs(ckpt_dir, cfg["seeds"], arms, lambda p, a, s: load_run(p, cfg, a, s, n_train),
                                    lambda a, s: new_run(cfg, a, s, n_train), log=log)
    ordered = list(runs.values())  # seed after seed, the arms in order

    def write():
        if out:
            write_json(summarise_runs(cfg, ordered, params), out)

    bar = progress_bar(cfg["steps"] * len(runs), "runs", progress, initial=sum(r["step"] for r in ordered),
                       mininterval=5.0)
    train_in_turns(runs, paths, turn_groups(cfg["seeds"], arms, cfg["order"]), steps_of=lambda a: cfg["steps"],
                   train=lambda r, n, **kw: train_steps(r, cfg, data, n, **kw),
                   save=lambda r, p: save_run(r, p, cfg), write=write, chunk=cfg["chunk"], max_steps=max_steps,
                   bar=bar, describe_final=lambda f: f"accuracy {f['accuracy']:.4f}", log=log)
    return summarise_runs(cfg, ordered, params)


def plot_curves(results: Dict, path: str) -> bool:
    """Test accuracy (%) against training steps, one colour per arm (thin: each
    seed; thick: mean over seeds at shared steps).  False (and no file) without matplotlib."""
    c = results["config"]

    def label(arm):
        a = results["arms"][arm]
        return f"{arm} (L={a['levels']}, ff={a['ff']}, {a['params'] / 1000:.1f}k par.)"

    return resumable.plot_curves(
        results, path, metric="accuracy", scale=100.0, ylabel="test accuracy (%)", label=label,
        legend_loc="lower right",
        title=f"{c['task']}, T={c['seq_len']}, d={c['d_model']}, {c['layers']} layers, batch {c['batch_size']}")


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(prog="python -m research.long_run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ARM_DEFAULTS
    ap.add_argument("--task", choices=sorted(TASKS), default=d["task"])
    ap.add_argument("--seq-len", type=cli.positive_int, default=None,
                    help=f"default {d['seq_len']} for listops, 1024 for cifar and imdb")
    ap.add_argument("--seeds", type=int, nargs="+", default=d["seeds"])
    ap.add_argument("--steps", type=cli.positive_int, default=d["steps"], help="training steps per run")
    ap.add_argument("--warmup", type=cli.non_negative_int, default=d["warmup"])
    ap.add_argument("--batch-size", type=cli.positive_int, default=d["batch_size"])
    ap.add_argument("--lr", type=cli.positive_float, default=d["lr"])
    ap.add_argument("--weight-decay", type=cli.non_negative_float, default=d["weight_decay"])
    ap.add_argument("--d-model", type=cli.positive_int, default=d["d_model"])
    ap.add_argument("--heads", type=cli.positive_int, default=d["heads"])
    ap.add_argument("--layers", type=cli.positive_int, default=d["layers"])
    ap.add_argument("--ff", type=cli.positive_int, default=d["ff"])
    ap.add_argument("--matched-ff", type=cli.positive_int, default=d["matched_ff"],
                    help="ff of the parameter-matched standard arm")
    ap.add_argument("--dropout", type=cli.probability, default=d["dropout"])
    ap.add_argument("--levels", type=cli.positive_int, default=d["levels"], help="HKT levels")
    ap.add_argument("--n-train", type=cli.positive_int, default=d["n_train"])
    ap.add_argument("--n-test", type=cli.positive_int, default=d["n_test"])
    ap.add_argument("--data-dir", default=d["data_dir"], help="cifar, imdb: folder with cifar-10-batches-py/ or aclImdb/")
    ap.add_argument("--eval-every", type=cli.non_negative_int, default=d["eval_every"],
                    help="evaluate every N steps (0: only at the end)")
    ap.add_argument("--chunk", type=cli.positive_int, default=d["chunk"], help="steps per turn; a checkpoint after each")
    ap.add_argument("--order", choices=["seed", "all"], default=d["order"],
                    help="seed: a seed's arms take turns, seed after seed; all: every run takes turns")
    ap.add_argument("--standard-impl", choices=["hkt1", "mha"], default=d["standard_impl"],
                    help="hkt1: MultiheadHKT(levels=1) (= nn.MultiheadAttention, fast kernels); mha: nn.MultiheadAttention")
    ap.add_argument("--max-steps", type=cli.non_negative_int, default=None,
                    help="stop (saving) after this many steps in this call")
    ap.add_argument("--ckpt-dir", default="results/listops512_ckpt")
    ap.add_argument("--out", default="results/listops512.json")
    ap.add_argument("--plot", default=None, help="curves PNG (default: --out with .png)")
    ap.add_argument("--threads", type=cli.positive_int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = d["seq_len"] if args.task == "listops" else TASKS[args.task]["seq_len"]
    cli.check_unique(ap, args.seeds, "--seeds")
    check_model_args(ap, args)
    cli.check_writable(ap, args.out)
    cli.set_threads(args.threads)
    cfg = {k: getattr(args, k) for k in ARM_DEFAULTS}
    data = load_task_or_exit(ap, args)
    try:
        res = run_all(cfg, args.ckpt_dir, args.out, progress=not args.no_progress, max_steps=args.max_steps,
                      data=data)
    except CheckpointError as e:
        ap.error(f"--ckpt-dir: {e}")
    resumable.plot_beside(res, args.out, args.plot, plot_curves)
    p = res["progress"]
    print(f"{p['steps_done']}/{p['steps_total']} steps, {p['runs_finished']}/{p['runs']} runs finished",
          file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
