"""The maths the library computes in plain torch, beside its kernels: the
default score scale 1/sqrt(D), the compute dtype and the conversion of a float mask to it, kv heads repeated for
grouped-query attention, a level's factor scale * w, and the attention as
dense (B, H, T, S) matrices (MultiheadHKT's need_weights, the double backward
of the attention and varlen ops).

hkt.reference keeps its own copy of each, written from docs/contract.md and
importing nothing of hkt, so that a differential test never has the library's
maths on both of its sides; tests/ops/test_library_maths.py holds the two copies
to the same answers.  The operations here are the reference's, in its order,
so a gradient computed through them has the bits it had when the library
called the reference.
"""
import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["default_scale", "compute_dtype", "float_mask_in", "repeat_kv", "level_factor", "combined_scores", "windowed_scores", "probs_of_scores",
           "masked_probs", "dense_attention", "band_seen"]


def default_scale(D: int) -> float:
    """1/sqrt(D), the score scale where none is given (D > 0 features per
    head): the one place Python computes it, as the extension does when handed
    None."""
    return 1.0 / math.sqrt(D)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the kernels' outputs and sums: float32 or float64 (float32 for bfloat16 inputs)."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def float_mask_in(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A float mask in the dtype its scores are computed in (the one conversion
    of the kernels' path, backend="sdpa" and the module's weights).  Rounded,
    but a finite value beyond dtype's range becomes dtype's largest finite
    number of its sign, not +-inf: a conversion must not hide an entry."""
    out = mask.to(dtype)
    if mask.element_size() < out.element_size():  # a wider type holds every value
        return out
    over = out.isinf() & mask.isfinite()
    # nextafter has no derivative in torch 2.11 and older: taken of a detached
    # tensor, with the mask's gradient passed straight through the conversion
    edge = torch.nextafter(out.detach(), torch.zeros_like(out))
    if out.requires_grad:
        edge = edge + (mask - mask.detach()).to(out.dtype)
    return torch.where(over, edge, out)


def repeat_kv(x: Tensor, H: int) -> Tensor:
    """x (B, H_kv, n, d) with each kv head repeated H // H_kv times, as H query
    heads read them (query head h reads kv head h // (H // H_kv)); callers have
    checked that H_kv divides H."""
    reps = H // x.shape[1]
    return x if reps == 1 else x.repeat_interleave(reps, dim=1)


def level_factor(scale: float, w: Tensor) -> Tensor:
    """scale * w in w's dtype, the factor the kernels apply to a level: where
    both are nonzero but the product underflows to 0, the smallest subnormal of
    the product's sign, so an inf in q or k still gives +-inf (not 0 * inf)."""
    f = scale * w
    if scale == 0.0:
        return f
    sign = torch.sign(w.detach()) * (1.0 if scale > 0 else -1.0)
    tiny = torch.nextafter(torch.zeros_like(f), sign)
    # f + tiny where f is +-0: the derivative in w stays scale, as the kernels' dw is
    return torch.where((f == 0) & (w != 0), f + tiny, f)


def _expand_level(g: Tensor, level: int, T: int, S: int) -> Tensor:
    """A level-``level`` block of scores (..., ceil(T/2^l), ceil(S/2^l)) at
    full size (..., T, S), entry (i, j) from block (i >> l, j >> l); gathered
    by index (a repeat cut back to T would have torch.compile guard on T's
    remainder)."""
    if level == 0:
        return g
    rows = torch.div(torch.arange(T, device=g.device), 1 << level, rounding_mode="floor")
    cols = torch.div(torch.arange(S, device=g.device), 1 << level, rounding_mode="floor")
    return g.index_select(-2, rows).index_select(-1, cols)


def _level_scores(q: List[Tensor], k: List[Tensor], w: Tensor, scale: Optional[float]) -> List[Tensor]:
    """Each level's term scale * w[l] * <q[l][i >> l], k[l][j >> l]>: L tensors (B, H, T, S)."""
    H, T, D = q[0].shape[1:]
    S = k[0].shape[-2]
    if scale is None:
        scale = default_scale(D)
    L = len(q)
    per_head = w if w.dim() == 2 else w.unsqueeze(0).expand(H, L)
    terms = []
    for l in range(L):
        f = level_factor(scale, per_head[:, l]).view(1, H, 1, 1)
        terms.append(f * _expand_level(q[l] @ repeat_kv(k[l], H).transpose(-1, -2), l, T, S))
    return terms


def combined_scores(q: List[Tensor], k: List[Tensor], w: Tensor, scale: Optional[float] = None) -> Tensor:
    """The scores summed over the levels, level 0 first: (B, H, T, S)."""
    terms = _level_scores(q, k, w, scale)
    score = terms[0]
    for term in terms[1:]:
        score = score + term
    return score


def windowed_scores(q: Sequence[Tensor], k: Sequence[Tensor], w: Tensor, windows: Sequence[Optional[int]],
                    scale: Optional[float] = None):
    """(score, seen) with windows (docs/contract.md section 1.11): each level's
    term where |(i >> l) - (j >> l)| < W_l / 2^l (everywhere for a level with
    no window), summed level 0 first, (B, H, T, S); seen (T, S), the pairs at
    least one level sees."""
    terms = _level_scores(list(q), list(k), w, scale)
    T, S = terms[0].shape[-2:]
    device = terms[0].device
    i = torch.arange(T, device=device).view(T, 1)
    j = torch.arange(S, device=device).view(1, S)
    score = None
    seen = torch.zeros(T, S, dtype=torch.bool, device=device)
    for l, (term, W) in enumerate(zip(terms, windows)):
        if W is None:
            seen = torch.ones_like(seen)
        else:
            sees = ((i >> l) - (j >> l)).abs() < (W >> l)
            term = torch.where(sees, term, torch.zeros_like(term))
            seen = seen | sees
        score = term if score is None else score + term
    return score, seen


def band_seen(sliding_window: int, is_causal: bool, T: int, S: int, device=None) -> Tensor:
    """The sliding-window band (T, S) (docs/contract.md section 1.13): True
    where i - j < W and, without causality, j - i < W."""
    d = torch.arange(T, device=device).unsqueeze(1) - torch.arange(S, device=device).unsqueeze(0)
    seen = d < sliding_window
    return seen if is_causal else seen & (-d < sliding_window)


def probs_of_scores(score: Tensor, seen: Optional[Tensor], attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
    """The softmax of scores (B, H, T, S) over the visible keys: those ``seen``
    allows (None: all), causality and a bool mask allow; a float mask is added.
    A hidden entry weighs nothing and passes no gradient, even in a NaN row; a
    row with nothing visible is zeros (and zero gradients)."""
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
    hidden = score == float("-inf")  # -inf added to a NaN score is NaN: visible
    score = torch.where(hidden, score.detach(), score)
    # softmax of a harmless row where nothing is visible, then zeroed: no NaN in
    # the value or the gradient
    row_any = ~hidden.all(dim=-1, keepdim=True)
    P = torch.softmax(torch.where(row_any, score, torch.zeros_like(score)), dim=-1)
    return P.masked_fill(hidden, 0.0)


def masked_probs(q: List[Tensor], k: List[Tensor], w: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                 scale: Optional[float]) -> Tensor:
    """P (B, H, T, S) of an attention call without windows, positional
    arguments only so that TorchScript compiles it (MultiheadHKT's weights)."""
    return probs_of_scores(combined_scores(q, k, w, scale), None, attn_mask, is_causal)


def dense_attention(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                    is_causal: bool, scale: Optional[float], dropout_p: float = 0.0,
                    keep: Optional[Tensor] = None, softcap: float = 0.0, sliding_window: int = 0) -> Tensor:
    """hkt_attention without windows through the (B, H, T, S) matrices, for
    arguments already checked: differentiable to any order (the double
    backward of the ops recomputes the forward with it).  ``keep``: the kept
    entries (B, H, T, S) of dropout_p > 0; ``softcap`` > 0: the combined
    scores capped before the mask (docs/contract.md section 1.12);
    ``sliding_window`` > 0: the band (section 1.13), 0 for none."""
    if scale is not None:
        scale = float(scale)
    if softcap or sliding_window:
        scores = combined_scores(list(q), list(k), w, scale)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        seen = band_seen(sliding_window, is_causal, *scores.shape[-2:], scores.device) if sliding_window else None
        P = probs_of_scores(scores, seen, attn_mask, is_causal)
    else:
        P = masked_probs(list(q), list(k), w, attn_mask, is_causal, scale)
    if dropout_p > 0:
        P = P * keep.to(P.dtype) / (1.0 - dropout_p) if dropout_p < 1 else torch.zeros_like(P)
    return P @ repeat_kv(v, P.shape[1])
