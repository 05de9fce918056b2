"""Resumable byte-level language modelling: HKT levels 1, 2, 3 on the standard library's sources.

    python -m research.lm_run --threads 1        # T=1024, 3 seeds x levels 1, 2, 3, equal steps (~4.5 h)
    python -m research.lm_run --threads 1 --steps 40 --warmup 10 --seeds 0 --eval-every 1000 \\
        --eval-windows 2 --chunk 40 --ckpt-dir /tmp/lm_timing --out results/lm1024_step_time.json  # step times
    python -m research.lm_run --threads 1 --equal-time-from results/lm1024_step_time.json \\
        --equal-time-anchor fastest --ckpt-dir results/lm1024_time_ckpt \\
        --out results/lm1024_time.json                  # equal wall-clock budgets (copy L1's checkpoints first)

Our substitute for the paper's byte-level IMDB task (which needs a download):
validation bits per byte of :class:`research.bytelm.ByteLM` on the
Python standard library's own ``.py`` files (:mod:`research.stdlib_bytes`,
split by file, nothing downloaded; the figures depend on the Python version,
recorded in the JSON).  Arms ``L1``, ``L2``, ``L3`` are the same model with
``levels`` 1, 2, 3; ``L1`` is standard attention (MultiheadHKT with one level
computes exactly ``nn.MultiheadAttention``).  A seed's arms start from the same
weights wherever their shapes agree (:func:`~research.bytelm.build_bytelm`)
and see the same batches (one sampler seeded by the seed).

As in :mod:`research.long_run`: each run's full state (model, AdamW,
LR schedule, sampler generator, the run's own RNG state (dropout's), step,
loss average, step times, curve) is saved to ``--ckpt-dir/<arm>_seed<s>.pt``
every ``--chunk`` steps and on SIGINT/SIGTERM; the same command again resumes
every run (bitwise as if it had never stopped) and skips finished ones.  A
checkpoint resumes only under the same settings and corpus (``--data-root``, or
for the standard library the Python version, and the byte counts of both
splits); one written before the corpus was recorded is taken to be of the
standard library's.  For each seed in turn the arms
take turns in chunks.  ``--out`` is rewritten after every evaluation (every
``--eval-every`` steps, on ``--eval-windows`` fixed validation windows of
``--seq-len`` bytes): config, corpus, per-run curves (step, training and
validation bits per byte, training seconds so far), time per step per arm and a
summary of finished runs; ``--plot`` draws the curves against steps and against
training time.

Defaults: 3000 steps of 8 windows of 1024 bytes (24.6M bytes, about two passes
over the 11.2M training bytes of Python 3.11), d=128, 2 layers, 4 heads (the time
a step takes on one thread: docs/paper.md).

Equal steps is the default.  ``--equal-time-from`` reads the time per step of
each arm from an earlier results file and gives every arm as many steps as fit
in the slowest arm's ``--steps`` (so the standard arm, faster per step, trains
longer); each arm's LR schedule spans its own steps.  With
``--equal-time-anchor fastest`` the fastest arm keeps ``--steps`` and the
others get fewer: the fastest arm's runs are then those of the equal-steps
comparison, and its finished checkpoints, copied into ``--ckpt-dir``, are
resumed as finished rather than trained again.  The file must be an lm_run
results file with a time per step for every arm of ``--levels``.  Take the time per step from a
short run on an otherwise idle machine (``--steps 40 --seeds 0``): step times
from runs that shared the machine are no guide.
"""
import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional

import torch

from . import cli, resumable
from .bytelm import bits_per_byte, build_bytelm, evaluate_bpb
from .resumable import (CheckpointError, advance, lr_lambda, median_by_arm, open_runs, progress_bar, progress_info,
                        read_checkpoint, restore, run_state, save_atomic, time_per_step, train_in_turns, turn_groups)
from .stdlib_bytes import BatchSampler, Corpus, describe, eval_windows, load_corpus, stdlib_dir
from .train import training_step, write_json

__all__ = ["LM_DEFAULTS", "arm_levels", "arm_steps", "arm_windows", "new_run", "save_run", "load_run", "train_steps",
           "run_all", "plot_curves", "main"]

LM_DEFAULTS = dict(seq_len=1024, seeds=[0, 1, 2], levels=[1, 2, 3], steps=3000, warmup=150, batch_size=8, lr=2e-3,
                   weight_decay=0.01, d_model=128, layers=2, heads=4, dropout=0.0, val_fraction=0.05,
                   split_seed=0, eval_every=250, eval_windows=64, chunk=250, arm_steps=None, window=None)

# what a checkpoint must agree on to be resumed under a configuration
_STATE_KEYS = ("seq_len", "warmup", "batch_size", "lr", "weight_decay", "d_model", "layers", "heads", "dropout",
               "val_fraction", "split_seed", "eval_windows")


def arm_levels(cfg: Dict) -> Dict[str, int]:
    """{"L1": 1, "L2": 2, ...}: arm name -> HKT levels (L1 = standard attention)."""
    return {f"L{l}": l for l in cfg["levels"]}


def arm_steps(cfg: Dict, arm: str) -> int:
    """Training steps of ``arm``: ``cfg["arm_steps"][arm]`` if set, else ``cfg["steps"]``."""
    return (cfg.get("arm_steps") or {}).get(arm, cfg["steps"])


def arm_windows(cfg: Dict, levels: int) -> Optional[List[Optional[int]]]:
    """The windows of an arm with ``levels`` levels: with ``cfg["window"]`` = W
    and levels > 1, W * 2^l for every level but the top one, which sees every
    key (docs/contract.md section 1.11); else None."""
    W = cfg.get("window")
    return None if W is None or levels == 1 else [W << l for l in range(levels - 1)] + [None]


def _model_kw(cfg: Dict, levels: int) -> Dict:
    return dict(d_model=cfg["d_model"], n_layers=cfg["layers"], n_heads=cfg["heads"], levels=levels,
                max_len=cfg["seq_len"], dropout=cfg["dropout"], windows=arm_windows(cfg, levels))


def new_run(cfg: Dict, arm: str, seed: int, train_data: torch.Tensor) -> Dict:
    """Fresh run state at step 0."""
    model = build_bytelm(seed, **_model_kw(cfg, arm_levels(cfg)[arm]))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(arm_steps(cfg, arm), cfg["warmup"]))
    sampler = BatchSampler(train_data, cfg["seq_len"], cfg["batch_size"], seed)
    return {"arm": arm, "seed": seed, "model": model, "opt": opt, "sched": sched, "sampler": sampler, "step": 0,
            "loss_ema": None, "times": [], "train_time": 0.0, "history": [], "final": None}


def corpus_id(corpus: Corpus) -> Dict:
    """What a checkpoint's corpus must match: the folder read (None: the
    standard library, then also the Python version, whose files it is) and
    the bytes of each split (a folder whose files changed is another corpus)."""
    info = corpus.info
    root = None if _is_stdlib(corpus) else os.path.abspath(info["root"])
    return {"data_root": root, **({"python_version": info["python_version"]} if root is None else {}),
            "train_bytes": info["train_bytes"], "val_bytes": info["val_bytes"]}


def _is_stdlib(corpus: Corpus) -> bool:
    return os.path.abspath(corpus.info["root"]) == os.path.abspath(stdlib_dir())


def _state_config(cfg: Dict, arm: str) -> Dict:
    # "windows" only when there are some: checkpoints from before windows existed still resume
    windows = arm_windows(cfg, arm_levels(cfg)[arm])
    return {**{k: cfg[k] for k in _STATE_KEYS}, "levels": arm_levels(cfg)[arm], "steps": arm_steps(cfg, arm),
            **({"windows": windows} if windows else {})}


def save_run(run: Dict, path: str, cfg: Dict, corpus: Corpus) -> None:
    """Writes the run's state atomically (temporary file, then rename).  The
    file also loads with :func:`research.bytelm.load_checkpoint`."""
    state = {
        "config": _state_config(cfg, run["arm"]), "arm": run["arm"], "seed": run["seed"], "corpus": corpus_id(corpus),
        **run_state(run), "model_config": run["model"].config, "sampler": run["sampler"].state_dict(),
        "train_time": run["train_time"],
    }
    save_atomic(state, path)


def load_run(path: str, cfg: Dict, arm: str, seed: int, corpus: Corpus) -> Dict:
    """A run restored from ``path``; :class:`~research.resumable.CheckpointError`
    (a ValueError) if it was made with another configuration or corpus, or is unreadable."""
    this = corpus_id(corpus)
    # checkpoints from before the corpus was recorded: all made on the standard library (the committed ones)
    legacy = {"corpus": this} if _is_stdlib(corpus) else None
    state = read_checkpoint(path, _state_config(cfg, arm), arm, seed, tool="research.lm_run", legacy=legacy,
                            corpus=this)
    run = restore(new_run(cfg, arm, seed, corpus.train), state)
    run["sampler"].load_state_dict(state["sampler"])
    run["train_time"] = state["train_time"]
    return run


def train_steps(run: Dict, cfg: Dict, val, n: int, *, bar=None, on_eval=None) -> None:
    """Advances ``run`` by up to ``n`` steps (stops at its arm's steps or on
    SIGINT/SIGTERM), evaluating every ``eval_every`` steps and at the end."""
    model, total = run["model"], arm_steps(cfg, run["arm"])

    def record_eval():
        vb = evaluate_bpb(model, *val)
        run["history"].append({"step": run["step"], "train_bpb": run["loss_ema"], "val_bpb": vb,
                               "train_time": run["train_time"]})
        if run["step"] == total:
            run["final"] = {"val_bpb": vb, "train_bpb": run["loss_ema"]}

    model.train()
    advance(run, n, total, run["sampler"].sample,
            lambda x, y: training_step(model, run["opt"], run["sched"], bits_per_byte, x, y).item(), record_eval,
            cfg["eval_every"], bar=bar, on_eval=on_eval, postfix="{:.3f} bpb")


def summarise_runs(cfg: Dict, runs: List[Dict], params: Dict[str, int], corpus_info: Dict) -> Dict:
    """The results JSON: config, corpus, arms, progress, time per step, summary, per-run curves."""
    out_runs, finished = [], {}
    for r in runs:
        entry = {"arm": r["arm"], "seed": r["seed"], "levels": arm_levels(cfg)[r["arm"]], "step": r["step"],
                 "steps": arm_steps(cfg, r["arm"]), "finished": r["final"] is not None,
                 "time_per_step": time_per_step(r["times"]), "train_time": r["train_time"], "history": r["history"]}
        if r["final"] is not None:
            entry.update(r["final"])
            finished.setdefault(r["arm"], []).append(r["final"]["val_bpb"])
        out_runs.append(entry)
    tps = median_by_arm(runs)
    ratios = {f"{a}_over_L1": t / tps["L1"] for a, t in tps.items() if a != "L1" and "L1" in tps}
    summary = {a: {"val_bpb_mean": statistics.mean(v), "val_bpb_std": statistics.stdev(v) if len(v) > 1 else 0.0,
                   "n": len(v)} for a, v in finished.items()}
    return {
        "task": "byte-level language modelling on the Python standard library's .py sources (our substitute for "
                "the paper's byte-level IMDB task); metric: validation bits per byte, lower is better",
        "config": {**{k: cfg[k] for k in _STATE_KEYS}, "seeds": list(cfg["seeds"]), "levels": list(cfg["levels"]),
                   "steps": cfg["steps"], "arm_steps": {a: arm_steps(cfg, a) for a in arm_levels(cfg)},
                   "eval_every": cfg["eval_every"], "chunk": cfg["chunk"], "window": cfg.get("window"),
                   "torch_threads": torch.get_num_threads()},
        "corpus": corpus_info,
        "arms": {a: {"levels": l, "attention": "standard (MultiheadHKT levels=1 = nn.MultiheadAttention)" if l == 1
                     else f"HKT, {l} levels" + (f", windows {arm_windows(cfg, l)}" if arm_windows(cfg, l) else ""),
                     "params": params.get(a)} for a, l in arm_levels(cfg).items()},
        "progress": progress_info(runs, sum(arm_steps(cfg, r["arm"]) for r in runs)),
        "time_per_step": {**tps, **ratios},
        "summary": summary,
        "runs": out_runs,
    }


def run_all(cfg: Dict, ckpt_dir: str, out: Optional[str], *, progress: bool = True, max_steps: Optional[int] = None,
            log=sys.stderr, data_root: Optional[str] = None, corpus: Optional[Corpus] = None) -> Dict:
    """Trains (or resumes) every run of ``cfg``; returns the results dict.

    ``max_steps`` caps the training steps of this call (all runs together), for
    tests and short sessions; the state is saved before returning.  ``corpus``:
    already loaded (by :func:`~research.stdlib_bytes.load_corpus` with
    ``cfg``'s split), else read from ``data_root``.
    """
    cfg = {**LM_DEFAULTS, **cfg}
    if corpus is None:
        corpus = load_corpus(data_root, val_fraction=cfg["val_fraction"], seed=cfg["split_seed"])
    val = eval_windows(corpus.val, cfg["seq_len"], cfg["eval_windows"])
    arms = list(arm_levels(cfg))
    runs, paths, params = open_runs(ckpt_dir, cfg["seeds"], arms, lambda p, a, s: load_run(p, cfg, a, s, corpus),
                                    lambda a, s: new_run(cfg, a, s, corpus.train), log=log)
    ordered = list(runs.values())  # seed after seed, the arms in order

    def write():
        if out:
            write_json(summarise_runs(cfg, ordered, params, describe(corpus.info)), out)

    bar = progress_bar(sum(arm_steps(cfg, a) for a, _ in runs), "lm runs", progress,
                       initial=sum(r["step"] for r in ordered))
    train_in_turns(runs, paths, turn_groups(cfg["seeds"], arms), steps_of=lambda a: arm_steps(cfg, a),
                   train=lambda r, n, **kw: train_steps(r, cfg, val, n, **kw),
                   save=lambda r, p: save_run(r, p, cfg, corpus), write=write, chunk=cfg["chunk"], max_steps=max_steps,
                   bar=bar, describe_final=lambda f: f"validation {f['val_bpb']:.4f} bits per byte", log=log)
    return summarise_runs(cfg, ordered, params, describe(corpus.info))


def equal_time_steps(results_path: str, steps: int, anchor: str = "slowest",
                     arms: Optional[List[str]] = None) -> Dict[str, int]:
    """Per-arm steps for equal wall-clock budgets: the ``anchor`` arm (the
    slowest or the fastest per step, in ``results_path``) gets ``steps``, each
    other arm as many as fit in that time.  ``"fastest"`` keeps the fastest
    arm's run exactly as in an equal-steps run of ``steps``, so its finished
    checkpoints can be reused and only the other arms train.  ValueError
    unless ``results_path`` is an lm_run results file (readable JSON) with a
    time per step for each of ``arms`` (default: the arms it has): an arm
    without one would silently train the equal-steps budget."""
    if anchor not in ("slowest", "fastest"):
        raise ValueError(f"anchor: 'slowest' or 'fastest', not {anchor!r}")
    try:
        with open(results_path) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"equal_time_from: cannot read {results_path}: {e}") from e
    if not isinstance(res, dict) or not isinstance(res.get("time_per_step"), dict) or "corpus" not in res:
        raise ValueError(f"equal_time_from: {results_path} is not an research.lm_run results file "
                         f"(no corpus and time_per_step entries)")
    tps = {a: t for a, t in res["time_per_step"].items() if not a.endswith("_over_L1") and t is not None}
    missing = sorted(set(arms or []) - set(tps))
    if missing or not tps:
        raise ValueError(f"equal_time_from: {results_path} has no time per step for arm(s) "
                         f"{missing or arms or 'any'} (it has {sorted(tps)}); time them first")
    if arms is not None:
        tps = {a: tps[a] for a in arms}
    budget = steps * (max(tps.values()) if anchor == "slowest" else min(tps.values()))
    return {a: int(round(budget / t)) for a, t in tps.items()}


def plot_curves(results: Dict, path: str) -> bool:
    """Validation bits per byte against steps and against training time, one
    colour per arm (thin: each seed; thick: mean over seeds at shared steps).
    False (and no file) without matplotlib."""
    c = results["config"]
    return resumable.plot_curves(
        results, path, metric="val_bpb", ylabel="validation bits per byte", time_key="train_time",
        label=lambda arm: f"{arm} ({'standard' if results['arms'][arm]['levels'] == 1 else 'HKT'})",
        title=f"byte-level LM on the Python {results['corpus']['python_version']} standard library, "
              f"T={c['seq_len']}, d={c['d_model']}, {c['layers']} layers")


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(prog="python -m research.lm_run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LM_DEFAULTS
    # the ints a run needs at least one of; then those that may be 0 (warm-up, split seed, eval only at the end)
    for name in ("seq_len", "steps", "batch_size", "d_model", "layers", "heads", "eval_windows", "chunk"):
        ap.add_argument("--" + name.replace("_", "-"), type=cli.positive_int, default=d[name])
    for name in ("warmup", "split_seed", "eval_every"):
        ap.add_argument("--" + name.replace("_", "-"), type=cli.non_negative_int, default=d[name])
    ap.add_argument("--lr", type=cli.positive_float, default=d["lr"])
    ap.add_argument("--weight-decay", type=cli.non_negative_float, default=d["weight_decay"])
    ap.add_argument("--dropout", type=cli.probability, default=d["dropout"])
    ap.add_argument("--val-fraction", type=cli.open_fraction, default=d["val_fraction"])
    ap.add_argument("--seeds", type=int, nargs="+", default=d["seeds"])
    ap.add_argument("--levels", type=cli.positive_int, nargs="+", default=d["levels"],
                    help="one arm per value (1 = standard)")
    ap.add_argument("--window", type=cli.positive_int, default=None,
                    help="W: every arm with levels > 1 gets windows W * 2^l below a global top level")
    ap.add_argument("--equal-time-from", default=None,
                    help="a results JSON: give each arm the steps that fit in the anchor arm's --steps")
    ap.add_argument("--equal-time-anchor", choices=["slowest", "fastest"], default="slowest",
                    help="which arm (per step) keeps --steps under --equal-time-from")
    ap.add_argument("--max-steps", type=cli.non_negative_int, default=None,
                    help="stop (saving) after this many steps in this call")
    ap.add_argument("--data-root", default=None, help="read .py files here instead of the standard library")
    ap.add_argument("--ckpt-dir", default="results/lm1024_ckpt")
    ap.add_argument("--out", default="results/lm1024.json")
    ap.add_argument("--plot", default=None, help="curves PNG (default: --out with .png)")
    ap.add_argument("--threads", type=cli.positive_int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cli.check_unique(ap, args.seeds, "--seeds")
    cli.check_unique(ap, args.levels, "--levels")
    cli.check_heads(ap, args.d_model, args.heads)
    cli.check_writable(ap, args.out)
    cli.set_threads(args.threads)
    cfg = {k: getattr(args, k) for k in LM_DEFAULTS if k != "arm_steps"}
    if args.equal_time_from:
        try:
            cfg["arm_steps"] = equal_time_steps(args.equal_time_from, args.steps, args.equal_time_anchor,
                                                arms=list(arm_levels(cfg)))
        except ValueError as e:
            ap.error(f"--equal-time-from: {e}")
    try:
        corpus = load_corpus(args.data_root, val_fraction=args.val_fraction, seed=args.split_seed)
        # either split shorter than a window would fail later, after the other runs' work
        eval_windows(corpus.val, args.seq_len, args.eval_windows)
        BatchSampler(corpus.train, args.seq_len, args.batch_size)
    except ValueError as e:
        ap.error(f"--data-root: {e}")
    try:
        res = run_all(cfg, args.ckpt_dir, args.out, progress=not args.no_progress, max_steps=args.max_steps,
                      corpus=corpus)
    except CheckpointError as e:
        ap.error(f"--ckpt-dir: {e}")
    resumable.plot_beside(res, args.out, args.plot, plot_curves)
    p = res["progress"]
    print(f"{p['steps_done']}/{p['steps_total']} steps, {p['runs_finished']}/{p['runs']} runs finished", file=sys.stderr)
    for a, s in res["summary"].items():
        print(f"{a}: validation {s['val_bpb_mean']:.4f} +- {s['val_bpb_std']:.4f} bits per byte (n={s['n']})",
              file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
