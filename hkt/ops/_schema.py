"""What every hkt custom op's registration shares: its tags, the scale as the
schemas take it, and the autograd of an op with no derivative.

CUDA graphs: the CUDA kernels are queued on torch's current stream, never
synchronize and never allocate (the backward's scratch comes from torch), so
the ops should be capturable; they are tagged cudagraph_unsafe until that has
been seen on a GPU, and because a replayed graph repeats the dropout seed it
was captured with (the seed is read on the host).  The tag makes
torch.compile(mode="reduce-overhead") run the ops outside its CUDA graphs
(graph partitions on either side of them are still captured).
HKT_CUDAGRAPH_SAFE=1 at import registers them without it, for
tests/kernels/test_cuda.py::test_compiled_reduce_overhead_captures_untagged_ops,
which shows whether the tag can go (README, "CUDA graphs").
"""
import math
import os

import torch

from .._core.kernels import schema_sliding_window, window_softcap

__all__ = ["OP_OPTIONS", "schema_scale", "schema_softcap", "schema_sliding_window", "no_derivative"]

_CUDAGRAPH_SAFE = os.environ.get("HKT_CUDAGRAPH_SAFE", "0") == "1"
_TAGS = () if _CUDAGRAPH_SAFE or not hasattr(torch.Tag, "cudagraph_unsafe") else (torch.Tag.cudagraph_unsafe,)
# custom_op takes tags from torch 2.5 on; 2.4's has neither the argument nor that tag
OP_OPTIONS = {"tags": _TAGS} if _TAGS else {}


def schema_scale(scale):
    """A checked scale (None, an int or a float) as the schemas take it: None
    or a float; an int beyond the float range as inf, which the extension
    refuses by name."""
    if scale is None or isinstance(scale, float):
        return scale
    try:
        return float(scale)
    except OverflowError:
        return math.inf


# a softcap as the schemas take it, a float, 0.0 for none (FlashAttention's
# convention), checked by the extension: the windowed kernels take it so too
schema_softcap = window_softcap


def no_derivative(op: str, message: str) -> None:
    """Registers op's autograd as a NotImplementedError with message (which
    names the op): a gradient through an op with no derivative of its own."""
    def refuse(ctx, *grads):
        raise NotImplementedError(message)

    def keep_nothing(ctx, inputs, output):
        pass
    torch.library.register_autograd(op, refuse, setup_context=keep_nothing)
