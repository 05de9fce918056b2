"""Decoding with a KV cache: :func:`hkt_attention_with_kvcache`, and the cache
behind :meth:`hkt.MultiheadHKT.init_cache` / :meth:`hkt.MultiheadHKT.decode`.

Causal HKT can be decoded token by token: with causal downsampling anchored at
2^l p, the level-l query and key of block p depend only on tokens <= 2^l p, so
they are known as soon as that token arrives, and a position t needs nothing
after t.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _kernels
from ._autograd import _heads
from ._checks import _CALL_FAILED, _check_tensor
from ._guards import _autocast_inputs, _refuse_meta, _refuse_trace
from ._window_decode import _rows, append_windowed, attend_windowed_rows, cache_rows
from .ops import decode as decode_op
from .ops._schema import schema_scale

__all__ = ["hkt_attention_with_kvcache", "DecodeCache"]


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
        non-finite scale.

    Under ``torch.autocast`` the other inputs are cast to the caches' dtype,
    in which the kernel computes.
    """
    _refuse_trace("hkt_attention_with_kvcache")
    if torch.is_grad_enabled() and _any_requires_grad(q, k_cache, v_cache, w, k, v):
        raise RuntimeError("hkt_attention_with_kvcache: not differentiable (forward-only decoding kernel), but an "
                           "input requires grad; call it under torch.no_grad() or torch.inference_mode()")
    try:
        if torch._C._is_any_autocast_enabled() and isinstance(v_cache, Tensor) and v_cache.is_floating_point():
            # in the caches' dtype, which the kernel computes in (the caches, written
            # in place, cannot be cast), as autocast promotes a mixed call to its widest
            q, k, v, w = _autocast_inputs(q, k, v, w, to=v_cache.dtype)
        if torch.compiler.is_compiling():  # torch.compile, torch.export: the op, which they record
            return _decode_op(q, k_cache, v_cache, w, cache_seqlens, k, v, scale)
        return _kernels._decode(q, k_cache, v_cache, w, cache_seqlens, k, v, scale)
    except _CALL_FAILED:
        # nothing is checked in Python on the way in; when something failed, say
        # which argument the extension could not see was wrong, if one was
        _check_decode_inputs(q, k_cache, v_cache, w, k, v)
        _refuse_meta(q[0], "decoding")
        raise


def _decode_op(q, k_cache, v_cache, w, cache_seqlens, k, v, scale) -> Tensor:
    """The call as hkt::decode (read only) or hkt::decode_append (k and v written
    into the caches first) take it: cache_seqlens as a tensor, or None beside
    an int."""
    lens = (cache_seqlens, 0) if isinstance(cache_seqlens, Tensor) else (None, cache_seqlens)
    if k is None and v is None:
        return decode_op.decode(list(q), list(k_cache), v_cache, w, *lens, schema_scale(scale))
    return decode_op.decode_append(list(q), list(k_cache), v_cache, w, *lens, list(k), v, schema_scale(scale))


def _check_decode_inputs(q, k_cache, v_cache, w, k, v) -> None:
    """What the extension cannot name: sequences of tensors, dense, on q[0]'s
    device (shapes, dtypes and everything else are the extension's)."""
    for name, xs in (("q", q), ("k_cache", k_cache), ("k", k)):
        if xs is None and name == "k":
            continue
        if isinstance(xs, Tensor) or not isinstance(xs, (list, tuple)):
            raise TypeError(f"{name}: expected a list or tuple of L tensors (one per level), got {type(xs).__name__}")
        if len(xs) == 0:
            raise ValueError(f"{name}: expected at least one level, got an empty sequence")
    if not isinstance(q[0], Tensor):
        raise TypeError(f"q[0]: expected a torch.Tensor, got {type(q[0]).__name__}")
    device = q[0].device
    for name, xs in (("q", q), ("k_cache", k_cache), ("k", k)):
        for l, x in enumerate(xs or ()):
            _check_tensor(x, name, l, None, device)
    for name, x in (("v_cache", v_cache), ("w", w), ("v", v)):
        if x is not None or name != "v":
            _check_tensor(x, name, None, None, device)


class DecodeCache:
    """What :meth:`hkt.MultiheadHKT.decode` keeps between calls, for a batch of
    ``batch_size`` sequences of at most ``max_len`` tokens (made by
    :meth:`hkt.MultiheadHKT.init_cache`).

    Attributes (H_kv = the module's kv heads, hd = head_dim, K = downsample_kernel):
        length: tokens decoded so far (the same for every sequence).
        k: L tensors, ``k[l]`` (B, H_kv, ceil(max_len / 2^l), hd): the level-l
            keys of the blocks begun so far (with windows, see ``v_sums``).
        v: (B, H_kv, max_len, hd), the values so far (with windows, see ``v_sums``).
        inputs: for each level l >= 1, the downsampling state (B, 2, K,
            embed_dim): the last K inputs of the query stream ([:, 0]) and of
            the key stream ([:, 1]) at level l - 1, oldest first (zeros before
            the start, as causal downsampling pads), from which level l's next
            block is computed when its first token arrives.  ``q_inputs`` and
            ``k_inputs`` are the two halves.
        q_coarse, k_coarse: for each level l >= 1, (B, H, 1, hd) and (B, H_kv,
            1, hd): the level-l query and key of the latest block begun, which
            the following tokens of that block reuse.
        v_sums: None, or for a module with ``windows``, for each level l >= 1,
            (B, H_kv, rows_l, hd): the sum of the values of every complete
            level-l block (docs/contract.md section 1.11).  A step then reads
            the keys and values of level 0's window, and past each level's
            window only its blocks' keys and value sums, so its cost grows as
            S / 2^(L-1) (a global top level), not as S.  With windows, ``k``,
            ``v`` and ``v_sums`` of a level with a window are rings of rows_l
            rows (``hkt._window_decode.cache_rows``), block c in row c %
            rows_l, holding what a step reads (its window, and the few blocks
            beyond it that pieces of runs need); only the levels without a
            window keep all ceil(max_len / 2^l) blocks, so the cache grows as
            max_len / 2^g, g the first level without a window.
    """

    def __init__(self, k: List[Tensor], v: Tensor, inputs: List[Tensor], q_coarse: List[Tensor],
                 k_coarse: List[Tensor], max_len: int, v_sums: Optional[List[Tensor]] = None) -> None:
        self.k, self.v, self.v_sums = k, v, v_sums
        self.inputs, self.q_coarse, self.k_coarse = inputs, q_coarse, k_coarse
        self.max_len = max_len
        self.length = 0
        self._constants = None  # _step_constants: (parameters, their versions, _Constants)
        # a windowed call in rounds whose rings were written past what a retry of it reads (_attend)
        self._torn = False

    @property
    def q_inputs(self) -> List[Tensor]:
        return [x[:, 0] for x in self.inputs]

    @property
    def k_inputs(self) -> List[Tensor]:
        return [x[:, 1] for x in self.inputs]

    @property
    def batch_size(self) -> int:
        return self.v.shape[0]

    def __repr__(self) -> str:
        return (f"DecodeCache(batch_size={self.batch_size}, length={self.length}, max_len={self.max_len}, "
                f"levels={len(self.k)}, dtype={self.v.dtype}, device={self.v.device})")


def _check_decodable(mha) -> None:
    """Options decode does not implement (they are not causal self-attention
    over one token stream, or not deterministic)."""
    if mha.bias_k is not None:
        raise ValueError("add_bias_kv: MultiheadHKT.decode does not support add_bias_kv=True")
    if mha.add_zero_attn:
        raise ValueError("add_zero_attn: MultiheadHKT.decode does not support add_zero_attn=True")
    if mha.kdim != mha.embed_dim or mha.vdim != mha.embed_dim:
        raise ValueError(f"kdim/vdim: MultiheadHKT.decode is self-attention and needs kdim = vdim = embed_dim "
                         f"({mha.embed_dim}), got kdim={mha.kdim}, vdim={mha.vdim}")


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name}: must be at least 1, got {x}")
    return x


def init_cache(mha, batch_size: int, max_len: int, *, device=None, dtype=None) -> DecodeCache:
    """:meth:`hkt.MultiheadHKT.init_cache`."""
    _check_decodable(mha)
    batch_size, max_len = _positive_int(batch_size, "batch_size"), _positive_int(max_len, "max_len")
    ref = mha._stored_weight()
    device = ref.device if device is None else torch.device(device)
    dtype = ref.dtype if dtype is None else dtype
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: decoding runs in float32 or float64, got {dtype}")
    B, L, K, E, hd = batch_size, mha.levels, mha.downsample_kernel, mha.embed_dim, mha.head_dim
    Hk = mha.num_kv_heads
    kw = {"device": device, "dtype": dtype}
    # every block of each level, or with windows rings where the steps read only near the newest token
    rows = [-(-max_len // 2**l) for l in range(L)] if mha.windows is None else cache_rows(mha.windows, max_len)[0]
    k = [torch.zeros(B, Hk, rows[l], hd, **kw) for l in range(L)]
    v = torch.zeros(B, Hk, rows[0], hd, **kw)
    inputs = [torch.zeros(B, 2, K, E, **kw) for _ in range(L - 1)]
    q_coarse = [torch.zeros(B, mha.num_heads, 1, hd, **kw) for _ in range(L - 1)]
    k_coarse = [torch.zeros(B, Hk, 1, hd, **kw) for _ in range(L - 1)]
    v_sums = None if mha.windows is None else [torch.zeros(B, Hk, rows[l], hd, **kw) for l in range(1, L)]
    return DecodeCache(k, v, inputs, q_coarse, k_coarse, max_len, v_sums)


def _downsample_new(history: Tensor, taps: Tensor, first: int, lo: int, hi: int) -> Tensor:
    """Elements [lo, hi) of causal_downsample(x) (hkt.modules), where ``history``
    holds x's elements [first, ...): out[p] = sum_r taps[r] * x[2p - r], summed
    in causal_downsample's order so the two agree to the last bit.  Strided
    slices, not index tensors: this runs for every generated token."""
    j, m = 2 * lo - first, 2 * (hi - lo) - 1  # history rows j, j + 2, ... (hi - lo of them)
    out = history[:, j:j + m:2] * taps[0]
    for r in range(1, taps.shape[0]):
        out = out + history[:, j - r:j - r + m:2] * taps[r]
    return out


def _check_step(mha, x, cache) -> Tensor:
    """x as (B, n, E), after checking it against the module and the cache."""
    if not isinstance(cache, DecodeCache):
        raise TypeError(f"cache: expected the DecodeCache of mha.init_cache(...), got {type(cache).__name__}")
    if cache._torn:
        raise RuntimeError("cache: a decode call failed after writing some of its tokens into the rings of a "
                           "windowed cache, over rows that a retry would read; make a new cache with init_cache")
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        want = "(B, n, E)" if mha.batch_first else "(n, B, E)"
        raise ValueError(f"x: expected 3 dimensions {want}, got shape {tuple(x.shape)}")
    if not mha.batch_first:
        x = x.transpose(0, 1)
    B, n, E = x.shape
    if E != mha.embed_dim:
        raise ValueError(f"x: expected {mha.embed_dim} features (embed_dim), got {E}")
    if B != cache.batch_size:
        raise ValueError(f"x: batch size {B} does not match the cache's {cache.batch_size}")
    if cache.length + n > cache.max_len:
        raise ValueError(f"x: {n} new tokens do not fit in the cache: it holds {cache.length} of max_len = "
                         f"{cache.max_len}")
    if x.dtype != cache.v.dtype or x.device != cache.v.device:
        raise TypeError(f"x: is {x.dtype} on {x.device}, but the cache is {cache.v.dtype} on {cache.v.device}")
    if (len(cache.k) != mha.levels or cache.k[0].shape[1] != mha.num_kv_heads or cache.v.shape[3] != mha.head_dim
            or any(s.shape[2:] != (mha.downsample_kernel, mha.embed_dim) for s in cache.inputs)):
        raise ValueError("cache: was made by another module (levels, kv heads, head size, embed_dim or "
                         "downsample_kernel differ)")
    if (mha.windows is None) != (cache.v_sums is None):
        raise ValueError("cache: was made by a module " + ("without" if cache.v_sums is None else "with")
                         + " windows; make it with this module's init_cache")
    own = mha._stored_weight().dtype
    if own != cache.v.dtype and not torch.is_autocast_enabled(x.device.type):
        # the projections run in the module's dtype: only autocast reconciles the two
        raise TypeError(f"cache: is {cache.v.dtype} but the module's parameters are {own}; make the cache in "
                        f"the module's dtype (init_cache's default), or decode under torch.autocast")
    if mha.training and mha.dropout > 0:
        raise ValueError(f"dropout: MultiheadHKT.decode has no dropout, but the module is in training mode with "
                         f"dropout={mha.dropout}; call mha.eval()")
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in mha.parameters())):
        raise RuntimeError("MultiheadHKT.decode: inference only (the decoding kernel has no backward); call it "
                           "under torch.no_grad() or torch.inference_mode()")
    return x


class _Constants:
    """What a decoding step reads from the module besides its input, kept in
    the cache between steps (:func:`_step_constants`).

    projs, w: ``level_projections()`` and ``level_weights()``.
    taps: per level l >= 1, (2, K, E): the query stream's and the key stream's
        taps (one per feature) in the order of ``DecodeCache.inputs`` (oldest
        first), so that one product with the state, summed, gives both streams'
        next element.
    stacked: per level l >= 1, when query and key projections have the same
        shape (no grouped kv heads) and both or neither have a bias, (weights
        (2, E, E), bias (2, 1, E) or None): both projections in one batched
        matmul; else None.
    """

    def __init__(self, mha) -> None:
        self.projs = mha.level_projections() if mha.levels > 1 else []
        self.w = mha.level_weights()
        self.taps: List[Tensor] = []
        self.stacked: List[Optional[Tuple[Tensor, Optional[Tensor]]]] = []
        for l in range(1, mha.levels):
            self.taps.append(torch.stack([mha.q_downsample[l - 1].flip(0), mha.k_downsample[l - 1].flip(0)]))
            cwq, cbq, cwk, cbk = self.projs[l]
            if cwq.shape != cwk.shape or (cbq is None) != (cbk is None):
                self.stacked.append(None)
                continue
            bias = None if cbq is None else torch.stack([cbq, cbk]).unsqueeze(1)
            self.stacked.append((torch.stack([cwq.t(), cwk.t()]), bias))


def _step_constants(mha, cache: DecodeCache) -> _Constants:
    """The module's :class:`_Constants`, kept in the cache between steps: they
    are a few dozen slicing and stacking ops and a softmax per step otherwise,
    most of a small model's step when made every step.  Made again whenever a parameter they read was replaced
    or changed in place where autograd's version counter sees it (a foreach
    or single-tensor optimiser step, load_state_dict, an in-place op under
    no_grad).  Updates it does not see (a fused optimiser's step, edits
    through ``.data``) leave them stale: MultiheadHKT.decode's docstring says
    to start a new cache after changing parameters, whose past keys and
    values were made with the old ones anyway."""
    params = (mha.in_proj_weight, mha.in_proj_bias, mha.q_proj_weight, mha.k_proj_weight, mha.coarse_q_proj_weight,
              mha.coarse_q_proj_bias, mha.coarse_k_proj_weight, mha.coarse_k_proj_bias, mha.level_logits,
              mha.q_downsample, mha.k_downsample)
    try:
        versions = tuple(p._version if p is not None else None for p in params)
    except RuntimeError:  # inference tensors (a module made under inference_mode) keep no versions
        versions = None
    kept = cache._constants
    # the parameters themselves are kept and compared by identity, not by id(): a
    # replaced parameter freed, a new one may get its id (and start at version 0 too)
    if (versions is None or kept is None or kept[1] != versions
            or any(a is not b for a, b in zip(kept[0], params))):
        cache._constants = kept = (params, versions, _Constants(mha))
    return kept[2]


def decode(mha, x: Tensor, cache: DecodeCache) -> Tensor:
    """:meth:`hkt.MultiheadHKT.decode`."""
    _check_decodable(mha)
    x = _check_step(mha, x, cache)
    if x.shape[1] == 1:
        out = _decode_one(mha, x, cache)
    else:
        out = _decode_many(mha, x, cache)
    return out if mha.batch_first else out.transpose(0, 1)


def _attend(mha, qs: List[Tensor], cache: DecodeCache, w: Tensor, t0: int, ks: List[Tensor], v: Tensor) -> Tensor:
    """The new positions' attention, (B, H, n, hd), their keys and values
    written into the cache first: the decoding kernel, or with windows
    hkt._window_decode's (all the new positions in one call on the CPU)."""
    if mha.windows is None:
        return hkt_attention_with_kvcache(qs, cache.k, cache.v, w, t0, ks, v)
    sums = [cache.v] + cache.v_sums
    chunk = cache_rows(mha.windows, cache.max_len)[1]  # what the rings have room for between reads
    if v.shape[2] > chunk:  # a later round overwrites ring rows that the first reads: no retry once it starts
        cache._torn = True
    outs = []
    for i in range(0, v.shape[2], chunk):
        append_windowed(cache.k, sums, [x[:, :, i:i + chunk] for x in ks], v[:, :, i:i + chunk], t0 + i)
        outs.append(attend_windowed_rows([x[:, :, i:i + chunk] for x in qs], cache.k, sums, w, t0 + i, mha.windows))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _decode_one(mha, x: Tensor, cache: DecodeCache) -> Tensor:
    """decode for one new token per sequence (generation's step), in as few
    torch ops as the step allows: at that size each op's fixed cost, not its
    arithmetic, is the time.  Level l gains its next block only when the token
    begins one (t divisible by 2^l); then both streams' next element is one
    product of the taps with the state and a sum, and both projections one
    batched matmul."""
    B, t = x.shape[0], cache.length
    H, Hk, hd = mha.num_heads, mha.num_kv_heads, mha.head_dim
    c = _step_constants(mha, cache)
    # with one token, (B, 1, heads * hd) is (B, heads, 1, hd) in memory: views, not transposes
    r = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).view(B, H + 2 * Hk, 1, hd)
    qs, ks = [r[:, :H]], [r[:, H:H + Hk]]
    inputs, q_coarse, k_coarse = list(cache.inputs), list(cache.q_coarse), list(cache.k_coarse)
    new = x.unsqueeze(1).expand(B, 2, 1, x.shape[2])  # level 0's new element, in both streams
    for l in range(1, mha.levels):
        if new is not None:  # level l-1 gained an element: the state moves on
            inputs[l - 1] = torch.cat([inputs[l - 1][:, :, 1:], new], dim=2)
            new = None
            if t % 2**l == 0:  # and it begins level l's block t / 2^l
                new = (inputs[l - 1] * c.taps[l - 1]).sum(2, keepdim=True)  # (B, 2, 1, E)
                if c.stacked[l - 1] is not None:
                    wt, bias = c.stacked[l - 1]
                    both = new.transpose(0, 1).reshape(2, B, -1)  # a view for B = 1
                    pr = torch.bmm(both, wt) if bias is None else torch.baddbmm(bias, both, wt)  # (2, B, E)
                    q_coarse[l - 1], k_coarse[l - 1] = pr[0].view(B, H, 1, hd), pr[1].view(B, Hk, 1, hd)
                else:
                    cwq, cbq, cwk, cbk = c.projs[l]
                    q_coarse[l - 1] = F.linear(new[:, 0], cwq, cbq).view(B, H, 1, hd)
                    k_coarse[l - 1] = F.linear(new[:, 1], cwk, cbk).view(B, Hk, 1, hd)
        qs.append(q_coarse[l - 1])
        ks.append(k_coarse[l - 1])
    out = _attend(mha, qs, cache, c.w, t, ks, r[:, H + Hk:])
    # the state moves on only once the step went through
    cache.inputs, cache.q_coarse, cache.k_coarse = inputs, q_coarse, k_coarse
    cache.length = t + 1
    cache._torn = False
    # the module, not F.linear of its weight, as forward: its hooks (an adapter, prune's mask) run
    return mha.out_proj(out.view(B, 1, -1))


def _decode_many(mha, x: Tensor, cache: DecodeCache) -> Tensor:
    """decode for n >= 2 new tokens per sequence (a prompt, or chunks)."""
    B, n, _ = x.shape
    H, Hk = mha.num_heads, mha.num_kv_heads
    t0, K, hd = cache.length, mha.downsample_kernel, mha.head_dim
    q0, k0, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).split(
        [mha.embed_dim, mha.kv_dim, mha.kv_dim], dim=-1)
    qs, ks = [_heads(q0, H, hd)], [_heads(k0, Hk, hd)]
    inputs, q_coarse, k_coarse = list(cache.inputs), list(cache.q_coarse), list(cache.k_coarse)
    xq = xk = x  # the new elements of level l-1's query and key streams
    c = _step_constants(mha, cache)
    for l in range(1, mha.levels):
        # level l-1 gained elements [first, ...) and level l gains [lo, hi): those
        # whose first token arrived now (block p begins at token 2^l p)
        first, lo, hi = -(-t0 // 2 ** (l - 1)), -(-t0 // 2**l), -(-(t0 + n) // 2**l)
        if xq.shape[1] > 0:  # the downsampling state moves on
            hist_q = torch.cat([inputs[l - 1][:, 0], xq], dim=1)
            hist_k = torch.cat([inputs[l - 1][:, 1], xk], dim=1)
            inputs[l - 1] = torch.stack([hist_q[:, -K:], hist_k[:, -K:]], dim=1)
        if hi == lo:
            # every new token (if any) lies in block lo - 1, begun earlier
            xq = xk = xq[:, :0]
            qs.append(q_coarse[l - 1].expand(-1, -1, n, -1))
            ks.append(k_coarse[l - 1].expand(-1, -1, n, -1))
            continue
        xq = _downsample_new(hist_q, mha.q_downsample[l - 1], first - K, lo, hi)
        xk = _downsample_new(hist_k, mha.k_downsample[l - 1], first - K, lo, hi)
        cwq, cbq, cwk, cbk = c.projs[l]
        q_new = _heads(F.linear(xq, cwq, cbq), H, hd)
        k_new = _heads(F.linear(xk, cwk, cbk), Hk, hd)
        # each new token's block: lo - 1 (begun earlier) or one of the new ones
        rows = [((t0 + i) >> l) - (lo - 1) for i in range(n)]
        q_all = torch.cat([q_coarse[l - 1], q_new], dim=2)
        k_all = torch.cat([k_coarse[l - 1], k_new], dim=2)
        qs.append(_rows(q_all, rows))
        ks.append(_rows(k_all, rows))
        q_coarse[l - 1], k_coarse[l - 1] = q_all[:, :, -1:], k_all[:, :, -1:]
    out = _attend(mha, qs, cache, c.w, t0, ks, _heads(v, Hk, hd))
    # the state moves on only once the step went through
    cache.inputs, cache.q_coarse, cache.k_coarse = inputs, q_coarse, k_coarse
    cache.length = t0 + n
    cache._torn = False
    return mha.out_proj(out.transpose(1, 2).reshape(B, n, mha.embed_dim))
