"""The public functional API: hkt.hkt_attention."""
import math
import numbers
import types
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _kernels, _sdpa, ops
from .reference import float_mask_in

__all__ = ["hkt_attention"]

_SEED_HIGH = 2**62

# backend=None / "auto" on CUDA tensors: the "sdpa" backend until hkt's CUDA
# kernels have beaten it on a real GPU in benchmarks/gpu_check.sh (today's
# kernels are written to be plainly right, not fast, and have not run on one).
# Set to True once they have; dropout (which "sdpa" refuses) always takes the
# kernels.
_CUDA_KERNELS_PREFERRED = False
_BACKENDS = (None, "auto", "kernels", "sdpa")


# dynamo before torch 2.11 (2.4.1 checked) cannot trace the torch.func check
# (fullgraph compiles fail on it): under torch.compile there it is skipped
_FUNCTORCH_CHECK_TRACES = torch.torch_version.TorchVersion(torch.__version__) >= (2, 11)


def _functorch_active() -> bool:
    if not _FUNCTORCH_CHECK_TRACES and torch.compiler.is_compiling():
        return False
    return torch._C._are_functorch_transforms_active()


def _pick_backend(backend, q, dropout_p) -> str:
    """"kernels" or "sdpa" for this call (backend already validated).  Under
    torch.func transforms (vmap, grad, jacrev, ...) the kernels, which take
    plain arrays, cannot run: "sdpa", plain differentiable torch ops, does the
    same maths there."""
    if _functorch_active():
        if backend == "kernels":
            raise NotImplementedError(
                "backend: hkt's kernels do not run under torch.func transforms (vmap, grad, jacrev, ...); "
                "backend=None or 'sdpa' computes the same attention with differentiable torch ops there")
        if _real(dropout_p) and dropout_p > 0:
            raise NotImplementedError(
                "dropout_p: dropout runs only in hkt's kernels, which do not run under torch.func transforms "
                "(vmap, grad, jacrev, ...); use dropout_p=0 there (for example the module in eval mode)")
        return "sdpa"
    if backend == "kernels" or backend == "sdpa":
        return backend
    q0 = q[0] if isinstance(q, (list, tuple)) and len(q) else None
    if isinstance(q0, Tensor) and q0.is_cuda and not _CUDA_KERNELS_PREFERRED and _real(dropout_p) and dropout_p == 0:
        return "sdpa"
    return "kernels"


class ShapeError(ValueError, AssertionError):
    """A malformed shape, rank or size, named in the message.  A ValueError, as
    hkt's other argument errors are, and an AssertionError, which
    nn.MultiheadAttention raises for the same mistakes (its asserts): code
    written against either catches it.  Raised explicitly, so ``python -O``
    keeps the check."""


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


def _recording() -> bool:
    """Whether torch.compile or torch.jit.trace is recording this call: they
    record registered ops, never the extension's direct calls, so the custom op
    must run (a trace of a direct call would replay whatever memory the output
    had: no op, no error)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _c_apply(fn):
    """fn.apply as the C function torch.autograd.Function.apply calls last,
    without the Python layer before it, about 3.5 us of a small forward's ~30
    (torch 2.13, Xeon model 167): binding default arguments (only when the
    Function defines setup_context; hkt's do not) and unwrapping dead
    torch.func wrappers, a generator over every argument.  hkt's Functions run
    only with no torch.func transform active (_pick_backend); a dead wrapper
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


def hkt_attention(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    w: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> Tensor:
    r"""Hierarchical Kernel Transformer attention.

    For L levels::

        score[i, j] = scale * sum_l w[l] * <q[l][i >> l], k[l][j >> l]>   (+ float attn_mask)
        out[i]      = sum_j softmax_j(score[i, j] over visible j) * v[j]

    Args:
        q: L tensors, ``q[l]`` of shape (B, H, ceil(T / 2^l), D).
        k: L tensors, ``k[l]`` of shape (B, H_kv, ceil(S / 2^l), D).  H_kv
            may be smaller than H if it divides it (grouped-query attention,
            H_kv = 1 multi-query): query head h reads kv head h // (H // H_kv),
            without copies; the gradient of a kv head is summed over its query
            heads in a fixed order (bitwise the same for any thread count).
        v: (B, H_kv, S, Dv) values at full resolution.
        w: level weights, (L,) or (H, L); used as given (not normalised).
        attn_mask: as in ``scaled_dot_product_attention``: bool (True = may
            attend) or float (added to the score), broadcastable to (B, H, T, S).
            May be combined with ``is_causal`` (both apply).
        is_causal: key j is visible to query i only when j <= i.
        dropout_p: dropout on the attention probabilities (apply it only in
            training); the mask is drawn from torch's default generator.
        scale: score scale, default 1 / sqrt(D).  ``scale`` and ``dropout_p``
            take any real number but a bool (NumPy scalars too, as in SDPA).
            Meta tensors give meta results of the right shapes (the custom
            op's fake kernel), after the same argument checks.  Under
            ``torch.autocast`` the inputs are cast as SDPA's are: to bfloat16,
            or to float32 where autocast asks for float16 (float64 stays).
        backend: how to compute it.  ``"kernels"``: hkt's own kernels (CPU;
            CUDA in a build made with ``HKT_CUDA=1``): O(T) memory, exact 4/3
            score cost on the CPU, bitwise deterministic, bfloat16 native
            on CPUs with AVX512_BF16 at full rate (else computed in float32).  ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``
            on the concatenated level vectors (L times one attention's score
            work, in the inputs' dtype, on whatever kernel SDPA picks; its
            determinism is SDPA's); no dropout (``ValueError``).  ``None`` or
            ``"auto"``: the kernels on the CPU, and on CUDA "sdpa" unless
            ``dropout_p > 0`` (hkt's CUDA kernels are not fast yet); under
            ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``,
            per-sample gradients, ...) "sdpa", since the kernels cannot run
            there (``"kernels"`` and ``dropout_p > 0`` raise
            ``NotImplementedError`` under them).

    Returns:
        (B, H, T, Dv), laid out in memory like ``q[0]`` when Dv = D and
        ``q[0]`` is dense with unit feature stride (the gradients of ``q``,
        ``k`` and ``v`` likewise follow their inputs), else contiguous.  A
        query row with no visible key gives zeros (and zero gradients).  Gradients flow to every ``q[l]``, ``k[l]``, ``v``, ``w``
        and a float ``attn_mask`` that requires grad (its gradient is the
        score's, summed over the dimensions it is broadcast along; computing it
        costs one more pass over the scores in the backward).

    Non-finite values: NaN (or +inf) in ``q``, ``k``, ``w`` or a float mask
    entry that a query row can see makes that row's output NaN, and the
    gradients that flow through it NaN, as in plain arithmetic.  A hidden entry
    (bool mask False, above the diagonal under ``is_causal``, or -inf in a float
    mask over a score that is not NaN) contributes nothing, even to a NaN row;
    -inf added to a NaN score is NaN, as in SDPA, so that entry is visible.  NaN in ``v`` reaches every
    row that sees that key.  A non-finite value that only hidden entries see
    may or may not show up elsewhere (0 * NaN inside a tile).  A level's factor
    ``scale * w[l]`` never rounds to 0 from two nonzero numbers (it is kept at
    the smallest subnormal of its sign), so an inf in ``q`` or ``k`` gives a
    +-inf score however small the factor.

    Raises:
        TypeError / ValueError naming the argument for wrong types, ranks,
        shapes (``q[l]`` must have ceil(T/2^l) rows), mixed dtypes or devices,
        dtypes other than float32/float64/bfloat16, a non-finite scale, a
        dropout_p outside [0, 1], an unknown backend, or dropout_p > 0 with
        backend="sdpa"; NotImplementedError for backend="kernels" or
        dropout_p > 0 under torch.func transforms.

    float32 and float64 run in their own precision.  bfloat16 on a CPU with
    AVX512_BF16 whose cores run its dot products at full rate or that has AMX
    (``hkt._C.cpu_bf16_preferred()``: AMD's, and Intel's with AMX, whose tiles
    take the products, ``hkt._C.cpu_bf16_amx()``; ``HKT_BF16=native``,
    ``avx512bf16`` (no AMX) or ``upcast`` overrides) and an even D runs natively:
    every matrix product takes bfloat16 operands and sums in float32, the
    softmax and its gradient are float32, and P and dS are rounded to bfloat16
    where they enter a product, as flash-attention kernels do (the backward
    needs an even Dv too, else it runs in float32).  bfloat16 anywhere else is
    computed in float32 (upcast on entry, results rounded back to bfloat16).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected None, 'auto', 'kernels' or 'sdpa', got {backend!r}")
    try:
        if torch._C._is_any_autocast_enabled():  # 0.2 us; the device's own check, 1 us, only then
            q, k, v, w = _autocast_inputs(q, k, v, w)
        if _pick_backend(backend, q, dropout_p) == "sdpa":
            return _sdpa_path(q, k, v, w, attn_mask, is_causal, dropout_p, scale)
        return _attention(q, k, v, w, attn_mask, is_causal, dropout_p, scale)
    except _CALL_FAILED:
        dead = _unwrap_dead(q, k, v, w, attn_mask)
        if dead is not None:  # failed in DLPack, before any kernel ran (with dropout: a new seed)
            return hkt_attention(*dead[:4], attn_mask=dead[4], is_causal=is_causal, dropout_p=dropout_p,
                                 scale=scale, backend=backend)
        _name_the_argument(q, k, v, w, attn_mask)
        raise


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


# what a call with a bad argument may raise on its way to the extension
_CALL_FAILED = (TypeError, ValueError, AttributeError, IndexError, RuntimeError, BufferError)


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
            attn_mask = float_mask_in(attn_mask, _kernels.compute_dtype(dtype))
        attn_mask = _as_4d(attn_mask)
    return attn_mask, dropout_p, scale


def _eager_seed(dropout_p: float) -> int:
    """The dropout seed of an eager call, from torch's default generator."""
    # on the CPU, whatever torch's default device is: the generator the docs name
    return int(torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device="cpu")) if dropout_p > 0 else 0


def _attention(q, k, v, w, attn_mask, is_causal, dropout_p, scale):
    """The call itself.  Shapes, strides, devices, float32/float64 dtypes, the
    scale's finiteness and dropout_p's range are the extension's to check."""
    q0 = q[0]
    if q0.dtype == torch.bfloat16:  # upcast before the extension sees it: mixed dtypes would pass unnoticed
        _check_inputs(q, k, v, w)
    attn_mask, dropout_p, scale = _kernel_args(attn_mask, is_causal, dropout_p, scale, q0.dtype)
    if _recording() or q0.is_meta:
        # torch.compile or torch.jit.trace: the registered custom op, which they
        # record; meta tensors (shapes only) take its fake kernel
        if q0.is_meta:  # no extension call checks them: the same checks, in Python
            _check_inputs(q, k, v, w)
            _check_mask(attn_mask, q0.device)
            _sdpa.check_arguments(q, k, v, w, attn_mask, dropout_p, scale, dropout_allowed=True)
        # without dropout the seed is never read: a tensor on q's device keeps the
        # traced graph free of CPU work (CUDA graph partitions)
        seed = torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device="cpu") if dropout_p > 0 else torch.zeros(
            (), dtype=torch.int64, device=q0.device)
        out, _ = ops.attention_forward(list(q), list(k), v, w, attn_mask, is_causal, dropout_p,
                                       _scale_value(scale, q0), seed)
        return out
    # eager: straight to the kernels, no dispatcher (same kernels, same arguments as the op)
    seed = _eager_seed(dropout_p)
    if torch.is_grad_enabled() and (any(x.requires_grad for x in q) or any(x.requires_grad for x in k) or
                                    v.requires_grad or w.requires_grad or
                                    (attn_mask is not None and attn_mask.requires_grad)):
        return _ATTENTION_APPLY(len(q), len(k), is_causal, dropout_p, scale, seed, attn_mask, *q, *k, v, w)
    return _kernels._forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed, like_inputs=True,
                             want_lse=False)[0]


def check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale, *, dropout_allowed: bool):
    """Every argument of an hkt_attention call checked in Python, as the
    extension checks them for the kernels, with the same messages: for the
    callers that never reach it (backend="sdpa", and hkt.reference, which
    takes the same arguments).  Returns (attn_mask, dropout_p, scale): the mask
    4-D (a view), the scalars as _check_scalars returns them."""
    _check_inputs(q, k, v, w)
    _check_mask(attn_mask, q[0].device)
    dropout_p, scale = _check_scalars(is_causal, dropout_p, scale)
    if attn_mask is not None:
        attn_mask = _as_4d(attn_mask)
    _sdpa.check_arguments(q, k, v, w, attn_mask, dropout_p, scale, dropout_allowed=dropout_allowed)
    return attn_mask, dropout_p, scale


def _sdpa_path(q, k, v, w, attn_mask, is_causal, dropout_p, scale):
    """backend="sdpa" (hkt._sdpa): every argument checked in Python first, as
    the extension would for the kernels, then plain differentiable torch ops."""
    attn_mask, dropout_p, scale = check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale,
                                             dropout_allowed=False)
    return _sdpa.sdpa_attention(q, k, v, w, attn_mask, is_causal, scale)


def _heads(x: Tensor, H: int, hd: int) -> Tensor:
    """(B, n, H * hd) -> (B, H, n, hd): projected features split into heads, the
    layout hkt_attention takes (MultiheadHKT and its decoding share it)."""
    return x.reshape(x.shape[0], x.shape[1], H, hd).transpose(1, 2)


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


def _scale_value(scale, q0: Tensor) -> float:
    """The score scale as a float (the custom ops' schema wants one): 1/sqrt(D) by
    default, as the extension computes it when handed None."""
    if scale is None:
        D = q0.shape[-1] if q0.dim() else 0
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    try:
        return float(scale)
    except OverflowError:  # an int beyond the float range; the extension says so
        return math.inf


def _check_mask(attn_mask, device):
    if attn_mask is None:
        return
    _check_tensor(attn_mask, "attn_mask", None, None, device)
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask: dtype must be bool or floating point, got {attn_mask.dtype}")


class _Attention(torch.autograd.Function):
    """Autograd for eager calls: the kernels directly, without the custom op's
    dispatch (the op, ``hkt::attention_forward``, is what ``torch.compile``
    traces; both run the same kernels on the same arguments).  A backward run
    with ``create_graph=True`` goes through the ``hkt::attention_backward`` op,
    whose own derivative is registered, so double backward works too."""

    @staticmethod
    def forward(ctx, L, Lk, is_causal, dropout_p, scale, seed, attn_mask, *qkvw):
        # Lk: k's own count, which the extension checks against q's and names
        q, k, v, w = list(qkvw[:L]), list(qkvw[L:L + Lk]), qkvw[L + Lk], qkvw[L + Lk + 1]
        out, results = _save_forward(ctx, q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed)
        ctx.save_for_backward(*qkvw, *results)
        return out

    @staticmethod
    def backward(ctx, dout):
        L, saved = ctx.L, ctx.saved_tensors
        q, k = list(saved[:L]), list(saved[L:2 * L])
        v, w = saved[2 * L:2 * L + 2]
        dq, dk, dv, dw, dmask = _run_backward(ctx, dout, q, k, v, w, saved[2 * L + 2:], ctx.needs_input_grad[6])
        return (None, None, None, None, None, None, dmask, *dq, *dk, dv, dw)


_ATTENTION_APPLY = _c_apply(_Attention)


def _save_forward(ctx, q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed):
    """The eager forward's kernels: (out, results), results what its backward
    needs (out, lse and the mask) for save_for_backward after the inputs.  Never
    kept on ctx itself: out's grad_fn is ctx, so ctx -> out -> ctx would be a
    cycle, and each call's graph (with everything upstream that it saved) would
    wait for Python's cycle collector, or, with gc off, never be freed."""
    out, lse = _kernels._forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed, like_inputs=True)
    ctx.L, ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.seed = len(q), is_causal, dropout_p, scale, seed
    return out, (out, lse, attn_mask)


def _run_backward(ctx, dout, q, k, v, w, results, mask_needs_grad, into=None):
    """(dq, dk, dv, dw, dmask) of the eager autograd Functions: the kernels, or,
    under create_graph, the differentiable hkt::attention_backward op.  into:
    (dq[0], dk[0], dv) arrays for the kernels to write those gradients in."""
    out, lse, attn_mask = results
    L = len(q)
    # a float mask that requires grad gets one; a bool mask never needs one
    mask_grad = bool(mask_needs_grad) and attn_mask is not None and attn_mask.is_floating_point()
    if torch.is_grad_enabled():  # create_graph: a backward that is itself differentiable
        args = (ctx.is_causal, ctx.dropout_p, _scale_value(ctx.scale, q[0]))
        grads = ops.attention_backward(dout, q, k, v, w, out, lse, attn_mask, *args,
                                       torch.tensor(ctx.seed, dtype=torch.int64, device="cpu"), mask_grad)
        return grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1], (grads[2 * L + 2] if mask_grad else None)
    return _kernels._backward(dout, q, k, v, w, out, lse, attn_mask, ctx.is_causal, ctx.dropout_p, ctx.scale,
                              ctx.seed, mask_grad, like_inputs=True, into=into)


def _qkv_heads(qkv: Tensor, H: int, H_kv: int, hd: int):
    """A packed projection's output (B, T, (H + 2 H_kv) hd) as level 0's q, k and v heads (views)."""
    q, k, v = qkv.split([H * hd, H_kv * hd, H_kv * hd], dim=-1)
    return _heads(q, H, hd), _heads(k, H_kv, hd), _heads(v, H_kv, hd)


class _QKVAttention(torch.autograd.Function):
    """_Attention for a module's packed self-attention projection: level 0's
    q, k and v are heads of one (B, T, (H + 2 H_kv) hd) tensor, whose gradient
    the kernels write as one such tensor.  Through split, autograd would
    concatenate the three gradients instead: a copy of the projection's whole
    output into fresh memory, 2% of a T=1024 training step."""

    @staticmethod
    def forward(ctx, H, H_kv, is_causal, dropout_p, scale, seed, attn_mask, qkv, w, *coarse):
        hd = qkv.shape[-1] // (H + 2 * H_kv)
        q0, k0, v = _qkv_heads(qkv, H, H_kv, hd)
        n = len(coarse) // 2
        out, results = _save_forward(ctx, [q0, *coarse[:n]], [k0, *coarse[n:]], v, w, attn_mask, is_causal,
                                     dropout_p, scale, seed)
        ctx.heads = (H, H_kv, hd)
        ctx.save_for_backward(qkv, w, *coarse, *results)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        qkv, w = saved[0], saved[1]
        coarse, results = saved[2:-3], saved[-3:]
        n = len(coarse) // 2
        q0, k0, v = _qkv_heads(qkv, *ctx.heads)
        q, k = [q0, *coarse[:n]], [k0, *coarse[n:]]
        # whole only where the kernels write qkv's dtype now (bfloat16 natively: the
        # choice is the backward's own, hkt._kernels.native_bf16 read again)
        if torch.is_grad_enabled() or (qkv.dtype == torch.bfloat16 and not _kernels._native_bf16(q0, v.shape[-1])):
            dq, dk, dv, dw, dmask = _run_backward(ctx, dout, q, k, v, w, results, ctx.needs_input_grad[6])
            B, T = qkv.shape[0], qkv.shape[1]
            dqkv = torch.cat([x.transpose(1, 2).reshape(B, T, -1) for x in (dq[0], dk[0], dv)], dim=-1)
        else:
            # contiguous, whatever layout a saved-tensors hook handed qkv back in: the
            # kernels write the heads of dq, dk, dv with unit feature stride
            dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
            dq, dk, dv, dw, dmask = _run_backward(ctx, dout, q, k, v, w, results, ctx.needs_input_grad[6],
                                                  into=_qkv_heads(dqkv, *ctx.heads))
        return (None, None, None, None, None, None, dmask, dqkv, dw, *dq[1:], *dk[1:])


_QKV_APPLY = _c_apply(_QKVAttention)


def qkv_attention(qkv: Tensor, q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor,
                  attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float) -> Tensor:
    """hkt_attention(q, k, v, w, ...) for a module's packed self-attention
    projection ``qkv`` (B, T, (H + 2 H_kv) hd), whose heads are q[0], k[0] and v.
    In eager calls on the kernels that need gradients, whose kernels write the
    gradients in qkv's dtype (float32, float64, native bfloat16), their
    gradient is written as one tensor, qkv's (_QKVAttention); anywhere else
    hkt_attention itself, the same values."""
    if torch._C._is_any_autocast_enabled():
        # the inputs hkt_attention would compute with (w cast too); q[0], k[0] and v
        # stay qkv's heads where they already are in autocast's dtype
        q, k, v, w = _autocast_inputs(q, k, v, w)
    own_dtype = qkv.dtype in (torch.float32, torch.float64) or _kernels._native_bf16(q[0], v.shape[-1])
    own_dtype = own_dtype and q[0].dtype == k[0].dtype == v.dtype == qkv.dtype
    if (own_dtype and torch.is_grad_enabled() and qkv.requires_grad
            and not qkv.is_meta and not _recording() and _pick_backend(None, q, dropout_p) == "kernels"):
        try:
            mask, dropout_p, _ = _kernel_args(attn_mask, is_causal, dropout_p, None, qkv.dtype)
            return _QKV_APPLY(q[0].shape[1], k[0].shape[1], is_causal, dropout_p, None,
                                       _eager_seed(dropout_p), mask, qkv, w, *q[1:], *k[1:])
        except _CALL_FAILED:
            _name_the_argument(q, k, v, w, attn_mask)
            raise
    return hkt_attention(q, k, v, w, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)
