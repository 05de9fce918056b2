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


def _read_batch(path: str) -> Tuple[Tensor, Tensor]:
    """(data (N, 3, 1024) uint8, labels (N,) int64) of one batch file;
    ValueError naming the file unless it is a CIFAR-10 python batch: a dict with
    ``data`` (N, 3072) uint8-valued and ``labels`` (N values in 0..9) (bytes
    keys as distributed, or str keys as a re-pickling leaves them).  Unchecked,
    a short label list silently paired later images with other labels."""
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except OSError:
        raise
    except Exception as e:  # torn or foreign files fail in many ways (unpickling, EOF, missing classes)
        raise ValueError(f"CIFAR-10 batch {path!r}: not a readable pickle ({type(e).__name__}: {e})") from e
    if not isinstance(batch, dict):
        raise ValueError(f"CIFAR-10 batch {path!r}: expected a dict, got {type(batch).__name__}")
    entries = {}
    for key in ("data", "labels"):
        entries[key] = batch.get(key.encode(), batch.get(key))
        if entries[key] is None:
            raise ValueError(f"CIFAR-10 batch {path!r}: no {key!r} entry (keys {sorted(map(str, batch))})")
    try:
        data = torch.as_tensor(entries["data"])
        labels = torch.as_tensor(entries["labels"])
    except Exception as e:
        raise ValueError(f"CIFAR-10 batch {path!r}: data or labels are not arrays of numbers ({e})") from e
    if data.dim() != 2 or data.shape[1] != 3072:
        raise ValueError(f"CIFAR-10 batch {path!r}: data has shape {tuple(data.shape)}, expected (N, 3072)")
    if data.is_floating_point() or data.is_complex() or (data.numel() and (data.min() < 0 or data.max() > 255)):
        raise ValueError(f"CIFAR-10 batch {path!r}: data must hold byte values 0..255")
    if labels.dim() != 1 or len(labels) != len(data):
        raise ValueError(f"CIFAR-10 batch {path!r}: {tuple(labels.shape)} labels for {len(data)} images")
    if labels.is_floating_point() or labels.is_complex() or (labels.numel() and (labels.min() < 0 or labels.max() > 9)):
        raise ValueError(f"CIFAR-10 batch {path!r}: labels must be integers in 0..9")
    return data.to(torch.uint8).reshape(-1, 3, 1024), labels.to(torch.int64)


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
        FileNotFoundError saying where to put the files; ValueError for a bad
        split or ``limit`` < 1, or naming a file that is no CIFAR-10 batch.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split: must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit: expected None or an int >= 1, got {limit}")
    d = _find_dir(root)
    names = CIFAR_TRAIN_FILES if split == "train" else CIFAR_TEST_FILES
    datas, labels = [], []
    for name in names:
        path = os.path.join(d, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CIFAR-10 batch {path!r} is missing. " + _HELP.format(where=repr(d)))
        data, lab = _read_batch(path)
        datas.append(data)
        labels.append(lab)
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
