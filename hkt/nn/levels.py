"""hkt.Levels: what HKT's levels above level 0 are in every layout -- heads,
levels, downsampling taps, level weights and windows -- and the operations
each layout of their coarse parameters gives (:meth:`Levels._add_coarse_levels`,
:meth:`Levels._reset_coarse_projections`, :meth:`Levels.coarse_levels`).  The
layouts: nn.MultiheadAttention's projections of the streams
(hkt/nn/_mha_levels.py, :class:`hkt.MultiheadHKT`'s) and projected heads
(hkt/integrations/transformers/levels.py, a converted Hugging Face layer's).

Shapes below: B batch, T query length, S key length, H heads, H_kv kv heads,
hd head size, L levels, K downsample_kernel.
"""
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .._core.checks import ShapeError

__all__ = ["Levels"]


class Levels(nn.Module):
    r"""The levels l >= 1 of an HKT attention, and the weights of every level.

    Level l downsamples the previous level's query and key sequences with
    :func:`hkt.causal_downsample` (separate taps for the query stream,
    ``q_downsample`` (L-1, K, query features), and the key stream,
    ``k_downsample`` (L-1, K, key features)) and maps them with its own
    coarse projections, whose form the layout gives
    (:meth:`_add_coarse_levels`).  Values stay at full resolution.  The level
    weights are ``w = softmax(level_logits, -1)``, ``level_logits`` (num_heads,
    levels) (docs/contract.md section 2.2), convex in every layout
    (:meth:`level_weights`).  ``levels=1`` registers none of them.

    ``windows`` (one entry per level, None or W_l tokens, growing with the
    level; docs/contract.md section 1.11) gives each level a window: near-linear
    cost in the sequence length.  Masks and dropout apply as without windows:
    ``is_causal=True`` and a ``key_padding_mask`` alone keep the cost near
    linear; an ``attn_mask`` (alone or with key padding) or dropout in training
    makes the kernels visit each key the windows let through, O(T * S) work
    like dense attention.

    A trained attention's start (:meth:`hkt.MultiheadHKT.from_mha`, the
    Hugging Face conversion): the coarse levels start switched off but
    trainable.

    * the coarse query projections are zero, so every coarse score is 0.
      They still get gradients at once (the gradient of a level-l query is
      ``scale * w_l * dS_l @ k_l`` with nonzero keys); the key projections
      and taps get theirs from the second step on, once the coarse queries
      are nonzero.
    * the taps are 1/K and the coarse key projections give level 0's keys,
      so a coarse key starts as the causal block average of the pretrained
      keys, a meaningful target for the coarse queries rather than a random
      one.
    * ``level_logits`` give level 0 the weight ``w0`` in every head and split
      the rest evenly; level 0's queries are scaled by ``1 / w0`` (w0 as
      computed in the module's dtype) so ``w0 * <q0 / w0, k0>`` is the
      trained score.  The price: level 0's effective step size is w0 times
      the trained one's under Adam-like optimisers, and weight decay acts on
      a query projection 1/w0 as large.  A larger w0 keeps level 0 closer to
      the trained attention but gives the coarse levels less weight (the
      weights themselves stay trainable).

    The layouts, each a subclass that gives only what differs:
    ``hkt.nn._mha_levels.MHALevels`` (levels made from the query and key
    streams with nn.MultiheadAttention-style projections, with bias;
    :class:`hkt.MultiheadHKT`, whose decoding state is a
    :class:`hkt.LevelCache`) and
    ``hkt.integrations.transformers.HKTLevels`` (levels made from projected
    heads, a map per head; a converted Hugging Face layer's).  A layout
    registers its coarse parameters after its module's level 0 (their order
    in ``parameters()``, which optimiser state follows).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, levels: int, downsample_kernel: int,
                 windows: Optional[Tuple[Optional[int], ...]], device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.levels = levels
        self.downsample_kernel = downsample_kernel
        # a window per level (None: none); TorchScript reads only whether there are any
        self.windows = windows
        self._windowed = windows is not None
        # no values, only a dtype and a device: levels=1's level_weights() (no level_logits) are
        # ones in them, and a buffer follows the module through .to() as the parameters do
        self.register_buffer("_weights_like", torch.empty(0, device=device, dtype=dtype), persistent=False)

    @staticmethod
    def _check_options(embed_dim: int, num_heads: int, num_kv_heads: Optional[int], levels,
                       downsample_kernel) -> int:
        """The heads (of embed_dim query features), levels and
        downsample_kernel, checked before the windows (which need L); returns
        num_kv_heads (None: num_heads)."""
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                             f"and num_heads={num_heads}")
        if embed_dim % num_heads != 0:
            raise ShapeError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_kv_heads is None:
            num_kv_heads = num_heads
        if (isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1
                or num_heads % num_kv_heads != 0):
            raise ValueError(f"num_kv_heads: expected an int >= 1 that divides num_heads ({num_heads}), got "
                             f"{num_kv_heads!r}")
        Levels._check_levels(levels, downsample_kernel)
        return num_kv_heads

    @staticmethod
    def _check_levels(levels, downsample_kernel) -> None:
        """levels and downsample_kernel: ints >= 1 (every layout's rule)."""
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
            raise ValueError(f"levels: expected an int >= 1, got {levels!r}")
        if isinstance(downsample_kernel, bool) or not isinstance(downsample_kernel, int) or downsample_kernel < 1:
            raise ValueError(f"downsample_kernel: expected an int >= 1, got {downsample_kernel!r}")

    def _add_coarse_levels(self, device=None, dtype=None) -> None:
        """The layout's: registers ``q_downsample``, ``k_downsample``, its
        coarse projections and ``level_logits`` (num_heads, levels), or None
        for each with levels=1."""
        raise NotImplementedError(f"{type(self).__name__}: a Levels layout registers its coarse parameters")

    def _reset_coarse_projections(self) -> None:
        """The layout's: its coarse projections' init for training from
        scratch (:meth:`_reset_levels`), levels > 1 only."""
        raise NotImplementedError(f"{type(self).__name__}: a Levels layout initialises its coarse projections")

    def coarse_levels(self, query: Tensor, key: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        """The layout's: levels 1 .. L-1 of the query and key streams, the
        query heads (B, H, ceil(T / 2^l), hd) and key heads (B, H_kv,
        ceil(S / 2^l), hd), the block p of level l depending only on the
        inputs' rows <= 2^l p; empty lists for levels=1.  The inputs' form
        is the layout's."""
        raise NotImplementedError(f"{type(self).__name__}: a Levels layout makes its coarse levels")

    def _reset_levels(self) -> None:
        """Init for training from scratch: downsampling taps 1/K (with K = 2,
        level l starts as the mean of the 2^l inputs ending at position 2^l p:
        a causal average pool); the coarse projections as the layout says
        (:meth:`_reset_coarse_projections`); level_logits zero (equal level
        weights)."""
        if self.levels > 1:
            nn.init.constant_(self.q_downsample, 1.0 / self.downsample_kernel)
            nn.init.constant_(self.k_downsample, 1.0 / self.downsample_kernel)
            self._reset_coarse_projections()
            nn.init.constant_(self.level_logits, 0.0)

    @torch.no_grad()
    def _start_from_trained(self, level0_weight: float) -> Tensor:
        """What every conversion of a trained attention starts its levels with
        (:meth:`hkt.MultiheadHKT.from_mha`, the Hugging Face conversion): taps
        1/K (coarse vectors are causal block averages) and ``level_logits``
        giving level 0 the weight w0 = ``level0_weight`` in every head and the
        other levels the rest, evenly.  Returns w0 (num_heads,) as computed in
        the module's dtype, for the caller's 1/w0 on level 0.  The coarse
        projections' start is the layout's."""
        L = self.levels
        self.q_downsample.fill_(1.0 / self.downsample_kernel)
        self.k_downsample.fill_(1.0 / self.downsample_kernel)
        # theta_0 - theta_l = log(w0 (L-1) / (1 - w0)) gives softmax weight w0 to level 0.
        self.level_logits.zero_()
        self.level_logits[:, 0] = math.log(level0_weight * (L - 1) / (1.0 - level0_weight))
        return torch.softmax(self.level_logits, dim=-1)[:, 0]

    def level_weights(self) -> Tensor:
        """The convex level weights w = softmax(level_logits), (num_heads,
        levels); levels=1: ones (num_heads, 1) in the module's dtype and on
        its device."""
        logits = self.level_logits
        if logits is None:
            like = self._weights_like
            return torch.ones((self.num_heads, 1), dtype=like.dtype, device=like.device)
        return torch.softmax(logits, dim=-1)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if "_weights_like" not in self._buffers:  # a module pickled whole before the buffer was added
            like = next(iter(list(self.parameters()) + list(self.buffers())), torch.empty(0))
            self.register_buffer("_weights_like", like.new_empty(0), persistent=False)
