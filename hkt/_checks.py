"""Every argument rule of an attention call in one place: the checks (with the
extension's messages, for the callers that never reach it: backend="sdpa",
meta tensors, and the names behind a call that failed on its way there), the
conversion of a float mask to the compute dtype, and the compute dtype itself.
The kernels' path (_kernels), the "sdpa" backend (_sdpa), the public calls
(functional, kvcache, varlen) and the module (modules) all take them from here,
so no two of them can disagree.

Of hkt it imports only hkt._maths, for the conversion of a float mask (the
library's maths; hkt.reference keeps its own copy of it and of these rules).
"""
import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from ._maths import float_mask_in


class ShapeError(ValueError, AssertionError):
    """A malformed shape, rank or size, named in the message.  A ValueError, as
    hkt's other argument errors are, and an AssertionError, which
    nn.MultiheadAttention raises for the same mistakes (its asserts): code
    written against either catches it.  Raised explicitly, so ``python -O``
    keeps the check."""


# the most levels a call may have (docs/contract.md section 1; the kernels'
# per-level arrays are sized for it)
_MAX_LEVELS = 24

# the largest window the kernels take: a level's radius W_l / 2^l is an int64
# there, and a block's first key (t >> l) - radius + 1 is scaled back by 2^l
# without overflow up to this (any longer sequence is far beyond memory)
_MAX_WINDOW = 1 << 62


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the kernels' outputs and sums: float32 or float64 (float32 for bfloat16 inputs)."""
    return torch.float32 if dtype == torch.bfloat16 else dtype



def _level_len(n: int, l: int) -> int:
    return ((n - 1) >> l) + 1 if n > 0 else 0


def _shape_error(name: str, want, meaning: str, got) -> ValueError:
    return ValueError(f"{name}: expected shape {tuple(want)} {meaning}, got {tuple(got)}")


def check_arguments(q, k, v, w, attn_mask, dropout_p, scale, dropout_allowed=False) -> None:
    """What the extension checks for the kernels, for the inputs SDPA would
    otherwise take silently (a level one row too long is sliced away by the
    concatenation, for example), and for meta tensors, which never reach the
    extension (dropout_allowed: the kernels' fake kernel takes dropout).  Types,
    devices and dtypes are checked by the caller (_check_inputs)."""
    L = len(q)
    dtype = q[0].dtype
    named = [(f"q[{l}]", x) for l, x in enumerate(q)] + [(f"k[{l}]", x) for l, x in enumerate(k)]
    for name, x in named + [("v", v), ("w", w)]:
        if x.dtype != dtype:
            raise TypeError(f"{name}: dtype {str(x.dtype)[6:]} does not match q[0]'s {str(dtype)[6:]}")
    if L > _MAX_LEVELS:
        raise ValueError(f"q: expected 1 to {_MAX_LEVELS} levels, got {L}")
    if len(k) != L:
        raise ValueError(f"k: expected {L} levels like q, got {len(k)}")
    if q[0].dim() != 4:
        raise ValueError(f"q[0]: expected 4 dimensions (B, H, T, D), got {q[0].dim()}")
    B, H, T, D = q[0].shape
    if D < 1:
        raise ValueError("q[0]: head dimension D must be at least 1")
    if k[0].dim() != 4:
        raise ValueError(f"k[0]: expected 4 dimensions (B, H_kv, S, D), got {k[0].dim()}")
    Hk, S = k[0].shape[1], k[0].shape[2]
    if (Hk < 1 and (H != 0 or Hk != 0)) or (Hk >= 1 and H % Hk != 0):
        raise ValueError(f"k[0]: its {Hk} heads (H_kv) must divide q[0]'s {H} heads (H)")
    for l in range(L):
        f = 1 << l
        if q[l].shape != (B, H, _level_len(T, l), D):
            raise _shape_error(f"q[{l}]", (B, H, _level_len(T, l), D), f"= (B, H, ceil(T/{f}), D)", q[l].shape)
        if k[l].shape != (B, Hk, _level_len(S, l), D):
            raise _shape_error(f"k[{l}]", (B, Hk, _level_len(S, l), D), f"= (B, H_kv, ceil(S/{f}), D)",
                               k[l].shape)
    if v.dim() != 4:
        raise ValueError(f"v: expected 4 dimensions (B, H_kv, S, Dv), got {v.dim()}")
    if v.shape[:3] != (B, Hk, S):
        raise _shape_error("v", (B, Hk, S, v.shape[3]), "= (B, H_kv, S, Dv)", v.shape)
    if w.dim() == 1:
        if w.shape != (L,):
            raise _shape_error("w", (L,), "= (L,)", w.shape)
    elif w.shape != (H, L):
        raise _shape_error("w", (H, L), "= (H, L) or (L,)", w.shape)
    if attn_mask is not None:
        full = (B, H, T, S)
        if attn_mask.dim() != 4 or any(m != 1 and m != n for m, n in zip(attn_mask.shape, full)):
            raise ValueError(f"attn_mask: expected 4 dimensions, each 1 or that of (B, H, T, S) = {full}, "
                             f"got {tuple(attn_mask.shape)}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1], got {dropout_p!r}")
    if dropout_p > 0 and not dropout_allowed:
        raise ValueError("dropout_p: the 'sdpa' backend has no dropout (SDPA's own dropout pattern is not the "
                         "kernels' one); use backend='kernels' (backend=None picks them when dropout_p > 0)")
    if scale is not None:
        try:
            finite = math.isfinite(float(scale))
        except OverflowError:  # an int beyond the float range
            finite = False
        if not finite:
            raise ValueError(f"scale: must be a finite number, got {scale!r}")


# what a call with a bad argument may raise on its way to the extension
_CALL_FAILED = (TypeError, ValueError, AttributeError, IndexError, RuntimeError, BufferError)


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


def _check_inputs(q, k, v, w):
    """One pass over the inputs (shapes, strides, devices and float32/float64
    dtypes are the extension's to check, with messages that name the argument).
    Returns (q[0]'s dtype, whether any input requires grad)."""
    for name, xs in (("q", q), ("k", k)):
        if isinstance(xs, Tensor) or not isinstance(xs, (list, tuple)):
            raise TypeError(f"{name}: expected a list or tuple of L tensors (one per level), got "
                            f"{type(xs).__name__}")
        if len(xs) == 0:
            raise ValueError(f"{name}: expected at least one level, got an empty sequence")
    if not isinstance(q[0], Tensor):
        raise TypeError(f"q[0]: expected a torch.Tensor, got {type(q[0]).__name__}")
    dtype, device = q[0].dtype, q[0].device
    if dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise TypeError(f"q[0]: dtype must be float32, float64 or bfloat16, got {dtype}")
    grad = False
    for l, x in enumerate(q):
        grad |= _check_tensor(x, "q", l, dtype, device)
    for l, x in enumerate(k):
        grad |= _check_tensor(x, "k", l, dtype, device)
    grad |= _check_tensor(v, "v", None, dtype, device)
    grad |= _check_tensor(w, "w", None, dtype, device)
    return dtype, grad


def _check_mask(attn_mask, device):
    if attn_mask is None:
        return
    _check_tensor(attn_mask, "attn_mask", None, None, device)
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask: dtype must be bool or floating point, got {attn_mask.dtype}")


def _check_scalars(is_causal, dropout_p, scale):
    """Types of the scalar arguments (their ranges are the extension's, or
    hkt._sdpa's, to check).  Returns (dropout_p, scale) as the extension takes
    them: dropout_p a float, scale None, an int or a float (a NumPy scalar as
    a float)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {_type_name(is_causal)}")
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


def _as_4d(attn_mask: Tensor) -> Tensor:
    """The mask kept at its own size, as a view with leading 1s (never expanded):
    the kernels broadcast it, and a float mask's gradient comes back in its shape."""
    if attn_mask.dim() < 4:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    return attn_mask


def check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale, *, dropout_allowed: bool):
    """Every argument of an hkt_attention call checked in Python, as the
    extension checks them for the kernels, with the same messages: for the
    callers that never reach it (backend="sdpa").  Returns (attn_mask,
    dropout_p, scale): the mask 4-D (a view), the scalars as _check_scalars
    returns them."""
    _check_inputs(q, k, v, w)
    _check_mask(attn_mask, q[0].device)
    dropout_p, scale = _check_scalars(is_causal, dropout_p, scale)
    if attn_mask is not None:
        attn_mask = _as_4d(attn_mask)
    check_arguments(q, k, v, w, attn_mask, dropout_p, scale, dropout_allowed=dropout_allowed)
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


def _name_the_argument(q, k, v, w, attn_mask):
    """The fast path checks nothing the extension checks; when something failed
    on the way there, raise the error that says which argument was wrong, if one
    was (else return, and the caller re-raises the original)."""
    _check_inputs(q, k, v, w)
    if q[0].dim() != 4:  # its sizes are read before the extension sees it (a 0-d one: IndexError)
        raise ShapeError(f"q[0]: expected 4 dimensions (B, H, T, D), got {q[0].dim()}")
    _check_mask(attn_mask, q[0].device)
    if attn_mask is not None and attn_mask.dim() <= 4 and q[0].dim() == 4 and k[0].dim() == 4:
        # the extension sees the mask made 4-D: name the shape the caller passed
        full = (q[0].shape[0], q[0].shape[1], q[0].shape[2], k[0].shape[2])
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, full) == full
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} does not broadcast to (B, H, T, S) = "
                             f"{full}")


def _kernel_args(attn_mask, is_causal, dropout_p, scale, dtype):
    """The scalar checks and the mask as the kernels take it (a float mask in
    the compute dtype, 4-D); returns (attn_mask, dropout_p, scale) as
    _check_scalars returns them."""
    dropout_p, scale = _check_scalars(is_causal, dropout_p, scale)
    if attn_mask is not None:
        if attn_mask.is_floating_point():
            attn_mask = float_mask_in(attn_mask, compute_dtype(dtype))
        attn_mask = _as_4d(attn_mask)
    return attn_mask, dropout_p, scale
