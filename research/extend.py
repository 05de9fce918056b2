"""Context extension by conversion: a byte-level decoder trained at T=1024, then
run at 4k and 16k as a sliding window, or given HKT's windowed levels and
fine-tuned briefly at a long length.

    nice python -m research.extend --threads 1      # resumes; appends to results/longrange.json
    python -m research.extend --smoke               # tiny, seconds

The base is :class:`research.bytelm.ByteLM` with standard attention
(``levels=1``), trained on the standard library's sources at ``--base-len``.
Arms, all from the same base weights:

- ``swa``: the base as it is, every attention a sliding window of
  ``--base-len`` keys (``MultiheadHKT(levels=1, windows=[W])``), no training;
- ``swa_ft``: the same, fine-tuned at ``--ft-len`` for the same budget as
  ``hkt_win`` (a control: what fine-tuning alone buys);
- ``hkt_win``: every attention given HKT's windowed levels
  (``levels=3, windows=[W, 2W, None]``, level 0's projections the base's, the
  coarse ones new) and fine-tuned at ``--ft-len`` for ``--ft-steps`` steps,
  at most a tenth of the base's training tokens.

Each is measured at every ``--lengths`` (and the base at its own length, for
reference): bits per byte on held-out sources and
passkey accuracy (a 5-digit number stated at a random depth inside held-out
sources, asked for at the end; the share of its digits the model predicts
given the ones before, greedy).
"""
import argparse
import os
import statistics
import sys
import time
from typing import Dict, Optional, Sequence, Tuple

import torch

from . import cli
from .bytelm import ByteLM, bits_per_byte, evaluate_bpb
from .resumable import lr_lambda, stop_on_signals, train_chunked
from .train import training_step
from .stdlib_bytes import BatchSampler, eval_windows, load_corpus

__all__ = ["ARMS", "DEFAULTS", "base_model", "arm_model", "passkey_accuracy", "run", "main"]

ARMS = ("swa", "swa_ft", "hkt_win")
DEFAULTS = dict(base_len=1024, base_steps=1500, batch_size=8, lr=2e-3, warmup=150, d_model=128, layers=2, heads=4,
                ft_len=8192, ft_steps=150, ft_lr=5e-4, lengths=[4096, 16384], eval_windows=4, passkeys=16, chunk=100,
                seed=0)


def _model(cfg: Dict, levels: int, windows) -> ByteLM:
    return ByteLM(d_model=cfg["d_model"], n_layers=cfg["layers"], n_heads=cfg["heads"], levels=levels,
                  max_len=max(cfg["lengths"] + [cfg["ft_len"], cfg["base_len"]]), windows=windows)


def _train(model: ByteLM, cfg: Dict, data, *, T: int, steps: int, batch: int, lr: float, warmup: int, path: str,
           seed: int, log=sys.stderr) -> Dict:
    """Trains ``model`` in chunks with a checkpoint at ``path`` after each; resumes from it."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup))
    sampler = BatchSampler(data, T, batch, seed)
    done = train_chunked(path, model, opt, sched, sampler, sampler.sample,
                         lambda x, y: training_step(model, opt, sched, bits_per_byte, x, y).item(),
                         steps=steps, chunk=cfg["chunk"], config={"T": T, "steps": steps, "batch": batch, "lr": lr},
                         label=f"extend: {os.path.basename(path or 'run')}", log=log)
    return {"steps": steps, "tokens": steps * batch * T, "seconds_per_step": done["seconds_per_step"]}


def base_model(cfg: Dict, corpus, ckpt_dir: Optional[str]) -> Tuple[ByteLM, Dict]:
    """The base ByteLM (standard attention) trained at ``base_len``."""
    torch.manual_seed(cfg["seed"])
    model = _model(cfg, 1, None)
    facts = _train(model, cfg, corpus.train, T=cfg["base_len"], steps=cfg["base_steps"], batch=cfg["batch_size"],
                   lr=cfg["lr"], warmup=cfg["warmup"], seed=cfg["seed"],
                   path=ckpt_dir and os.path.join(ckpt_dir, f"base_T{cfg['base_len']}_seed{cfg['seed']}.pt"))
    return model, facts


def arm_model(arm: str, base: ByteLM, cfg: Dict) -> ByteLM:
    """``arm``'s model holding the base's weights (HKT's coarse levels newly initialised)."""
    W = cfg["base_len"]
    torch.manual_seed(cfg["seed"] + 1)
    model = _model(cfg, 1, [W]) if arm.startswith("swa") else _model(cfg, 3, [W, 2 * W, None])
    missing = model.load_state_dict(base.state_dict(), strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    return model


PASSKEY = b"\n# the pass key is %05d. remember it.\n"
QUESTION = b"\n# what is the pass key? the pass key is "


@torch.no_grad()
def passkey_accuracy(model: ByteLM, filler: torch.Tensor, T: int, n: int, seed: int) -> float:
    """The share of a passkey's 5 digits predicted (greedy, given the digits
    before) at the end of T bytes of held-out text with the key at a random depth;
    None where T is too short to hold the key, the question and as much text."""
    if T < 2 * (len(PASSKEY % 0) + len(QUESTION) + 5):
        return None
    model.eval()
    gen = torch.Generator().manual_seed(seed * 1009 + T)
    hits = []
    for _ in range(n):
        key = int(torch.randint(100000, (1,), generator=gen))
        answer = b"%05d" % key
        body = T - len(QUESTION) - len(answer)
        start = int(torch.randint(filler.numel() - body, (1,), generator=gen))
        text = bytearray(filler[start:start + body].tolist())
        at = int(torch.randint(body - len(PASSKEY % key), (1,), generator=gen))
        text[at:at + len(PASSKEY % key)] = PASSKEY % key
        seq = torch.tensor(list(bytes(text) + QUESTION + answer), dtype=torch.int64)[None]
        pred = model(seq[:, :-1]).argmax(-1)[0, -len(answer):]
        hits.append(float((pred == seq[0, -len(answer):]).float().mean()))
    model.train()
    return statistics.fmean(hits)


def run(cfg: Dict, results: Dict, out: Optional[str], ckpt_dir: Optional[str], save) -> None:
    corpus = load_corpus()
    base, base_facts = base_model(cfg, corpus, ckpt_dir)
    results.setdefault("extension", [])
    if not any(r["arm"] == "base" and r["seed"] == cfg["seed"] for r in results["extension"]):
        x, y = eval_windows(corpus.val, cfg["base_len"], cfg["eval_windows"])
        results["extension"].append({
            "experiment": "context extension", "arm": "base", "length": cfg["base_len"], "seed": cfg["seed"],
            "base_length": cfg["base_len"], "base_steps": base_facts["steps"], "base_tokens": base_facts["tokens"],
            "base_seconds_per_step": base_facts["seconds_per_step"], "finetune_steps": 0, "finetune_tokens": 0,
            "parameters": sum(p.numel() for p in base.parameters()),
            "val_bits_per_byte": evaluate_bpb(base, x, y, batch_size=1),
            "passkey_accuracy": passkey_accuracy(base, corpus.val, cfg["base_len"], cfg["passkeys"], cfg["seed"]),
            "n_passkeys": cfg["passkeys"], "eval_windows": cfg["eval_windows"]})
        save(results, out, ("extension", "extension_config"))
    for arm in ARMS:
        if any(r["arm"] == arm and r["seed"] == cfg["seed"] for r in results["extension"]):
            continue
        model = arm_model(arm, base, cfg)
        ft = {"steps": 0, "tokens": 0, "seconds_per_step": None}
        if arm != "swa":
            ft = _train(model, cfg, corpus.train, T=cfg["ft_len"], steps=cfg["ft_steps"], batch=1, lr=cfg["ft_lr"],
                        warmup=max(1, cfg["ft_steps"] // 10), seed=cfg["seed"] + 7,
                        path=ckpt_dir and os.path.join(ckpt_dir, f"{arm}_ft{cfg['ft_len']}_seed{cfg['seed']}.pt"))
        for T in cfg["lengths"]:
            x, y = eval_windows(corpus.val, T, cfg["eval_windows"])
            t0 = time.perf_counter()
            bpb = evaluate_bpb(model, x, y, batch_size=1)
            rec = {"experiment": "context extension", "arm": arm, "length": T, "seed": cfg["seed"],
                   "base_length": cfg["base_len"], "base_steps": base_facts["steps"],
                   "base_tokens": base_facts["tokens"], "base_seconds_per_step": base_facts["seconds_per_step"],
                   "finetune_length": cfg["ft_len"] if ft["steps"] else None, "finetune_steps": ft["steps"],
                   "finetune_tokens": ft["tokens"], "finetune_seconds_per_step": ft["seconds_per_step"],
                   "parameters": sum(p.numel() for p in model.parameters()),
                   "val_bits_per_byte": bpb, "eval_seconds_per_window": (time.perf_counter() - t0) / len(x),
                   "passkey_accuracy": passkey_accuracy(model, corpus.val, T, cfg["passkeys"], cfg["seed"]),
                   "n_passkeys": cfg["passkeys"], "eval_windows": cfg["eval_windows"]}
            results["extension"].append(rec)
            save(results, out, ("extension", "extension_config"))
            print(f"extend: {arm} T={T}: {bpb:.3f} bits/byte, passkey {rec['passkey_accuracy']:.2f}",
                  file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    from .longrange import _load, _save  # one results file for both experiments, each writing its own keys
    ap = argparse.ArgumentParser(prog="python -m research.extend", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; writes nothing unless --out")
    ap.add_argument("--base-steps", type=cli.int_at_least(1))
    ap.add_argument("--ft-steps", type=cli.int_at_least(1))
    ap.add_argument("--threads", type=cli.int_at_least(1))
    ap.add_argument("--out", default=None, help="results JSON (default results/longrange.json)")
    ap.add_argument("--ckpt-dir", default=None, help="checkpoints (default ~/.cache/hkt/extend; --smoke: none)")
    args = ap.parse_args(argv)
    cli.set_threads(args.threads)
    cfg = dict(DEFAULTS)
    if args.smoke:
        cfg.update(base_len=64, base_steps=40, batch_size=2, d_model=16, layers=1, heads=2, ft_len=256, ft_steps=2,
                   lengths=[256], eval_windows=1, passkeys=2, chunk=2, warmup=1)
    for k in ("base_steps", "ft_steps"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    if cfg["ft_steps"] * cfg["ft_len"] * 10 > cfg["base_steps"] * cfg["batch_size"] * cfg["base_len"]:
        ap.error(f"--ft-steps: {cfg['ft_steps']} steps of {cfg['ft_len']} tokens are over a tenth of the base's "
                 f"{cfg['base_steps'] * cfg['batch_size'] * cfg['base_len']} training tokens")
    out = args.out if (args.out or args.smoke) else "results/longrange.json"
    ckpt_dir = args.ckpt_dir if (args.ckpt_dir or args.smoke) else os.path.expanduser("~/.cache/hkt/extend")
    if ckpt_dir:
        os.makedirs(ckpt_dir, exist_ok=True)
    cli.check_writable(ap, out)
    results = _load(out)
    results["extension_config"] = cfg
    with stop_on_signals():
        try:
            run(cfg, results, out, ckpt_dir, _save)
        except KeyboardInterrupt:
            print("extend: stopped; the same command resumes", file=sys.stderr)
    _save(results, out, ("extension", "extension_config"))
    return results


if __name__ == "__main__":
    main()
