"""Byte-level IMDB sentiment (Maas et al. 2011) from the ``aclImdb`` folder.

Each review is read as UTF-8 bytes, one token per byte (byte + 1, so 0 is
padding; vocabulary 257), truncated or right-padded to ``max_len``.
Nothing is downloaded.
"""
import os
from typing import Tuple

import torch
from torch import Tensor

__all__ = ["load_imdb", "encode_bytes"]

_HELP = ("Download the Large Movie Review Dataset (aclImdb_v1.tar.gz) from "
         "https://ai.stanford.edu/~amaas/data/sentiment/ and unpack it so that {where} holds "
         "train/pos, train/neg, test/pos and test/neg with one .txt file per review.")


def encode_bytes(text: str, max_len: int) -> Tensor:
    """(max_len,) int64: the UTF-8 bytes of ``text`` + 1, truncated, padded with 0."""
    b = text.encode("utf-8")[:max_len]
    out = torch.zeros(max_len, dtype=torch.int64)
    if b:
        out[:len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8).to(torch.int64) + 1
    return out


def _find_dir(root: str, split: str) -> str:
    for d in (root, os.path.join(root, "aclImdb")):
        if os.path.isdir(os.path.join(d, split, "pos")) and os.path.isdir(os.path.join(d, split, "neg")):
            return d
    raise FileNotFoundError(f"IMDB {split!r} split not found under {os.path.abspath(root)!r}. "
                            + _HELP.format(where=repr(os.path.join(os.path.abspath(root), "aclImdb"))))


def load_imdb(root: str, split: str = "train", *, max_len: int = 1024, limit: int = None) -> Tuple[Tensor, Tensor]:
    """Loads byte-level IMDB from ``root`` (or ``root/aclImdb``).

    Files are read in sorted name order, negatives then positives, so the
    result is deterministic; shuffle in the loader.

    Args:
        root: folder holding train/ and test/ (each with pos/ and neg/).
        split: "train" or "test".
        max_len: sequence length (1024 in the paper).
        limit: at most this many reviews per class (so up to ``2 * limit`` in all).

    Returns:
        tokens (N, max_len) int64 and labels (N,) int64, 0 negative, 1 positive.

    Raises:
        FileNotFoundError saying where to put the files; ValueError for a bad split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split: must be 'train' or 'test', got {split!r}")
    if max_len < 1:
        raise ValueError(f"max_len: must be >= 1, got {max_len}")
    d = _find_dir(root, split)
    seqs, labels = [], []
    for label, sub in ((0, "neg"), (1, "pos")):
        folder = os.path.join(d, split, sub)
        names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
        if limit is not None:
            names = names[:limit]
        for name in names:
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                seqs.append(encode_bytes(f.read(), max_len))
            labels.append(label)
    if not seqs:
        raise FileNotFoundError(f"no .txt reviews in {os.path.join(d, split)!r}. " + _HELP.format(where=repr(d)))
    return torch.stack(seqs), torch.tensor(labels, dtype=torch.int64)
