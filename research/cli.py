"""Argument checks shared by the experiments' command lines.

A bad value must stop the command before any training, as an argparse error
that names the option (exit code 2, no traceback): found later it costs the
training already done, and let through it hangs (``--chunk 0``) or writes a
silently wrong result (``--n-train 0`` read as the default).  The ``type=``
converters below raise :class:`argparse.ArgumentTypeError`, which argparse
reports as ``argument --name: ...``; the ``check_*`` functions take the parser
and call ``parser.error`` for checks that need more than one value or the
file system.
"""
import argparse
import math
import os
import tempfile
from typing import Callable, Optional, Sequence

__all__ = ["int_at_least", "positive_int", "non_negative_int", "positive_float", "non_negative_float",
           "probability", "open_fraction", "check_unique", "check_heads", "check_writable", "set_threads"]


def _parse(kind: type, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low``."""
    def convert(text: str) -> int:
        value = _parse(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    convert.__name__ = f"int_at_least_{low}"
    return convert


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def _float_in(describe: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def convert(text: str) -> float:
        value = _parse(float, text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {describe}, got {value!r}")
        return value
    convert.__name__ = describe
    return convert


positive_float = _float_in("a number > 0", lambda v: v > 0)
non_negative_float = _float_in("a number >= 0", lambda v: v >= 0)
probability = _float_in("a probability in [0, 1)", lambda v: 0 <= v < 1)  # dropout: p = 1 drops everything
open_fraction = _float_in("a fraction in (0, 1)", lambda v: 0 < v < 1)


def check_unique(parser: argparse.ArgumentParser, values: Sequence, flag: str) -> None:
    """Repeated values (``--seeds 0 0``) would count one run twice in a mean
    and its spread, or train it twice under one checkpoint."""
    seen = [v for i, v in enumerate(values) if v in values[:i]]
    if seen:
        parser.error(f"{flag}: repeated value(s) {sorted(set(seen))}; give each once")


def check_heads(parser: argparse.ArgumentParser, d_model: int, heads: int) -> None:
    """Multi-head attention splits ``d_model`` into ``heads`` equal parts."""
    if d_model % heads:
        parser.error(f"--heads: {heads} heads do not divide --d-model {d_model}")


def check_writable(parser: argparse.ArgumentParser, path: Optional[str], flag: str = "--out") -> None:
    """Whether ``path`` can be written, tried now (a file created and removed,
    or an existing file opened for appending, which leaves it as it was) rather
    than found out after the training whose results it was to hold.  Missing
    parent folders are not made here (the writer makes them); the nearest
    existing one must take a new file."""
    if path is None:
        return
    full = os.path.abspath(path)
    if os.path.isdir(full):
        parser.error(f"{flag}: {path!r} is a directory; give a file path")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        parser.error(f"{flag}: cannot write {path!r}: {parent!r} is not a directory")
    try:
        if os.path.exists(full):
            with open(full, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".hkt_write_test_"):
                pass
    except OSError as e:
        parser.error(f"{flag}: cannot write {path!r}: {e.strerror or e}")


def set_threads(threads: Optional[int]) -> None:
    """torch's intra-op threads, when ``--threads`` was given (a positive_int)."""
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
