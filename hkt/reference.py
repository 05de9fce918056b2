"""Plain-PyTorch HKT attention: the definition the kernels are tested against.

It materialises the full (B, H, T, S) score matrix, so it is O(T*S) in memory
and slow; use it for checking, never for training.  No library module uses
it: MultiheadHKT's ``need_weights=True`` probabilities come from the
library's own copy of the formulas (hkt/_core/maths.py), which
tests/ops/test_library_maths.py holds to the same answers as this one.

It imports nothing of hkt: the definition the kernels are tested against must
not lean on the code under test (its argument checks are its own, below).
"""
import math
import numbers
from typing import List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["hkt_attention_reference", "attention_probs", "masked_probs", "combined_scores", "level_terms",
           "upsample_level", "repeat_kv", "check_windows", "window_seen", "windowed_scores", "band_seen"]

# the most levels a call may have (docs/contract.md section 1; the kernels'
# per-level arrays are sized for it)
_MAX_LEVELS = 24


def repeat_kv(x: Tensor, H: int) -> Tensor:
    """Grouped-query attention spelled out: x (B, H_kv, n, d) with its kv heads
    repeated to H heads, query head h reading kv head h // (H // H_kv)."""
    Hk = x.shape[1]
    if Hk == H:
        return x
    if Hk < 1 or H % Hk != 0:
        raise ValueError("H: the {} kv heads of x must divide the {} heads asked for".format(Hk, H))
    return x.repeat_interleave(H // Hk, dim=1)


def upsample_level(g: Tensor, level: int, T: int, S: int) -> Tensor:
    """Expands a level-``level`` score block (..., ceil(T/2^l), ceil(S/2^l)) to
    (..., T, S): entry (i, j) takes block (i >> l, j >> l)."""
    if level == 0:
        return g
    # gathered by index, (T, S) directly: a repeat cut back to T (or S) has
    # torch.compile guard on whether 2^l * ceil(T / 2^l) == T, one more
    # compiled graph for each length class
    rows = torch.div(torch.arange(T, device=g.device), 1 << level, rounding_mode="floor")
    cols = torch.div(torch.arange(S, device=g.device), 1 << level, rounding_mode="floor")
    return g.index_select(-2, rows).index_select(-1, cols)


def level_terms(q: List[Tensor], k: List[Tensor], w: Tensor, scale: Optional[float] = None) -> List[Tensor]:
    """Each level's contribution scale * w[l] * upsample(q[l] k[l]^T), L tensors (B, H, T, S).
    (q and k may be any sequences; the List annotations let TorchScript compile it.)"""
    B, H, T, D = q[0].shape
    S = k[0].shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    L = len(q)
    w2 = w.unsqueeze(0).expand(H, L) if w.dim() == 1 else w
    return [level_factor(scale, w2[:, l]).view(1, H, 1, 1)
            * upsample_level(q[l] @ repeat_kv(k[l], H).transpose(-1, -2), l, T, S) for l in range(L)]


def level_factor(scale: float, w: Tensor) -> Tensor:
    """scale * w (a level's factor, one per head), in w's dtype; where both are
    nonzero but the product rounds to 0, the smallest subnormal of its sign
    instead, so an inf in q or k times it is +-inf, as the exact product is,
    not 0 * inf = NaN.  The kernels apply the same factor."""
    f = scale * w
    if scale == 0.0:
        return f
    tiny = torch.nextafter(torch.zeros_like(f), torch.sign(w.detach()) * (1.0 if scale > 0 else -1.0))
    # f + tiny (f is +-0 there): the derivative in w stays scale, as the kernels' dw is
    return torch.where((f == 0) & (w != 0), f + tiny, f)


def combined_scores(q: List[Tensor], k: List[Tensor], w: Tensor, scale: Optional[float] = None) -> Tensor:
    """score[i, j] = scale * sum_l w[l] * <q[l][i >> l], k[l][j >> l]>, shape (B, H, T, S)."""
    terms = level_terms(q, k, w, scale)
    score = terms[0]
    for term in terms[1:]:
        score = score + term
    return score


def attention_probs(q: Sequence[Tensor], k: Sequence[Tensor], w: Tensor, *, attn_mask: Optional[Tensor] = None,
                    is_causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """P (B, H, T, S): the combined scores, masked as :func:`hkt.hkt_attention` masks
    them, through the softmax.  A row with nothing visible is zeros."""
    return masked_probs(list(q), list(k), w, attn_mask, is_causal, scale)


def float_mask_in(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A float mask in the dtype its scores are computed in (every path's one
    conversion: the kernels', backend="sdpa"'s and this reference's).  Rounded,
    but a finite value beyond dtype's range becomes dtype's largest finite number
    of its sign, not +-inf: a conversion must not hide an entry.  (A float64 mask
    of torch.finfo(torch.float64).min, as padding masks are made, would be -inf
    in a float32 call: a row of them the uniform average in float64 and zeros in
    float32.)"""
    out = mask.to(dtype)
    if mask.element_size() < out.element_size():  # a wider type holds every value
        return out
    over = out.isinf() & mask.isfinite()
    # nextafter of a detached tensor: torch 2.11 and older have no derivative for
    # it (the backward raises); the mask's gradient passes straight through the
    # conversion there, as newer torch's derivative passes it
    edge = torch.nextafter(out.detach(), torch.zeros_like(out))
    if out.requires_grad:
        edge = edge + (mask - mask.detach()).to(out.dtype)
    return torch.where(over, edge, out)


def masked_probs(q: List[Tensor], k: List[Tensor], w: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                 scale: Optional[float]) -> Tensor:
    """:func:`attention_probs` with positional arguments only, so that TorchScript
    compiles it (MultiheadHKT's returned weights call it)."""
    return probs_of_scores(combined_scores(q, k, w, scale), None, attn_mask, is_causal)


def probs_of_scores(score: Tensor, seen: Optional[Tensor], attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
    """The softmax of combined scores (B, H, T, S) over the visible keys: those
    ``seen`` (T, S) allows (None: all; the windows' union, section 1.11), that
    causality and a bool mask allow; a float mask is added."""
    T, S = score.shape[-2:]
    visible = torch.ones(T, S, dtype=torch.bool, device=score.device)
    if seen is not None:
        visible = visible & seen
    if is_causal:
        visible = torch.tril(visible)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            score = score + float_mask_in(attn_mask, score.dtype)
    score = score.masked_fill(~visible, float("-inf"))
    # A hidden entry (score -inf: masked, causal, or -inf in a float mask) weighs
    # nothing and passes no gradient, even in a row that holds NaN (where the
    # softmax of every entry is NaN).  A NaN score counts as visible, so NaN in
    # gives NaN out.
    hidden = score == float("-inf")
    score = torch.where(hidden, score.detach(), score)
    # A row with nothing visible gives zeros: softmax a harmless row, then zero it,
    # so neither the value nor the gradient picks up NaN.
    row_any = ~hidden.all(dim=-1, keepdim=True)
    P = torch.softmax(torch.where(row_any, score, torch.zeros_like(score)), dim=-1)
    return P.masked_fill(hidden, 0.0)


def check_windows(windows, L: int, *, growing: bool = False):
    """``windows`` checked (docs/contract.md section 1.11): None, or a list or
    tuple of L entries, each None (the level sees every key) or W_l, a positive
    multiple of 2^l (an int, not a bool).  Returns None when no level has a
    window (today's HKT), else a tuple of L entries, W_l or None.  ``growing``:
    also require what the kernels' block sharing needs: each window larger than
    the one below it, and no window above a level without one."""
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


def window_seen(windows: Sequence[Optional[int]], T: int, S: int, device=None) -> List[Optional[Tensor]]:
    """Per level, the (T, S) bool of the pairs it sees: |(i >> l) - (j >> l)| <
    W_l / 2^l, or None where the level has no window (it sees every pair)."""
    i = torch.arange(T, device=device).view(T, 1)
    j = torch.arange(S, device=device).view(1, S)
    return [None if W is None else ((i >> l) - (j >> l)).abs() < (W >> l) for l, W in enumerate(windows)]


def windowed_scores(q: Sequence[Tensor], k: Sequence[Tensor], w: Tensor, windows: Sequence[Optional[int]],
                    scale: Optional[float] = None):
    """(score, seen): score[i, j] the sum of the level terms of the levels that
    see (i, j), (B, H, T, S); seen (T, S) where at least one level does."""
    terms = level_terms(list(q), list(k), w, scale)
    T, S = terms[0].shape[-2:]
    seen_l = window_seen(windows, T, S, terms[0].device)
    score = None
    seen = torch.zeros(T, S, dtype=torch.bool, device=terms[0].device)
    for term, sl in zip(terms, seen_l):
        if sl is None:
            seen = torch.ones_like(seen)
        else:
            term = torch.where(sl, term, torch.zeros_like(term))
            seen = seen | sl
        score = term if score is None else score + term
    return score, seen


def hkt_attention_reference(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    w: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    dropout_mask: Optional[Tensor] = None,
    return_probs: bool = False,
    windows: Optional[Sequence[Optional[int]]] = None,
    softcap: Optional[float] = None,
    sliding_window: Optional[int] = None,
):
    """HKT attention exactly as docs/contract.md section 1 defines it.

    Same arguments as :func:`hkt.hkt_attention`, refused as it refuses them
    (a TypeError / ValueError naming the argument; k and v may have
    fewer heads than q: grouped-query attention, :func:`repeat_kv`).  Dropout needs an explicit
    ``dropout_mask`` (B, H, T, S) of kept entries (e.g. from
    ``hkt._C.dropout_mask``), so results are reproducible.  With
    ``return_probs`` also returns P (B, H, T, S) before dropout.
    ``windows``: one entry per level, None or W_l tokens (docs/contract.md
    section 1.11): the dense definition, any windows (the kernels need them
    growing with the level).
    ``softcap``: None (or 0.0) for none, else c > 0: the combined score s
    becomes c * tanh(s / c) before the mask is applied (docs/contract.md
    section 1.12).
    ``sliding_window``: None for none, else an int W >= 1: key j is visible
    to query i only when i - j < W (and, without ``is_causal``, j - i < W),
    for the combined score (docs/contract.md section 1.13).
    """
    dropout_p, scale = _checked(q, k, v, w, attn_mask, is_causal, dropout_p, scale)
    softcap = _checked_softcap(softcap)
    sliding_window = _checked_sliding_window(sliding_window)
    windows = check_windows(windows, len(q))
    if windows is None:
        score, seen = combined_scores(list(q), list(k), w, scale), None
    else:
        score, seen = windowed_scores(q, k, w, windows, scale)
    if softcap is not None:
        score = softcap * torch.tanh(score / softcap)
    if sliding_window is not None:
        band = band_seen(sliding_window, is_causal, score.shape[-2], score.shape[-1], score.device)
        seen = band if seen is None else seen & band
    P = probs_of_scores(score, seen, attn_mask, is_causal)
    Pd = P
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("dropout_mask: required when dropout_p > 0")
        if not isinstance(dropout_mask, Tensor) or dropout_mask.shape != P.shape:
            got = tuple(dropout_mask.shape) if isinstance(dropout_mask, Tensor) else type(dropout_mask).__name__
            raise ValueError(f"dropout_mask: expected a tensor of shape (B, H, T, S) = {tuple(P.shape)}, got {got}")
        Pd = P * dropout_mask.to(P.dtype) / (1.0 - dropout_p) if dropout_p < 1 else torch.zeros_like(P)
    out = Pd @ repeat_kv(v, P.shape[1])
    return (out, P) if return_probs else out


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def band_seen(sliding_window: int, is_causal: bool, T: int, S: int, device=None) -> Tensor:
    """The sliding-window band (T, S): True where i - j < W and, without
    causality, j - i < W (i, j counted from 0, as causality counts them)."""
    d = torch.arange(T, device=device).unsqueeze(1) - torch.arange(S, device=device).unsqueeze(0)
    seen = d < sliding_window
    return seen if is_causal else seen & (-d < sliding_window)


def _checked_sliding_window(sliding_window) -> Optional[int]:
    """``sliding_window`` as an int, or None for no band; anything else must
    be an integer >= 1 that is not a bool (nor a tensor)."""
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, numbers.Integral) or isinstance(sliding_window, bool):
        t = type(sliding_window)  # named as the extension names it: torch.Tensor, numpy.float64, float
        name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        raise TypeError(f"sliding_window: expected None or an int >= 1, got {name}")
    if int(sliding_window) < 1:
        raise ValueError(f"sliding_window: must be an int >= 1 (or None for no band), got {int(sliding_window)!r}")
    return int(sliding_window)


def _checked_softcap(softcap) -> Optional[float]:
    """``softcap`` as a float, or None where there is none (None or 0.0, the
    FlashAttention convention); anything else must be a finite positive real."""
    if softcap is None:
        return None
    if not _is_real(softcap):
        raise TypeError(f"softcap: expected None or a real number, got {type(softcap).__name__}")
    softcap = float(softcap)
    if softcap == 0.0:
        return None
    if not (0.0 < softcap < float("inf")):
        raise ValueError(f"softcap: must be positive and finite (or None/0.0 for none), got {softcap!r}")
    return softcap


def _checked(q, k, v, w, attn_mask, is_causal, dropout_p, scale):
    """The arguments of :func:`hkt_attention_reference` refused where
    hkt.hkt_attention refuses them, with a TypeError or ValueError whose
    message starts with the argument's name.  Returns (dropout_p, scale) as
    floats (scale None for the default)."""
    for name, xs in (("q", q), ("k", k)):
        if not isinstance(xs, (list, tuple)):
            raise TypeError(f"{name}: expected a list or tuple of tensors (one per level), got {type(xs).__name__}")
    if not 1 <= len(q) <= _MAX_LEVELS:
        raise ValueError(f"q: expected 1 to {_MAX_LEVELS} levels, got {len(q)}")
    if len(k) != len(q):
        raise ValueError(f"k: expected {len(q)} levels, as q has, got {len(k)}")
    named = [(f"q[{l}]", x) for l, x in enumerate(q)] + [(f"k[{l}]", x) for l, x in enumerate(k)]
    named += [("v", v), ("w", w)]
    for name, x in named:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if q[0].dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise TypeError(f"q[0]: dtype must be float32, float64 or bfloat16, got {q[0].dtype}")
    for name, x in named:
        if x.dtype != q[0].dtype:
            raise TypeError(f"{name}: dtype {x.dtype} is not q[0]'s {q[0].dtype}")
        if x.device != q[0].device:
            raise ValueError(f"{name}: on {x.device}, q[0] on {q[0].device}")
    _check_shapes(q, k, v, w)
    if attn_mask is not None:
        _check_mask(attn_mask, q[0], k[0])
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__}")
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p: expected a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1], got {dropout_p!r}")
    if scale is None:
        return float(dropout_p), None
    if not _is_real(scale):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    try:
        scale_f = float(scale)
    except OverflowError:  # an int beyond the float range
        scale_f = math.inf
    if not math.isfinite(scale_f):
        raise ValueError(f"scale: must be a finite number, got {scale!r}")
    return float(dropout_p), scale_f


def _check_shapes(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor) -> None:
    """q[l] (B, H, ceil(T/2^l), D), k[l] (B, H_kv, ceil(S/2^l), D) with H_kv
    dividing H, v (B, H_kv, S, Dv), w (L,) or (H, L): else a ValueError naming
    the first argument that is not so."""
    if q[0].dim() != 4 or q[0].shape[3] < 1:
        raise ValueError(f"q[0]: expected (B, H, T, D) with D >= 1, got shape {tuple(q[0].shape)}")
    if k[0].dim() != 4:
        raise ValueError(f"k[0]: expected (B, H_kv, S, D), got shape {tuple(k[0].shape)}")
    B, H, T, D = q[0].shape
    Hk, S = k[0].shape[1], k[0].shape[2]
    if (Hk == 0 and H != 0) or (Hk > 0 and H % Hk != 0):
        raise ValueError(f"k[0]: its {Hk} heads must divide q[0]'s {H}")
    for l in range(len(q)):
        # -(-n >> l): ceil(n / 2^l)
        for name, x, want in ((f"q[{l}]", q[l], (B, H, -(-T >> l), D)), (f"k[{l}]", k[l], (B, Hk, -(-S >> l), D))):
            if tuple(x.shape) != want:
                raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, Hk, S):
        raise ValueError(f"v: expected shape (B, H_kv, S, Dv) with (B, H_kv, S) = {(B, Hk, S)}, got "
                         f"{tuple(v.shape)}")
    if tuple(w.shape) not in ((len(q),), (H, len(q))):
        raise ValueError(f"w: expected shape (L,) = {(len(q),)} or (H, L) = {(H, len(q))}, got {tuple(w.shape)}")


def _check_mask(attn_mask, q0: Tensor, k0: Tensor) -> None:
    """A bool or floating tensor on q[0]'s device that broadcasts to (B, H, T, S)."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask: expected a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask: dtype must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask.device != q0.device:
        raise ValueError(f"attn_mask: on {attn_mask.device}, q[0] on {q0.device}")
    full = (*q0.shape[:3], k0.shape[2])
    try:
        fits = attn_mask.dim() <= 4 and torch.broadcast_shapes(attn_mask.shape, full) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} does not broadcast to (B, H, T, S) = {full}")
