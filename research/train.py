"""Train one small Transformer classifier with standard or HKT attention.

    python -m research.train --task listops --attention hkt --seed 0 --out run.json

Tasks: ``listops`` (synthetic, built in), ``cifar`` (sequential CIFAR-10 from
``--data-dir``: the python pickle batches) and ``imdb`` (byte-level, the
``aclImdb`` folder in ``--data-dir``).  The model is the same for both
attentions; ``--attention hkt`` swaps every ``nn.MultiheadAttention`` for
``hkt.MultiheadHKT`` with :func:`hkt.swap_attention` right after the (seeded)
initialisation, so the two runs of a seed start from the same weights and see
the same batches.

The JSON written to ``--out`` holds accuracy (test set), steps, the median
time per training step and the full configuration.  ``--out`` is tried for
writing before training starts.
"""
import argparse
import json
import math
import os
import sys
import time
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from . import cli
from .resumable import lr_lambda, time_per_step

__all__ = ["TASKS", "Classifier", "build_model", "load_task", "evaluate", "training_step", "train_classifier",
           "finite_or_none", "write_json", "main"]

# vocab (token ids, 0 = padding), classes, default sequence length
TASKS = {
    "listops": {"vocab": 16, "classes": 10, "seq_len": 128},
    "cifar": {"vocab": 257, "classes": 10, "seq_len": 1024},
    "imdb": {"vocab": 257, "classes": 2, "seq_len": 1024},
}


def load_task(task: str, *, seq_len: Optional[int] = None, n_train: Optional[int] = None,
              n_test: Optional[int] = None, data_dir: str = "data", data_seed: int = 1234):
    """(train_x, train_y, test_x, test_y) LongTensors for ``task``.

    ListOps is generated (train from ``data_seed``, test from ``data_seed + 1``;
    defaults 5000 / 1000 examples); CIFAR-10 and IMDB are read from
    ``data_dir`` (FileNotFoundError saying where to put them if absent) and
    optionally cut to ``n_train`` / ``n_test`` examples (IMDB: the first
    ``ceil(n / 2)`` negative and ``floor(n / 2)`` positive reviews, exactly
    ``n`` when the folder has that many).  ValueError for ``n_train`` or
    ``n_test`` < 1.
    """
    from research import data

    if task not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {task!r}")
    for name, n in (("n_train", n_train), ("n_test", n_test)):
        if n is not None and n < 1:  # 0 is no "use the default": a model cannot train or test on nothing
            raise ValueError(f"{name}: expected None or an int >= 1, got {n}")
    seq_len = seq_len or TASKS[task]["seq_len"]
    if task == "listops":
        tr = data.generate_listops(5000 if n_train is None else n_train, seq_len, seed=data_seed)
        te = data.generate_listops(1000 if n_test is None else n_test, seq_len, seed=data_seed + 1)
    elif task == "cifar":
        if seq_len != 1024:
            raise ValueError(f"seq_len: sequential CIFAR-10 has 1024 pixels per image, got {seq_len}")
        tr = data.load_cifar10(data_dir, "train", limit=n_train)
        te = data.load_cifar10(data_dir, "test", limit=n_test)
    else:
        tr = _balanced_imdb(data_dir, "train", seq_len, n_train)
        te = _balanced_imdb(data_dir, "test", seq_len, n_test)
    return tr[0], tr[1], te[0], te[1]


def _balanced_imdb(data_dir: str, split: str, seq_len: int, n: Optional[int]):
    """IMDB's files come sorted, negatives then positives: ``n`` examples are
    the first ceil(n / 2) negatives and floor(n / 2) positives."""
    from research import data

    x, y = data.load_imdb(data_dir, split, max_len=seq_len, limit=None if n is None else -(-n // 2))
    if n is not None:
        keep = torch.cat([(y == 0).nonzero()[:, 0][:-(-n // 2)], (y == 1).nonzero()[:, 0][:n // 2]])
        x, y = x[keep], y[keep]
    return x, y


class Classifier(nn.Module):
    """Token embedding + learned position embedding -> nn.TransformerEncoder
    (pre-norm, batch_first) -> mean over non-padding tokens -> LayerNorm -> Linear.

    Input (B, T) int64 token ids with 0 as padding; output (B, classes) logits.
    """

    def __init__(self, vocab: int, classes: int, seq_len: int, *, d_model: int = 64, heads: int = 4,
                 layers: int = 2, ff: int = 128, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=0)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        pad = tokens == 0
        h = self.embed(tokens) + self.pos.weight[:tokens.shape[1]]
        h = self.encoder(h, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        h = (h * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.head(self.norm(h))


def build_model(task: str, attention: str = "standard", *, seq_len: Optional[int] = None, levels: int = 3,
                seed: int = 0, **kw) -> nn.Module:
    """A :class:`Classifier` for ``task``, initialised from ``seed``; with
    ``attention="hkt"`` its attentions are swapped for MultiheadHKT (``levels``)."""
    if attention not in ("standard", "hkt"):
        raise ValueError(f"attention: expected 'standard' or 'hkt', got {attention!r}")
    info = TASKS[task]
    torch.manual_seed(seed)
    model = Classifier(info["vocab"], info["classes"], seq_len or info["seq_len"], **kw)
    if attention == "hkt":
        from hkt import swap_attention
        swap_attention(model, levels=levels)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 256) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((model(x[i:i + batch_size]).argmax(-1) == y[i:i + batch_size]).sum())
    model.train()
    return correct / max(1, len(x))


def training_step(model: nn.Module, opt, sched, loss_fn, x: Tensor, y: Tensor, **model_kw) -> Tensor:
    """One optimiser step as every training loop here takes it: loss, backward,
    gradients clipped at norm 1, AdamW, then the learning-rate schedule.
    ``model_kw`` go to the model with ``x``.  Returns the loss."""
    loss = loss_fn(model(x, **model_kw), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def train_classifier(task: str = "listops", attention: str = "standard", *, seed: int = 0, steps: int = 300,
          batch_size: int = 32, lr: float = 1e-3, weight_decay: float = 0.01, warmup: int = 20,
          seq_len: Optional[int] = None, d_model: int = 64, heads: int = 4, layers: int = 2, ff: int = 128,
          dropout: float = 0.0, levels: int = 3, n_train: Optional[int] = None, n_test: Optional[int] = None,
          data_dir: str = "data", eval_every: int = 0, progress: bool = True, data=None,
          desc: Optional[str] = None) -> Dict:
    """Trains one model and returns the results dict (what ``--out`` holds).

    AdamW with linear warm-up then cosine decay, gradient clipping at 1, batches
    drawn from a generator seeded by ``seed``.  ``data`` may pass preloaded
    (train_x, train_y, test_x, test_y) to skip :func:`load_task`.

    Returns:
        {"task", "attention", "seed", "accuracy" (test), "train_accuracy" (on up
        to 1000 training examples), "final_loss", "steps", "time_per_step"
        (median seconds of a training step), "train_time", "params", "history",
        "config"}.

    Raises:
        ValueError for ``steps`` < 1 (no step: no loss, no time per step).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    info = TASKS[task]
    seq_len = seq_len or info["seq_len"]
    if data is None:
        data = load_task(task, seq_len=seq_len, n_train=n_train, n_test=n_test, data_dir=data_dir)
    xtr, ytr, xte, yte = data
    if xtr.shape[1] != seq_len:
        raise ValueError(f"data: sequences have length {xtr.shape[1]}, expected seq_len={seq_len}")
    model = build_model(task, attention, seq_len=seq_len, levels=levels, seed=seed, d_model=d_model, heads=heads,
                        layers=layers, ff=ff, dropout=dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup))
    g = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    bar = None
    if progress:
        try:  # optional: pip install "hkt[experiments]"; without it, no bar
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=steps, desc=desc or f"{task}/{attention}/seed{seed}", leave=True, dynamic_ncols=True)
    times, history, perm, pos = [], [], torch.randperm(len(xtr), generator=g), 0
    loss_ema = None
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        if pos + batch_size > len(perm):
            perm, pos = torch.randperm(len(xtr), generator=g), 0
        idx = perm[pos:pos + batch_size]
        pos += batch_size
        t0 = time.perf_counter()
        loss = training_step(model, opt, sched, loss_fn, xtr[idx], ytr[idx])
        times.append(time.perf_counter() - t0)
        lv = loss.item()
        if not math.isfinite(lv):
            raise FloatingPointError(f"loss became {lv} at step {step}")
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            history.append({"step": step + 1, "loss": loss_ema, "accuracy": evaluate(model, xte, yte)})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.3f}", ms=f"{1e3 * times[-1]:.0f}")
    train_time = time.perf_counter() - start
    acc = evaluate(model, xte, yte)
    history.append({"step": steps, "loss": loss_ema, "accuracy": acc})
    if bar is not None:
        bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{acc:.3f}")
        bar.close()
    return {
        "task": task, "attention": attention, "seed": seed, "accuracy": acc,
        "train_accuracy": evaluate(model, xtr[:1000], ytr[:1000]), "final_loss": loss_ema, "steps": steps,
        "time_per_step": time_per_step(times), "train_time": train_time,
        "params": sum(p.numel() for p in model.parameters()), "history": history,
        "config": {"task": task, "attention": attention, "seed": seed, "steps": steps, "batch_size": batch_size,
                   "lr": lr, "weight_decay": weight_decay, "warmup": warmup, "seq_len": seq_len, "d_model": d_model,
                   "heads": heads, "layers": layers, "ff": ff, "dropout": dropout,
                   "levels": levels if attention == "hkt" else 1, "n_train": len(xtr), "n_test": len(xte),
                   "torch_threads": torch.get_num_threads()},
    }


def add_training_args(ap: argparse.ArgumentParser) -> None:
    """The options shared by train, reproduce and listops_compare (check them with :func:`check_model_args`)."""
    ap.add_argument("--task", choices=sorted(TASKS), default="listops")
    ap.add_argument("--steps", type=cli.positive_int, default=300)
    ap.add_argument("--batch-size", type=cli.positive_int, default=32)
    ap.add_argument("--lr", type=cli.positive_float, default=1e-3)
    ap.add_argument("--weight-decay", type=cli.non_negative_float, default=0.01)
    ap.add_argument("--warmup", type=cli.non_negative_int, default=20)
    ap.add_argument("--seq-len", type=cli.positive_int, default=None, help="default: 128 for listops, 1024 otherwise")
    ap.add_argument("--d-model", type=cli.positive_int, default=64)
    ap.add_argument("--heads", type=cli.positive_int, default=4)
    ap.add_argument("--layers", type=cli.positive_int, default=2)
    ap.add_argument("--ff", type=cli.positive_int, default=128)
    ap.add_argument("--dropout", type=cli.probability, default=0.0)
    ap.add_argument("--levels", type=cli.positive_int, default=3, help="HKT levels (ignored for standard attention)")
    ap.add_argument("--n-train", type=cli.positive_int, default=None, help="listops: examples generated (default 5000)")
    ap.add_argument("--n-test", type=cli.positive_int, default=None, help="listops: default 1000")
    ap.add_argument("--data-dir", default="data", help="folder with cifar-10-batches-py/ or aclImdb/")
    ap.add_argument("--eval-every", type=cli.non_negative_int, default=0,
                    help="also evaluate every N steps (0: only at the end)")
    ap.add_argument("--threads", type=cli.positive_int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bars")


def check_model_args(ap: argparse.ArgumentParser, args) -> None:
    """The checks of the classifier's options that need more than one value:
    heads must divide d_model; the task fixes or bounds the sequence length."""
    from research.data.listops import MIN_LEN

    cli.check_heads(ap, args.d_model, args.heads)
    if args.task == "cifar" and args.seq_len not in (None, 1024):
        ap.error(f"--seq-len: sequential CIFAR-10 has 1024 pixels per image, got {args.seq_len}")
    if args.task == "listops" and args.seq_len is not None and args.seq_len < MIN_LEN:
        ap.error(f"--seq-len: the shortest ListOps expression has {MIN_LEN} tokens, got {args.seq_len}")


def load_task_or_exit(ap: argparse.ArgumentParser, args):
    """:func:`load_task` for the parsed options; a missing or malformed data
    folder is a parser error naming --data-dir (before any training)."""
    try:
        return load_task(args.task, seq_len=args.seq_len, n_train=args.n_train, n_test=args.n_test,
                         data_dir=args.data_dir)
    except (FileNotFoundError, ValueError) as e:
        if args.task == "listops":  # generated, no folder to blame: a bug, not bad input
            raise
        ap.error(f"--data-dir: {e}")


def training_kwargs(args) -> Dict:
    return dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                warmup=args.warmup, seq_len=args.seq_len, d_model=args.d_model, heads=args.heads,
                layers=args.layers, ff=args.ff, dropout=args.dropout, levels=args.levels, n_train=args.n_train,
                n_test=args.n_test, data_dir=args.data_dir, eval_every=args.eval_every,
                progress=not args.no_progress)


def finite_or_none(x: Optional[float]) -> Optional[float]:
    """``x``, or None (null in JSON) where it is undefined (NaN or infinite)."""
    return x if x is None or math.isfinite(x) else None


def write_json(obj, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        # no NaN or Infinity tokens (not JSON): an undefined value is None (null), a NaN here is a bug
        json.dump(obj, f, indent=2, allow_nan=False)
        f.write("\n")


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(prog="python -m research.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(ap)
    ap.add_argument("--attention", choices=["standard", "hkt"], default="hkt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    check_model_args(ap, args)
    cli.check_writable(ap, args.out)
    cli.set_threads(args.threads)
    data = load_task_or_exit(ap, args)
    res = train_classifier(args.task, args.attention, seed=args.seed, data=data, **training_kwargs(args))
    print(f"{args.task} {args.attention} seed {args.seed}: accuracy {res['accuracy']:.4f}, "
          f"{1e3 * res['time_per_step']:.1f} ms/step", file=sys.stderr)
    if args.out:
        write_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
