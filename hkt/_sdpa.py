"""HKT attention through torch's scaled_dot_product_attention (the "sdpa" backend).

The HKT score is one dot product of concatenated vectors:

    score[i, j] = scale * sum_l w[l] <q[l][i >> l], k[l][j >> l]>
                = scale * <Q~[i], K~[j]>,   Q~[i] = concat_l(w[l] q[l][i >> l]),
                                            K~[j] = concat_l(k[l][j >> l])

so SDPA on Q~ (B, H, T, L*D), K~ (B, H_kv, S, L*D) and v, with the score scale of D
(not of L*D), computes it, and autograd carries the gradients back through the
concatenation to every q[l], k[l] and w.  It spends L times the score work of
one attention (the kernels spend sum 4^-l), but runs on whatever SDPA runs on
(FlashAttention, memory-efficient or cuDNN kernels on a GPU, in the inputs'
dtype).  Each row of Q~ and K~ is a repeat of a coarse row, built with expand +
reshape, whose backward is a plain sum (deterministic).

Differences from plain SDPA that hkt's contract fixes here:

- ``is_causal`` together with ``attn_mask``: one combined mask (SDPA refuses
  both at once);
- a query row with no visible key gives zeros and zero gradients: such rows
  are given an all-visible mask row (finite scores, so nothing becomes NaN in
  SDPA's forward or backward) and their output is then set to 0, which also
  zeroes every gradient that flows through them;
- ``is_causal`` with a scale <= 0 (hkt allows any finite scale): the causal
  mask goes to SDPA as a mask, not as ``is_causal``, with which torch 2.13's
  CPU kernel gave NaN rows for finite inputs;
- dropout is refused: SDPA draws its own dropout pattern, not the kernels'
  (hkt_dropout.h), so the two backends would differ.

One rule of the contract (docs/contract.md section 1.9) is SDPA's here, not
hkt's: a NaN or inf in q, k, w or v may also reach rows in which it is hidden,
because SDPA hides an entry by adding -inf to its score (-inf + NaN is NaN) and
multiplies a zero probability by v.

No data-dependent branch: the fix-up is applied unconditionally (masked_fill
with a mask that is usually all False), so this traces under torch.compile and
can be captured in a CUDA graph.
"""
import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import float_mask_in, repeat_kv

__all__ = ["sdpa_attention", "concat_levels"]

_MAX_LEVELS = 24

# SDPA's enable_gqa is torch 2.5's; before, the kv heads are repeated (a copy)
_SDPA_TAKES_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def _sdpa(qt: Tensor, kt: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: float) -> Tensor:
    """F.scaled_dot_product_attention, kt and v with H_kv <= H heads (grouped-query:
    query head h reads kv head h // (H // H_kv), as the kernels do)."""
    H = qt.shape[1]
    if kt.shape[1] != H and not _SDPA_TAKES_GQA:
        kt, v = repeat_kv(kt, H), repeat_kv(v, H)
    if _SDPA_TAKES_GQA:
        return F.scaled_dot_product_attention(qt, kt, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=kt.shape[1] != H)
    return F.scaled_dot_product_attention(qt, kt, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _level_len(n: int, l: int) -> int:
    return ((n - 1) >> l) + 1 if n > 0 else 0


def _repeat_rows(x: Tensor, l: int, n: int) -> Tensor:
    """(B, H, ceil(n/2^l), D) -> (B, H, n, D), row i = x[..., i >> l, :]."""
    if l == 0:
        return x
    B, H, m, D = x.shape
    return x.unsqueeze(3).expand(B, H, m, 1 << l, D).reshape(B, H, m << l, D)[:, :, :n]


def concat_levels(q: Sequence[Tensor], k: Sequence[Tensor], w: Tensor):
    """(Q~, K~): the concatenated query and key vectors whose plain dot product is
    sum_l w[l] <q[l][i >> l], k[l][j >> l]> (w (L,) or (H, L), folded into Q~)."""
    T, S = q[0].shape[2], k[0].shape[2]
    H = q[0].shape[1]
    qs, ks = [], []
    for l in range(len(q)):
        wl = w[l] if w.dim() == 1 else w[:, l].reshape(1, H, 1, 1)
        qs.append(_repeat_rows(q[l] * wl, l, T))
        ks.append(_repeat_rows(k[l], l, S))
    return torch.cat(qs, dim=-1), torch.cat(ks, dim=-1)


def _shape_error(name: str, want, meaning: str, got) -> ValueError:
    return ValueError(f"{name}: expected shape {tuple(want)} {meaning}, got {tuple(got)}")


def check_arguments(q, k, v, w, attn_mask, dropout_p, scale, dropout_allowed=False) -> None:
    """What the extension checks for the kernels, for the inputs SDPA would
    otherwise take silently (a level one row too long is sliced away by the
    concatenation, for example), and for meta tensors, which never reach the
    extension (dropout_allowed: the kernels' fake kernel takes dropout).  Types,
    devices and dtypes are checked by the caller (functional._check_inputs)."""
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


def sdpa_attention(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                   is_causal: bool, scale: Optional[float]) -> Tensor:
    """HKT attention (no dropout) through F.scaled_dot_product_attention.
    attn_mask is None or 4-D (each dimension 1 or full), bool or floating;
    arguments already checked (check_arguments)."""
    T, D = q[0].shape[2], q[0].shape[3]
    S = k[0].shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    qt, kt = concat_levels(q, k, w)
    scale = float(scale)
    if attn_mask is None and (not is_causal or scale > 0):
        # is_causal alone leaves no row empty (row i sees key 0) unless S == 0,
        # where SDPA gives zeros
        return _sdpa(qt, kt, v, None, is_causal, scale)
    if attn_mask is None:
        # is_causal with a scale <= 0: torch 2.13's CPU kernel for is_causal gives
        # NaN rows there (finite inputs, Dv = L * D); with an explicit mask it is
        # right, so the causal mask goes as one
        attn_mask = torch.ones((1, 1, T, S), dtype=torch.bool, device=qt.device)
    causal = None
    if is_causal:
        causal = torch.ones(T, S, dtype=torch.bool, device=qt.device).tril()
    if attn_mask.dtype == torch.bool:
        visible = attn_mask if causal is None else attn_mask & causal
        empty = ~visible.any(dim=-1, keepdim=True)
        mask = visible | empty
    else:
        mask = float_mask_in(attn_mask, qt.dtype)
        if causal is not None:
            mask = mask.masked_fill(~causal, float("-inf"))
        # NaN is visible (it makes its row NaN, as in the kernels)
        empty = (mask == float("-inf")).all(dim=-1, keepdim=True)
        mask = mask.masked_fill(empty, 0.0)
    out = _sdpa(qt, kt, v, mask, False, scale)
    return out.masked_fill(empty, 0.0)
