"""hkt.LevelCache: the decoding state of a module's levels, what
:meth:`hkt.MultiheadHKT.decode` keeps between calls (made by
:meth:`hkt.MultiheadHKT.init_cache`), and the step that advances it.

Causal HKT can be decoded token by token: with causal downsampling anchored at
2^l p, the level-l query and key of block p depend only on tokens <= 2^l p, so
they are known as soon as that token arrives, and a position t needs nothing
after t.  The module's level 0 (its projections, out_proj) and its
:class:`hkt.Levels` parameters are read through their public names.

The levels' keys, values and value sums, and the step that writes new
positions into them and attends, are a :class:`LevelStore`, which a converted
transformers layer's state
(hkt.integrations.transformers.decoding.HeadLevelCache) holds too.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.attention import heads as _heads
from .windowed import _rows, cache_rows, decode_windowed, fill_windowed
from ..kvcache import hkt_attention_with_kvcache

__all__ = ["LevelCache", "LevelStore"]

def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name}: must be at least 1, got {x}")
    return x


class _Constants:
    """What a decoding step reads from the module besides its input, kept in
    the cache between steps (:meth:`LevelCache._step_constants`).

    projs, w: ``level_projections()`` and ``level_weights()``.
    taps: per level l >= 1, (2, K, E): the query stream's and the key stream's
        taps (one per feature) in the order of ``LevelCache.inputs`` (oldest
        first), so that one product with the state, summed, gives both streams'
        next element.
    stacked: per level l >= 1, when query and key projections have the same
        shape (no grouped kv heads) and both or neither have a bias, (weights
        (2, E, E), bias (2, 1, E) or None): both projections in one batched
        matmul; else None.
    """

    def __init__(self, module) -> None:
        self.projs = module.level_projections() if module.levels > 1 else []
        self.w = module.level_weights()
        self.taps: List[Tensor] = []
        self.stacked: List[Optional[Tuple[Tensor, Optional[Tensor]]]] = []
        for l in range(1, module.levels):
            self.taps.append(torch.stack([module.q_downsample[l - 1].flip(0), module.k_downsample[l - 1].flip(0)]))
            cwq, cbq, cwk, cbk = self.projs[l]
            if cwq.shape != cwk.shape or (cbq is None) != (cbk is None):
                self.stacked.append(None)
                continue
            bias = None if cbq is None else torch.stack([cbq, cbk]).unsqueeze(1)
            self.stacked.append((torch.stack([cwq.t(), cwk.t()]), bias))


class LevelStore:
    """Each level's keys and value sums: the decoding state that
    :class:`LevelCache` (a module's) and ``HeadLevelCache`` (a converted
    transformers layer's) both keep, and the step that writes new positions
    into it and attends to them.

    k[l] (B, H_kv, rows_l, D): level l's key of each block; k[0] None where
    level 0 is kept elsewhere (a converted layer's, in transformers' cache:
    :meth:`attend`'s ``level0``).
    sums[l] (B, H_kv, rows_l, Dv): level l's block sums of the values,
    sums[0] the values; with windows every level's, without only level 0's
    (none where level 0 is kept elsewhere).
    windows: None, or one entry per level.  A level with a window keeps a
    ring of ``cache_rows`` rows (block c in row c % rows_l), what a step
    reads; every other level all its blocks: ceil(max_len / 2^l) of them, or
    with ``max_len`` None an array grown by doubling (:meth:`grow`: a
    generation's length is not known in advance).
    chunk: the most new positions one round of a windowed call writes and
    then reads (``cache_rows``).
    """

    def __init__(self, k: List[Optional[Tensor]], sums: List[Tensor], windows=None,
                 max_len: Optional[int] = None) -> None:
        self.k, self.sums, self.max_len = k, sums, max_len
        self.windows = None if windows is None else tuple(windows)
        # an unknown max_len: one too large for any ring to hold every block
        self.chunk = None if windows is None else cache_rows(self.windows, max_len or 1 << 48)[1]

    @classmethod
    def empty(cls, batch_size: int, kv_heads: int, head_dim: int, levels: int, windows, max_len: int,
              **kw) -> "LevelStore":
        """Zeros for ``max_len`` positions, ``kw`` the tensors' device and dtype."""
        B, L = batch_size, levels
        # every block of each level, or with windows rings where the steps read only near the newest token
        rows = [-(-max_len // 2**l) for l in range(L)] if windows is None else cache_rows(windows, max_len)[0]
        k = [torch.zeros(B, kv_heads, rows[l], head_dim, **kw) for l in range(L)]
        sums = [torch.zeros(B, kv_heads, rows[l], head_dim, **kw) for l in range(1 if windows is None else L)]
        return cls(k, sums, windows, max_len)

    @classmethod
    def filled(cls, windows, k: List[Tensor], v: Tensor, counts: Tensor) -> "LevelStore":
        """A windowed store of unknown ``max_len`` filled from a prompt: k[l]
        (B, H_kv, ceil(T / 2^l), D) the level-l keys, v (B, H_kv, T, Dv) the
        values, row b's tokens its first ``counts[b]`` positions."""
        windows = tuple(windows)
        T = v.shape[2]
        B, Hk, _, D = k[0].shape
        rows = [r if W is not None else -(-T >> l)
                for l, (r, W) in enumerate(zip(cache_rows(windows, 1 << 48)[0], windows))]
        store = cls([k[0].new_zeros(B, Hk, rows[l], D) for l in range(len(k))],
                    [v.new_zeros(B, Hk, rows[l], v.shape[3]) for l in range(len(k))], windows)
        counts = [int(c) for c in counts]
        if all(c == T for c in counts):
            fill_windowed(store.k, store.sums, k, v)
        else:  # each row's own length
            for b, c in enumerate(counts):
                fill_windowed([x[b:b + 1] for x in store.k], [x[b:b + 1] for x in store.sums],
                              [x[b:b + 1, :, :-(-c >> l)] for l, x in enumerate(k)], v[b:b + 1, :, :c])
        return store

    def grow(self, n: int) -> None:
        """Room for positions up to n - 1 in every level without a window
        (a store of unknown ``max_len``), doubling, so that growing costs O(1)
        per position.  Through ``torch.cat``: an array in an autograd graph
        stays in it."""
        for x in (self.k, self.sums):
            for l, a in enumerate(x):
                need = -(-n >> l)
                if a is not None and (self.windows is None or self.windows[l] is None) and a.shape[2] < need:
                    grow = max(need, 2 * a.shape[2]) - a.shape[2]
                    x[l] = torch.cat([a, a.new_zeros(*a.shape[:2], grow, a.shape[3])], dim=2)

    def attend(self, qs: List[Tensor], ks: Optional[List[Tensor]], v: Optional[Tensor], w: Tensor, t0,
               scale: Optional[float] = None, softcap: Optional[float] = None, level0=None,
               sliding_window: Optional[int] = None) -> Tensor:
        """The attention of n new positions per row, (B, H, n, Dv), their keys
        and values written into the store first: qs[l], ks[l] (B, heads, n, D)
        the level-l query and key of each new position's block, v (B, H_kv,
        n, Dv), t0 the position of the first (an int, or (B,) each row's).
        Without windows the decoding kernel (:func:`hkt_attention_with_kvcache`);
        ``level0``: (keys, values) of level 0 kept elsewhere, every new key
        already written (ks and v None).  With windows
        :func:`hkt.decoding.windowed.decode_windowed`: one call where every row is
        at the same position, else one per row, each in rounds of at most
        ``chunk`` positions, so that no ring overwrites a row a round reads.
        ``softcap``: None or 0.0 for none, else the scores' cap;
        ``sliding_window``: None, or the band of the decoding kernel (without
        windows only)."""
        if self.windows is None:
            keys, values = (self.k, self.sums[0]) if level0 is None else ([level0[0], *self.k[1:]], level0[1])
            return hkt_attention_with_kvcache(qs, keys, values, w, t0, ks, v, scale=scale, softcap=softcap,
                                              sliding_window=sliding_window)
        softcap = softcap or 0.0
        starts = [t0] if isinstance(t0, int) else [int(t) for t in t0]
        if self.max_len is None:
            self.grow(max(starts) + v.shape[2])
        if len(set(starts)) == 1:
            return decode_windowed(self.k, self.sums, qs, ks, v, w, starts[0], self.windows, self.chunk, scale,
                                   softcap)
        return torch.cat([decode_windowed([x[b:b + 1] for x in self.k], [x[b:b + 1] for x in self.sums],
                                          [x[b:b + 1] for x in qs], [x[b:b + 1] for x in ks], v[b:b + 1], w, t,
                                          self.windows, self.chunk, scale, softcap)
                          for b, t in enumerate(starts)], dim=0)

    def write_block(self, level: int, key: Tensor, slots: List[int]) -> None:
        """Row b's block ``slots[b]`` of a level without a window set to
        ``key[b]`` (key (B, H_kv, 1, D)), in place (in a copy where the level
        is part of an earlier call's graph, which a backward may still read)."""
        k = self.k[level]
        if k.requires_grad:
            k = self.k[level] = k.detach().clone()
        if len(set(slots)) == 1:  # every row at the same position: one slice (a generation without padding)
            k[:, :, slots[0]:slots[0] + 1] = key
            return
        index = torch.tensor(slots, device=k.device)[:, None, None, None].expand(-1, k.shape[1], 1, k.shape[3])
        k.scatter_(2, index, key)

    def reorder(self, index: Tensor) -> None:
        """Rows ``index`` (B',) of the batch (beam search's reordering)."""
        self.k = [None if x is None else x[index.to(x.device)] for x in self.k]
        self.sums = [x[index.to(x.device)] for x in self.sums]


class LevelCache:
    """What :meth:`hkt.MultiheadHKT.decode` keeps between calls, for a batch of
    ``batch_size`` sequences of at most ``max_len`` tokens (made by
    :meth:`hkt.MultiheadHKT.init_cache`; 0.2.0 called it
    ``hkt.kvcache.DecodeCache``).  It holds, per level, the downsampling
    state (the last ``downsample_kernel`` inputs of the query and key
    streams), the coarse keys so far, and the values; with ``windows`` also
    each level's block sums of the values, which let a step read only level
    0's window of single keys.

    ``init_cache`` raises ValueError for options decode does not support
    (``add_bias_kv``, ``add_zero_attn``, ``kdim`` / ``vdim`` other than
    ``embed_dim``) and ``batch_size`` / ``max_len`` below 1; TypeError for
    dtypes other than float32 and float64.

    ``decode`` works however the sequence is split into calls (one token at a
    time, or chunks; coarse blocks may be partly filled).  Level l's query
    and key of block p are made when its first token, 2^l p, arrives.  It
    runs the CPU decoding kernel (:func:`hkt.hkt_attention_with_kvcache`),
    with ``getattr(module, "num_kv_heads", num_heads)`` kv heads.  With
    ``windows``, the new positions are computed from the cache's block sums
    (a C kernel on the CPU in float32 and float64, torch elsewhere;
    ``hkt.decoding.windowed``): a step costs level 0's window plus a few blocks
    per level, not the whole sequence.

    Inference only: call it under ``torch.no_grad()`` or
    ``torch.inference_mode()`` (``RuntimeError`` otherwise: the kernel has no
    backward).  ``ValueError`` for ``add_bias_kv``, ``add_zero_attn``,
    ``kdim`` / ``vdim`` other than ``embed_dim``, training mode with
    ``dropout > 0``, a wrong shape of ``x`` or more tokens than the cache has
    room for, or a cache made by a module of another configuration;
    ``TypeError`` for an ``x`` of another dtype or device than the cache, or a
    cache of another dtype than the module's parameters (outside
    ``torch.autocast``).

    The cache holds the keys and values of past tokens as the parameters made
    them: after changing parameters (training), start a new cache.  (Between
    steps, an in-place change that autograd's version counter sees is picked
    up for the next tokens; a fused optimiser's step or an edit through
    ``.data`` is not.)

    Hooks: ``decode`` is not the module's ``__call__``, so the module's own
    forward hooks and pre-hooks do not run (they take ``forward``'s arguments
    and output, which a decoding step does not have), except torch.nn.utils'
    pre-hooks that recompute a weight before every call (``prune``, the old
    ``weight_norm`` and ``spectral_norm``): it runs those first, so it reads
    the weights ``forward`` would.  ``out_proj`` is called as a module, as in
    ``forward``, so its hooks run (an adapter, a pruning mask); a
    parametrization is computed where the weight is read, as in ``forward``.

    Attributes (H_kv = the module's kv heads, hd = head_dim, K = downsample_kernel):
        length: tokens decoded so far (the same for every sequence).
        store: the :class:`LevelStore` that holds ``k``, ``v`` and ``v_sums``.
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
            rows (``hkt.decoding.windowed.cache_rows``), block c in row c %
            rows_l, holding what a step reads (its window, and the few blocks
            beyond it that pieces of runs need); only the levels without a
            window keep all ceil(max_len / 2^l) blocks, so the cache grows as
            max_len / 2^g, g the first level without a window.
    """

    def __init__(self, store: LevelStore, inputs: List[Tensor], q_coarse: List[Tensor], k_coarse: List[Tensor],
                 max_len: int) -> None:
        self.store = store  # the levels' keys, values and value sums (k, v, v_sums)
        self.inputs, self.q_coarse, self.k_coarse = inputs, q_coarse, k_coarse
        self.max_len = max_len
        self.length = 0
        self._constants = None  # _step_constants: (parameters, their versions, _Constants)
        # a windowed call in rounds whose rings were written past what a retry of it reads (_attend)
        self._torn = False

    @property
    def k(self) -> List[Tensor]:
        return self.store.k

    @property
    def v(self) -> Tensor:
        return self.store.sums[0]

    @property
    def v_sums(self) -> Optional[List[Tensor]]:
        return None if self.store.windows is None else self.store.sums[1:]

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
        return (f"LevelCache(batch_size={self.batch_size}, length={self.length}, max_len={self.max_len}, "
                f"levels={len(self.k)}, dtype={self.v.dtype}, device={self.v.device})")

    @staticmethod
    def check_module(module) -> None:
        """Options of the module decode does not implement (they are not
        causal self-attention over one token stream, or not deterministic)."""
        if module.bias_k is not None:
            raise ValueError("add_bias_kv: MultiheadHKT.decode does not support add_bias_kv=True")
        if module.add_zero_attn:
            raise ValueError("add_zero_attn: MultiheadHKT.decode does not support add_zero_attn=True")
        if module.kdim != module.embed_dim or module.vdim != module.embed_dim:
            raise ValueError(f"kdim/vdim: MultiheadHKT.decode is self-attention and needs kdim = vdim = embed_dim "
                             f"({module.embed_dim}), got kdim={module.kdim}, vdim={module.vdim}")

    @classmethod
    def empty(cls, module, batch_size: int, max_len: int, ref: Tensor, device=None, dtype=None) -> "LevelCache":
        """An empty cache for ``module`` (its levels, heads, sizes and windows;
        its options checked by :meth:`check_module`): ``batch_size`` sequences
        of at most ``max_len`` tokens, on ``device`` in ``dtype`` (default
        ``ref``'s, a parameter of the module)."""
        batch_size, max_len = _positive_int(batch_size, "batch_size"), _positive_int(max_len, "max_len")
        device = ref.device if device is None else torch.device(device)
        dtype = ref.dtype if dtype is None else dtype
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype: decoding runs in float32 or float64, got {dtype}")
        B, L, K, E, hd = batch_size, module.levels, module.downsample_kernel, module.embed_dim, module.head_dim
        Hk = module.num_kv_heads
        kw = {"device": device, "dtype": dtype}
        store = LevelStore.empty(B, Hk, hd, L, module.windows, max_len, **kw)
        inputs = [torch.zeros(B, 2, K, E, **kw) for _ in range(L - 1)]
        q_coarse = [torch.zeros(B, module.num_heads, 1, hd, **kw) for _ in range(L - 1)]
        k_coarse = [torch.zeros(B, Hk, 1, hd, **kw) for _ in range(L - 1)]
        return cls(store, inputs, q_coarse, k_coarse, max_len)

    def step(self, module, x: Tensor, param_dtype: torch.dtype) -> Tensor:
        """:meth:`hkt.MultiheadHKT.decode` of ``x`` (the module's layout), the
        module's options already checked; ``param_dtype``: its parameters'."""
        x = self._check_step(module, x, param_dtype)
        if x.shape[1] == 1:
            out = self._decode_one(module, x)
        else:
            out = self._decode_many(module, x)
        return out if module.batch_first else out.transpose(0, 1)

    @staticmethod
    def _downsample_new(history: Tensor, taps: Tensor, first: int, lo: int, hi: int) -> Tensor:
        """Elements [lo, hi) of causal_downsample(x), where ``history``
        holds x's elements [first, ...): out[p] = sum_r taps[r] * x[2p - r], summed
        in causal_downsample's order so the two agree to the last bit.  Strided
        slices, not index tensors: this runs for every generated token."""
        j, m = 2 * lo - first, 2 * (hi - lo) - 1  # history rows j, j + 2, ... (hi - lo of them)
        out = history[:, j:j + m:2] * taps[0]
        for r in range(1, taps.shape[0]):
            out = out + history[:, j - r:j - r + m:2] * taps[r]
        return out

    def _check_step(self, module, x, param_dtype: torch.dtype) -> Tensor:
        """x as (B, n, E), after checking it against the module and the cache."""
        if self._torn:
            raise RuntimeError("cache: a decode call failed after writing some of its tokens into the rings of a "
                               "windowed cache, over rows that a retry would read; make a new cache with init_cache")
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            want = "(B, n, E)" if module.batch_first else "(n, B, E)"
            raise ValueError(f"x: expected 3 dimensions {want}, got shape {tuple(x.shape)}")
        if not module.batch_first:
            x = x.transpose(0, 1)
        B, n, E = x.shape
        if E != module.embed_dim:
            raise ValueError(f"x: expected {module.embed_dim} features (embed_dim), got {E}")
        if B != self.batch_size:
            raise ValueError(f"x: batch size {B} does not match the cache's {self.batch_size}")
        if self.length + n > self.max_len:
            raise ValueError(f"x: {n} new tokens do not fit in the cache: it holds {self.length} of max_len = "
                             f"{self.max_len}")
        if x.dtype != self.v.dtype or x.device != self.v.device:
            raise TypeError(f"x: is {x.dtype} on {x.device}, but the cache is {self.v.dtype} on {self.v.device}")
        if (len(self.k) != module.levels or self.k[0].shape[1] != module.num_kv_heads
                or self.v.shape[3] != module.head_dim
                or any(s.shape[2:] != (module.downsample_kernel, module.embed_dim) for s in self.inputs)):
            raise ValueError("cache: was made by another module (levels, kv heads, head size, embed_dim or "
                             "downsample_kernel differ)")
        if (module.windows is None) != (self.store.windows is None):
            raise ValueError("cache: was made by a module " + ("without" if self.store.windows is None else "with")
                             + " windows; make it with this module's init_cache")
        if module.windows is not None and tuple(module.windows) != self.store.windows:
            raise ValueError(f"cache: was made by a module with other windows ({list(self.store.windows)}, this "
                             f"module's {list(module.windows)}); make it with this module's init_cache")
        own = param_dtype
        if own != self.v.dtype and not torch.is_autocast_enabled(x.device.type):
            # the projections run in the module's dtype: only autocast reconciles the two
            raise TypeError(f"cache: is {self.v.dtype} but the module's parameters are {own}; make the cache in "
                            f"the module's dtype (init_cache's default), or decode under torch.autocast")
        if module.training and module.dropout > 0:
            raise ValueError(f"dropout: MultiheadHKT.decode has no dropout, but the module is in training mode with "
                             f"dropout={module.dropout}; call mha.eval()")
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
            raise RuntimeError("MultiheadHKT.decode: inference only (the decoding kernel has no backward); call it "
                               "under torch.no_grad() or torch.inference_mode()")
        return x

    def _step_constants(self, module) -> _Constants:
        """The module's :class:`_Constants`, kept in the cache between steps: they
        are a few dozen slicing and stacking ops and a softmax per step otherwise,
        most of a small model's step when made every step.  Made again whenever a
        parameter they read was replaced or changed in place where autograd's version counter sees it (a foreach
        or single-tensor optimiser step, load_state_dict, an in-place op under
        no_grad).  Updates it does not see (a fused optimiser's step, edits
        through ``.data``) leave them stale: MultiheadHKT.decode's docstring says
        to start a new cache after changing parameters, whose past keys and
        values were made with the old ones anyway."""
        m = module
        params = (m.in_proj_weight, m.in_proj_bias, m.q_proj_weight, m.k_proj_weight, m.coarse_q_proj_weight,
                  m.coarse_q_proj_bias, m.coarse_k_proj_weight, m.coarse_k_proj_bias, m.level_logits,
                  m.q_downsample, m.k_downsample)
        try:
            versions = tuple(p._version if p is not None else None for p in params)
        except RuntimeError:  # inference tensors (a module made under inference_mode) keep no versions
            versions = None
        kept = self._constants
        # the parameters themselves are kept and compared by identity, not by id(): a
        # replaced parameter freed, a new one may get its id (and start at version 0 too)
        if (versions is None or kept is None or kept[1] != versions
                or any(a is not b for a, b in zip(kept[0], params))):
            self._constants = kept = (params, versions, _Constants(module))
        return kept[2]

    def _attend(self, qs: List[Tensor], w: Tensor, t0: int, ks: List[Tensor], v: Tensor) -> Tensor:
        """The new positions' attention, (B, H, n, hd), their keys and values
        written into the cache first (:meth:`LevelStore.attend`)."""
        store = self.store
        if store.windows is not None and v.shape[2] > store.chunk:
            # a later round overwrites ring rows that the first reads: no retry once it starts
            self._torn = True
        return store.attend(qs, ks, v, w, t0)

    def _decode_one(self, module, x: Tensor) -> Tensor:
        """decode for one new token per sequence (generation's step), in as few
        torch ops as the step allows: at that size each op's fixed cost, not its
        arithmetic, is the time.  Level l gains its next block only when the token
        begins one (t divisible by 2^l); then both streams' next element is one
        product of the taps with the state and a sum, and both projections one
        batched matmul."""
        B, t = x.shape[0], self.length
        H, Hk, hd = module.num_heads, module.num_kv_heads, module.head_dim
        c = self._step_constants(module)
        # with one token, (B, 1, heads * hd) is (B, heads, 1, hd) in memory: views, not transposes
        r = F.linear(x, module.in_proj_weight, module.in_proj_bias).view(B, H + 2 * Hk, 1, hd)
        qs, ks = [r[:, :H]], [r[:, H:H + Hk]]
        inputs, q_coarse, k_coarse = list(self.inputs), list(self.q_coarse), list(self.k_coarse)
        new = x.unsqueeze(1).expand(B, 2, 1, x.shape[2])  # level 0's new element, in both streams
        for l in range(1, module.levels):
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
        out = self._attend(qs, c.w, t, ks, r[:, H + Hk:])
        # the state moves on only once the step went through
        self.inputs, self.q_coarse, self.k_coarse = inputs, q_coarse, k_coarse
        self.length = t + 1
        self._torn = False
        # the module, not F.linear of its weight, as forward: its hooks (an adapter, prune's mask) run
        return module.out_proj(out.view(B, 1, -1))

    def _decode_many(self, module, x: Tensor) -> Tensor:
        """decode for n >= 2 new tokens per sequence (a prompt, or chunks)."""
        B, n, _ = x.shape
        H, Hk = module.num_heads, module.num_kv_heads
        t0, K, hd = self.length, module.downsample_kernel, module.head_dim
        q0, k0, v = F.linear(x, module.in_proj_weight, module.in_proj_bias).split(
            [module.embed_dim, module.kv_dim, module.kv_dim], dim=-1)
        qs, ks = [_heads(q0, H, hd)], [_heads(k0, Hk, hd)]
        inputs, q_coarse, k_coarse = list(self.inputs), list(self.q_coarse), list(self.k_coarse)
        xq = xk = x  # the new elements of level l-1's query and key streams
        c = self._step_constants(module)
        for l in range(1, module.levels):
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
            xq = self._downsample_new(hist_q, module.q_downsample[l - 1], first - K, lo, hi)
            xk = self._downsample_new(hist_k, module.k_downsample[l - 1], first - K, lo, hi)
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
        out = self._attend(qs, c.w, t0, ks, _heads(v, Hk, hd))
        # the state moves on only once the step went through
        self.inputs, self.q_coarse, self.k_coarse = inputs, q_coarse, k_coarse
        self.length = t0 + n
        self._torn = False
        return module.out_proj(out.transpose(1, 2).reshape(B, n, module.embed_dim))
