"""A converted layer's levels (:class:`HKTLevels`, the layout of
:class:`hkt.Levels` made from projected heads) and its prefill: the whole op
over a sequence with no cached positions, and the decoding state it keeps
for the steps that follow (hkt/integrations/transformers/decoding.py).

Shapes below: B batch, N sequence length, H query heads, H_kv key/value
heads of D features, L levels, K taps."""
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

import hkt
from hkt._core.checks import check_windows
from hkt.decoding.level_cache import LevelStore
from hkt.decoding.tails import BlockTails
from hkt.downsample import causal_downsample
from hkt.nn.levels import Levels

from .decoding import CachedDecoding, HeadLevelCache, PackedPrompt, _kernel_decodes
from .masks import (_band, _compact_index, _layout_index, _one_run, _placed_index, _row_layout, _shift_index,
                    _split_documents, _take)


class HKTLevels(CachedDecoding, Levels):
    """The parameters HKT adds to one attention module (its ``hkt`` child), for
    H query heads, H_kv key/value heads of D features and L levels (K taps):
    an :class:`hkt.Levels` made from projected heads (:meth:`coarse_levels`),
    a map per head and no bias:

    * ``q_downsample`` (L-1, K, H D), ``k_downsample`` (L-1, K, H_kv D): the taps
      of level l's causal downsampling of level l-1's query and key sequences
      (channels = the heads' features side by side);
    * ``coarse_q_proj`` (L-1, H, D, D), ``coarse_k_proj`` (L-1, H_kv, D, D):
      level l's map of each head's downsampled vector (torch layout, out x in);
    * ``level_logits`` (H, L): the level weights are ``softmax(level_logits)``
      (``level_weights()``, convex as everywhere) and the op is handed them times
      ``level_scale`` (``scaled_level_weights()``), ``level_scale`` (a buffer, not saved: it follows from the
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
                         check_windows(windows, levels, growing=True), device, dtype)
        self.level0_weight = level0_weight
        self.decode_state: Optional[Union[HeadLevelCache, PackedPrompt]] = None
        # whether the module's latest call was handed a cache (_note_cache): not every
        # family passes use_cache down to its attention
        self.cached_call = False
        # levels=1 has it too (ones), so that scaled_level_weights() needs no branch
        self.register_buffer("level_scale", torch.ones(num_heads, 1, device=device, dtype=dtype), persistent=False)
        self._add_coarse_levels(device=device, dtype=dtype)
        self.reset_parameters()

    def _add_coarse_levels(self, device=None, dtype=None) -> None:
        """Registers the parameters the class's docstring lists, in its order
        (None of them for levels=1)."""
        if self.levels == 1:
            for name in ("q_downsample", "k_downsample", "coarse_q_proj", "coarse_k_proj", "level_logits"):
                self.register_parameter(name, None)
            return
        H, Hk, D, Lc, K = self.num_heads, self.num_kv_heads, self.head_dim, self.levels - 1, self.downsample_kernel
        kw = {"device": device, "dtype": dtype}
        self.q_downsample = nn.Parameter(torch.empty(Lc, K, H * D, **kw))
        self.k_downsample = nn.Parameter(torch.empty(Lc, K, Hk * D, **kw))
        self.coarse_q_proj = nn.Parameter(torch.empty(Lc, H, D, D, **kw))
        self.coarse_k_proj = nn.Parameter(torch.empty(Lc, Hk, D, D, **kw))
        self.level_logits = nn.Parameter(torch.empty(H, self.levels, **kw))

    def _reset_coarse_projections(self) -> None:
        """For training from scratch (:meth:`hkt.Levels._reset_levels`; a
        conversion starts from :meth:`reset_parameters` instead): each head's
        map xavier_uniform."""
        for maps in (self.coarse_q_proj, self.coarse_k_proj):
            for l in range(self.levels - 1):
                for h in range(maps.shape[1]):
                    nn.init.xavier_uniform_(maps[l, h])

    def coarse_heads(self, x: Tensor, stream: str, inputs: Optional[List[Tensor]] = None) -> List[Tensor]:
        """Levels 1 .. L-1 of one stream of projected heads, the query
        (``stream="q"``) or key (``"k"``) heads x (B, heads, N, D): level l
        (B, heads, ceil(N / 2^l), D), the block p of which depends only on
        x's rows <= 2^l p.  ``inputs``, a list: each level's sequence before
        its projection, (B, ceil(N / 2^l), heads D), levels 0 .. L-2,
        appended to it (what a decoding state keeps the latest of)."""
        taps, proj = (self.q_downsample, self.coarse_q_proj) if stream == "q" else (self.k_downsample,
                                                                                  self.coarse_k_proj)
        B, Hx, N, D = x.shape
        flat = x.transpose(1, 2).reshape(B, N, Hx * D).to(taps.dtype)
        out = []
        for l in range(1, self.levels):
            if inputs is not None:
                inputs.append(flat)
            flat = causal_downsample(flat, taps[l - 1])
            n = flat.shape[1]
            out.append(torch.einsum("bnhd,hed->bhne", flat.view(B, n, Hx, D), proj[l - 1]).to(x.dtype))
        return out

    def coarse_levels(self, query: Tensor, key: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        """Levels 1 .. L-1 of the projected query heads (B, H, N, D) and key
        heads (B, H_kv, S, D): :meth:`coarse_heads` of each; empty for
        levels=1."""
        if self.levels == 1:
            return [], []
        return self.coarse_heads(query, "q"), self.coarse_heads(key, "k")

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

    def scaled_level_weights(self) -> Tensor:
        """w (H, L) for hkt_attention: the convex :meth:`hkt.Levels.level_weights`
        (softmax(level_logits), or ones for levels=1) times ``level_scale``."""
        return self.level_weights() * self.level_scale

    def prefill(self, query, key, value, w, real, scaling, dropout, use_cache: bool, causal: bool = True,
                window: Optional[int] = None, softcap: Optional[float] = None):
        """No cached positions: the whole op over the sequence (causal, or
        bidirectional over each row's tokens for an encoder).  Each row is
        first laid out with its tokens at positions 0 .. count - 1, so its
        coarse blocks are those of the row alone (padding would otherwise move
        their boundaries and average padding into them): shifted by its left
        padding where its tokens are one run, else gathered in order (a pad
        token inside a prompt); right padding is masked.
        ``window`` (a causal layer's sliding window): query i sees key j only
        when i - j < window in the model's positions, as transformers' mask has
        it: the kernels' band (``sliding_window``: T x window work) where a
        shift keeps the distances, a mask over every (query, key) pair where a
        gather does not (holes): dense cost.  The
        module's ``windows`` (never with ``window``: convert refuses both) go to
        the windowed kernels with the key-padding mask: near-linear cost.
        ``softcap``: the model's attention-logit cap (Gemma 2's), or None."""
        B, H, T, D = query.shape
        pad, count = _row_layout(real, B, T, query.device)
        # each row's layout where its tokens are not one run; None: a shift by its padding
        layout = None if real is None or _one_run(real, pad, count) else _compact_index(real)
        shifted = real is not None and (layout is not None or bool(pad.any()))
        q0, k0, v0 = query, key, value
        if shifted:
            index = _layout_index(pad, layout, torch.zeros_like(pad), T)
            q0, k0, v0 = _take(query, index), _take(key, index), _take(value, index)
        mask = None
        if real is not None:  # in the layout each row's tokens are its rows 0 .. count - 1
            mask = (torch.arange(T, device=query.device) < count[:, None])[:, None, None, :]
        band = None  # the window as the kernels' band, where the layout keeps the model's distances
        if window is not None and layout is None:
            band = window
        elif window is not None:
            mask = _band(layout, window) if mask is None else mask & _band(layout, window)
        # the levels' inputs, whose latest elements the decoding state keeps (_decode_state)
        inputs = ([], []) if use_cache and _kernel_decodes(query, w, dropout, key, value) else (None, None)
        qs = [q0] + self.coarse_heads(q0, "q", inputs[0])
        ks = [k0] + self.coarse_heads(k0, "k", inputs[1])
        out = hkt.hkt_attention(qs, ks, v0, w, attn_mask=mask, is_causal=causal, dropout_p=dropout, scale=scaling,
                                windows=self.windows, softcap=softcap, sliding_window=band)
        if use_cache:  # kept as transformers keeps its cache: with their graph, if any, so gradients flow across calls
            self.decode_state = self._decode_state(query, key, w, dropout, pad, count, qs, ks, v0,
                                                   None if layout is None else real, inputs)
        if shifted:  # back to the model's layout
            out = _take(out, _shift_index(-pad, T) if layout is None else _placed_index(real))
        if real is not None:  # padding rows give zeros
            out = out.masked_fill(~real[:, None, :, None], 0.0)
        return out

    def _decode_state(self, query, key, w, dropout, pad, count, qs, ks, v0, holes=None, inputs=(None, None)
                      ) -> HeadLevelCache:
        """What a prefill of T positions keeps for the decoding steps that follow:
        the latest queries the next blocks are downsampled from (each row's
        latest tokens'), and the coarse
        keys (a :class:`hkt.decoding.level_cache.LevelStore` whose level 0 is HF's cache);
        with windows, where the steps can run the windowed decoding kernel
        (:func:`_kernel_decodes`), the levels' rings (``LevelStore.filled``
        from ``ks`` and ``v0``, each row's tokens first), else every query so
        far and no store: such a step recomputes the windowed op over the whole
        sequence.  ``holes`` (B, T): which positions are tokens where some
        row's are not one run (the steps lay the rows out from it), else None.
        Where the steps run the decoding kernels, ``inputs`` (each stream's
        levels before their projections, from coarse_heads) give the state's
        ``tails``: its one-token steps then make only the blocks they begin."""
        T = query.shape[2]
        n = self.tail_length()
        # in the layout's order: a row's latest tokens are not its latest positions when it has holes
        tail = query[:, :, -n:] if holes is None else _take(qs[0], _shift_index(count - n, n))
        last_key = key[:, :, -1].detach()
        if self.windows is None:
            store = LevelStore([None] + ks[1:], [])
            if inputs[0] is None or self.levels == 1:
                return HeadLevelCache(T, pad, last_key, tail, store, real=holes)
        elif not _kernel_decodes(query, w, dropout, key, v0):
            return HeadLevelCache(T, pad, last_key, query, None, real=holes)
        with torch.no_grad():
            if self.windows is not None:
                store = LevelStore.filled(self.windows, ks, v0, count)
            tails = BlockTails.of_levels(inputs[0], inputs[1], count, self.downsample_kernel)
            return HeadLevelCache(T, pad, last_key, tail, store, _latest_blocks(qs, count), holes, tails,
                                  _latest_blocks(ks, count))

    def tail_length(self) -> int:
        """How many of the latest full-resolution queries a decoding step can need
        beyond its own: level l's block of a position t is downsampled from
        positions >= t - K (2^l - 1) (K taps, 2^l - 1 back to the block's first
        position), read from a start aligned to 2^(L-1)."""
        top = 2 ** (self.levels - 1)
        return self.downsample_kernel * (top - 1) + top


def prefill_documents(levels: HKTLevels, query, key, value, w, real, docs, scaling, dropout, causal, window,
                      softcap):
    """A prefill whose rows hold packed sequences (``docs`` (B, T), from the
    model's block-diagonal mask): each sequence a row of its own, right-padded
    (``_split_documents``), through :meth:`HKTLevels.prefill`, so that no
    coarse block mixes two of them, and back to the model's layout.  Keeps no
    decoding state."""
    rows, index, tokens, (row, slot) = _split_documents(docs, real)
    q, k, v = ((x[rows, :, index]).transpose(1, 2) for x in (query, key, value))
    out = levels.prefill(q, k, v, w, None if bool(tokens.all()) else tokens, scaling, dropout, False, causal, window,
                         softcap)
    return out[row, :, slot].permute(0, 2, 1, 3)


def _latest_blocks(qs, count: Tensor):
    """Each row's last token's block at each level l >= 1 (B, H, 1, D), of
    ``qs`` (every level's queries, each row's tokens first; row b's first
    ``count[b]`` positions its tokens)."""
    last = (count - 1).clamp(min=0)[:, None] >> torch.arange(1, len(qs), device=count.device)
    return [_take(x, last[:, l - 1:l]) for l, x in enumerate(qs[1:], 1)]
