"""HKT attention in Hugging Face transformers models (docs/transformers.md).

Importing this module registers ``"hkt"`` with transformers' ``AttentionInterface``
(and its mask interface, so that models build the boolean causal-and-padding mask
for it).  Then:

    convert(model, levels=3, downsample_kernel=2, level0_weight=0.5) -> model
        gives every attention module of a loaded model (a decoder: causal HKT;
        an encoder: bidirectional) HKT's trainable parts, initialised so that
        the model computes what it computed before, and switches it to
        attn_implementation="hkt";
    from_pretrained(ModelClass, path, **kwargs) -> model
        loads a converted model saved with save_pretrained, HKT parameters included.

The attention function receives the projected, rotary-embedded query and key of
each head.  Level 0 is them; level l >= 1 causally downsamples the previous
level's query (key) sequence, per channel, with trainable taps
(:func:`hkt.downsample.causal_downsample`) and maps each head's downsampled vector
with its own trainable (head_dim x head_dim) matrix (:meth:`hkt.Levels.coarse_heads`,
each layer's levels an :class:`hkt.Levels`).  The attention itself is
:func:`hkt.hkt_attention`; decoding steps with a cache run
:func:`hkt.hkt_attention_with_kvcache` (CPU, float32/float64, no grad; with
windows the windowed decoding kernel over the rings of
its :class:`hkt.level_cache.LevelStore`) or :func:`hkt.hkt_attention` one new
token at a time (with windows, over the whole sequence).
"""
import functools
import inspect
import json
import os
import weakref
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # the extra is optional: say how to get it
    raise ImportError('hkt.integrations.transformers needs transformers 5: pip install "hkt[transformers]"') from e

import hkt
from hkt._checks import check_windows
from hkt.level_cache import HeadLevelCache, LevelStore
from hkt.levels import Levels

__all__ = ["convert", "from_pretrained", "hkt_attention_forward", "HKTLevels", "NAME"]

NAME = "hkt"
# the key in model.config (and config.json) that says a model is converted, and how
CONFIG_KEY = "hkt"
# hkt_attention_with_kvcache for decoding steps where it can run (tests turn it off
# to check the other path, hkt_attention one token at a time, against it)
_DECODE_KERNEL = True


class HKTLevels(Levels):
    """The parameters HKT adds to one attention module (its ``hkt`` child), for
    H query heads, H_kv key/value heads of D features and L levels (K taps):
    an :class:`hkt.Levels` made from projected heads (``Levels._add_head_levels``):

    * ``q_downsample`` (L-1, K, H D), ``k_downsample`` (L-1, K, H_kv D): the taps
      of level l's causal downsampling of level l-1's query and key sequences
      (channels = the heads' features side by side);
    * ``coarse_q_proj`` (L-1, H, D, D), ``coarse_k_proj`` (L-1, H_kv, D, D):
      level l's map of each head's downsampled vector (torch layout, out x in);
    * ``level_logits`` (H, L): the level weights are ``softmax(level_logits) *
      level_scale``, ``level_scale`` (a buffer, not saved: it follows from the
      config) being 1 / (level 0's weight at conversion), so that level 0's
      score starts as the model's own.

    ``levels=1`` has none of them (level 0 is the model's attention unchanged).

    ``windows`` (``Levels.windows``, from ``convert(windows=...)``): level l
    sees only the keys within its window (docs/contract.md section 1.11), at
    near-linear cost in the sequence length.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, levels: int, downsample_kernel: int,
                 level0_weight: float, *, windows=None, device=None, dtype=None) -> None:
        # windows: checked by convert (hkt's rule, docs/contract.md section 1.11); None when no level has one
        super().__init__(num_heads, head_dim, num_kv_heads, levels, downsample_kernel,
                         check_windows(windows, levels, growing=True))
        self.level0_weight = level0_weight
        self.decode_state: Optional[HeadLevelCache] = None
        # whether the module's latest call was handed a cache (_note_cache): not every
        # family passes use_cache down to its attention
        self.cached_call = False
        # levels=1 has it too (ones): the dtype and device of level_weights() (Levels._reference_weight)
        self.register_buffer("level_scale", torch.ones(num_heads, 1, device=device, dtype=dtype), persistent=False)
        self._add_head_levels(device=device, dtype=dtype)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The conversion's initialisation, MultiheadHKT.from_mha's for these
        parameters: coarse queries zero (every coarse score 0, the model's
        function unchanged), coarse keys the block averages of the model's keys
        (taps 1/K, identity maps: a meaningful target for the coarse queries),
        level 0's weight ``level0_weight`` and the rest split evenly."""
        if self.levels == 1:
            return
        w0 = self._start_from_trained(self.level0_weight)
        self.coarse_q_proj.zero_()
        eye = torch.eye(self.head_dim, dtype=self.coarse_k_proj.dtype, device=self.coarse_k_proj.device)
        self.coarse_k_proj.copy_(eye.expand_as(self.coarse_k_proj))
        self.level_scale.copy_(1.0 / w0[:, None])

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"levels={self.levels}, downsample_kernel={self.downsample_kernel}"
                + ("" if self.windows is None else f", windows={list(self.windows)}"))

    def _reference_weight(self) -> Tensor:
        return self.level_scale

    def level_weights(self) -> Tensor:
        """w (H, L) for hkt_attention: :meth:`hkt.Levels.level_weights`
        (softmax(level_logits), or ones for levels=1) times ``level_scale``."""
        return super().level_weights() * self.level_scale

    def prefill(self, query, key, value, w, real, scaling, dropout, use_cache: bool, causal: bool = True,
                window: Optional[int] = None, softcap: Optional[float] = None):
        """No cached positions: the whole op over the sequence (causal, or
        bidirectional over each row's tokens for an encoder).  Each row is
        first shifted so that its first token is at position 0, so its coarse
        blocks are those of the row alone (left padding would otherwise move their
        boundaries and average padding into them); right padding is masked.
        ``window`` (a causal layer's sliding window): query i sees key j only
        when i - j < window, as transformers' mask has it (the shift keeps the
        distances), a mask over every (query, key) pair: dense cost.  The
        module's ``windows`` (never with ``window``: convert refuses both) go to
        the windowed kernels with the key-padding mask: near-linear cost.
        ``softcap``: the model's attention-logit cap (Gemma 2's), or None."""
        B, H, T, D = query.shape
        pad, count = _row_layout(real, B, T, query.device)
        shifted = real is not None and bool(pad.any())
        q0, k0, v0 = query, key, value
        if shifted:
            index = _shift_index(pad, T)
            q0, k0, v0 = _take(query, index), _take(key, index), _take(value, index)
        mask = None
        if real is not None:  # after the shift each row's tokens are its rows 0 .. count - 1
            mask = (torch.arange(T, device=query.device) < count[:, None])[:, None, None, :]
        if window is not None:
            near = _window_mask(T, T, window, query.device)[None, None]
            mask = near if mask is None else mask & near
        qs = [q0] + self.coarse_heads(q0, "q")
        ks = [k0] + self.coarse_heads(k0, "k")
        out = hkt.hkt_attention(qs, ks, v0, w, attn_mask=mask, is_causal=causal, dropout_p=dropout, scale=scaling,
                                windows=self.windows, softcap=softcap)
        if use_cache:  # kept as transformers keeps its cache: with their graph, if any, so gradients flow across calls
            self.decode_state = self._decode_state(query, key, w, dropout, pad, count, qs, ks, v0)
        if shifted:  # back to the model's layout
            out = _take(out, _shift_index(-pad, T))
        if real is not None:  # padding rows give zeros
            out = out.masked_fill(~real[:, None, :, None], 0.0)
        return out

    def _decode_state(self, query, key, w, dropout, pad, count, qs, ks, v0) -> HeadLevelCache:
        """What a prefill of T positions keeps for the decoding steps that follow:
        the latest queries the next blocks are downsampled from, and the coarse
        keys (a :class:`hkt.level_cache.LevelStore` whose level 0 is HF's cache);
        with windows, where the steps can run the windowed decoding kernel
        (:func:`_kernel_decodes`), the levels' rings (``LevelStore.filled``
        from ``ks`` and ``v0``, each row's tokens first), else every query so
        far and no store: such a step recomputes the windowed op over the whole
        sequence."""
        T = query.shape[2]
        tail = query[:, :, -self.tail_length():]
        if self.windows is None:
            return HeadLevelCache(T, pad, key[:, :, -1].detach(), tail, LevelStore([None] + ks[1:], []))
        if not _kernel_decodes(query, w, dropout):
            return HeadLevelCache(T, pad, key[:, :, -1].detach(), query, None)
        with torch.no_grad():  # qs: each row's last token's block at each level
            last = ((count - 1).clamp(min=0)[:, None] >> torch.arange(1, self.levels, device=count.device))
            q_blocks = [_take(x, last[:, l - 1:l]) for l, x in enumerate(qs[1:], 1)]
            store = LevelStore.filled(self.windows, ks, v0, count)
        return HeadLevelCache(T, pad, key[:, :, -1].detach(), tail, store, q_blocks)

    def tail_length(self) -> int:
        """How many of the latest full-resolution queries a decoding step can need
        beyond its own: level l's block of a position t is downsampled from
        positions >= t - K (2^l - 1) (K taps, 2^l - 1 back to the block's first
        position), read from a start aligned to 2^(L-1)."""
        top = 2 ** (self.levels - 1)
        return self.downsample_kernel * (top - 1) + top

    def decode_cached(self, query, key, value, w, real, scaling, dropout, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None):
        """T new positions after S - T cached ones (HF's cache holds level 0's keys
        and values, the module's decode state the coarse levels; a layer with a
        sliding window keeps every key in HF's cache, see :func:`_note_cache`,
        and its new queries see the keys less than ``sliding_window`` back)."""
        B, H, T, D = query.shape
        S = key.shape[2]
        state = self.decode_state
        past = S - T
        if state is None:
            raise RuntimeError("attn_implementation='hkt': a call with cached positions, but this layer kept no HKT "
                               "decoding state: the cache must be filled by this model's forward with use_cache=True, "
                               "starting from an empty cache")
        if state.length != past or state.pad.shape[0] != B or not torch.equal(state.last_key, key[:, :, past - 1]):
            raise _unsupported(
                "a cache that changed between steps other than by appending or beam search's reordering (assisted "
                "or speculative decoding's cropping, a cache from another call), since each layer keeps HKT's "
                "coarse levels (their blocks; with windows, their rings) outside transformers' cache, a step at a "
                "time, and cannot crop them", "generate without an assistant model (no assistant_model or "
                "prompt_lookup_num_tokens), or convert with levels=1")
        pad, count = _row_layout(real, B, S, query.device)
        if not torch.equal(pad, state.pad):
            raise _unsupported("padding that changes during decoding")
        if not bool((pad + count == S).all()):
            raise _unsupported("keys after the new tokens during decoding (right padding, or a static cache's "
                               "unfilled slots)", "pad on the left, and use the default dynamic cache")
        if self.windows is not None and state.store is not None:
            if not _kernel_decodes(query, w, dropout):
                raise _unsupported("a decoding step with gradients or dropout after a prompt run without them, "
                                   "with windows (that prompt kept the windowed decoding's rings, not every query)",
                                   "run the prompt and the steps in the same grad mode")
            return self._decode_rings(query, key, value, w, pad, count, scaling, softcap)
        if self.windows is not None:
            # the windowed kernels place query i at position i: the new rows are the last T of the
            # op over every position so far (near-linear in S per step), as the uncached forward computes them
            q_all = torch.cat([state.q_tail, query], dim=2)
            out = self.prefill(q_all, key, value, w, real, scaling, dropout, False, softcap=softcap)[:, :, -T:]
            state.length, state.last_key, state.q_tail = S, key[:, :, -1].detach(), q_all
            return out
        t0, start, new_rows, q_all, qs, k_win = self._new_blocks(query, key, pad, count)
        store = state.store
        store.grow(S)
        store.k[1:] = _write_blocks(store.k[1:], k_win, start, new_rows)
        coarse_k = store.k[1:]
        shifted = bool(pad.any())
        k0 = _take(key, _shift_index(pad, S)) if shifted else key
        v0 = _take(value, _shift_index(pad, S)) if shifted else value
        if sliding_window is None and _kernel_decodes(query, w, dropout):
            with torch.no_grad():
                out = store.attend(qs, None, None, w.detach(), t0, scaling, softcap, level0=(k0, v0))
        else:  # any device, dtype, grad mode or window: one new token at a time, its keys those up to it
            ks = [k0] + [c[:, :, :-(-S // 2 ** l)] for l, c in enumerate(coarse_k, start=1)]
            keys = torch.arange(S, device=query.device)
            rows = []
            for i in range(T):
                seen = keys <= (t0 + i)[:, None]
                if sliding_window is not None:
                    seen = seen & (keys > (t0 + i)[:, None] - sliding_window)
                rows.append(hkt.hkt_attention([x[:, :, i:i + 1] for x in qs], ks, v0, w,
                                              attn_mask=seen[:, None, None, :], dropout_p=dropout, scale=scaling,
                                              softcap=softcap))
            out = torch.cat(rows, dim=2)
        state.length = S
        state.last_key = key[:, :, -1].detach()
        state.q_tail = q_all[:, :, -self.tail_length():]
        return out

    def _new_blocks(self, query, key, pad, count):
        """The coarse levels of T new positions after S - T cached ones:
        (t0 (B,) each row's position, tokens only, of its first new query;
        start (B,) where the window of positions its new blocks are computed from
        begins; the new positions (B, T); every query the state and the call
        hold; qs, the new positions' query of each level; and the window's
        coarse keys, level l's block p at slot p - start / 2^l)."""
        B, H, T, D = query.shape
        S = key.shape[2]
        L, K = self.levels, self.downsample_kernel
        top = 2 ** (L - 1)
        t0 = count - T
        # the window each row's new blocks are computed from, from an aligned start, so
        # its blocks are the row's own; its rows before the start are all the blocks need
        start = torch.clamp((t0 - K * (top - 1)) // top * top, min=0)
        window = _shift_index(pad + start, T + self.tail_length())  # positions in the model's layout
        q_all = torch.cat([self.decode_state.q_tail, query], dim=2)  # positions S - q_all.shape[2] .. S - 1
        q_win = _take(q_all, window - (S - q_all.shape[2]))
        new_rows = (t0[:, None] + torch.arange(T, device=query.device))  # (B, T) positions of the new queries
        qs = [query]  # level l: the new positions' blocks, found in the window's level l
        qs += [_take(qc, (new_rows >> l) - (start[:, None] >> l))
               for l, qc in enumerate(self.coarse_heads(q_win, "q"), 1)]
        return t0, start, new_rows, q_all, qs, self.coarse_heads(_take(key, window), "k")

    @torch.no_grad()
    def _decode_rings(self, query, key, value, w, pad, count, scaling, softcap=None):
        """T new positions through the windowed decoding kernel, the levels'
        state in the rings the prefill filled: each level's keys of the blocks
        the new positions begin, and the new values, written there, then the
        new rows read from them (hkt._window_decode), at a cost bounded by the
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
            t0, start, new_rows, q_all, qs, k_win = self._new_blocks(query, key, pad, count)
            ks = [key[:, :, S - T:]] + [_take(kc, (new_rows >> l) - (start[:, None] >> l))
                                        for l, kc in enumerate(k_win, 1)]
            state.q_blocks = [x[:, :, -1:] for x in qs[1:]]
        out = state.store.attend(qs, ks, value[:, :, S - T:], w.detach(), t0, scaling, softcap)
        state.length, state.last_key = S, key[:, :, -1].detach()
        state.q_tail = q_all[:, :, -self.tail_length():]
        return out


def _kernel_decodes(query: Tensor, w: Tensor, dropout: float) -> bool:
    """Whether a decoding step runs hkt's CPU decoding kernels (float32 and
    float64, no gradient wanted, no dropout: they have no backward), else
    hkt_attention one way or another."""
    return (_DECODE_KERNEL and query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
            and not (torch.is_grad_enabled() and (query.requires_grad or w.requires_grad)) and dropout == 0)


def _unsupported(what: str, instead: str = "") -> NotImplementedError:
    return NotImplementedError(f"attn_implementation='hkt': {what} is not supported" + (f"; {instead}" if instead
                                                                                          else ""))


# the last mask _real_tokens read and what it found: a model hands every layer the same mask
_last_mask = (lambda: None, None, None)


def _real_tokens(mask: Optional[Tensor], B: int, T: int, S: int, causal: bool = True) -> Optional[Tensor]:
    """:func:`_read_mask`, once per mask object (and version) a model builds."""
    global _last_mask
    if mask is None:
        return _read_mask(mask, B, T, S, causal)
    ref, key, real = _last_mask
    if ref() is mask and key == (mask._version, B, T, S, causal):
        return real
    real = _read_mask(mask, B, T, S, causal)
    _last_mask = (weakref.ref(mask), (mask._version, B, T, S, causal), real)
    return real


def _window_mask(T: int, S: int, window: int, device) -> Tensor:
    """(T, S) bool: query i (position S - T + i) sees key j when j is not after
    it and less than ``window`` back, transformers' sliding window (masking_utils:
    q - kv < sliding_window)."""
    q = torch.arange(S - T, S, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    return (k <= q) & (q - k < window)


def _read_mask(mask: Optional[Tensor], B: int, T: int, S: int, causal: bool = True, window: Optional[int] = None,
               pad: Optional[Tensor] = None) -> Optional[Tensor]:
    """Which of the S keys of each row are tokens (not padding), (B, S) bool, from
    the 4-D mask the model built (None: no padding), after checking that it is
    causal (``causal``; else bidirectional) attention over each row's tokens,
    within the layer's sliding ``window`` if it has one (causal layers only),
    and nothing else: the coarse levels
    average neighbouring tokens, which another mask (packed sequences, sliding
    windows, bidirectional blocks) would have to cut, and they cannot.  With a
    window a key is seen by the query at its own position, so a prefill's tokens
    are the keys some query sees; a decoding step's queries see only the latest
    keys, so its tokens are those from each row's first (``pad``, kept by the
    layer's decoding state; absent, the keys some query sees) on."""
    if mask is None:
        if T != S and T != 1:  # transformers' prefill into a static cache (its later slots empty)
            raise _unsupported("a static cache (cache_implementation='static') with levels > 1, since every call "
                               "gets all of its slots, the unfilled ones after the new tokens too, where HKT's "
                               "coarse levels need each row's keys up to its newest token",
                               "use the default dynamic cache (generate without cache_implementation), or convert "
                               "with levels=1")
        return None
    if mask.dim() != 4 or mask.shape[-2:] != (T, S) or mask.shape[0] not in (1, B):
        raise ValueError(f"attention_mask: expected a 4-D mask (B, 1, {T}, {S}), got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        visible = mask[:, 0]
    elif mask.is_floating_point():
        if bool((mask[:, 0] > torch.finfo(mask.dtype).min / 2).logical_and(mask[:, 0] != 0).any()):
            raise _unsupported("a float attention_mask with biases other than 0 and -inf (or the dtype's minimum)")
        visible = mask[:, 0] > torch.finfo(mask.dtype).min / 2
    else:
        raise TypeError(f"attention_mask: dtype must be bool or floating point, got {mask.dtype}")
    visible = visible.expand(B, T, S)
    pos = torch.arange(S, device=mask.device)
    if window is not None:
        if T == S or pad is None or pad.shape[0] != B:
            real = visible.any(dim=1)
        else:
            real = pos[None, :] >= pad[:, None].to(mask.device)
        if not torch.equal(visible, _window_mask(T, S, window, mask.device) & real[:, None, :]):
            raise _unsupported(f"an attention mask other than causal attention over each row's tokens within the "
                               f"layer's sliding window ({window} positions)")
    else:
        real = visible[:, -1]  # the last query (position S - 1) sees every token of its row
        # query i is position S - T + i
        allowed = (pos[None, :] <= pos[S - T:, None] if causal
                   else torch.ones(T, S, dtype=torch.bool, device=mask.device))
        # every row, padding queries too: packed sequences' mask looks like left padding
        # from its last row alone
        if not torch.equal(visible, allowed & real[:, None, :]):
            raise _unsupported(f"an attention mask other than {'causal' if causal else 'bidirectional'} attention "
                               "over each row's tokens (packed "
                               "sequences, sliding windows, bidirectional blocks, a static cache's unfilled slots, a "
                               "custom 4-D mask)")
    first = torch.where(real.any(dim=1), real.int().argmax(dim=1), 0)
    count = real.sum(dim=1)
    if not torch.equal(real, (pos >= first[:, None]) & (pos < (first + count)[:, None])):
        raise _unsupported("padding inside a sequence (each row's tokens must be one run, padded on the left "
                           "and/or the right)")
    if bool(real.all()):
        return None
    return real


def _shift_index(pad: Tensor, n: int) -> Tensor:
    """(B, n) indices pad[b] + i: n positions of row b from position pad[b] on
    (for :func:`_take`, which clamps them into range)."""
    return pad[:, None] + torch.arange(n, device=pad.device)


def _take(x: Tensor, index: Tensor) -> Tensor:
    """x (B, h, N, D) at positions index (B, n) of dim 2 (clamped into range:
    the rows read past the end lie after every token, where causality keeps
    them from mattering)."""
    index = index.clamp(0, x.shape[2] - 1)
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def hkt_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                          **kwargs):
    """The function transformers calls for attn_implementation="hkt": query
    (B, H, T, D), key and value (B, H_kv, S, D) with S - T cached positions
    before the T new ones, ``attention_mask`` the model's 4-D boolean mask (or
    None: causal, no padding).  Returns (output (B, T, H, D), None)."""
    levels = getattr(module, "hkt", None)
    if not isinstance(levels, HKTLevels):
        raise RuntimeError(f"{type(module).__name__}: has no HKT parameters; run "
                           "hkt.integrations.transformers.convert(model) before attn_implementation='hkt'")
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise _unsupported(name)
    softcap = kwargs.get("softcap")  # Gemma 2's attn_logit_softcapping: hkt caps the combined score
    # the layer's sliding window: at levels=1 the model's own mask carries it
    window = kwargs.get("sliding_window")
    if window is None:
        window = _windowed(module)
    if kwargs.get("output_attentions"):
        raise _unsupported("output_attentions=True (the kernels never form the attention weights)")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    B, H, T, D = query.shape
    S = key.shape[2]
    if (H, key.shape[1], D) != (levels.num_heads, levels.num_kv_heads, levels.head_dim):
        raise ValueError(f"{type(module).__name__}: the attention function received {H} query heads, "
                         f"{key.shape[1]} key heads of {D} features, but convert read {levels.num_heads}, "
                         f"{levels.num_kv_heads} and {levels.head_dim} from the module")
    w = levels.level_weights().to(query.dtype)
    if levels.levels == 1:  # the model's own attention: any mask it builds
        return _level0(query, key, value, w, attention_mask, scaling, dropout, causal, softcap).transpose(1, 2), None
    if not causal and S != T:
        raise _unsupported("non-causal attention with keys other than the queries' own (cross-attention, or a "
                           "bidirectional model's cache) with levels > 1", "convert with levels=1")
    if window is not None and not causal:
        raise _unsupported("a sliding window on bidirectional attention with levels > 1", "convert with levels=1")
    if window is None:
        real = _real_tokens(attention_mask, B, T, S, causal)
    else:
        state = levels.decode_state
        # not cached per mask as _real_tokens does: a decoding step's reading depends on the layer's state
        real = _read_mask(attention_mask, B, T, S, causal, window, None if state is None else state.pad)
    if S == T:
        keep = causal and (levels.cached_call or bool(kwargs.get("use_cache")))
        out = levels.prefill(query, key, value, w, real, scaling, dropout, keep, causal, window, softcap)
    else:
        out = levels.decode_cached(query, key, value, w, real, scaling, dropout, window, softcap)
    return out.transpose(1, 2), None


def _level0(query, key, value, w, mask, scaling, dropout, causal, softcap=None):
    """levels=1: the model's attention, on hkt's kernels, with its own mask."""
    T = query.shape[2]
    if mask is None:  # no padding; causal: T = S, a static cache's first T of S, or one new token
        return hkt.hkt_attention([query], [key], value, w, is_causal=causal and T > 1, dropout_p=dropout,
                                 scale=scaling, softcap=softcap)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return hkt.hkt_attention([query], [key], value, w, attn_mask=mask, dropout_p=dropout, scale=scaling,
                             softcap=softcap)


def _row_layout(real: Optional[Tensor], B: int, S: int, device):
    """(pad, count): each row's padding before its tokens and its token count (B,)."""
    if real is None:
        return torch.zeros(B, dtype=torch.long, device=device), torch.full((B,), S, dtype=torch.long, device=device)
    count = real.sum(dim=1)
    pad = torch.where(count > 0, real.int().argmax(dim=1), 0)
    return pad, count


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


def _reorder_cache(model: nn.Module, cache, beam_idx: Tensor):
    """Beam search's cache reordering (``generate`` calls ``model._reorder_cache``
    where a model has one): transformers' cache as it would be reordered
    without HKT (by the model class's own ``_reorder_cache`` where it has one),
    and every converted layer's coarse levels with it."""
    own = getattr(type(model), "_reorder_cache", None)
    if own is not None:
        cache = own(model, cache, beam_idx)
    else:
        cache.reorder_cache(beam_idx)
    for m in model.modules():
        if isinstance(m, HKTLevels) and m.decode_state is not None:
            m.decode_state.reorder(beam_idx)
    return cache


def _reads_attention_interface(cls) -> bool:
    """Whether a module class's forward looks up transformers' attention
    functions (``ALL_ATTENTION_FUNCTIONS``, the AttentionInterface): in the
    installed transformers every attention class that routes through the
    interface does so in its own ``forward``, whatever its projections are
    called (fused ones included)."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _attention_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of a transformers model that call the AttentionInterface."""
    return [m for m in model.modules() if _reads_attention_interface(type(m))]


def _first_attr(objects, names):
    for obj in objects:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _head_shape(m: nn.Module):
    """(H, H_kv, D) of an attention module: from its own attributes where it
    has them (each family names them its own way), else from its config."""
    config = getattr(m, "config", None)
    H = _first_attr([m, config], ("num_heads", "num_attention_heads"))
    D = _first_attr([m], ("head_dim", "head_size", "attention_head_size")) or _first_attr([config], ("head_dim",))
    if D is None and H and _first_attr([config], ("hidden_size",)):
        D = config.hidden_size // H
    Hk = _first_attr([m], ("num_key_value_heads", "num_kv_heads"))
    groups = _first_attr([m], ("num_key_value_groups",))
    if Hk is None and groups and H:
        Hk = H // groups
    if Hk is None:
        Hk = _first_attr([config], ("num_key_value_heads",)) or H
    if not H or not D:
        raise ValueError(f"model: {type(m).__name__} names neither its heads nor its head size in a way HKT reads "
                         "(num_heads / num_attention_heads, head_dim / head_size, or its config's)")
    return H, Hk, D


def _windowed(m: nn.Module) -> Optional[int]:
    """The sliding window an attention module passes to the attention function:
    its own attribute where it has one (per layer, as Qwen2 and Gemma 2/3
    alternate), else its config's (Mistral, Phi-3, Starcoder2 read it there)."""
    if hasattr(m, "sliding_window"):
        return m.sliding_window
    return getattr(getattr(m, "config", None), "sliding_window", None)


# the names under which transformers' attention classes take the cache
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _note_cache(module: nn.Module, args, kwargs) -> None:
    """A converted attention module's forward pre-hook: records whether this
    call has a cache to which a later call appends (then its prefill keeps the
    coarse levels' decoding state).  With levels > 1 a layer with a sliding
    window gets a cache layer that keeps every key (transformers' keeps the
    last window's only): the coarse levels' decoding reads the keys of the
    blocks it forms in the row's own layout, which may lie before the window."""
    caches = [kwargs[name] for name in _CACHE_ARGS if kwargs.get(name) is not None]
    module.hkt.cached_call = bool(caches)
    if caches and module.hkt.levels > 1 and _windowed(module) is not None:
        _keep_every_key(caches[0], getattr(module, "layer_idx", None))


def _keep_every_key(cache, index: Optional[int]) -> None:
    """Replaces a cache's sliding-window layer ``index``, while still empty, by
    a layer that keeps every key (transformers' mask then covers them all)."""
    layers = getattr(cache, "layers", None)
    if index is None or not isinstance(layers, list) or not 0 <= index < len(layers):
        return
    if not getattr(layers[index], "is_sliding", False):
        return
    if getattr(layers[index], "is_initialized", False):
        raise _unsupported("a cache that keeps only a sliding window of keys, already filled, with levels > 1",
                           "start from an empty cache: the model's converted layers then keep every key")
    from transformers.cache_utils import DynamicLayer
    layers[index] = DynamicLayer()


def _check_options(levels, downsample_kernel, level0_weight) -> None:
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels: expected an int >= 1, got {levels!r}")
    if isinstance(downsample_kernel, bool) or not isinstance(downsample_kernel, int) or downsample_kernel < 1:
        raise ValueError(f"downsample_kernel: expected an int >= 1, got {downsample_kernel!r}")
    if not isinstance(level0_weight, (int, float)) or isinstance(level0_weight, bool) or not 0 < level0_weight < 1:
        raise ValueError(f"level0_weight: must be in (0, 1), got {level0_weight!r}")


def convert(model: nn.Module, levels: int = 3, downsample_kernel: int = 2, *, level0_weight: float = 0.5,
            windows: Optional[List[Optional[int]]] = None) -> nn.Module:
    """Turns a loaded transformers model into an HKT model, in place, and returns it.

    Its attention modules are those whose forward calls transformers'
    AttentionInterface (whatever their projections are called: Llama's
    ``q_proj``, Phi-3's fused ``qkv_proj``, GPT-2's ``c_attn``, BERT's
    ``query``), with their head counts and head size read from the module or
    its config.  Every one gets an :class:`HKTLevels` child ``hkt`` on the
    device and in the dtype of its parameters, initialised so that the
    model computes what it computed before (levels=1 is the same attention,
    on hkt's kernels); the new parameters train if the attention's did.  The
    model's config gets ``hkt = {"levels", "downsample_kernel",
    "level0_weight"}`` (saved by ``save_pretrained``; :func:`from_pretrained`
    reads it) and attn_implementation "hkt".  Causal attention (decoders)
    becomes causal HKT; bidirectional attention (encoders, ``is_causal``
    False) non-causal HKT over each row's tokens.  A layer with a sliding
    window (Mistral's, Qwen2's, Gemma 2/3's local layers) keeps it: every
    level sees exactly the keys the model's mask lets the layer see, a mask
    over every (query, key) pair (dense cost); with levels > 1 its cache
    layer keeps every key.

    ``windows`` (None, or one entry per level: None or W_l tokens, a
    positive multiple of 2^l, growing with the level; docs/contract.md
    section 1.11) gives every converted layer per-level windows: level l sees
    only the keys whose level-l block is less than W_l / 2^l blocks from the
    query's, at near-linear cost in the sequence length on the CPU (the
    windowed kernels run there only).  Stored in ``config.hkt["windows"]``.
    It needs levels >= 2 (with one level a window is a plain sliding window
    that hides every key beyond it) and a model without sliding-window
    layers of its own.  A decoding step with the cache runs the windowed
    decoding kernel over rings filled at the prompt (CPU, float32/float64,
    no gradients; a cost bounded by the windows), elsewhere it recomputes
    the windowed op over the whole sequence (near-linear in its length).

    Raises:
        ValueError for bad options (``windows[l]`` named), a model with no
        such attention module, one already converted, (levels > 1)
        cross-attention, or windows on a model with sliding-window layers,
        each saying what to do instead;
        NotImplementedError (later) from ``generate`` with a static cache
        and levels > 1, or with assisted decoding (a cropped cache).
    """
    _check_options(levels, downsample_kernel, level0_weight)
    windows = check_windows(windows, levels, growing=True)
    if windows is not None and levels == 1:
        raise ValueError("windows: needs levels >= 2 (with one level a window is a plain sliding window that hides "
                         "every key beyond it); convert with levels >= 2, the top level without a window")
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(f"model: no attention module of transformers' AttentionInterface kind found in "
                         f"{type(model).__name__}")
    shapes = []
    for m in modules:
        name = f"{type(m).__name__} (layer {getattr(m, 'layer_idx', '?')})"
        if isinstance(getattr(m, "hkt", None), HKTLevels):
            raise ValueError("model: already converted to HKT")
        if levels > 1 and getattr(m, "is_cross_attention", False):
            raise ValueError(f"model: {name} is cross-attention, whose keys come from another sequence: HKT's "
                             "coarse levels are for self-attention; convert with levels=1")
        if windows is not None and _windowed(m) is not None:
            raise ValueError(f"windows: {name} has a sliding window of its own ({_windowed(m)} positions), which "
                             "per-level windows would replace; convert it without windows, or build it without "
                             "its sliding window")
        shapes.append(_head_shape(m))
    for m, (H, Hk, D) in zip(modules, shapes):
        ref = next(m.parameters())
        trains = any(p.requires_grad for p in m.parameters())
        m.hkt = HKTLevels(H, Hk, D, levels, downsample_kernel, level0_weight, windows=windows, device=ref.device,
                          dtype=ref.dtype)
        m.hkt.requires_grad_(trains)
        m.register_forward_pre_hook(_note_cache, with_kwargs=True)
    model.config.hkt = {"levels": levels, "downsample_kernel": downsample_kernel, "level0_weight": level0_weight}
    if windows is not None:  # only then: a conversion without windows keeps the config it always had
        model.config.hkt["windows"] = list(windows)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise ValueError(f"model: {type(model).__name__} does not take a registered attention implementation")
    # generate's beam search asks the model first, then the cache
    model._reorder_cache = functools.partial(_reorder_cache, model)
    return model


def _checkpoint_tensors(path: str, wanted: List[str]) -> Dict[str, Tensor]:
    """The tensors named ``wanted`` from the safetensors checkpoint in ``path``
    (one file or shards with an index)."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = {name: "model.safetensors" for name in wanted}
    files: Dict[str, List[str]] = {}
    for name in wanted:
        if name not in weight_map:
            raise ValueError(f"path: the checkpoint in {path} has no {name} (its config says it is an HKT model)")
        files.setdefault(weight_map[name], []).append(name)
    out = {}
    for file, names in files.items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            have = set(f.keys())
            for name in names:
                if name not in have:
                    raise ValueError(f"path: the checkpoint in {path} has no {name} (its config says it is an "
                                     "HKT model)")
                out[name] = f.get_tensor(name)
    return out


def from_pretrained(model_class, path: str, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` of a model converted and
    saved with ``save_pretrained``: its base weights loaded by transformers,
    converted with the options in its config (``config.hkt``), then its HKT
    parameters loaded from the checkpoint.  ``path`` is a local directory.
    ``model_class`` may be an Auto class (``AutoModel``,
    ``AutoModelForCausalLM``): the class it picks for the saved config loads it."""
    if getattr(model_class, "_model_mapping", None) is not None:  # an Auto class
        from transformers import AutoConfig
        from transformers.models.auto.auto_factory import _get_model_class
        model_class = _get_model_class(AutoConfig.from_pretrained(path), model_class._model_mapping)
    config = model_class.config_class.from_pretrained(path)
    options = getattr(config, CONFIG_KEY, None)
    if not isinstance(options, dict):
        raise ValueError(f"path: the config in {path} has no '{CONFIG_KEY}' entry: not saved from a model converted "
                         "by hkt.integrations.transformers.convert")
    options = dict(options)
    # transformers' own list of checkpoint keys the class does not define but expects:
    # the HKT parameters, which convert adds after it loads the rest (its load
    # report would otherwise call them unexpected)
    own = "_keys_to_ignore_on_load_unexpected" in model_class.__dict__
    before = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected")
    model_class._keys_to_ignore_on_load_unexpected = list(before or []) + [r"\.hkt\."]
    try:
        model = model_class.from_pretrained(path, **kwargs)
    finally:
        if own:
            model_class._keys_to_ignore_on_load_unexpected = before
        else:
            del model_class._keys_to_ignore_on_load_unexpected
    convert(model, options.pop("levels"), options.pop("downsample_kernel"), **options)
    names = [n for n in model.state_dict() if ".hkt." in n]
    loaded = _checkpoint_tensors(path, names)
    missing, _ = model.load_state_dict(loaded, strict=False)
    left = [n for n in missing if ".hkt." in n]
    if left:
        raise ValueError(f"path: the checkpoint in {path} lacks HKT parameters {left[:3]}")
    return model


AttentionInterface.register(NAME, hkt_attention_forward)
# the boolean causal mask with padding that sdpa takes (or None when there is none)
AttentionMaskInterface.register(NAME, sdpa_mask)
