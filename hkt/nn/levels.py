"""hkt.Levels: the owner of HKT's levels above level 0 -- the downsampling
taps, the coarse projections, the level weights and the windows.  Their
decoding state is :class:`hkt.LevelCache` (hkt/decoding/level_cache.py).

Shapes below: B batch, T query length, S key length, E the query stream's
features, H heads, H_kv kv heads, hd head size, L levels, K downsample_kernel.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.attention import heads as _heads
from .._core.checks import ShapeError
from ..downsample import causal_downsample
from ..functional import hkt_attention

__all__ = ["Levels"]


class Levels(nn.Module):
    r"""The levels l >= 1 of an HKT attention, and the weights of every level.

    Level l downsamples the previous level's input with :func:`causal_downsample`
    (separate taps for the query stream, ``q_downsample`` (L-1, K, E), and the
    key stream, ``k_downsample`` (L-1, K, kdim)) and projects it with its own
    query and key projections ``coarse_q_proj_weight`` (L-1, H hd, E),
    ``coarse_k_proj_weight`` (L-1, H_kv hd, kdim) and biases
    ``coarse_q_proj_bias``, ``coarse_k_proj_bias`` (absent without bias).
    Values stay at full resolution.  The level weights are ``w =
    softmax(level_logits, -1)``, ``level_logits`` (num_heads, levels)
    (docs/contract.md section 2.2).  ``levels=1`` registers none of them.

    ``windows`` (one entry per level, None or W_l tokens, growing with the
    level; docs/contract.md section 1.11) gives each level a window: near-linear
    cost in the sequence length.  Masks and dropout apply as without windows:
    ``is_causal=True`` and a ``key_padding_mask`` alone keep the cost near
    linear; an ``attn_mask`` (alone or with key padding) or dropout in training
    makes the kernels visit each key the windows let through, O(T * S) work
    like dense attention.

    A trained attention's start (:meth:`hkt.MultiheadHKT.from_mha`): the
    coarse levels start switched off but trainable.

    * ``coarse_q_proj_weight`` and ``coarse_q_proj_bias`` are zero, so every
      coarse score is 0.  They still get gradients at once (the gradient of
      a level-l query is ``scale * w_l * dS_l @ k_l`` with nonzero keys);
      the key projections and taps get theirs from the second step on,
      once the coarse queries are nonzero.
    * ``coarse_k_proj_weight`` / ``_bias`` copy level 0's key projection and
      the taps are 1/K, so a coarse key starts as the causal block average of
      the pretrained keys, a meaningful target for the coarse queries rather
      than a random one.
    * ``level_logits`` give level 0 the weight ``w0`` in every head and split
      the rest evenly; level 0's query projection (weight rows and bias) is
      scaled by ``1 / w0`` (w0 as computed in the module's dtype) so ``w0 *
      <q0 / w0, k0>`` is the trained score.  The price: level 0's effective
      step size is w0 times the trained one's under Adam-like optimisers, and
      weight decay acts on a query projection 1/w0 as large.  A larger w0
      keeps level 0 closer to the trained attention but gives the coarse
      levels less weight (the weights themselves stay trainable).

    Levels made from projected heads instead (per head a map of its
    downsampled vector, no bias; :meth:`_add_head_levels`,
    :meth:`coarse_heads`) serve the Hugging Face conversion
    (``hkt.integrations.transformers.HKTLevels``, a subclass).

    A module that has a level 0 (:class:`hkt.MultiheadHKT`) subclasses it, so
    that these parameters keep the names they have always had in its
    ``state_dict``; it calls :meth:`_add_levels` after registering level 0's
    parameters (their order in ``parameters()``, which optimiser state follows)
    and gives :meth:`_reference_weight`.  Its decoding state is a
    :class:`hkt.LevelCache`.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, levels: int, downsample_kernel: int,
                 windows: Optional[Tuple[Optional[int], ...]]) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.levels = levels
        self.downsample_kernel = downsample_kernel
        # a window per level (None: none); TorchScript reads only whether there are any
        self.windows = windows
        self._windowed = windows is not None

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
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
            raise ValueError(f"levels: expected an int >= 1, got {levels!r}")
        if isinstance(downsample_kernel, bool) or not isinstance(downsample_kernel, int) or downsample_kernel < 1:
            raise ValueError(f"downsample_kernel: expected an int >= 1, got {downsample_kernel!r}")
        return num_kv_heads

    def _add_levels(self, q_dim: int, k_dim: int, bias: bool, device=None, dtype=None) -> None:
        """Registers the coarse parameters for query and key streams of q_dim
        and k_dim features (None for levels=1)."""
        factory_kwargs = {"device": device, "dtype": dtype}
        Lc, K = self.levels - 1, self.downsample_kernel
        Eq, Ekv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if Lc > 0:
            self.q_downsample = nn.Parameter(torch.empty((Lc, K, q_dim), **factory_kwargs))
            self.k_downsample = nn.Parameter(torch.empty((Lc, K, k_dim), **factory_kwargs))
            self.coarse_q_proj_weight = nn.Parameter(torch.empty((Lc, Eq, q_dim), **factory_kwargs))
            self.coarse_k_proj_weight = nn.Parameter(torch.empty((Lc, Ekv, k_dim), **factory_kwargs))
            if bias:
                self.coarse_q_proj_bias = nn.Parameter(torch.empty((Lc, Eq), **factory_kwargs))
                self.coarse_k_proj_bias = nn.Parameter(torch.empty((Lc, Ekv), **factory_kwargs))
            else:
                self.register_parameter("coarse_q_proj_bias", None)
                self.register_parameter("coarse_k_proj_bias", None)
            self.level_logits = nn.Parameter(torch.empty((self.num_heads, self.levels), **factory_kwargs))
        else:
            for name in ("q_downsample", "k_downsample", "coarse_q_proj_weight", "coarse_k_proj_weight",
                         "coarse_q_proj_bias", "coarse_k_proj_bias", "level_logits"):
                self.register_parameter(name, None)

    def _add_head_levels(self, device=None, dtype=None) -> None:
        """Registers the coarse parameters of levels made from projected heads
        (the Hugging Face conversion's, hkt.integrations.transformers): taps
        over the heads' features side by side, ``q_downsample`` (L-1, K, H hd)
        and ``k_downsample`` (L-1, K, H_kv hd); each head's own map of its
        downsampled vector, ``coarse_q_proj`` (L-1, H, hd, hd) and
        ``coarse_k_proj`` (L-1, H_kv, hd, hd) (torch layout, out x in); and
        ``level_logits`` (H, L).  None of them for levels=1."""
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

    def coarse_heads(self, x: Tensor, stream: str, inputs: Optional[List[Tensor]] = None) -> List[Tensor]:
        """Levels 1 .. L-1 of a sequence of projected heads (levels of
        :meth:`_add_head_levels`): of the query (``stream="q"``) or key
        (``"k"``) heads x (B, heads, N, hd), level l (B, heads, ceil(N / 2^l),
        hd), the block p of which depends only on x's rows <= 2^l p.
        ``inputs``, a list: each level's sequence before its projection, (B,
        ceil(N / 2^l), heads hd), level 0 first, appended to it (what a
        decoding state keeps the latest of)."""
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

    def _reset_levels(self) -> None:
        """Init for training from scratch: downsampling taps 1/K (with K = 2,
        level l starts as the mean of the 2^l inputs ending at position 2^l p:
        a causal average pool); each coarse projection xavier_uniform with zero
        bias; level_logits zero (equal level weights)."""
        if self.levels > 1:
            nn.init.constant_(self.q_downsample, 1.0 / self.downsample_kernel)
            nn.init.constant_(self.k_downsample, 1.0 / self.downsample_kernel)
            for l in range(self.levels - 1):
                nn.init.xavier_uniform_(self.coarse_q_proj_weight[l])
                nn.init.xavier_uniform_(self.coarse_k_proj_weight[l])
            if self.coarse_q_proj_bias is not None:
                nn.init.constant_(self.coarse_q_proj_bias, 0.0)
                nn.init.constant_(self.coarse_k_proj_bias, 0.0)
            nn.init.constant_(self.level_logits, 0.0)

    @torch.no_grad()
    def _start_from_trained(self, level0_weight: float) -> Tensor:
        """What every conversion of a trained attention starts its levels with
        (:meth:`hkt.MultiheadHKT.from_mha`, the Hugging Face conversion): taps
        1/K (coarse vectors are causal block averages) and ``level_logits``
        giving level 0 the weight w0 = ``level0_weight`` in every head and the
        other levels the rest, evenly.  Returns w0 (num_heads,) as computed in
        the module's dtype, for the caller's 1/w0 on level 0."""
        L = self.levels
        self.q_downsample.fill_(1.0 / self.downsample_kernel)
        self.k_downsample.fill_(1.0 / self.downsample_kernel)
        # theta_0 - theta_l = log(w0 (L-1) / (1 - w0)) gives softmax weight w0 to level 0.
        self.level_logits.zero_()
        self.level_logits[:, 0] = math.log(level0_weight * (L - 1) / (1.0 - level0_weight))
        return torch.softmax(self.level_logits, dim=-1)[:, 0]

    def _reference_weight(self) -> Tensor:
        """A tensor in the module's dtype and on its device (levels=1 has no
        parameter here): the subclass's."""
        raise NotImplementedError("Levels._reference_weight: given by the module that has level 0")

    def level_weights(self) -> Tensor:
        """The convex level weights w = softmax(level_logits), (num_heads, levels)."""
        logits = self.level_logits
        if logits is None:
            w = self._reference_weight()
            return torch.ones((self.num_heads, 1), dtype=w.dtype, device=w.device)
        return torch.softmax(logits, dim=-1)

    def coarse_projections(self) -> List[Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]]:
        """Per level l >= 1, ``(W_q, b_q, W_k, b_k)``: level l's query and key
        projections, torch layout (biases None without bias); empty for levels=1."""
        out: List[Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]] = []
        cqw, ckw = self.coarse_q_proj_weight, self.coarse_k_proj_weight
        cqb, ckb = self.coarse_q_proj_bias, self.coarse_k_proj_bias
        if cqw is not None and ckw is not None:
            for l in range(1, self.levels):
                out.append((cqw[l - 1], None if cqb is None else cqb[l - 1], ckw[l - 1],
                            None if ckb is None else ckb[l - 1]))
        return out

    def level_inputs(self, query: Tensor, key: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        """The sequences each level's projections read: level 0 is ``query``
        (B, T, E) and ``key`` (B, S, kdim) (batch first), level l the
        previous level's causally downsampled by 2 with that stream's taps
        (:func:`causal_downsample`, ``q_downsample[l - 1]`` / ``k_downsample[l - 1]``),
        so level l holds ceil(T / 2^l) and ceil(S / 2^l) rows."""
        xq, xk = [query], [key]
        qd, kd = self.q_downsample, self.k_downsample
        if qd is not None and kd is not None:
            for l in range(1, self.levels):
                xq.append(causal_downsample(xq[l - 1], qd[l - 1]))
                xk.append(causal_downsample(xk[l - 1], kd[l - 1]))
        return xq, xk

    def _add_coarse_heads(self, qs: List[Tensor], ks: List[Tensor], query: Tensor, key: Tensor) -> None:
        """Appends levels 1 .. L-1 to qs and ks (level 0's heads): the query
        heads (B, H, ceil(T/2^l), hd) and key heads (B, H_kv, ceil(S/2^l), hd)
        of the batch-first query (B, T, E) and key (B, S, kdim) streams."""
        if self.levels > 1:
            H, Hk, hd = self.num_heads, self.num_kv_heads, self.head_dim
            xqs, xks = self.level_inputs(query, key)
            projs = self.coarse_projections()
            for l in range(1, self.levels):
                cwq, cbq, cwk, cbk = projs[l - 1]
                qs.append(_heads(F.linear(xqs[l], cwq, cbq), H, hd))
                ks.append(_heads(F.linear(xks[l], cwk, cbk), Hk, hd))

    @torch.jit.unused
    def _windowed_attention(self, qs: List[Tensor], ks: List[Tensor], v: Tensor, w: Tensor, mask: Optional[Tensor],
                            causal: bool, dropout_p: float, packs: bool) -> Tensor:
        """hkt_attention with the windows; what they cannot take refused by name."""
        if packs:
            raise ValueError("pack_padding: not supported with windows (its packed call takes no windows)")
        return hkt_attention(qs, ks, v, w, attn_mask=mask, is_causal=causal, dropout_p=dropout_p,
                             windows=self.windows)
