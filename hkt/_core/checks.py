"""The argument rules of an attention call that only Python can check, each in
one place: sequences and tensor types, layouts, devices, bfloat16 mixes (the
extension sees bfloat16 upcast), the scalars' types, a mask's broadcast as the
caller passed it, the windows.  Every path runs them before any kernel call;
the rest (shapes, dtypes, strides, sizes, the scalars' ranges) is the
extension's, whose messages name the argument: the kernels' path meets them in
the call, and the calls that never reach the kernels (meta tensors, the "sdpa"
backend, windows) ask for them through check_call
(hkt._core.kernels.check_forward, the extension's checks without a kernel run).
Also the mask as the kernels take it (_kernel_mask).
"""
import numbers
from typing import Optional

import torch
from torch import Tensor

from .kernels import check_forward
from .maths import compute_dtype, float_mask_in


class ShapeError(ValueError, AssertionError):
    """A malformed shape, rank or size, named in the message.  A ValueError, as
    hkt's other argument errors are, and an AssertionError, which
    nn.MultiheadAttention raises for the same mistakes (its asserts): code
    written against either catches it.  Raised explicitly, so ``python -O``
    keeps the check."""


# the largest window the kernels take: a level's radius W_l / 2^l is an int64
# there, and a block's first key (t >> l) - radius + 1 is scaled back by 2^l
# without overflow up to this (any longer sequence is far beyond memory)
_MAX_WINDOW = 1 << 62


def _type_name(x) -> str:
    """x's type for a message, with its module unless built in (NumPy's bool is
    called 'bool' too)."""
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _real(x) -> bool:
    """A real number other than a bool: int, float, or a NumPy (or other
    numbers.Real) scalar, as SDPA takes for dropout_p and scale."""
    if isinstance(x, (int, float)):  # the common case first: an ABC's isinstance is slower
        return not isinstance(x, bool)
    return isinstance(x, numbers.Real)


_STRIDED, _BF16 = torch.strided, torch.bfloat16


def _check_tensor(x, name: str, level: Optional[int], dtype, device) -> bool:
    """What the extension cannot see: that x is a dense torch.Tensor on q[0]'s
    device (only those go through DLPack: a sparse tensor, or one on another
    device than q[0], would fail there without its name) and, where bfloat16 is
    on either side (the extension sees bfloat16 upcast to float32), that its
    dtype is q[0]'s (dtype None: any).  Returns x.requires_grad.  The
    argument's name is name[level] (name alone when level is None), built only
    for a message."""
    if isinstance(x, Tensor) and x.layout == torch.strided and not x.is_nested and x.device == device and (
            x.dtype == dtype or dtype is None or (dtype != torch.bfloat16 and x.dtype != torch.bfloat16)):
        return x.requires_grad
    if level is not None:
        name = f"{name}[{level}]"
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name}: only dense (strided) tensors are supported, got layout {x.layout}")
    if x.is_nested:  # strided layout, but no sizes or strides of its own
        raise TypeError(f"{name}: nested tensors are not supported; pad them (with a mask) or pack them "
                        "(hkt.hkt_attention_varlen)")
    if x.device != device:
        raise ValueError(f"{name}: is on {x.device} but q[0] is on {device}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name}: dtype {x.dtype} does not match q[0]'s {dtype}")
    return x.requires_grad


def _check_inputs(q, k, v, w, is_causal=False, dropout_p=0.0, scale=None, want_grad=True):
    """One pass over the inputs and the scalars (shapes, strides, devices and
    float32/float64 dtypes, the scalars' ranges, are the extension's to
    check, with messages that name the argument).  Returns (whether any
    input requires grad, dropout_p, scale), the scalars as _check_scalars
    returns them.  want_grad=False (grad mode off): requires_grad is not read
    and False returned."""
    if not (isinstance(q, (list, tuple)) and isinstance(k, (list, tuple)) and q and k):
        check_levels("q", q)
        check_levels("k", k)
    q0 = q[0]
    if not isinstance(q0, Tensor):
        raise TypeError(f"q[0]: expected a torch.Tensor, got {type(q0).__name__}")
    dtype = q0.dtype
    if dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise TypeError(f"q[0]: dtype must be float32, float64 or bfloat16, got {dtype}")
    # the common case first, inline (a call per tensor is a fair part of a
    # small call's time); where a tensor fails it, each one checked and named
    cpu, bf16 = q0.is_cpu, dtype is _BF16
    device = None if cpu else q0.device
    # True from the start when nobody asks: `grad or x.requires_grad` then never reads it
    grad = not want_grad
    for x in (*q, *k, v, w):
        if (isinstance(x, Tensor) and x.layout is _STRIDED and not x.is_nested
                and (x.is_cpu if cpu else x.device == device)
                and (x.dtype is dtype or not (bf16 or x.dtype is _BF16))):
            grad = grad or x.requires_grad
        else:
            grad = _check_each(q, k, v, w, dtype, q0.device)
            break
    grad = grad and want_grad
    # the scalars' rules are _check_scalars'; the common types, as they are, skip the call
    if is_causal.__class__ is not bool or dropout_p.__class__ is not float or not (
            scale is None or scale.__class__ is float):
        dropout_p, scale = _check_scalars(is_causal, dropout_p, scale)
    return grad, dropout_p, scale


def check_levels(name: str, xs) -> None:
    """xs is a list or tuple of at least one level (the extension names a
    wrong sequence in its own words; these are the ones the docs give)."""
    if isinstance(xs, Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of L tensors (one per level), got {type(xs).__name__}")
    if len(xs) == 0:
        raise ValueError(f"{name}: expected at least one level, got an empty sequence")


def _check_each(q, k, v, w, dtype, device) -> bool:
    """_check_inputs' rules, one tensor at a time, naming the first that fails
    them; whether any requires grad."""
    grad = False
    for l, x in enumerate(q):
        grad |= _check_tensor(x, "q", l, dtype, device)
    for l, x in enumerate(k):
        grad |= _check_tensor(x, "k", l, dtype, device)
    grad |= _check_tensor(v, "v", None, dtype, device)
    grad |= _check_tensor(w, "w", None, dtype, device)
    return grad


def _check_mask(attn_mask, device):
    if attn_mask is None:
        return
    _check_tensor(attn_mask, "attn_mask", None, None, device)
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask: dtype must be bool or floating point, got {attn_mask.dtype}")


def _check_scalars(is_causal, dropout_p, scale):
    """Types of the scalar arguments (their ranges are the extension's, or
    hkt.ops.sdpa's, to check).  Returns (dropout_p, scale) as the extension takes
    them: dropout_p a float, scale None, an int or a float (a NumPy scalar as
    a float)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {_type_name(is_causal)}")
    if dropout_p.__class__ is not float:  # the common case, a float, without a call
        if not _real(dropout_p):
            raise TypeError(f"dropout_p: expected a float, got {_type_name(dropout_p)}")
        try:
            dropout_p = float(dropout_p)
        except OverflowError:  # an int beyond the float range
            raise ValueError("dropout_p: must be in [0, 1], got an int beyond the float range") from None
    if scale is not None:
        if not _real(scale):
            raise TypeError(f"scale: expected a float or None, got {_type_name(scale)}")
        if not isinstance(scale, (int, float)):
            scale = float(scale)
    return dropout_p, scale


def _as_4d(attn_mask: Tensor, q0: Tensor, k0: Tensor) -> Tensor:
    """The mask kept at its own size, as a view with leading 1s (never expanded):
    the kernels broadcast it, and a float mask's gradient comes back in its
    shape.  A mask of at most 4 dimensions must broadcast to (B, H, T, S) as
    the caller passed it (the extension sees the 4-D view, and would name its
    shape)."""
    shape = attn_mask.shape
    if len(shape) <= 4 and q0.dim() == 4 and k0.dim() == 4:
        full = (q0.shape[0], q0.shape[1], q0.shape[2], k0.shape[2])
        if any(m != 1 and m != n for m, n in zip(reversed(shape), reversed(full))):
            raise ValueError(f"attn_mask: shape {tuple(shape)} does not broadcast to (B, H, T, S) = {full}")
    if len(shape) < 4:
        attn_mask = attn_mask.reshape((1,) * (4 - len(shape)) + tuple(shape))
    return attn_mask


def check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale, *, dropout_allowed: bool, softcap=None,
               sliding_window=None):
    """Every argument of an hkt_attention call checked before any kernel runs,
    for the callers that never reach the extension or reach it late (meta
    tensors, backend="sdpa", windows): torch's rules here, then the
    extension's own (hkt._core.kernels.check_forward); dropout_allowed: False for
    the "sdpa" backend, which has none.  Returns (attn_mask,
    dropout_p, scale): the mask 4-D (a view), the scalars as _check_scalars
    returns them."""
    _, dropout_p, scale = _check_inputs(q, k, v, w, is_causal, dropout_p, scale)
    _check_mask(attn_mask, q[0].device)
    if attn_mask is not None:
        attn_mask = _as_4d(attn_mask, q[0], k[0])
    # the rest is the extension's to check: asked without running the kernels
    check_forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale, softcap, sliding_window)
    if dropout_p > 0 and not dropout_allowed:
        raise ValueError("dropout_p: the 'sdpa' backend has no dropout (SDPA's own dropout pattern is not the "
                         "kernels' one); use backend='kernels' (backend=None picks them when dropout_p > 0)")
    return attn_mask, dropout_p, scale


def check_windows(windows, L: int, *, growing: bool = False):
    """``windows`` checked (docs/contract.md section 1.11): None, or a list or
    tuple of L entries, each None (the level sees every key) or W_l, a positive
    multiple of 2^l (an int, not a bool) of at most 2^62 tokens.  Returns None
    when no level has a window, else a tuple of L entries, W_l or None.
    ``growing``: also require what the kernels' block sharing needs: each
    window larger than the one below it, and no window above a level without
    one."""
    if windows is None:
        return None
    if not isinstance(windows, (list, tuple)):
        raise TypeError(f"windows: expected None or a list of {L} entries (None or an int, one per level), "
                        f"got {type(windows).__name__}")
    if len(windows) != L:
        raise ValueError(f"windows: expected one entry per level, {L}, got {len(windows)}")
    out = []
    for l, W in enumerate(windows):
        if W is None:
            out.append(None)
            continue
        ok = isinstance(W, int) and not isinstance(W, bool)
        if not ok and hasattr(W, "__index__") and not isinstance(W, (bool, float)):
            try:
                W, ok = int(W.__index__()), True
            except TypeError:
                ok = False
        if not ok or W <= 0 or W % (1 << l):
            raise ValueError(f"windows[{l}]: expected None or a positive multiple of {1 << l} (2^{l}) tokens, "
                             f"got {W!r}")
        if W > _MAX_WINDOW:
            raise ValueError(f"windows[{l}]: at most 2^62 tokens, got {W!r}; None is a level that sees every key")
        out.append(W)
    if growing:
        for l in range(1, L):
            if out[l] is not None and out[l - 1] is None:
                raise ValueError(f"windows[{l}]: the kernels need no window above a level without one "
                                 f"(windows[{l - 1}] is None); got {out[l]}")
            if out[l] is not None and out[l] <= out[l - 1]:
                raise ValueError(f"windows[{l}]: the kernels need each window larger than the one below it, "
                                 f"windows[{l - 1}] = {out[l - 1]}; got {out[l]}")
    return None if all(W is None for W in out) else tuple(out)


def _kernel_mask(attn_mask: Tensor, q0: Tensor, k0: Tensor) -> Tensor:
    """The mask checked (a tensor on q[0]'s device, bool or floating,
    broadcasting to (B, H, T, S)) and made as the kernels take it: a float
    mask in the compute dtype, 4-D."""
    _check_mask(attn_mask, q0.device)
    return _as_4d(kernel_mask_dtype(attn_mask, q0), q0, k0)


def kernel_mask_dtype(attn_mask: Tensor, q0: Tensor) -> Tensor:
    """A mask already checked in the dtype the kernels take: a float mask in
    the compute dtype, a bool one as it is."""
    if attn_mask.is_floating_point():
        attn_mask = float_mask_in(attn_mask, compute_dtype(q0.dtype))
    return attn_mask
