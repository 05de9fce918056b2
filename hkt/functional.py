"""The public functional API: hkt.hkt_attention."""
import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import ops

__all__ = ["hkt_attention"]

_SEED_HIGH = 2**62


def _check_levels(xs, name: str):
    if isinstance(xs, Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name}: expected a list or tuple of L tensors (one per level), got {type(xs).__name__}")
    if len(xs) == 0:
        raise ValueError(f"{name}: expected at least one level, got an empty sequence")
    for l, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}[{l}]: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}[{l}]: expected 4 dimensions (B, H, n, D), got shape {tuple(x.shape)}")


def _check_tensor(x, name: str, ndims):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ndims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))} dimensions, got shape {tuple(x.shape)}")


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
) -> Tensor:
    r"""Hierarchical Kernel Transformer attention.

    For L levels::

        score[i, j] = scale * sum_l w[l] * <q[l][i >> l], k[l][j >> l]>   (+ float attn_mask)
        out[i]      = sum_j softmax_j(score[i, j] over visible j) * v[j]

    Args:
        q: L tensors, ``q[l]`` of shape (B, H, ceil(T / 2^l), D).
        k: L tensors, ``k[l]`` of shape (B, H, ceil(S / 2^l), D).
        v: (B, H, S, Dv) values at full resolution.
        w: level weights, (L,) or (H, L); used as given (not normalised).
        attn_mask: as in ``scaled_dot_product_attention``: bool (True = may
            attend) or float (added to the score), broadcastable to (B, H, T, S).
            May be combined with ``is_causal`` (both apply).
        is_causal: key j is visible to query i only when j <= i.
        dropout_p: dropout on the attention probabilities (apply it only in
            training); the mask is drawn from torch's default generator.
        scale: score scale, default 1 / sqrt(D).

    Returns:
        (B, H, T, Dv).  A query row with no visible key gives zeros (and zero
        gradients).  Gradients flow to every ``q[l]``, ``k[l]``, ``v``, ``w``
        and a float ``attn_mask`` that requires grad (its gradient is the
        score's, summed over the dimensions it is broadcast along; computing it
        costs one more pass over the scores in the backward).

    Non-finite values: NaN (or +inf) in ``q``, ``k``, ``w`` or a float mask
    entry that a query row can see makes that row's output NaN, and the
    gradients that flow through it NaN, as in plain arithmetic.  A hidden entry
    (bool mask False, above the diagonal under ``is_causal``, or -inf in a float
    mask) contributes nothing, even to a NaN row.  NaN in ``v`` reaches every
    row that sees that key.

    Raises:
        TypeError / ValueError naming the argument for wrong types, ranks,
        shapes (``q[l]`` must have ceil(T/2^l) rows), mixed dtypes or devices,
        dtypes other than float32/float64/bfloat16, a non-finite scale or a
        dropout_p outside [0, 1].

    float32 and float64 run in their own precision; bfloat16 inputs are computed
    in float32 (upcast on entry, results rounded back to bfloat16).
    """
    _check_levels(q, "q")
    _check_levels(k, "k")
    if len(k) != len(q):
        raise ValueError(f"k: expected {len(q)} levels like q, got {len(k)}")
    _check_tensor(v, "v", (4,))
    _check_tensor(w, "w", (1, 2))
    if q[0].dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise TypeError(f"q[0]: dtype must be float32, float64 or bfloat16, got {q[0].dtype}")
    device = q[0].device
    for name, x in [(f"q[{l}]", x) for l, x in enumerate(q)] + [(f"k[{l}]", x) for l, x in enumerate(k)] + [
            ("v", v), ("w", w)]:
        if x.dtype != q[0].dtype:
            raise TypeError(f"{name}: dtype {x.dtype} does not match q[0]'s {q[0].dtype}")
        if x.device != device:
            raise ValueError(f"{name}: is on {x.device} but q[0] is on {device}")
        if x.layout != torch.strided:
            raise TypeError(f"{name}: only dense (strided) tensors are supported, got layout {x.layout}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1], got {dropout_p}")
    D = q[0].shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    else:
        try:
            scale = float(scale)
        except OverflowError:  # an int beyond float range
            scale = math.inf
        if not math.isfinite(scale):
            raise ValueError(f"scale: must be a finite number, got {scale}")

    B, H, T = q[0].shape[:3]
    S = k[0].shape[2]
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask: expected a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.device != device:
            raise ValueError(f"attn_mask: is on {attn_mask.device} but q[0] is on {device}")
        if attn_mask.layout != torch.strided:
            raise TypeError(f"attn_mask: only dense (strided) tensors are supported, got layout {attn_mask.layout}")
        if attn_mask.dtype != torch.bool:
            if not attn_mask.is_floating_point():
                raise TypeError(f"attn_mask: dtype must be bool or floating point, got {attn_mask.dtype}")
            attn_mask = attn_mask.to(q[0].dtype)
        # Kept at its own size (a view with leading 1s, never expanded): the
        # kernels broadcast it, and a float mask's gradient comes back in its shape.
        full = (B, H, T, S)
        if attn_mask.dim() > 4 or any(n not in (1, f) for n, f in zip(reversed(attn_mask.shape), reversed(full))):
            raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} is not broadcastable to "
                             f"(B, H, T, S) = {full}")
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))

    if dropout_p > 0:
        seed = torch.randint(0, _SEED_HIGH, (), dtype=torch.int64)
    else:
        seed = torch.zeros((), dtype=torch.int64)
    out, _ = ops.attention_forward(list(q), list(k), v, w, attn_mask, is_causal, float(dropout_p), float(scale),
                                   seed)
    return out
