"""The machinery shared by the resumable multi-run drivers
(:mod:`research.long_run`, :mod:`research.lm_run`).

A driver keeps a dict per run (its ``"arm"``, ``"seed"``, ``"model"``,
``"step"``, ``"loss_ema"``, ``"times"``, ``"history"`` and ``"final"``, plus
whatever it needs itself) and says how a run is built, loaded, saved, fed,
evaluated and summarised; this module does the rest the same way for both:
the learning-rate schedule, the optional progress bar, the stop flag set by
SIGINT/SIGTERM, the training loop's bookkeeping, the turns in chunks under a
step budget with a checkpoint after each chunk and a final save, the time
per step and progress figures of the results JSON, and the plot of its curves.
"""
import contextlib
import math
import os
import signal
import statistics
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["lr_lambda", "progress_bar", "Stop", "stop_on_signals", "save_atomic", "CheckpointError",
           "load_state", "read_checkpoint", "run_state", "restore", "own_rng", "open_runs", "turn_groups", "advance",
           "train_in_turns", "train_chunked", "time_per_step", "median_by_arm", "progress_info"]


def lr_lambda(steps: int, warmup: int) -> Callable[[int], float]:
    """The LR factor at each step: linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    def lr_at(step):  # the schedule of research.train
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return lr_at


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0, mininterval: float = 1.0):
    """A tqdm bar, or None when disabled or tqdm is missing."""
    if not enabled:
        return None
    try:  # optional: pip install "hkt[experiments]"; without it, no bar
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=mininterval)


class Stop:
    """Set by SIGINT/SIGTERM under :func:`stop_on_signals`; training loops
    check it between steps, so a stop ends the chunk cleanly and the runs are
    saved with every step done."""
    requested = False


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Clears :class:`Stop`, routes SIGINT/SIGTERM to it, restores the old handlers on exit."""
    old = {}

    def stop(signum, frame):
        Stop.requested = True
    Stop.requested = False
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, stop)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def save_atomic(state: Dict, path: str) -> None:
    """torch.save to a temporary file, then rename: a crash mid-write leaves the old checkpoint intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here: unreadable, or written for other settings."""


def load_state(path: str, tool: str, keys: Sequence[str]) -> Dict:
    """torch.load of the checkpoint dict at ``path``, which must hold ``keys``;
    :class:`CheckpointError` naming ``path`` and ``tool`` (whose checkpoint it
    should be) for a file that is none (torn, empty, random bytes, another
    program's), the cause chained: the raw errors (EOFError, UnpicklingError,
    a zip archive's RuntimeError, KeyError) name neither."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        missing = [k for k in keys if k not in state]
    except (FileNotFoundError, PermissionError, IsADirectoryError):  # no file to read: these name the path
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable checkpoint of {tool} ({type(e).__name__}: {e})") from e
    if missing:
        raise CheckpointError(f"{path}: not a checkpoint of {tool} (no {', '.join(missing)} entries)")
    return state


def read_checkpoint(path: str, config: Dict, arm: str, seed: int, *, tool: str, legacy: Optional[Dict] = None,
                    **also) -> Dict:
    """The state saved at ``path``; :class:`CheckpointError`, naming the
    settings that differ, unless it was written for ``config``, ``arm``,
    ``seed`` and the further top-level entries ``also`` (a run resumed under
    other settings would silently mix two experiments), or naming ``path`` and
    ``tool`` (the driver) when it is no checkpoint of that driver (damaged,
    empty, another program's), the cause chained.  ``legacy``: what an entry of
    ``also`` that older checkpoints lack is taken to be (default None)."""
    state = load_state(path, tool, ("config", "arm", "seed"))
    saved = {**state["config"], **{k: state.get(k, (legacy or {}).get(k)) for k in also}}
    if saved != {**config, **also} or state["arm"] != arm or state["seed"] != seed:
        diff = {k: (saved.get(k), v) for k, v in {**config, **also}.items() if saved.get(k) != v}
        raise CheckpointError(f"{path}: checkpoint written with another configuration (checkpoint, now): {diff}; "
                              f"use another --ckpt-dir or the original options")
    return state


def run_state(run: Dict) -> Dict:
    """The checkpoint entries every driver saves (what :func:`restore` puts
    back): model, optimiser, LR schedule, the run's own RNG state, step, loss
    average, step times, curve and final results."""
    return {"model": run["model"].state_dict(), "opt": run["opt"].state_dict(), "sched": run["sched"].state_dict(),
            # the run's own state, not torch.get_rng_state(): that is whichever run trained last's
            "torch_rng": run.setdefault("rng", torch.get_rng_state()), "step": run["step"],
            "loss_ema": run["loss_ema"], "times": torch.tensor(run["times"], dtype=torch.float64),
            "history": run["history"], "final": run["final"]}


def restore(run: Dict, state: Dict) -> Dict:
    """Puts the saved model, optimiser, LR schedule, the run's own RNG state
    (``run["rng"]``, see :func:`own_rng`), step, loss average, step times,
    curve and final results back into the fresh ``run`` (the driver restores
    its batch order itself); returns ``run``."""
    run["model"].load_state_dict(state["model"])
    run["opt"].load_state_dict(state["opt"])
    run["sched"].load_state_dict(state["sched"])
    run.update(rng=state["torch_rng"], step=state["step"], loss_ema=state["loss_ema"], times=state["times"].tolist(),
               history=state["history"], final=state["final"])
    return run


@contextlib.contextmanager
def own_rng(run: Dict) -> Iterator[None]:
    """Runs the block on the run's own CPU RNG state ``run["rng"]`` (taken
    from the global one if the run has none yet), stores the state back into
    the run afterwards and gives the global RNG back its state.  Dropout draws
    its seeds from torch's global RNG, so runs that take turns on it would
    hand each other their draws, and the turns of a resumed call (other chunk
    boundaries, finished runs skipped) differ from those of an uninterrupted
    one: with its own state, each run's draws do not depend on the others.
    A run without dropout draws nothing, so it trains as it would without this."""
    outer = torch.get_rng_state()
    torch.set_rng_state(run.setdefault("rng", outer))
    try:
        yield
    finally:
        run["rng"] = torch.get_rng_state()
        torch.set_rng_state(outer)


Key = Tuple[str, int]  # (arm, seed)


def open_runs(ckpt_dir: str, seeds: Sequence[int], arms: Sequence[str], load: Callable[[str, str, int], Dict],
              new: Callable[[str, int], Dict],
              log=sys.stderr) -> Tuple[Dict[Key, Dict], Dict[Key, str], Dict[str, int]]:
    """Every (arm, seed) run, seed after seed: ``load(path, arm, seed)`` where
    ``ckpt_dir/<arm>_seed<s>.pt`` exists, else ``new(arm, seed)``, whose
    RNG state (``run["rng"]``, see :func:`own_rng`) is the global one right
    after it is built (the same whatever the other runs did).  Returns the
    runs, their checkpoint paths and the parameter count of each arm."""
    runs, paths, params = {}, {}, {}
    for s in seeds:
        for a in arms:
            paths[a, s] = os.path.join(ckpt_dir, f"{a}_seed{s}.pt")
            if os.path.exists(paths[a, s]):
                runs[a, s] = load(paths[a, s], a, s)
                print(f"resumed {a} seed {s} at step {runs[a, s]['step']}", file=log, flush=True)
            else:
                runs[a, s] = new(a, s)
                runs[a, s]["rng"] = torch.get_rng_state()
            params[a] = sum(p.numel() for p in runs[a, s]["model"].parameters())
    return runs, paths, params


def turn_groups(seeds: Sequence[int], arms: Sequence[str], order: str = "seed") -> List[List[Key]]:
    """Groups of (arm, seed) keys whose runs take turns: one group per seed
    (``order="seed"``, so partial results cover every arm early) or all runs at once (``"all"``)."""
    if order == "all":
        return [[(a, s) for s in seeds for a in arms]]
    return [[(a, s) for a in arms] for s in seeds]


def advance(run: Dict, n: int, total: int, batch: Callable[[], tuple], step: Callable[..., object],
            evaluate: Callable[[], None], eval_every: int, *, bar=None, on_eval=None,
            postfix: str = "loss {:.3f}") -> None:
    """Advances ``run`` by up to ``n`` training steps, stopping at ``total``
    or on :class:`Stop`.  Each step: ``batch()`` (untimed), ``step(*batch)``
    (timed; returns the loss, a tensor or a number), then the loss average
    and, every ``eval_every`` steps and at ``total``, ``evaluate()`` (which
    records the curve and, at ``total``, ``run["final"]``), then ``on_eval()``.
    ``run["train_time"]``, where a driver keeps it, sums the step times.  The
    steps draw from the run's own RNG state (:func:`own_rng`)."""
    with own_rng(run):
        _advance(run, n, total, batch, step, evaluate, eval_every, bar, on_eval, postfix)


def _advance(run, n, total, batch, step, evaluate, eval_every, bar, on_eval, postfix) -> None:
    for _ in range(n):
        if run["step"] >= total or Stop.requested:
            break
        xy = batch()
        t0 = time.perf_counter()
        loss = step(*xy)
        run["times"].append(time.perf_counter() - t0)
        if "train_time" in run:
            run["train_time"] += run["times"][-1]
        # long_run's step returns the loss tensor, read after the timer; lm_run's reads it inside
        lv = loss.item() if torch.is_tensor(loss) else float(loss)
        if not math.isfinite(lv):
            raise FloatingPointError(f"{run['arm']} seed {run['seed']}: loss became {lv} at step {run['step']}")
        run["loss_ema"] = lv if run["loss_ema"] is None else 0.95 * run["loss_ema"] + 0.05 * lv
        run["step"] += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{run['arm']} s{run['seed']} step {run['step']} " + postfix.format(run["loss_ema"]),
                                refresh=False)
        if run["step"] == total or (eval_every and run["step"] % eval_every == 0):
            evaluate()
            if on_eval is not None:
                on_eval()


def train_in_turns(runs: Dict[Key, Dict], paths: Dict[Key, str], groups: List[List[Key]], *,
                   steps_of: Callable[[str], int], train: Callable[..., None], save: Callable[[Dict, str], None],
                   write: Callable[[], None], chunk: int, max_steps: Optional[int] = None, bar=None,
                   describe_final: Callable[[Dict], str], log=sys.stderr) -> None:
    """Within each group in turn, the unfinished runs take turns training
    ``chunk`` steps (``train(run, n, bar=..., on_eval=write)``), each saved
    after its chunk, until the group is done; stops after ``max_steps`` steps
    of this call (all runs together) or on SIGINT/SIGTERM.  However it ends,
    every run with steps is saved, ``write()`` rewrites the results and the
    bar is closed.  ``steps_of(arm)``: the training steps of an arm's runs."""
    budget = math.inf if max_steps is None else max_steps
    with stop_on_signals():
        try:
            write()
            for group in groups:
                while budget > 0 and not Stop.requested:
                    todo = [k for k in group if runs[k]["step"] < steps_of(k[0])]
                    if not todo:
                        break
                    for k in todo:
                        if budget <= 0 or Stop.requested:
                            break
                        r, before = runs[k], runs[k]["step"]
                        train(r, min(chunk, budget), bar=bar, on_eval=write)
                        budget -= r["step"] - before
                        save(r, paths[k])
                        if r["final"] is not None and before < steps_of(k[0]):
                            print(f"{k[0]} seed {k[1]} finished: {describe_final(r['final'])}", file=log, flush=True)
                if budget <= 0 or Stop.requested:
                    break
        finally:
            for k, r in runs.items():  # a stop mid-chunk: keep the steps done
                if os.path.exists(paths[k]) or r["step"] > 0:
                    save(r, paths[k])
            write()
            if bar is not None:
                bar.close()


def train_chunked(path: Optional[str], model, opt, sched, rng, batch: Callable[[], tuple], step: Callable[..., object],
                  *, steps: int, chunk: int, config: Optional[Dict] = None, label: str = "run",
                  log=sys.stderr) -> Dict:
    """Trains ``model`` for ``steps`` steps, each ``step(*batch())`` (one
    optimiser step returning its loss; only ``step`` is timed), in chunks of
    ``chunk`` with a checkpoint at ``path`` (None: none) after each, a stop by
    :class:`Stop` included.  A checkpoint there is resumed from (model,
    optimiser, schedule, ``rng``: a ``torch.Generator`` or anything with
    ``state_dict`` / ``load_state_dict``), refused if saved with another
    ``config``.  Raises KeyboardInterrupt when stopped before ``steps``.
    Returns {"steps", "seconds_per_step" (:func:`time_per_step`), "losses"}."""
    is_gen = isinstance(rng, torch.Generator)
    state = {"step": 0, "times": [], "loss": []}
    if path and os.path.exists(path):
        saved = torch.load(path, weights_only=False)
        if saved["config"] != config:
            raise SystemExit(f"--ckpt-dir: {path} was trained with another configuration; move it away "
                             f"or give another --ckpt-dir")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        rng.set_state(saved["rng"]) if is_gen else rng.load_state_dict(saved["rng"])
        state = saved["state"]
    while state["step"] < steps and not Stop.requested:
        stop_at = min(steps, state["step"] + chunk)
        while state["step"] < stop_at and not Stop.requested:
            args = batch()
            t0 = time.perf_counter()
            loss = step(*args)
            state["times"].append(time.perf_counter() - t0)
            state["loss"].append(float(loss))
            state["step"] += 1
        if path:
            save_atomic({"config": config, "model": model.state_dict(), "opt": opt.state_dict(),
                         "sched": sched.state_dict(), "rng": rng.get_state() if is_gen else rng.state_dict(),
                         "state": state}, path)
        print(f"{label}: step {state['step']}/{steps}, loss {statistics.fmean(state['loss'][-chunk:]):.3f}",
              file=log, flush=True)
    if state["step"] < steps:
        raise KeyboardInterrupt
    return {"steps": state["step"], "seconds_per_step": time_per_step(state["times"]), "losses": state["loss"]}


def time_per_step(times: List[float]) -> Optional[float]:
    """The median step time, skipping the first steps (allocator and cache warm-up); None before any step."""
    steady = times[3:] if len(times) > 3 else times
    return statistics.median(steady) if steady else None


def median_by_arm(runs: List[Dict]) -> Dict[str, float]:
    """{arm: median over its runs of :func:`time_per_step`}, for arms with steps."""
    tps = {}
    for r in runs:
        t = time_per_step(r["times"])
        if t is not None:
            tps.setdefault(r["arm"], []).append(t)
    return {a: statistics.median(v) for a, v in tps.items()}


def progress_info(runs: List[Dict], steps_total: int) -> Dict:
    """The results JSON's "progress": steps and runs done, and when."""
    return {"steps_done": sum(r["step"] for r in runs), "steps_total": steps_total,
            "runs_finished": sum(r["final"] is not None for r in runs), "runs": len(runs),
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def plot_curves(results: Dict, path: str, *, metric: str, ylabel: str, title: str,
                label: Callable[[str], str], scale: float = 1.0, time_key: Optional[str] = None,
                legend_loc: str = "best") -> bool:
    """Each run's curve of ``history[metric] * scale`` against the step (and,
    with ``time_key``, a second panel against that history entry in minutes),
    one colour per arm: thin lines each seed, a thick line the mean over seeds
    at the steps they share.  False (and no file) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2 if time_key else 1, figsize=(11 if time_key else 6.5, 4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for i, arm in enumerate(results["arms"]):
        runs = [r for r in results["runs"] if r["arm"] == arm and r["history"]]
        color = f"C{i}"
        for r in runs:
            ys = [h[metric] * scale for h in r["history"]]
            axes[0].plot([h["step"] for h in r["history"]], ys, color=color, alpha=0.3, lw=0.8)
            if time_key:
                axes[1].plot([h[time_key] / 60 for h in r["history"]], ys, color=color, alpha=0.3, lw=0.8)
        steps = sorted(set.intersection(*(set(h["step"] for h in r["history"]) for r in runs))) if runs else []
        mean = [statistics.mean(h[metric] * scale for r in runs for h in r["history"] if h["step"] == s)
                for s in steps]
        axes[0].plot(steps, mean, color=color, lw=2, label=f"{label(arm)}, mean of {len(runs)}")
    axes[0].set_xlabel("training step")
    if time_key:
        axes[1].set_xlabel("training time (minutes, sum of step times)")
    axes[0].set_ylabel(ylabel)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc=legend_loc)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_beside(results: Dict, out: str, plot: Optional[str], draw: Callable[[Dict, str], bool], log=sys.stderr) -> None:
    """Draws ``results`` with ``draw`` to ``plot``, by default ``out`` with
    ``.png``, and says so on ``log`` (nothing without matplotlib)."""
    plot = plot or os.path.splitext(out)[0] + ".png"
    if draw(results, plot):
        print(f"wrote {out} and {plot}", file=log)
