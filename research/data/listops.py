"""Synthetic ListOps (Nangia & Bowman 2018, as used in Long Range Arena).

An example is a nested expression over the digits 0-9 with four operators::

    [MAX 2 9 [MIN 4 7 ] 0 ]      -> 9
    [MED 1 5 3 9 ]               -> int(median) = 4
    [SM 5 6 7 ]                  -> (5 + 6 + 7) mod 10 = 8

and the label is its value (ten classes).  Everything is generated here from a
seed (``random.Random``), so a dataset is a pure function of its arguments.

Token ids (``LISTOPS_VOCAB``): 0 padding, 1..10 the digits 0..9, 11 ``[MAX``,
12 ``[MIN``, 13 ``[MED``, 14 ``[SM``, 15 ``]``.
"""
import random
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["LISTOPS_VOCAB", "MIN_LEN", "generate_listops", "evaluate_listops", "ListOps", "tokens_to_string"]

PAD = 0
_OPS = ["[MAX", "[MIN", "[MED", "[SM"]
LISTOPS_VOCAB = {"<pad>": PAD, **{str(d): d + 1 for d in range(10)}, **{op: 11 + i for i, op in enumerate(_OPS)},
                 "]": 15}
_ID_TO_TOKEN = {i: t for t, i in LISTOPS_VOCAB.items()}
_CLOSE = LISTOPS_VOCAB["]"]
# The shortest expression, '[OP a b ]': the root is always an operator, an operator takes at least 2 arguments.
MIN_LEN = 4


def _apply(op: str, values: Sequence[int]) -> int:
    if op == "[MAX":
        return max(values)
    if op == "[MIN":
        return min(values)
    if op == "[MED":
        s = sorted(values)
        n = len(s)
        # int(np.median(values)) as in the LRA generator: the mean of the middle two, floored
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


class _TooLong(Exception):
    pass


def _gen(rng: random.Random, depth: int, max_depth: int, max_args: int, value_p: float, out: List[int],
         budget: int) -> int:
    """Appends one sub-expression's tokens to ``out`` and returns its value.
    The root (depth 0) is always an operator, so every example needs reasoning."""
    if len(out) >= budget:
        raise _TooLong
    if depth > 0 and (depth >= max_depth or rng.random() < value_p):
        v = rng.randrange(10)
        out.append(v + 1)
        return v
    op = rng.choice(_OPS)
    out.append(LISTOPS_VOCAB[op])
    n = rng.randint(2, max_args)
    values = [_gen(rng, depth + 1, max_depth, max_args, value_p, out, budget) for _ in range(n)]
    out.append(_CLOSE)
    return _apply(op, values)


def generate_listops(n: int, max_len: int = 128, *, min_len: int = None, seed: int = 0, max_depth: int = None,
                     max_args: int = None, value_p: float = None) -> Tuple[Tensor, Tensor]:
    """Generates ``n`` ListOps examples.

    Args:
        n: number of examples.
        max_len: sequence length; shorter expressions are right-padded with 0.
        min_len: shortest accepted expression (default ``max_len // 4``); trees
            outside [min_len, max_len] are redrawn.
        seed: the only source of randomness.
        max_depth, max_args, value_p: tree shape: depth limit, most arguments
            of one operator, probability that a non-root node is a digit.  The
            defaults depend on ``max_len`` so that most drawn trees fit: LRA's
            10, 10, 0.25 at max_len >= 1000; 6, 5, 0.4 from 256; 5, 5, 0.5 below.

    Returns:
        tokens (n, max_len) int64 and labels (n,) int64 in 0..9.
    """
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if max_len < MIN_LEN:
        raise ValueError(f"max_len: must be >= {MIN_LEN} (the shortest expression, '[OP a b ]', has {MIN_LEN} "
                         f"tokens), got {max_len}")
    if min_len is None:
        min_len = max(MIN_LEN, max_len // 4)
    if not 1 <= min_len <= max_len:
        raise ValueError(f"min_len: must be in [1, max_len={max_len}], got {min_len}")
    shape = (10, 10, 0.25) if max_len >= 1000 else ((6, 5, 0.4) if max_len >= 256 else (5, 5, 0.5))
    max_depth = shape[0] if max_depth is None else max_depth
    max_args = shape[1] if max_args is None else max_args
    value_p = shape[2] if value_p is None else value_p
    if max_args < 2:
        raise ValueError(f"max_args: must be >= 2, got {max_args}")
    rng = random.Random(seed)
    tokens = torch.zeros(n, max_len, dtype=torch.int64)
    labels = torch.zeros(n, dtype=torch.int64)
    made, tries = 0, 0
    while made < n:
        tries += 1
        if tries > 1000 * (n + 10):
            raise ValueError(f"no expression of length in [{min_len}, {max_len}] after {tries} draws: "
                             f"adjust min_len, max_depth, max_args or value_p")
        out: List[int] = []
        try:
            value = _gen(rng, 0, max_depth, max_args, value_p, out, max_len + 1)
        except _TooLong:
            continue
        if not min_len <= len(out) <= max_len:
            continue
        tokens[made, :len(out)] = torch.tensor(out, dtype=torch.int64)
        labels[made] = value
        made += 1
    return tokens, labels



def evaluate_listops(tokens: Sequence[int]) -> int:
    """Value of one tokenised expression (padding ignored); a parser that is
    independent of the generator, so tests can check labels against it."""
    stack: List[Tuple[str, List[int]]] = []
    result = None
    for t in (int(x) for x in tokens):
        if t == PAD:
            continue
        tok = _ID_TO_TOKEN.get(t)
        if tok is None:
            raise ValueError(f"tokens: unknown ListOps token id {t}")
        if tok in _OPS:
            stack.append((tok, []))
        elif tok == "]":
            if not stack:
                raise ValueError("tokens: unbalanced ']'")
            op, vals = stack.pop()
            v = _apply(op, vals)
            if stack:
                stack[-1][1].append(v)
            else:
                result = v
        else:
            v = int(tok)
            if stack:
                stack[-1][1].append(v)
            else:
                result = v
    if stack or result is None:
        raise ValueError("tokens: incomplete expression")
    return result


def tokens_to_string(tokens: Sequence[int]) -> str:
    """'[MAX 2 9 ]' from token ids, padding dropped."""
    return " ".join(_ID_TO_TOKEN[int(t)] for t in tokens if int(t) != PAD)


class ListOps(torch.utils.data.TensorDataset):
    """``generate_listops`` as a Dataset of (tokens (max_len,), label) pairs;
    ``vocab_size`` = 16, ``num_classes`` = 10."""

    vocab_size = len(LISTOPS_VOCAB)
    num_classes = 10

    def __init__(self, n: int, max_len: int = 128, *, seed: int = 0, **kwargs):
        self.tokens, self.labels = generate_listops(n, max_len, seed=seed, **kwargs)
        self.max_len = max_len
        super().__init__(self.tokens, self.labels)
