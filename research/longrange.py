"""Long-range recall: synthetic tasks where far information decides the answer.

    python -m research.longrange --smoke          # one seed, the smallest length (< 2 minutes)
    nice python -m research.longrange --threads 1 # every task x arm x seed; resumes
    python -m research.longrange --table          # docs/paper.md's section and results/longrange.png

Tasks (generated on the fly from a seed; nothing is downloaded):

- ``passkey``: a 4-digit number hidden at a random depth inside repetitive
  filler; at the end the model is asked for each digit.  Accuracy overall and
  by depth (the needle's position as a fraction of the context).
- ``mqar``: multi-query associative recall (the Zoology study's task): N
  key-value pairs scattered through random filler, then queries of 8 of the
  keys (all of them when N < 8); the answer is the key's value.  Accuracy by N.
- ``flag``: a flag (0 or 1) at a random depth; at the end, queries carry a
  digit x and the answer is (x + 5 * flag) mod 10.  Not a copy: the far flag
  changes what the local digit means.  A model blind to the flag scores 0.5.

A token is a pair of components (its embedding is the sum of theirs): a
needle's digit is (slot s, value d), a query for it (slot s, QUERY), an MQAR
pair (key k, value v) and its query (key k, QUERY).  A query so shares a
component with what it asks for, and every task is a retrieval by content that
needs no positions; what varies is how far away the answer sits.

Arms, at equal depth, width, heads, tokens, optimiser and schedule (every arm
builds the same seeded model; only the attention differs):

- ``hkt_win``: ``MultiheadHKT(levels=3, windows=[W, 2W, None])``: level 0 sees W
  keys, level 1 2W, the top level every key (its far values block-summed);
- ``swa``: ``MultiheadHKT(levels=1, windows=[W])``: exactly sliding-window
  attention, O(T W);
- ``full``: full causal attention through ``torch.nn.functional.scaled_dot_product_attention``;
- ``hkt``: ``MultiheadHKT(levels=3)`` without windows.

Every arm is trained at ``--train-len`` tokens and evaluated at each of
``--lengths`` (positions are sinusoids started at a random offset in training,
so every absolute position up to the longest length is seen; only the
distances beyond the training length are new).  Training every arm at 16k
and 64k does not fit a 2-core CPU (docs/paper.md gives the measured seconds per
step at each length, which this driver also records).

Each (task, arm, seed) trains in chunks with a checkpoint after each
(``--ckpt-dir``, outside git), so the same command resumes; its evaluations are
appended to ``--out`` (one record per (task, arm, seed, length)).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hkt import MultiheadHKT
from . import cli
from .bytelm import sinusoidal_positions
from .resumable import lr_lambda, stop_on_signals, train_chunked
from .train import training_step

__all__ = ["TASKS", "ARMS", "make_batch", "RecallModel", "build_model", "attention_flops", "step_flops",
           "run_cell", "evaluate", "write_table", "main"]

TASKS = ("passkey", "mqar", "flag")
ARMS = ("hkt_win", "swa", "full", "hkt")

# components of a token (an embedding row each; a token's embedding is the sum of its two)
N_FILLER, N_KEYS, N_VALUES = 16, 16, 16
FILLER, KEY, VALUE = 0, N_FILLER, N_FILLER + N_KEYS
NONE, QUERY, FLAG = VALUE + N_VALUES, VALUE + N_VALUES + 1, VALUE + N_VALUES + 2
N_COMPONENTS = FLAG + 1
N_CLASSES = N_VALUES  # answers are values (digits 0-9 are values 0-9)
IGNORE = -100

PASSKEY_DIGITS = 4
MQAR_PAIRS = (2, 4, 8)
MQAR_QUERIES = 8
FLAG_QUERIES = 4
DEPTH_BINS = 5
CHANCE = {"passkey": 0.1, "mqar": 1 / N_VALUES, "flag": 0.5}  # flag: a model blind to the flag

DEFAULTS = dict(train_len=1024, lengths=[1024, 4096, 16384, 65536], seeds=[0, 1, 2], tasks=["passkey", "mqar"],
                arms=list(ARMS), window=64, d_model=64, heads=4, layers=2, ff=128, batch_size=8, steps=600,
                warmup=50, lr=3e-3, weight_decay=0.01, chunk=100, n_eval=64, eval_tokens=65536,
                max_pos=65536, full_max_len=16384)


# ----------------------------------------------------------------------------------------------------------------
# the tasks


def _tail(task: str, n_pairs: int = 0) -> int:
    """The number of query tokens at the end of a sequence."""
    if task == "passkey":
        return PASSKEY_DIGITS
    if task == "mqar":
        return min(n_pairs, MQAR_QUERIES)
    return FLAG_QUERIES


def make_batch(task: str, T: int, batch: int, gen: torch.Generator, *, n_pairs: Optional[int] = None
               ) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """``batch`` sequences of ``task`` at length ``T``: tokens (B, T, 2) int64
    (two components each), targets (B, T) (IGNORE except at the queries) and
    per-sequence facts (``depth``: the far item's position over T; ``n_pairs``)."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    tok = torch.empty(batch, T, 2, dtype=torch.int64)
    tgt = torch.full((batch, T), IGNORE, dtype=torch.int64)
    depth = torch.empty(batch)
    pairs = torch.empty(batch, dtype=torch.int64)
    for b in range(batch):
        if task == "passkey":
            # repetitive filler: the filler components in a cycle from a random phase
            phase = int(torch.randint(N_FILLER, (1,), generator=gen))
            tok[b, :, 0] = FILLER + (torch.arange(T) + phase) % N_FILLER
            tok[b, :, 1] = NONE
            body = T - PASSKEY_DIGITS
            at = int(torch.randint(body - PASSKEY_DIGITS + 1, (1,), generator=gen))
            digits = torch.randint(10, (PASSKEY_DIGITS,), generator=gen)
            slots = torch.arange(PASSKEY_DIGITS)
            tok[b, at:at + PASSKEY_DIGITS, 0] = KEY + slots
            tok[b, at:at + PASSKEY_DIGITS, 1] = VALUE + digits
            order = torch.randperm(PASSKEY_DIGITS, generator=gen)
            tok[b, body:, 0] = KEY + order
            tok[b, body:, 1] = QUERY
            tgt[b, body:] = digits[order]
            depth[b] = at / T
            pairs[b] = 1
        else:
            tok[b, :, 0] = FILLER + torch.randint(N_FILLER, (T,), generator=gen)
            tok[b, :, 1] = NONE
            if task == "mqar":
                n = n_pairs if n_pairs is not None else MQAR_PAIRS[int(torch.randint(len(MQAR_PAIRS), (1,),
                                                                                     generator=gen))]
                nq = _tail(task, n)
                body = T - nq
                where = torch.randperm(body, generator=gen)[:n]
                keys = torch.randperm(N_KEYS, generator=gen)[:n]
                values = torch.randint(N_VALUES, (n,), generator=gen)
                tok[b, where, 0] = KEY + keys
                tok[b, where, 1] = VALUE + values
                asked = torch.randperm(n, generator=gen)[:nq]
                tok[b, body:, 0] = KEY + keys[asked]
                tok[b, body:, 1] = QUERY
                tgt[b, body:] = values[asked]
                depth[b] = float(where[asked].min()) / T
                pairs[b] = n
            else:  # flag
                body = T - FLAG_QUERIES
                at = int(torch.randint(body, (1,), generator=gen))
                flag = int(torch.randint(2, (1,), generator=gen))
                tok[b, at] = torch.tensor([FLAG, VALUE + flag])
                x = torch.randint(10, (FLAG_QUERIES,), generator=gen)
                tok[b, body:, 0] = QUERY
                tok[b, body:, 1] = VALUE + x
                tgt[b, body:] = (x + 5 * flag) % 10
                depth[b] = at / T
                pairs[b] = 1
    return tok, tgt, {"depth": depth, "n_pairs": pairs}


# ----------------------------------------------------------------------------------------------------------------
# the model


class SDPAttention(nn.Module):
    """Causal multi-head attention on ``F.scaled_dot_product_attention``, with
    ``nn.MultiheadAttention``'s projections (the same parameter count)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.in_proj(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class HKTAttention(nn.Module):
    """Causal :class:`hkt.MultiheadHKT` self-attention."""

    def __init__(self, d_model: int, heads: int, levels: int, windows: Optional[List[Optional[int]]]):
        super().__init__()
        self.attn = MultiheadHKT(d_model, heads, batch_first=True, levels=levels, windows=windows)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False, is_causal=True)[0]


def arm_attention(arm: str, d_model: int, heads: int, window: int) -> nn.Module:
    if arm == "hkt_win":
        return HKTAttention(d_model, heads, 3, [window, 2 * window, None])
    if arm == "swa":
        return HKTAttention(d_model, heads, 1, [window])
    if arm == "full":
        return SDPAttention(d_model, heads)
    if arm == "hkt":
        return HKTAttention(d_model, heads, 3, None)
    raise ValueError(f"arm: expected one of {ARMS}, got {arm!r}")


class Block(nn.Module):
    def __init__(self, attn: nn.Module, d_model: int, ff: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), attn
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, ff), nn.GELU(), nn.Linear(ff, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class RecallModel(nn.Module):
    """Pre-norm causal transformer over two-component tokens, with a head over
    the answer classes.  ``forward(tokens (B, T, 2), offset)`` -> (B, T, classes)."""

    def __init__(self, arm: str, *, d_model: int, heads: int, layers: int, ff: int, window: int, max_pos: int):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(N_COMPONENTS, d_model)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
        self.register_buffer("pos", sinusoidal_positions(max_pos, d_model), persistent=False)
        self.blocks = nn.ModuleList(Block(arm_attention(arm, d_model, heads, window), d_model, ff)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, N_CLASSES)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        T = tokens.shape[1]
        h = self.embed(tokens).sum(2) * math.sqrt(self.d_model) + self.pos[offset:offset + T]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _params(arm: str, cfg: Dict, ff: int) -> int:
    with torch.device("meta"):
        model = RecallModel(arm, d_model=cfg["d_model"], heads=cfg["heads"], layers=cfg["layers"], ff=ff,
                            window=cfg["window"], max_pos=16)
    return sum(p.numel() for p in model.parameters())


def arm_ff(arm: str, cfg: Dict) -> int:
    """The MLP width of ``arm``: ``cfg["ff"]`` for the HKT arms; for the one-level
    arms the width that brings their parameter count nearest to HKT's (HKT's
    coarse projections are parameters the others lack)."""
    if arm.startswith("hkt"):
        return cfg["ff"]
    target = _params("hkt", cfg, cfg["ff"])
    base, per = _params(arm, cfg, cfg["ff"]), cfg["layers"] * (2 * cfg["d_model"] + 1)
    return cfg["ff"] + round((target - base) / per)


def build_model(arm: str, seed: int, cfg: Dict) -> RecallModel:
    """The seeded model of ``arm``: every arm draws its embedding from the same seed."""
    torch.manual_seed(seed)
    return RecallModel(arm, d_model=cfg["d_model"], heads=cfg["heads"], layers=cfg["layers"], ff=arm_ff(arm, cfg),
                       window=cfg["window"], max_pos=cfg["max_pos"])


# ----------------------------------------------------------------------------------------------------------------
# cost


def _visits(arm: str, T: int, W: int) -> Tuple[float, float]:
    """(score dot products, value rows read) per head over a causal sequence
    of T queries: the attention's work as the kernels do it (docs/contract.md
    section 1.11: a key only the top level sees costs one score per block)."""
    if arm == "full":
        n = T * (T + 1) / 2
        return n, n
    if arm == "swa":
        n = W * T - W * (W - 1) / 2 if T >= W else T * (T + 1) / 2
        return n, n
    levels = 3
    if arm == "hkt":  # every level scores every (coarse) key; values at full resolution
        n = T * (T + 1) / 2
        return sum(n / (1 << l) for l in range(levels)), n
    # hkt_win: level 0's W single keys (3 levels' scores each), level 1's next W in blocks of 2
    # (2 levels' scores), the rest in blocks of 4 (the top level's score, block-summed values)
    def seen(width: int) -> float:  # sum over queries i < T of min(i + 1, width)
        return width * T - width * (width - 1) / 2 if T >= width else T * (T + 1) / 2

    a = seen(W)  # single keys in level 0's window
    b = seen(2 * W) - a  # keys in level 1's window only: blocks of 2
    c = T * (T + 1) / 2 - a - b  # keys only the top level sees: blocks of 4
    scores = 3 * a + 2 * b / 2 + c / 4
    values = a + b / 2 + c / 4
    return scores, values


def attention_flops(arm: str, T: int, cfg: Dict) -> float:
    """Forward FLOPs of one sequence's attention scores and weighted values, all layers and heads."""
    D = cfg["d_model"] // cfg["heads"]
    scores, values = _visits(arm, T, cfg["window"])
    return 2.0 * D * (scores + values) * cfg["heads"] * cfg["layers"]


def step_flops(arm: str, T: int, cfg: Dict, batch: int) -> float:
    """FLOPs of a training step (forward + backward = 3x forward) on ``batch`` sequences of T:
    attention plus every projection and MLP."""
    d, ff, L = cfg["d_model"], arm_ff(arm, cfg), cfg["layers"]
    dense = 2.0 * T * L * (4 * d * d + 2 * d * ff) + 2.0 * T * d * N_CLASSES
    return 3.0 * batch * (dense + attention_flops(arm, T, cfg))


# ----------------------------------------------------------------------------------------------------------------
# training and evaluation


def _flat_loss(logits: Tensor, tgt: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, N_CLASSES), tgt.reshape(-1), ignore_index=IGNORE)


def _loss(model: RecallModel, tok: Tensor, tgt: Tensor, offset: int) -> Tensor:
    return _flat_loss(model(tok, offset), tgt)


@torch.no_grad()
def evaluate(model: RecallModel, task: str, T: int, n: int, seed: int, batch: int) -> Dict[str, object]:
    """Accuracy of ``model`` on ``n`` fresh sequences of length T (the same ones
    for every arm: drawn from ``seed``), overall, by depth and (mqar) by N."""
    model.eval()
    gen = torch.Generator().manual_seed(10_000 + seed * 7919 + T)
    settings = [None] if task != "mqar" else list(MQAR_PAIRS)
    hits: Dict[str, List[float]] = {}
    by_depth = [[0, 0] for _ in range(DEPTH_BINS)]
    per = max(1, n // len(settings))
    t0, seqs = time.perf_counter(), 0
    for n_pairs in settings:
        done = 0
        while done < per:
            bs = min(batch, per - done)
            tok, tgt, facts = make_batch(task, T, bs, gen, n_pairs=n_pairs)
            pred = model(tok).argmax(-1)
            ok = (pred == tgt) & (tgt != IGNORE)
            count = (tgt != IGNORE).sum(1)
            for b in range(bs):
                acc = float(ok[b].sum()) / float(count[b])
                hits.setdefault(str(n_pairs) if n_pairs else "all", []).append(acc)
                bin_ = min(DEPTH_BINS - 1, int(float(facts["depth"][b]) * DEPTH_BINS))
                by_depth[bin_][0] += float(ok[b].sum())
                by_depth[bin_][1] += float(count[b])
            done += bs
            seqs += bs
    seconds = time.perf_counter() - t0
    model.train()
    all_acc = [a for v in hits.values() for a in v]
    out = {"accuracy": statistics.fmean(all_acc), "n_eval": len(all_acc),
           "eval_seconds_per_sequence": seconds / max(1, seqs),
           "by_depth": [None if c == 0 else h / c for h, c in by_depth]}
    if task == "mqar":
        out["by_n_pairs"] = {k: statistics.fmean(v) for k, v in hits.items()}
    return out


_RUN_KEYS = ("train_len", "window", "d_model", "heads", "layers", "ff", "batch_size", "steps", "warmup", "lr",
             "weight_decay", "max_pos")


def train_run(task: str, arm: str, seed: int, cfg: Dict, ckpt_dir: Optional[str], log=sys.stderr
              ) -> Tuple[RecallModel, Dict]:
    """Trains (or resumes, or loads finished) the model of (task, arm, seed); returns it and its training facts."""
    model = build_model(arm, seed, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg["steps"], cfg["warmup"]))
    gen = torch.Generator().manual_seed(seed)
    T, B = cfg["train_len"], cfg["batch_size"]

    def batch():
        tok, tgt, _ = make_batch(task, T, B, gen)
        return tok, tgt, int(torch.randint(cfg["max_pos"] - T + 1, (1,), generator=gen))

    def step(tok, tgt, offset):
        return training_step(model, opt, sched, _flat_loss, tok, tgt, offset=offset).item()

    done = train_chunked(ckpt_dir and os.path.join(ckpt_dir, f"{task}_{arm}_seed{seed}.pt"), model, opt, sched,
                         gen, batch, step, steps=cfg["steps"], chunk=cfg["chunk"],
                         config={k: cfg[k] for k in _RUN_KEYS}, label=f"longrange: {task} {arm} seed {seed}", log=log)
    facts = {"steps": done["steps"], "tokens": done["steps"] * B * T, "seconds_per_step": done["seconds_per_step"],
             "final_loss": statistics.fmean(done["losses"][-50:])}
    return model, facts


def _load(out: Optional[str]) -> Dict:
    if out and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    return {"records": [], "skipped": []}


OWN_KEYS = ("config", "machine", "records", "skipped", "timing")


def _cell(record: Dict) -> Tuple:
    return record["task"], record["arm"], record["seed"], record["length"]


def _save(results: Dict, out: Optional[str], keys: Sequence[str] = OWN_KEYS) -> None:
    """Writes ``results``' ``keys`` into ``out``, keeping what other writers
    (research.extend) put there: read, update and replace under a lock."""
    if not out:
        return
    import fcntl
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = _load(out)
        for k in keys:
            if k not in results:
                continue
            if k in ("records", "skipped"):  # several workers may add cells: the union
                mine = {_cell(r) for r in results[k]}
                merged[k] = [r for r in merged.get(k, []) if _cell(r) not in mine] + results[k]
            else:
                merged[k] = results[k]
        measured = {_cell(r) for r in merged.get("records", [])}  # a cell run after it was skipped
        merged["skipped"] = [s for s in merged.get("skipped", []) if _cell(s) not in measured]
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(merged, f, indent=1)
            f.write("\n")
        os.replace(tmp, out)


def _load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_cell(task: str, arm: str, seed: int, cfg: Dict, results: Dict, out: Optional[str], ckpt_dir: Optional[str],
             log=sys.stderr) -> None:
    """Trains (task, arm, seed) and appends one record per evaluated length to ``results``."""
    done = {r["length"] for r in results["records"] if (r["task"], r["arm"], r["seed"]) == (task, arm, seed)}
    todo = [T for T in cfg["lengths"] if T not in done]
    if arm == "full":  # what was skipped stays skipped unless --full-max-len now reaches it
        skipped = {s["length"] for s in results["skipped"] if (s["task"], s["arm"], s["seed"]) == (task, arm, seed)}
        todo = [T for T in todo if T not in skipped or T <= cfg["full_max_len"]]
    if not todo:
        return
    model, facts = train_run(task, arm, seed, cfg, ckpt_dir, log)
    params = sum(p.numel() for p in model.parameters())
    for T in todo:
        if arm == "full" and T > cfg["full_max_len"]:
            results["skipped"].append({
                "task": task, "arm": arm, "seed": seed, "length": T,
                "why": f"full attention's cost grows as T^2: {attention_flops(arm, T, cfg):.3g} FLOPs per sequence "
                       f"forward at T={T}, {attention_flops(arm, T, cfg) / attention_flops('hkt_win', T, cfg):.0f}x "
                       f"hkt_win's; past --full-max-len={cfg['full_max_len']}"})
            _save(results, out)
            continue
        n = max(4, min(cfg["n_eval"], cfg["eval_tokens"] // T * 4))
        load = _load_average()
        ev = evaluate(model, task, T, n, seed, batch=max(1, min(8, 8192 // T)))
        rec = {"task": task, "arm": arm, "length": T, "train_length": cfg["train_len"], "seed": seed,
               "parameters": params, "steps": facts["steps"], "tokens": facts["tokens"],
               "seconds_per_step": facts["seconds_per_step"],
               "flops_per_step": step_flops(arm, cfg["train_len"], cfg, cfg["batch_size"]),
               "flops_per_sequence_forward_at_length": step_flops(arm, T, cfg, 1) / 3,
               "final_train_loss": facts["final_loss"], "metric": "accuracy", **ev,
               "load_average": load, "threads": torch.get_num_threads()}
        results["records"].append(rec)
        _save(results, out)
        print(f"longrange: {task} {arm} seed {seed} T={T}: accuracy {ev['accuracy']:.3f}", file=log, flush=True)


def time_lengths(cfg: Dict, lengths: Sequence[int], arms: Sequence[str], budget_s: float = 60.0) -> List[Dict]:
    """Seconds of one training step (batch 1, forward + backward) of each arm at each length;
    a length whose time, estimated from the previous one by FLOPs, passes ``budget_s`` is not timed."""
    rows = []
    for arm in arms:
        model = build_model(arm, 0, cfg)
        last = None  # (length, seconds) of the previous timing
        for T in lengths:
            row = {"arm": arm, "length": T, "flops_per_step": step_flops(arm, T, cfg, 1)}
            estimate = None if last is None else last[1] * step_flops(arm, T, cfg, 1) / step_flops(arm, last[0], cfg, 1)
            if estimate is not None and estimate > budget_s:
                row["seconds_per_step"] = None
                row["why"] = f"estimated {estimate:.0f} s from the previous length's time and FLOPs"
            else:
                tok, tgt, _ = make_batch("passkey", T, 1, torch.Generator().manual_seed(0))
                ts = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    _loss(model, tok, tgt, 0).backward()
                    ts.append(time.perf_counter() - t0)
                row["seconds_per_step"] = min(ts)
                last = (T, min(ts))
            row["load_average"] = _load_average()
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# tables and plot


def _len(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def _mean_sd(xs: List[float]) -> Tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summary(results: Dict) -> Dict[Tuple[str, str, int], List[float]]:
    cells: Dict[Tuple[str, str, int], List[float]] = {}
    for r in results["records"]:
        cells.setdefault((r["task"], r["arm"], r["length"]), []).append(r["accuracy"])
    return cells


def table_markdown(results: Dict) -> str:
    cells = summary(results)
    tasks = [t for t in TASKS if any(k[0] == t for k in cells)]
    lengths = sorted({k[2] for k in cells} | {s["length"] for s in results["skipped"]})
    lines = []
    for task in tasks:
        lines += [f"**{task}** (accuracy, mean ± sd over seeds; trained at "
                  f"{results.get('config', {}).get('train_len', '?')} tokens)", "",
                  "| arm | " + " | ".join(f"T={_len(T)}" for T in lengths) + " | s/step (train) | params |",
                  "|---|" + "---|" * (len(lengths) + 2)]
        for arm in ARMS:
            row = []
            recs = [r for r in results["records"] if r["task"] == task and r["arm"] == arm]
            if not recs:
                continue
            for T in lengths:
                accs = cells.get((task, arm, T))
                if accs:
                    m, s = _mean_sd(accs)
                    row.append(f"{m:.3f} ± {s:.3f} ({len(accs)})")
                elif any(s["task"] == task and s["arm"] == arm and s["length"] == T for s in results["skipped"]):
                    row.append("not run¹")
                else:
                    row.append("—")
            sps = statistics.median(r["seconds_per_step"] for r in recs)
            lines.append(f"| {arm} | " + " | ".join(row) + f" | {sps:.3f} | {recs[0]['parameters']:,} |")
        lines.append("")
        if task == "mqar":
            ns = sorted({int(k) for r in results["records"] if r["task"] == "mqar" for k in r.get("by_n_pairs", {})})
            lines += ["MQAR accuracy by number of pairs N (mean over seeds):", "",
                      "| arm | T | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
            for arm in ARMS:
                for T in lengths:
                    recs = [r for r in results["records"] if (r["task"], r["arm"], r["length"]) == ("mqar", arm, T)]
                    if recs:
                        vals = [statistics.fmean(r["by_n_pairs"][str(n)] for r in recs) for n in ns]
                        lines.append(f"| {arm} | {_len(T)} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
            lines.append("")
        if task == "passkey":
            lines += [f"Passkey accuracy by depth (needle position / T, {DEPTH_BINS} bins; mean over seeds):", "",
                      "| arm | T | " + " | ".join(f"{i / DEPTH_BINS:.1f}–{(i + 1) / DEPTH_BINS:.1f}"
                                                  for i in range(DEPTH_BINS)) + " |",
                      "|---|---|" + "---|" * DEPTH_BINS]
            for arm in ARMS:
                for T in lengths:
                    recs = [r for r in results["records"] if (r["task"], r["arm"], r["length"]) == ("passkey", arm, T)]
                    if recs:
                        vals = []
                        for i in range(DEPTH_BINS):
                            xs = [r["by_depth"][i] for r in recs if r["by_depth"][i] is not None]
                            vals.append(f"{statistics.fmean(xs):.2f}" if xs else "—")
                        lines.append(f"| {arm} | {_len(T)} | " + " | ".join(vals) + " |")
            lines.append("")
    if results["records"]:
        lines += ["Cost at each length: seconds of one sequence's forward pass (evaluation, median over cells, "
                  "1 thread; the load average beside each record in the JSON) and its FLOPs "
                  "(`research.longrange.step_flops`):", "",
                  "| arm | " + " | ".join(f"T={_len(T)}" for T in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for arm in ARMS:
            row = []
            for T in lengths:
                recs = [r for r in results["records"] if (r["arm"], r["length"]) == (arm, T)]
                row.append(f"{statistics.median(r['eval_seconds_per_sequence'] for r in recs):.3g} s, "
                           f"{recs[0]['flops_per_sequence_forward_at_length']:.2g}" if recs else "—")
            if any(x != "—" for x in row):
                lines.append(f"| {arm} | " + " | ".join(row) + " |")
        lines.append("")
    ext = results.get("extension", [])
    if ext:
        cfg = results.get("extension_config", {})
        lines += [f"**Context extension** (`python -m research.extend`): a byte-level model (ByteLM, d = "
                  f"{cfg.get('d_model')}, {cfg.get('layers')} layers, standard attention) trained at "
                  f"{cfg.get('base_len')} bytes for {cfg.get('base_steps')} steps; fine-tuning at "
                  f"{cfg.get('ft_len')} bytes for {cfg.get('ft_steps')} steps where the arm says so. Held-out bits "
                  f"per byte (lower is better) and passkey accuracy (share of the 5 digits):", "",
                  "| arm | T | bits per byte | passkey | fine-tuning tokens (base's) | parameters |",
                  "|---|---|---|---|---|---|"]
        for r in sorted(ext, key=lambda r: (["base", "swa", "swa_ft", "hkt_win"].index(r["arm"])
                                            if r["arm"] in ("base", "swa", "swa_ft", "hkt_win") else 9, r["length"])):
            lines.append(f"| {r['arm']} | {_len(r['length'])} | {r['val_bits_per_byte']:.3f} | "
                         f"{'—' if r['passkey_accuracy'] is None else format(r['passkey_accuracy'], '.2f')} | {r['finetune_tokens']:,} ({r['base_tokens']:,}) | "
                         f"{r['parameters']:,} |")
        lines.append("")
    whys = {s["why"].split(":")[0] for s in results["skipped"]}
    if whys:
        lines.append("¹ " + "; ".join(sorted(whys)) + " (the FLOPs are in results/longrange.json's `skipped`).")
        lines.append("")
    if results.get("timing"):
        ls = sorted({r["length"] for r in results["timing"]})
        lines += ["Seconds per training step (batch 1, forward + backward) at each length; FLOPs counted in "
                  "`research.longrange.step_flops`:", "",
                  "| arm | " + " | ".join(f"T={_len(T)}" for T in ls) + " |", "|---|" + "---|" * len(ls)]
        for arm in ARMS:
            rows = {r["length"]: r for r in results["timing"] if r["arm"] == arm}
            if rows:
                lines.append(f"| {arm} | " + " | ".join(
                    (f"{rows[T]['seconds_per_step']:.3g} s, {rows[T]['flops_per_step']:.2g} FLOPs"
                     if rows[T].get("seconds_per_step") else f"— ({rows[T]['flops_per_step']:.2g} FLOPs)")
                    if T in rows else "" for T in ls) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: Dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cells = summary(results)
    tasks = [t for t in TASKS if any(k[0] == t for k in cells)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    style = {"hkt_win": ("o", "-"), "swa": ("s", "-"), "full": ("^", "--"), "hkt": ("D", ":")}  # full and hkt overlap
    for ax, task in zip(axes[0], tasks):
        for arm in ARMS:
            pts = sorted((T, *_mean_sd(a)) for (t, ar, T), a in cells.items() if t == task and ar == arm)
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker=style[arm][0],
                            linestyle=style[arm][1], capsize=3, label=arm)
        ax.axhline(CHANCE[task], color="gray", linewidth=0.8, linestyle="-.", label="chance")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(task)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


SECTION = "## Long-range recall"
BEGIN, END = "<!-- begin: python -m research.longrange --table -->", "<!-- end: python -m research.longrange --table -->"


def write_table(results: Dict, paper: str) -> None:
    """Writes the tables from ``results`` between docs/paper.md's markers (in
    its "Long-range recall" section, appended with them where it is missing);
    the section's prose around them is left as it is."""
    tables = f"{BEGIN}\n\n{table_markdown(results)}\n![accuracy against length](../results/longrange.png)\n\n{END}"
    text = open(paper).read() if os.path.exists(paper) else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + tables + text[text.index(END) + len(END):]
    elif SECTION in text:
        end = text.find("\n## ", text.index(SECTION) + len(SECTION))
        end = len(text) if end < 0 else end + 1
        text = text[:end].rstrip() + "\n\n" + tables + "\n\n" + text[end:]
    else:
        text = text.rstrip() + f"\n\n{SECTION}\n\n{tables}\n"
    with open(paper, "w") as f:
        f.write(text.rstrip() + "\n")


# ----------------------------------------------------------------------------------------------------------------
# command line


def _config(args) -> Dict:
    cfg = dict(DEFAULTS)
    for k in DEFAULTS:
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    if args.smoke:
        cfg.update(seeds=[0], lengths=[1024], steps=args.steps or 40, n_eval=16, chunk=20, warmup=5)
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    ap = argparse.ArgumentParser(prog="python -m research.longrange", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one seed at the smallest length, few steps (< 2 min)")
    ap.add_argument("--table", action="store_true", help="write docs/paper.md's section and the plot from --out")
    ap.add_argument("--time-lengths", action="store_true", help="time one training step per arm and length")
    ap.add_argument("--tasks", nargs="+", choices=TASKS)
    ap.add_argument("--arms", nargs="+", choices=ARMS)
    ap.add_argument("--seeds", nargs="+", type=int)
    ap.add_argument("--lengths", nargs="+", type=cli.int_at_least(16))
    ap.add_argument("--train-len", type=cli.int_at_least(16))
    ap.add_argument("--window", type=cli.int_at_least(4))
    ap.add_argument("--steps", type=cli.int_at_least(1))
    ap.add_argument("--n-eval", type=cli.int_at_least(1))
    ap.add_argument("--full-max-len", type=cli.int_at_least(16))
    ap.add_argument("--threads", type=cli.int_at_least(1))
    ap.add_argument("--out", default=None, help="results JSON (default results/longrange.json; "
                                                 "--smoke: none unless given)")
    ap.add_argument("--ckpt-dir", default=None, help="checkpoints (default ~/.cache/hkt/longrange; --smoke: none)")
    ap.add_argument("--paper", default="docs/paper.md")
    ap.add_argument("--plot", default="results/longrange.png")
    args = ap.parse_args(argv)
    cli.set_threads(args.threads)
    out = args.out if (args.out or args.smoke) else "results/longrange.json"
    if args.table:
        results = _load(out)
        if not results["records"]:
            ap.error(f"--out: {out} holds no records")
        write_table(results, args.paper)
        plot(results, args.plot)
        print(table_markdown(results))
        return results
    cfg = _config(args)
    if cfg["max_pos"] < max(cfg["lengths"] + [cfg["train_len"]]):
        cfg["max_pos"] = max(cfg["lengths"] + [cfg["train_len"]])
    ckpt_dir = args.ckpt_dir if (args.ckpt_dir or args.smoke) else os.path.expanduser("~/.cache/hkt/longrange")
    if ckpt_dir:
        os.makedirs(ckpt_dir, exist_ok=True)
    cli.check_writable(ap, out)
    results = _load(out)
    from .timing import machine_info
    results["machine"] = {k: v for k, v in machine_info().items() if k not in ("threads", "hkt_commit", "date")}
    # what every cell shares (a worker's own selection of cells is not the experiment's)
    results["config"] = {k: v for k, v in cfg.items() if k not in ("tasks", "arms", "seeds", "lengths", "full_max_len")}
    if args.time_lengths:
        results["timing"] = time_lengths(cfg, cfg["lengths"], cfg["arms"])
        _save(results, out)
        return results
    with stop_on_signals():
        try:
            for seed in cfg["seeds"]:
                for task in cfg["tasks"]:
                    for arm in cfg["arms"]:
                        run_cell(task, arm, seed, cfg, results, out, ckpt_dir)
        except KeyboardInterrupt:
            print("longrange: stopped; the same command resumes", file=sys.stderr)
    _save(results, out)
    return results


if __name__ == "__main__":
    main()
