"""How a call meets torch before it reaches the kernels: whether torch.compile,
torch.jit.trace or a torch.func transform is recording it (they cannot see the
extension's direct calls), the casts torch.autocast asks for, the dead
torch.func wrappers a call unwraps, and the C entry of an autograd Function's
apply.  Imports nothing of hkt.
"""
import types
from typing import Optional

import torch
from torch import Tensor


def _recording() -> bool:
    """Whether torch.compile or torch.jit.trace is recording this call: they
    record registered ops, never the extension's direct calls, so the custom op
    must run (a trace of a direct call would replay whatever memory the output
    had: no op, no error)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


# dynamo before torch 2.11 (2.4.1 checked) cannot trace the torch.func check
# (fullgraph compiles fail on it): under torch.compile there it is skipped
_FUNCTORCH_CHECK_TRACES = torch.torch_version.TorchVersion(torch.__version__) >= (2, 11)


def _call_mode() -> str:
    """How torch runs this call, asked once: "transform" where a torch.func
    transform (vmap, grad, ...) is active around it, the kernels' plain arrays
    cannot run there; else "recording" where torch.compile or torch.jit.trace
    records it (see _recording); else "eager"."""
    compiling = torch.compiler.is_compiling()
    if (_FUNCTORCH_CHECK_TRACES or not compiling) and torch._C._are_functorch_transforms_active():
        return "transform"
    return "recording" if compiling or torch.jit.is_tracing() else "eager"


def _functorch_active() -> bool:
    """Whether a torch.func transform (vmap, grad, ...) is active around this call."""
    return _call_mode() == "transform"


def _refuse_trace(what: str) -> None:
    """For the kernels with no registered op (decoding, variable-length):
    torch.jit.trace cannot record them, so a trace would silently replay
    stale memory."""
    if torch.jit.is_tracing():
        raise RuntimeError(f"{what}: torch.jit.trace cannot record it (its kernels are called directly, not as a "
                           "registered op, so the trace would replay stale memory); call it outside the trace")


def _refuse_meta(q0, what: str) -> None:
    """For the calls with no shapes-only path (the extension's decoding and
    variable-length kernels): meta tensors hold no data for them to read, and
    cannot go through DLPack."""
    if isinstance(q0, Tensor) and q0.is_meta:
        raise ValueError(f"q[0]: {what} needs tensors with data; meta tensors are not supported")


def _autocast_inputs(q, k, v, w, to: Optional[torch.dtype] = None):
    """q, k, v and w as torch.autocast has them run, where it is on for q[0]'s
    device type: in its dtype where that is bfloat16, else (float16, which hkt
    does not compute) in float32; float64 stays float64, as autocast leaves it.
    SDPA's inputs are cast the same way (to the lower precision).  Without it a
    module whose projections autocast made bfloat16, next to level weights it
    left float32, would not run.  The casts are differentiable: float32
    parameters get float32 gradients.  A float mask needs none: the kernels
    take it in their compute dtype.  ``to``: every floating input in that
    dtype instead (decoding's, that of its caches); k may then be None."""
    if not (isinstance(q, (list, tuple)) and q and isinstance(q[0], Tensor)
            and (isinstance(k, (list, tuple)) or (to is not None and k is None))):
        return q, k, v, w  # malformed: left for the checks to name
    device = q[0].device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v, w
    keep = ()
    if to is None:
        to, keep = torch.get_autocast_dtype(device), (torch.float64,)
        if to != torch.bfloat16:
            to = torch.float32

    def cast(x):
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != to and x.dtype not in keep:
            return x.to(to)
        return x
    return [cast(x) for x in q], None if k is None else [cast(x) for x in k], cast(v), cast(w)


def _unwrap_dead(*args):
    """The tensors among args with dead torch.func wrappers unwrapped, as
    torch.autograd.Function.apply and torch's own ops take them; None when
    there was none (lists of tensors are looked into; live wrappers, under a
    running transform, stay as they are)."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    unwrap = getattr(torch._C._functorch, "unwrap_if_dead", None)
    if wrapped is None or unwrap is None:  # another torch's layout: nothing to do here
        return None
    found = False

    def one(x):
        nonlocal found
        if isinstance(x, Tensor) and wrapped(x):
            y = unwrap(x)  # x itself while its transform is running
            found = found or y is not x
            return y
        return x
    out = [[one(x) for x in a] if isinstance(a, (list, tuple)) else one(a) for a in args]
    return out if found else None


def _c_apply(fn):
    """fn.apply as the C function torch.autograd.Function.apply calls last,
    without the Python layer before it, a fair part of a small forward's
    time: binding default arguments (only when the
    Function defines setup_context; hkt's do not) and unwrapping dead
    torch.func wrappers, a generator over every argument.  hkt's Functions run
    only with no torch.func transform active (functional._pick_backend); a dead wrapper
    among their inputs (a tensor kept from inside a finished transform) fails
    in DLPack instead, and hkt_attention unwraps it and calls again
    (_unwrap_dead).  fn.apply itself where torch's classes are laid out
    otherwise."""
    base = getattr(super(torch.autograd.Function, fn), "apply", None)
    own_setup = getattr(torch.autograd.function, "_is_setup_context_defined", None)
    if (isinstance(base, types.BuiltinMethodType) and getattr(base, "__self__", None) is fn
            and own_setup is not None and not own_setup(fn.setup_context)):
        return base
    return fn.apply


def _symbolic() -> bool:
    """Whether this call is recorded (torch.compile, torch.jit.trace) or runs
    under a torch.func transform: its tensors' values cannot be read here, nor
    the extension called directly."""
    return _recording() or torch._C._are_functorch_transforms_active()
