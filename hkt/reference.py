"""Plain-PyTorch HKT attention: the definition the kernels are tested against.

It materialises the full (B, H, T, S) score matrix, so it is O(T*S) in memory
and slow; use it for checking, never for training.  One other use is by
design: MultiheadHKT's ``need_weights=True`` returns the (B, H, T, S)
probabilities, which are O(T*S) whatever computes them (as
nn.MultiheadAttention's are), so it takes them from :func:`masked_probs` here
rather than from a second copy of the same formula; its output still comes
from the kernels.
"""
import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["hkt_attention_reference", "attention_probs", "masked_probs", "combined_scores", "level_terms",
           "upsample_level", "repeat_kv"]


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
    score = combined_scores(q, k, w, scale)
    T, S = score.shape[-2:]
    visible = torch.ones(T, S, dtype=torch.bool, device=score.device)
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
):
    """HKT attention exactly as docs/contract.md section 1 defines it.

    Same arguments as :func:`hkt.hkt_attention`, checked as it checks them
    (the same TypeError / ValueError naming the argument; k and v may have
    fewer heads than q: grouped-query attention, :func:`repeat_kv`).  Dropout needs an explicit
    ``dropout_mask`` (B, H, T, S) of kept entries (e.g. from
    ``hkt._C.dropout_mask``), so results are reproducible.  With
    ``return_probs`` also returns P (B, H, T, S) before dropout.
    """
    # the arguments checked as hkt_attention checks them, with its messages
    # (imported here: hkt.functional's own imports reach this module)
    from .functional import check_call
    attn_mask, dropout_p, scale = check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale,
                                             dropout_allowed=True)
    P = attention_probs(q, k, w, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
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
