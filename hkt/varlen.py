"""Packed variable-length batches: hkt.hkt_attention_varlen, in the style of
flash_attn_varlen_func, and the helpers that lay out its levels."""
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from ._core import kernels as _kernels
from ._core.checks import _check_inputs
from ._core.guards import _autocast_inputs, _refuse_trace
from .ops import route as _route, varlen as varlen_op

__all__ = ["hkt_attention_varlen", "varlen_level_offsets", "pack_levels"]


def varlen_level_offsets(cu_seqlens: Tensor, levels: int) -> List[Tensor]:
    """Row offsets of every level of a packed batch.

    Level l packs each sequence's ceil(len / 2^l) level-l rows one after
    another, so its offsets are the cumulative sums of those counts.

    Args:
        cu_seqlens: (nseq + 1,) int32 or int64 level-0 offsets (0, then the
            running total of the sequence lengths), as for
            :func:`hkt_attention_varlen`.
        levels: L.

    Returns:
        L tensors shaped and typed like ``cu_seqlens``; entry l holds the level-l
        row offsets, entry 0 is ``cu_seqlens`` itself, and ``offsets[l][-1]`` is
        the number of rows ``q[l]`` (or ``k[l]``) must have.
    """
    return varlen_op.level_offsets(cu_seqlens, levels)


def pack_levels(xs: Sequence[Tensor], lengths: Tensor) -> List[Tensor]:
    """Packs padded per-level tensors into the layout of :func:`hkt_attention_varlen`.

    Args:
        xs: L tensors, ``xs[l]`` of shape (B, H, n_l, D) (``q[l]`` or ``k[l]`` as
            :func:`hkt.hkt_attention` takes them), sequence b's real rows first.
        lengths: (B,) level-0 lengths of the sequences.

    Returns:
        L tensors (sum_b ceil(lengths[b] / 2^l), H, D): the first
        ceil(lengths[b] / 2^l) rows of every batch element, in batch order.
        Differentiable (the padded rows get zero gradient).
    """
    out = []
    for l, x in enumerate(xs):
        rows = (lengths.to(torch.int64) + (2 ** l - 1)) // 2 ** l
        keep = torch.arange(x.shape[2], device=x.device) < rows.to(x.device)[:, None]  # (B, n_l)
        out.append(x.transpose(1, 2)[keep])
    return out


def hkt_attention_varlen(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    w: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> Tensor:
    r"""HKT attention over sequences of different lengths packed along one axis,
    as ``flash_attn_varlen_func`` takes them; nothing is padded or computed for
    padding.

    Sequence s owns level-0 query rows ``cu_seqlens_q[s] : cu_seqlens_q[s+1]``
    and key rows ``cu_seqlens_k[s] : cu_seqlens_k[s+1]``.  Every level is built
    per sequence: level l packs each sequence's ceil(len / 2^l) rows one after
    another (offsets: :func:`varlen_level_offsets`; from padded tensors:
    :func:`pack_levels`), so a level-l block never spans two sequences.  Each
    sequence's result is exactly :func:`hkt.hkt_attention` on that sequence
    alone (bitwise, on the CPU kernels).

    Args:
        q: L tensors, ``q[l]`` (sum_s ceil(T_s / 2^l), H, D).
        k: L tensors, ``k[l]`` (sum_s ceil(S_s / 2^l), H_kv, D); H_kv divides H
            (query head h reads kv head h // (H // H_kv)).
        v: (total_k, H_kv, Dv).
        w: level weights (L,) or (H, L), shared by all sequences.
        cu_seqlens_q, cu_seqlens_k: (nseq + 1,) int32 or int64 CPU tensors:
            0, then non-decreasing, ending at total_q (total_k) rows.  Lengths
            may be 0, and T_s may differ from S_s.
        max_seqlen_q, max_seqlen_k: accepted for flash-attn compatibility; None,
            or at least the longest sequence (checked, not needed).
        is_causal: within each sequence, key j visible to query i when j <= i
            (counted from the sequence's start).
        scale: default 1 / sqrt(D).

    Returns:
        (total_q, H, Dv).  A query of a sequence with no keys gives zeros.
        Gradients flow to every ``q[l]``, ``k[l]``, ``v`` and ``w`` (the
        gradient of ``w`` summed over sequences in a fixed order: bitwise the
        same for any thread count), to any order: a backward with
        ``create_graph=True`` differentiates the plain-PyTorch formula,
        sequence by sequence (O(T_s S_s) memory).

    CPU only; float32, float64 (own precision) and bfloat16 (natively, or
    computed in float32, where :func:`hkt.hkt_attention` runs it so).  Runs
    under ``torch.compile`` (fullgraph too) and ``torch.export`` as the
    ``hkt::varlen_forward`` op; not under TorchScript.  No attention
    mask and no dropout.  Under ``torch.autocast`` the inputs
    are cast as :func:`hkt.hkt_attention` casts them.  ``softcap``: None or
    0.0 only for now (anything else raises ``NotImplementedError``); pad the
    batch and call :func:`hkt.hkt_attention` with a mask for a capped call.

    Raises:
        TypeError / ValueError naming the argument: wrong dtypes, ranks or
        shapes (``q[l]`` must have exactly the rows the offsets give), offsets
        that do not start at 0, decrease ("offsets not increasing") or do not
        end at the number of rows, a ``max_seqlen_*`` below the longest
        sequence, H not divisible by H_kv.
    """
    _refuse_trace("hkt_attention_varlen")
    if _kernels._capped(softcap):  # the packed kernels' tasks take no cap yet
        raise NotImplementedError("softcap: hkt_attention_varlen takes no cap yet; pad the sequences and call "
                                  "hkt.hkt_attention with a key padding mask and softcap")
    if torch._C._is_any_autocast_enabled():
        q, k, v, w = _autocast_inputs(q, k, v, w)
    return _varlen(q, k, v, w, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)


def _varlen(q, k, v, w, cu_q, cu_k, max_q, max_k, is_causal, scale):
    # torch's rules, which the extension cannot name (the rest are its own): every
    # dtype checked here (bfloat16 arrays are upcast before the extension sees
    # them: w always, q, k, v off the native path, so a mix would pass
    # unnoticed), tensors that DLPack can export
    grad, _, scale = _check_inputs(q, k, v, w, is_causal, 0.0, scale)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor of int32 or int64 offsets, got {type(cu).__name__}")
    return _route.varlen(q, k, v, w, cu_q, cu_k, max_q, max_k, is_causal, scale, grad)
