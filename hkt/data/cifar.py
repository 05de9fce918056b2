"""Sequential CIFAR-10: each 32x32 image read pixel by pixel as a 1024-token sequence.

Reads the standard "CIFAR-10 python version" batches (``data_batch_1`` ..
``data_batch_5``, ``test_batch``: pickled dicts with ``b"data"`` (N, 3072) uint8,
red plane then green then blue, and ``b"labels"``).  Nothing is downloaded.
"""
import os
import pickle
from typing import Tuple

import torch
from torch import Tensor

__all__ = ["load_cifar10", "CIFAR_TRAIN_FILES", "CIFAR_TEST_FILES"]

CIFAR_TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST_FILES = ["test_batch"]
_HELP = ("Download 'CIFAR-10 python version' (cifar-10-python.tar.gz) from "
         "https://www.cs.toronto.edu/~kriz/cifar.html and unpack it so that {where} holds "
         "data_batch_1 .. data_batch_5 and test_batch.")


def _find_dir(root: str) -> str:
    for d in (root, os.path.join(root, "cifar-10-batches-py")):
        if os.path.isfile(os.path.join(d, "test_batch")) or os.path.isfile(os.path.join(d, "data_batch_1")):
            return d
    raise FileNotFoundError(f"CIFAR-10 batches not found under {os.path.abspath(root)!r}. "
                            + _HELP.format(where=repr(os.path.join(os.path.abspath(root), "cifar-10-batches-py"))))


def load_cifar10(root: str, split: str = "train", *, grayscale: bool = True, limit: int = None) -> Tuple[Tensor, Tensor]:
    """Loads sequential CIFAR-10 from ``root`` (or ``root/cifar-10-batches-py``).

    Args:
        root: folder holding the batch files.
        split: "train" (data_batch_1..5) or "test" (test_batch).
        grayscale: True gives LRA's setting, one token per pixel,
            ``round(0.299 R + 0.587 G + 0.114 B)``, shape (N, 1024);
            False gives the three channels interleaved per pixel, (N, 3072).
        limit: keep only the first ``limit`` images.

    Returns:
        tokens (N, 1024 or 3072) int64 with value + 1 (so 0 stays padding,
        vocabulary 257) and labels (N,) int64 in 0..9.

    Raises:
        FileNotFoundError saying where to put the files; ValueError for a bad split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split: must be 'train' or 'test', got {split!r}")
    d = _find_dir(root)
    names = CIFAR_TRAIN_FILES if split == "train" else CIFAR_TEST_FILES
    datas, labels = [], []
    for name in names:
        path = os.path.join(d, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CIFAR-10 batch {path!r} is missing. " + _HELP.format(where=repr(d)))
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        datas.append(torch.as_tensor(batch[b"data"], dtype=torch.uint8).reshape(-1, 3, 1024))
        labels.append(torch.as_tensor(batch[b"labels"], dtype=torch.int64))
        if limit is not None and sum(len(x) for x in labels) >= limit:
            break
    x = torch.cat(datas)
    y = torch.cat(labels)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    if grayscale:
        xf = x.to(torch.float64)
        tok = torch.round(0.299 * xf[:, 0] + 0.587 * xf[:, 1] + 0.114 * xf[:, 2]).to(torch.int64)
    else:
        tok = x.transpose(1, 2).reshape(len(x), 3072).to(torch.int64)
    return tok + 1, y
