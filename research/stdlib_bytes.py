"""Byte-level text that every Python installation ships: its own standard library.

The corpus is the bytes of the ``.py`` files under the running interpreter's
standard library directory (``sysconfig.get_paths()["stdlib"]``), read in
sorted order of their relative paths and split *by file* into train and
validation, so no file contributes to both.  Nothing is downloaded.  It is our
substitute for the paper's byte-level IMDB task (real text, T = 1024 bytes,
available on any machine).

**The corpus depends on the Python version** (and, slightly, on how Python was
installed): 3.11 and 3.12 ship different files and sizes, so bits-per-byte
figures are comparable only between runs on the same version.
:func:`load_corpus` records the version, the directory and the byte and file
counts with every result.

Left out, and why:

- ``site-packages`` / ``dist-packages``: third-party code, different on every
  machine (and ~10x the standard library's size on a developer's machine);
- test directories (``test``, ``tests``, ``idle_test``): the test suite is an
  optional part of an installation (Debian and Ubuntu ship it in a separate
  package, the Windows installer makes it a checkbox), so leaving it out keeps
  the corpus the same on more machines; it also holds deliberately malformed
  and generated files (bad encodings, syntax errors, long data tables) that are
  not representative source text.

Split: a file goes to validation when the first 8 bytes of
``sha256(f"{seed}:{relative path}")``, read as a fraction of 2**64, fall below
``val_fraction``: deterministic, independent of the file list (adding a file
moves no other file) and of the platform's path separator.
"""
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["stdlib_dir", "describe", "list_sources", "is_validation", "Corpus", "load_corpus", "BatchSampler",
           "eval_windows"]

# Directory names skipped anywhere in the tree (see the module docstring for why).
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_dir() -> str:
    """The running interpreter's standard library directory (a virtual
    environment reports its base interpreter's)."""
    return sysconfig.get_paths()["stdlib"]


def list_sources(root: Optional[str] = None) -> List[str]:
    """Relative paths ('/'-separated) of the ``.py`` files under ``root``
    (default :func:`stdlib_dir`), sorted, skipping :data:`SKIP_DIRS`."""
    root = stdlib_dir() if root is None else root
    if not os.path.isdir(root):
        raise ValueError(f"root: not a directory: {root!r}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def is_validation(rel_path: str, val_fraction: float, seed: int = 0) -> bool:
    """Whether the file ``rel_path`` belongs to the validation split."""
    h = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64 < val_fraction


@dataclass
class Corpus:
    """Train and validation bytes (1-D uint8 tensors, files concatenated in
    sorted order) and where they came from."""
    train: Tensor
    val: Tensor
    train_files: List[str]
    val_files: List[str]
    info: Dict[str, object] = field(default_factory=dict)


def load_corpus(root: Optional[str] = None, *, val_fraction: float = 0.05, seed: int = 0) -> Corpus:
    """Reads the corpus (about 12 MB and 0.1-0.3 s for Python 3.11's standard library).

    Args:
        root: directory to read (default: this interpreter's standard library).
        val_fraction: expected fraction of files in validation, in (0, 1).
        seed: the split's seed.

    Returns:
        A :class:`Corpus`; ``info`` holds python_version, root, seed,
        val_fraction and the file and byte counts of each split.

    Raises:
        ValueError for ``val_fraction`` outside (0, 1), a missing ``root``, or a
        split left empty (too few files for ``val_fraction``).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a value in (0, 1), got {val_fraction!r}")
    root = stdlib_dir() if root is None else root
    files = list_sources(root)
    parts: Dict[str, Tuple[List[str], List[bytes]]] = {"train": ([], []), "val": ([], [])}
    for rel in files:
        with open(os.path.join(root, *rel.split("/")), "rb") as f:
            data = f.read()
        names, chunks = parts["val" if is_validation(rel, val_fraction, seed) else "train"]
        names.append(rel)
        chunks.append(data)
    for split, (names, _) in parts.items():
        if not names:
            raise ValueError(f"val_fraction: the {split} split of {root!r} is empty ({len(files)} files, "
                             f"val_fraction={val_fraction})")
    tensors = {s: torch.frombuffer(bytearray(b"".join(c)), dtype=torch.uint8) for s, (_, c) in parts.items()}
    info = {"python_version": ".".join(map(str, sys.version_info[:3])), "root": root, "seed": seed,
            "val_fraction": val_fraction, "train_files": len(parts["train"][0]), "val_files": len(parts["val"][0]),
            "train_bytes": tensors["train"].numel(), "val_bytes": tensors["val"].numel()}
    return Corpus(tensors["train"], tensors["val"], parts["train"][0], parts["val"][0], info)


def describe(info: Dict) -> Dict:
    """A corpus's info as a results file or checkpoint records it: the folder
    read named without this machine's path ("the standard library" for
    :func:`stdlib_dir`, else the folder's own name)."""
    root = info["root"]
    named = ("the standard library" if os.path.abspath(root) == os.path.abspath(stdlib_dir())
             else os.path.basename(os.path.normpath(root)))
    return {**info, "root": named}


class BatchSampler:
    """Random windows of ``seq_len + 1`` bytes: ``sample()`` returns inputs x
    and next-byte targets y, both (batch_size, seq_len) int64, y[:, t] = x[:, t + 1]
    of the window.  Starts are uniform over every full window of ``data``, drawn
    from a ``torch.Generator`` seeded with ``seed``; ``state_dict`` /
    ``load_state_dict`` save and restore it (for resumable runs)."""

    def __init__(self, data: Tensor, seq_len: int, batch_size: int, seed: int = 0):
        if not isinstance(data, Tensor) or data.dim() != 1:
            raise TypeError("data: expected a 1-D tensor of bytes")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len, batch_size: expected >= 1, got {seq_len}, {batch_size}")
        if data.numel() < seq_len + 1:
            raise ValueError(f"data: {data.numel()} bytes, fewer than one window of seq_len + 1 = {seq_len + 1}")
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def sample(self) -> Tuple[Tensor, Tensor]:
        starts = torch.randint(0, self.data.numel() - self.seq_len, (self.batch_size,), generator=self.gen)
        w = self.data[starts[:, None] + self._offsets].long()
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> Dict[str, Tensor]:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: Dict[str, Tensor]) -> None:
        self.gen.set_state(state["gen"])


def eval_windows(data: Tensor, seq_len: int, n: int) -> Tuple[Tensor, Tensor]:
    """``n`` fixed windows (x, y as in :class:`BatchSampler`) at evenly spaced
    starts over ``data``: the same evaluation set for every run, no generator."""
    if n < 1:
        raise ValueError(f"n: expected >= 1, got {n}")
    last = data.numel() - seq_len - 1
    if last < 0:
        raise ValueError(f"data: {data.numel()} bytes, fewer than one window of seq_len + 1 = {seq_len + 1}")
    starts = torch.linspace(0, last, n).round().long()
    w = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return w[:, :-1], w[:, 1:]
