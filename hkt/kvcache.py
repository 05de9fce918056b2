"""Decoding with a KV cache: :func:`hkt_attention_with_kvcache` (the cache
behind :meth:`hkt.MultiheadHKT.init_cache` / :meth:`hkt.MultiheadHKT.decode`
is :class:`hkt.LevelCache`, hkt/decoding/level_cache.py).

Causal HKT can be decoded token by token: with causal downsampling anchored at
2^l p, the level-l query and key of block p depend only on tokens <= 2^l p, so
they are known as soon as that token arrives, and a position t needs nothing
after t.
"""
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ._core.checks import _check_tensor, check_levels
from ._core.guards import _autocast_inputs, _refuse_trace
from .ops import route as _route

__all__ = ["hkt_attention_with_kvcache"]


def _any_requires_grad(*args) -> bool:
    for a in args:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, Tensor) and x.requires_grad:
                return True
    return False


def hkt_attention_with_kvcache(
    q: Sequence[Tensor],
    k_cache: Sequence[Tensor],
    v_cache: Tensor,
    w: Tensor,
    cache_seqlens: Union[Tensor, int],
    k: Optional[Sequence[Tensor]] = None,
    v: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sliding_window: Optional[int] = None,
) -> Tensor:
    r"""HKT attention of Tn new positions against a key/value cache (causal
    decoding), in the style of FlashAttention's ``flash_attn_with_kvcache``.

    New position i of batch row b is ``t_i = cache_seqlens[b] + i``; it attends
    to the cached keys ``j <= t_i``::

        score[i, j] = scale * sum_l w[l] * <q[l][:, :, i], k_cache[l][:, :, j >> l]>
        out[i]      = softmax_j(score[i, j], j <= t_i) @ v_cache[:, :, j]

    which is row t_i of the causal :func:`hkt.hkt_attention` over the whole
    sequence 0 .. t_i.

    Args:
        q: L tensors, ``q[l]`` (B, H, Tn, D): the level-l query of each new
            position, i.e. the coarse query of its block ``t_i >> l`` (pass one
            row per new position; positions in one block repeat it).
        k_cache: L tensors, ``k_cache[l]`` (B, H_kv, Sl_max, D) with
            Sl_max >= ceil(S_max / 2^l): slot p holds the key of level-l block p.
        v_cache: (B, H_kv, S_max, Dv).  H must be a multiple of H_kv; query head
            h reads kv head ``h // (H // H_kv)`` (grouped-query attention, no
            copies; H_kv = H is ordinary multi-head attention).
        w: level weights, (L,) or (H, L), as in :func:`hkt.hkt_attention`.
        cache_seqlens: positions already in the cache before this call, an int
            (every batch row) or an int32/int64 tensor (B,) on the CPU; each
            >= 0 and at most S_max - Tn.  It is read, never updated: the caller
            adds Tn after the call.
        k, v: optional, given together: ``k[l]`` (B, H_kv, Tn, D) the level-l key
            of each new position (its block's coarse key) and ``v`` (B, H_kv, Tn,
            Dv).  They are written into the caches *in place* before the
            attention: ``k[l][:, :, i]`` into slot ``t_i >> l`` of ``k_cache[l]``
            (new positions in one block carry the same coarse key; the last one
            wins), ``v[:, :, i]`` into slot ``t_i`` of ``v_cache``.  The caches
            must then not overlap each other or any other argument.
        scale: score scale, default 1 / sqrt(D).
        softcap: None (or 0.0) for none, else c > 0: each score s becomes
            c * tanh(s / c), as in :func:`hkt.hkt_attention`
            (docs/contract.md section 1.12).
        sliding_window: None for none, else an int W >= 1: position t_i
            sees only the keys ``t_i - W < j <= t_i`` (the band of
            :func:`hkt.hkt_attention`, docs/contract.md section 1.13); the
            kernel reads nothing before the band.

    Returns:
        (B, H, Tn, Dv), in q's dtype.  Slots of the caches after position
        ``cache_seqlens[b] + Tn - 1`` are never read, so they may hold anything.

    Cost: scoring one new token against S cached keys takes S·D multiply-adds
    at level 0 and S·D / 2^l at level l, O(S·D·(1 + 1/2 + 1/4 + ...)) < 2 S·D
    (1.75 S·D for L = 3).  The full op's coarse levels cost 1/4 per level
    because a level-l score is shared by a 2^l x 2^l block of (query, key)
    pairs; a single query row shares it only along the key side (2^l keys), so
    each level halves, not quarters, the work.  The value side costs S·Dv as in
    standard attention.

    Computation: C kernels (float32 and float64), OpenMP over (batch, head, key
    chunk) with a fixed-order combine of the chunks (split-K, as in
    flash-decoding), so results are bitwise the same for any thread count.
    Non-finite values follow :func:`hkt.hkt_attention`: NaN in a query, key or
    weight a row sees makes that row NaN; NaN in ``v`` reaches the rows that see
    its key; a row whose every score is -inf gives zeros.

    Runs under ``torch.compile`` (fullgraph too) and ``torch.export`` as the
    ``hkt::decode`` / ``hkt::decode_append`` ops (the caches' writes included);
    not under ``torch.jit.trace``.

    CPU only: CUDA tensors raise ``ValueError`` (no silent fallback).  Not
    differentiable: with grad mode on, an input that requires grad raises
    ``RuntimeError`` (call it under ``torch.no_grad()`` or
    ``torch.inference_mode()``); a gradient is never silently missing.

    Raises:
        TypeError / ValueError naming the argument: wrong types, ranks, shapes
        or dtypes (float32 / float64 only, all alike), a cache too small for
        ``cache_seqlens + Tn`` or a coarse cache with fewer than
        ceil(S_max / 2^l) slots, a negative ``cache_seqlens``, H not divisible
        by H_kv, only one of k and v, overlapping written caches, a
        non-finite scale, a softcap that is not None, 0.0 or a finite
        positive number, a sliding_window that is not None or an int >= 1.

    Under ``torch.autocast`` the other inputs are cast to the caches' dtype,
    in which the kernel computes.
    """
    _refuse_trace("hkt_attention_with_kvcache")
    if torch.is_grad_enabled() and _any_requires_grad(q, k_cache, v_cache, w, k, v):
        raise RuntimeError("hkt_attention_with_kvcache: not differentiable (forward-only decoding kernel), but an "
                           "input requires grad; call it under torch.no_grad() or torch.inference_mode()")
    if torch._C._is_any_autocast_enabled() and isinstance(v_cache, Tensor) and v_cache.is_floating_point():
        # in the caches' dtype, which the kernel computes in (the caches, written
        # in place, cannot be cast), as autocast promotes a mixed call to its widest
        q, k, v, w = _autocast_inputs(q, k, v, w, to=v_cache.dtype)
    # torch's rules, which the extension cannot name (the rest are its own)
    _check_decode_inputs(q, k_cache, v_cache, w, k, v)
    return _route.decode(q, k_cache, v_cache, w, cache_seqlens, k, v, scale, softcap, sliding_window)


def _check_decode_inputs(q, k_cache, v_cache, w, k, v) -> None:
    """What the extension cannot name: sequences of tensors, dense, on q[0]'s
    device (shapes, dtypes and everything else are the extension's)."""
    for name, xs in (("q", q), ("k_cache", k_cache), ("k", k)):
        if xs is None and name == "k":
            continue
        check_levels(name, xs)
    if not isinstance(q[0], Tensor):
        raise TypeError(f"q[0]: expected a torch.Tensor, got {type(q[0]).__name__}")
    device = q[0].device
    for name, xs in (("q", q), ("k_cache", k_cache), ("k", k)):
        for l, x in enumerate(xs or ()):
            _check_tensor(x, name, l, None, device)
    for name, x in (("v_cache", v_cache), ("w", w), ("v", v)):
        if x is not None or name != "v":
            _check_tensor(x, name, None, None, device)
