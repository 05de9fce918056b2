"""The decoding state a converted layer keeps between the calls of a cached
generation (:class:`HeadLevelCache`, beside transformers' cache), and its
decoding steps after the prefill (:class:`CachedDecoding`, a part of
:class:`HKTLevels`): T new positions after S - T cached ones, through hkt's
decoding kernels where they run (:func:`_kernel_decodes`), the windowed
decoding kernel over the rings the prefill filled, or hkt_attention one new
token at a time; and the coarse key caches the new blocks are written into
(:func:`_write_blocks`)."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

import hkt
from hkt.decoding.level_cache import LevelStore
from hkt.decoding.tails import BlockTails

from .masks import _compact_index, _layout_index, _row_layout, _shift_index, _take, _unsupported


# hkt_attention_with_kvcache for decoding steps where it can run (tests turn it off
# to check the other path, hkt_attention one token at a time, against it)
_DECODE_KERNEL = True


def _kernel_decodes(query: Tensor, w: Tensor, dropout: float, *others: Tensor) -> bool:
    """Whether a decoding step runs hkt's CPU decoding kernels (float32 and
    float64, no gradient wanted of the query, the weights or ``others`` (the
    keys and values), no dropout: they have no backward), else hkt_attention
    one way or another."""
    return (_DECODE_KERNEL and query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in (query, w, *others)))
            and dropout == 0)


class HeadLevelCache:
    """The decoding state of levels made from projected heads
    (``hkt.integrations.transformers.HKTLevels.decode_state``): what a
    converted attention module keeps between the forward calls of one
    cached generation, beyond HF's key/value cache (which holds level 0).
    ``store`` (a :class:`hkt.decoding.level_cache.LevelStore`, each row in
    its own positions, padding removed: slot p of level l is the row's block
    p): without windows the
    coarse levels' keys (its level 0 is HF's cache); with windows every
    level's keys and value sums in rings, and ``q_blocks`` per level l >= 1
    (B, H, 1, D) the query of each row's latest block, which a step that
    begins no block reuses; None where the layer recomputes the windowed op
    over the whole sequence at each step.  Beside it the latest
    full-resolution queries the next blocks' queries are downsampled from
    (``q_tail``, each row's latest tokens'; with windows and no store every
    query so far), and what
    checks that the next call continues this cache (its length, its padding,
    its last key).  ``real`` (B, length) bool: which positions are tokens,
    where some row's are not one run (a pad token inside a prompt; the
    steps lay each row out from it, its tokens first), growing by each
    step's; None where each row's padding is ``pad``, before its tokens.
    Where the steps run hkt's decoding kernels, ``tails`` (a
    :class:`hkt.decoding.tails.BlockTails`), ``q_blocks`` and ``k_blocks``
    (per level l >= 1 (B, heads, 1, D), the query and key of each row's
    latest block): a one-token step then makes only the blocks its token
    begins (:meth:`step_levels`); ``tails`` None once a step of another
    kind has run."""

    packed = False  # see PackedPrompt

    def __init__(self, length: int, pad: Tensor, last_key: Tensor, q_tail: Tensor, store: Optional[LevelStore],
                 q_blocks: Optional[List[Tensor]] = None, real: Optional[Tensor] = None,
                 tails: Optional[BlockTails] = None, k_blocks: Optional[List[Tensor]] = None):
        self.length, self.pad, self.last_key, self._q_tail = length, pad, last_key, q_tail
        self.store, self.q_blocks, self.real = store, q_blocks or [], real
        self.tails, self.k_blocks = tails, k_blocks or []
        self._recent: List[Tensor] = []  # the queries of step_levels' steps since q_tail was last joined

    @property
    def q_tail(self) -> Tensor:
        """The latest full-resolution queries (B, H, n, D), the newest last."""
        self._join_recent()
        return self._q_tail

    def _join_recent(self, keep: Optional[int] = None) -> None:
        """The queries of the latest one-token steps joined to ``q_tail``, its
        last ``keep`` kept (None: all)."""
        if self._recent:
            self._q_tail = torch.cat([self._q_tail, *self._recent], dim=2)[:, :, -(keep or 0):]
            self._recent = []

    @q_tail.setter
    def q_tail(self, x: Tensor) -> None:
        self._q_tail, self._recent = x, []

    def tokens(self, S: int) -> Optional[Tensor]:
        """(B, S) which keys of a call with S of them, the new ones last, are
        tokens if it continues this state (the new ones all are); None where
        it cannot."""
        if self.real is None:
            return torch.arange(S, device=self.pad.device)[None, :] >= self.pad[:, None]
        if S < self.length:
            return None
        return torch.nn.functional.pad(self.real, (0, S - self.length), value=True)

    def continues(self, key: Tensor, T: int) -> bool:
        """Whether a call with keys ``key`` (B, H_kv, S, D), its last T new,
        continues this state: S - T positions kept, the same rows, the same
        last key (assisted decoding's cropping, a cache from another call do
        not)."""
        past = key.shape[2] - T
        return (self.length == past and self.pad.shape[0] == key.shape[0]
                and torch.equal(self.last_key, key[:, :, past - 1]))

    def advance(self, key: Tensor, q_tail: Tensor) -> None:
        """The state after a step whose keys, the new ones last, are ``key``
        (B, H_kv, S, D): S positions, its last key, and ``q_tail``, the
        latest queries the next blocks are downsampled from.  ``tails`` no
        longer follows: a step other than :meth:`step_levels`'s moved on."""
        if self.real is not None:
            self.real = self.tokens(key.shape[2])
        self.length, self.last_key, self.q_tail = key.shape[2], key[:, :, -1].detach(), q_tail
        self.tails = None

    def step_levels(self, levels, query: Tensor, key: Tensor, t: List[int], tail_length: int
                    ) -> Tuple[List[Tensor], List[Tensor]]:
        """One new position per row (t[b] its position, tokens only) through
        the levels of ``levels`` (an HKTLevels): the blocks it begins made
        from ``tails``, the state moved on.  Returns the new position's query
        and key of each level (its block's), (B, heads, 1, D) each; without
        windows the coarse keys written into the store too (grown to hold
        them).  ``query`` (B, H, 1, D) and ``key`` (B, H_kv, S, D), the new
        key last."""
        B, H, _, D = query.shape
        Hk = key.shape[1]
        taps_q, taps_k = levels.q_downsample, levels.k_downsample
        # (B, 1, heads, D) in memory for one token: the heads side by side, as the levels take them
        xq = query.transpose(1, 2).reshape(B, H * D).to(taps_q.dtype)
        k_new = key[:, :, -1:]
        xk = k_new.reshape(B, Hk * D).to(taps_k.dtype)
        dense = self.store.windows is None
        if dense:
            self.store.grow(key.shape[2])
        for l, new in enumerate(self.tails.push(xq, xk, t, taps_q, taps_k), start=1):
            if new is None:
                continue
            nq, nk, rows = new
            qb = _head_maps(nq, levels.coarse_q_proj[l - 1]).to(query.dtype)
            kb = _head_maps(nk, levels.coarse_k_proj[l - 1]).to(key.dtype)
            if rows is not None:  # the other rows keep their block
                qb = torch.where(rows[:, None, None], qb, self.q_blocks[l - 1][:, :, 0])
                kb = torch.where(rows[:, None, None], kb, self.k_blocks[l - 1][:, :, 0])
            self.q_blocks[l - 1], self.k_blocks[l - 1] = qb[:, :, None], kb[:, :, None]
            if dense:  # every row's block t >> l, the unchanged ones written back as they are
                self.store.write_block(l, self.k_blocks[l - 1], [tb >> l for tb in t])
        if self.real is not None:
            self.real = self.tokens(key.shape[2])
        self.length, self.last_key = key.shape[2], key[:, :, -1].detach()
        self._recent.append(query)  # joined to q_tail only where a step of another kind reads it
        if len(self._recent) >= tail_length:
            self._join_recent(tail_length)
        return [query] + self.q_blocks, [k_new] + self.k_blocks

    def write_blocks(self, length: int, window: List[Tensor], start: Tensor, rows: Tensor) -> List[Tensor]:
        """The store grown to ``length`` positions and the blocks of the new
        positions ``rows`` (B, T) written into its coarse keys
        (:func:`_write_blocks`, from the levels ``window`` of the positions
        from ``start`` (B,)); returns those coarse keys, levels 1 .. L-1."""
        self.store.grow(length)
        self.store.k[1:] = _write_blocks(self.store.k[1:], window, start, rows)
        return self.store.k[1:]

    def keep_blocks(self, qs: List[Tensor]) -> None:
        """``q_blocks`` from a step's queries of levels 1 .. L-1 (B, H, T, D):
        each row's latest block's."""
        self.q_blocks = [x[:, :, -1:] for x in qs]

    def reorder(self, index: Tensor) -> None:
        """Rows ``index`` (B',) of the batch, as beam search reorders HF's cache."""
        index = index.to(self.pad.device)
        self.pad, self.last_key, self.q_tail = self.pad[index], self.last_key[index], self.q_tail[index]
        self.q_blocks = [x[index] for x in self.q_blocks]
        self.k_blocks = [x[index] for x in self.k_blocks]
        if self.real is not None:
            self.real = self.real[index.to(self.real.device)]
        if self.tails is not None:
            self.tails.reorder(index)
        if self.store is not None:
            self.store.reorder(index)


class PackedPrompt:
    """The decoding state a prefill of packed sequences leaves (each layer's
    ``decode_state``): none to decode from, its coarse levels formed per
    sequence; a step after it is refused by name."""

    packed = True

    def reorder(self, index: Tensor) -> None:
        """Nothing to reorder (beam search reorders before its refused step)."""


class CachedDecoding:
    """:class:`HKTLevels`' decoding steps with a cache (its ``decode_state``,
    kept by its prefill)."""

    def decode_cached(self, query, key, value, w, real, scaling, dropout, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None):
        """T new positions after S - T cached ones (HF's cache holds level 0's keys
        and values, the module's decode state the coarse levels; a layer with a
        sliding window keeps every key in HF's cache, see :func:`_note_cache`,
        and its new queries see the keys less than ``sliding_window`` back)."""
        B, H, T, D = query.shape
        S = key.shape[2]
        state = self.decode_state
        if state is None:
            raise RuntimeError("attn_implementation='hkt': a call with cached positions, but this layer kept no HKT "
                               "decoding state: the cache must be filled by this model's forward with use_cache=True, "
                               "starting from an empty cache")
        if not state.continues(key, T):
            raise _unsupported(
                "a cache that changed between steps other than by appending or beam search's reordering (assisted "
                "or speculative decoding's cropping, a cache from another call), since each layer keeps HKT's "
                "coarse levels (their blocks; with windows, their rings) outside transformers' cache, a step at a "
                "time, and cannot crop them", "generate without an assistant model (no assistant_model or "
                "prompt_lookup_num_tokens), or convert with levels=1")
        pad, count = _row_layout(real, B, S, query.device)
        layout = None  # each row's layout: a shift by its padding, or where it has holes, a gather
        if state.real is not None:
            if real is None or not torch.equal(real, state.tokens(S)):
                raise _unsupported("padding that changes during decoding")
            layout = _compact_index(real)
            # the new tokens all are: padding after a row's tokens lies just before them
            after = not bool(real[:, S - T - 1].all())
        elif not torch.equal(pad, state.pad):
            raise _unsupported("padding that changes during decoding")
        else:
            after = not bool((pad + count == S).all())
        if after:
            raise _unsupported("keys after the new tokens during decoding (right padding, or a static cache's "
                               "unfilled slots)", "pad on the left, and use the default dynamic cache")
        # the window as the decoding kernel's band where the layout keeps the model's distances
        band = sliding_window is None or (layout is None and self.windows is None)
        if T == 1 and state.tails is not None and band and _kernel_decodes(query, w, dropout, key, value):
            return self._decode_step(query, key, value, w, pad, layout, count, scaling, softcap, sliding_window)
        if self.windows is not None and state.store is not None:
            if not _kernel_decodes(query, w, dropout, key, value):
                raise _unsupported("a decoding step with gradients or dropout after a prompt run without them, "
                                   "with windows (that prompt kept the windowed decoding's rings, not every query)",
                                   "run the prompt and the steps in the same grad mode")
            return self._decode_rings(query, key, value, w, pad, layout, count, scaling, softcap)
        if self.windows is not None:
            # the windowed kernels place query i at position i: the new rows are the last T of the
            # op over every position so far (near-linear in S per step), as the uncached forward computes them
            q_all = torch.cat([state.q_tail, query], dim=2)
            out = self.prefill(q_all, key, value, w, real, scaling, dropout, False, softcap=softcap)[:, :, -T:]
            state.advance(key, q_all)
            return out
        t0, start, new_rows, q_all, qs, k_win = self._new_blocks(query, key, pad, layout, count)
        store = state.store
        coarse_k = state.write_blocks(S, k_win, start, new_rows)
        k0, v0, positions = _level0_in_layout(key, value, pad, layout)
        if band and _kernel_decodes(query, w, dropout, key, value):
            with torch.no_grad():
                out = store.attend(qs, None, None, w.detach(), t0, scaling, softcap, level0=(k0, v0),
                                   sliding_window=sliding_window)
        else:  # any device, dtype, grad mode, or a window over holes: one new token at a time
            ks = [k0] + [c[:, :, :-(-S // 2 ** l)] for l, c in enumerate(coarse_k, start=1)]
            keys = torch.arange(S, device=query.device)
            rows = []
            for i in range(T):
                seen = keys <= (t0 + i)[:, None]
                if sliding_window is not None:  # in the model's positions: the new query's is S - T + i
                    seen = seen & (S - T + i - (keys if positions is None else positions) < sliding_window)
                rows.append(hkt.hkt_attention([x[:, :, i:i + 1] for x in qs], ks, v0, w,
                                              attn_mask=seen[:, None, None, :], dropout_p=dropout, scale=scaling,
                                              softcap=softcap))
            out = torch.cat(rows, dim=2)
        state.advance(key, q_all[:, :, -self.tail_length():])
        return out

    @torch.no_grad()
    def _decode_step(self, query, key, value, w, pad, layout, count, scaling, softcap=None, sliding_window=None):
        """One new token per row, in as few torch ops as the step allows (at
        that size each op's fixed cost is the time): the blocks it begins from
        the state's tails (:meth:`HeadLevelCache.step_levels`), then every
        level attended in one call of a decoding kernel: without windows
        hkt's KV-cache kernel over transformers' cache and the coarse keys
        (each row laid out after its padding ``pad``, or by ``layout``; a
        layer's ``sliding_window`` as its band), with windows the windowed
        decoding kernel over the rings."""
        state, S = self.decode_state, key.shape[2]
        t = (count - 1).tolist()
        qs, ks = state.step_levels(self, query, key, t, self.tail_length())
        t0 = torch.tensor(t, device=query.device)
        if state.store.windows is not None:
            return state.store.attend(qs, ks, value[:, :, S - 1:], w.detach(), t0, scaling, softcap)
        k0, v0, _ = _level0_in_layout(key, value, pad, layout)
        return state.store.attend(qs, None, None, w.detach(), t0, scaling, softcap, level0=(k0, v0),
                                  sliding_window=sliding_window)

    def _new_blocks(self, query, key, pad, layout, count):
        """The coarse levels of T new positions after S - T cached ones (each
        row laid out after its padding ``pad``, or by ``layout``, see
        :func:`_layout_index`):
        (t0 (B,) each row's position, tokens only, of its first new query;
        start (B,) where the window of positions its new blocks are computed from
        begins; the new positions (B, T); every query the state and the call
        hold; qs, the new positions' query of each level; and the window's
        coarse keys, level l's block p at slot p - start / 2^l)."""
        B, H, T, D = query.shape
        L, K = self.levels, self.downsample_kernel
        top = 2 ** (L - 1)
        t0 = count - T
        # the window each row's new blocks are computed from, from an aligned start, so
        # its blocks are the row's own; its rows before the start are all the blocks need
        start = torch.clamp((t0 - K * (top - 1)) // top * top, min=0)
        n = T + self.tail_length()
        q_all = torch.cat([self.decode_state.q_tail, query], dim=2)  # each row's tokens count - q_all.shape[2] ..
        q_win = _take(q_all, _shift_index(start - (count - q_all.shape[2]), n))
        window = _layout_index(pad, layout, start, n)  # positions in the model's layout
        new_rows = (t0[:, None] + torch.arange(T, device=query.device))  # (B, T) positions of the new queries
        qs = [query]  # level l: the new positions' blocks, found in the window's level l
        qs += [_take(qc, (new_rows >> l) - (start[:, None] >> l))
               for l, qc in enumerate(self.coarse_heads(q_win, "q"), 1)]
        return t0, start, new_rows, q_all, qs, self.coarse_heads(_take(key, window), "k")

    @torch.no_grad()
    def _decode_rings(self, query, key, value, w, pad, layout, count, scaling, softcap=None):
        """T new positions through the windowed decoding kernel, the levels'
        state in the rings the prefill filled: each level's keys of the blocks
        the new positions begin, and the new values, written there, then the
        new rows read from them (hkt.decoding.windowed), at a cost bounded by the
        windows (the top level's, where it has none, by S / 2^(L-1))."""
        state, T, S = self.decode_state, query.shape[2], key.shape[2]
        t0 = count - T
        if T == 1 and not bool(((t0 & 1) == 0).any()):
            # every row at an odd position: each level's block is the one before's (t >> l = (t - 1) >> l),
            # its query kept, and no block begins, so no coarse key is written (append_windowed) or read:
            # level 0's key stands in for them.  Half the steps skip the downsampling of the window
            q_all = torch.cat([state.q_tail, query], dim=2)
            qs, ks = [query] + state.q_blocks, [key[:, :, S - 1:]] * self.levels
        else:
            t0, start, new_rows, q_all, qs, k_win = self._new_blocks(query, key, pad, layout, count)
            ks = [key[:, :, S - T:]] + [_take(kc, (new_rows >> l) - (start[:, None] >> l))
                                        for l, kc in enumerate(k_win, 1)]
            state.keep_blocks(qs[1:])
        out = state.store.attend(qs, ks, value[:, :, S - T:], w.detach(), t0, scaling, softcap)
        state.advance(key, q_all[:, :, -self.tail_length():])
        return out


def _write_blocks(caches: List[Tensor], window: List[Tensor], start: Tensor, rows: Tensor) -> List[Tensor]:
    """The coarse key caches (grown to hold the new blocks: ``LevelStore.grow``)
    with the blocks of the new positions ``rows`` (B, T) written in, from the
    levels of the window that begins at each row's position ``start``.  In place where no
    gradient is wanted (generation); else a new tensor through which the
    gradient reaches the old blocks and each new one once (several new
    positions share a block: a scatter of each would count its gradient as
    many times)."""
    out = []
    for l, (cache, kc) in enumerate(zip(caches, window), start=1):
        offset = start[:, None] >> l  # the window's first block
        if torch.is_grad_enabled() and (kc.requires_grad or cache.requires_grad):
            slots = torch.arange(cache.shape[2], device=cache.device)[None, :]
            new = (slots >= rows[:, :1] >> l) & (slots <= rows[:, -1:] >> l)  # (B, slots)
            out.append(torch.where(new[:, None, :, None], _take(kc, slots - offset), cache))
            continue
        if cache.requires_grad:  # part of an earlier call's graph, which a backward may still read
            cache = cache.detach().clone()
        block = rows >> l
        index = block[:, None, :, None].expand(-1, kc.shape[1], -1, kc.shape[3])
        out.append(cache.scatter_(2, index, _take(kc, block - offset)))
    return out


def _level0_in_layout(key: Tensor, value: Tensor, pad: Tensor, layout: Optional[Tensor]):
    """Level 0's keys and values (B, H_kv, S, D) in each row's layout (after
    its padding ``pad``, or by ``layout``: :func:`_layout_index`), and the
    model's position of each of their rows (B, S); the keys and values as
    they are and None where no row has padding."""
    if layout is None and not bool(pad.any()):
        return key, value, None
    positions = _layout_index(pad, layout, torch.zeros_like(pad), key.shape[2])
    return _take(key, positions), _take(value, positions), positions


def _head_maps(x: Tensor, maps: Tensor) -> Tensor:
    """Each head's map of its vector: x (B, heads D), the heads side by side,
    maps (heads, D, D) (torch layout, out x in); (B, heads, D)."""
    heads, D = maps.shape[0], maps.shape[2]
    return torch.bmm(x.view(-1, heads, D).transpose(0, 1), maps.transpose(1, 2)).transpose(0, 1)
