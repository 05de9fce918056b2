"""The levels of :class:`hkt.MultiheadHKT` (:class:`MHALevels`): a
:class:`hkt.Levels` made from the batch-first query and key streams with
nn.MultiheadAttention-style projections, one per level.

Shapes below: B batch, T query length, S key length, E the query stream's
features, kdim the key stream's, H heads, H_kv kv heads, hd head size, L
levels, K downsample_kernel.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.attention import heads as _heads
from ..downsample import causal_downsample
from ..functional import hkt_attention
from .levels import Levels

__all__ = ["MHALevels"]


class MHALevels(Levels):
    r"""Levels l >= 1 made from the streams: level l downsamples the previous
    level's query stream (B, T, E) and key stream (B, S, kdim) with
    ``q_downsample`` (L-1, K, E) and ``k_downsample`` (L-1, K, kdim) and
    projects them with ``coarse_q_proj_weight`` (L-1, H hd, E),
    ``coarse_k_proj_weight`` (L-1, H_kv hd, kdim) and biases
    ``coarse_q_proj_bias``, ``coarse_k_proj_bias`` (absent without bias), the
    names :class:`hkt.MultiheadHKT`'s ``state_dict`` has always had.  From a
    trained attention (``hkt.MultiheadHKT.from_mha``) the coarse query
    projections and biases start at zero and the coarse key projections and
    biases copy level 0's."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, levels: int, downsample_kernel: int,
                 windows: Optional[Tuple[Optional[int], ...]], q_dim: int, k_dim: int, bias: bool, device=None,
                 dtype=None) -> None:
        super().__init__(num_heads, head_dim, num_kv_heads, levels, downsample_kernel, windows, device, dtype)
        # the streams' features and whether the projections have biases, for _add_coarse_levels
        self._coarse_shape = (q_dim, k_dim, bias)

    def _add_coarse_levels(self, device=None, dtype=None) -> None:
        """Registers the coarse parameters for query and key streams of q_dim
        and k_dim features (None for levels=1)."""
        factory_kwargs = {"device": device, "dtype": dtype}
        q_dim, k_dim, bias = self._coarse_shape
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

    def _reset_coarse_projections(self) -> None:
        """Each coarse projection xavier_uniform, its bias zero."""
        for l in range(self.levels - 1):
            nn.init.xavier_uniform_(self.coarse_q_proj_weight[l])
            nn.init.xavier_uniform_(self.coarse_k_proj_weight[l])
        if self.coarse_q_proj_bias is not None:
            nn.init.constant_(self.coarse_q_proj_bias, 0.0)
            nn.init.constant_(self.coarse_k_proj_bias, 0.0)

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

    def coarse_levels(self, query: Tensor, key: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        """Levels 1 .. L-1 of the batch-first query (B, T, E) and key (B, S,
        kdim) streams: the query heads (B, H, ceil(T/2^l), hd) and key heads
        (B, H_kv, ceil(S/2^l), hd), level l's projections of
        :meth:`level_inputs`' level l."""
        qs: List[Tensor] = []
        ks: List[Tensor] = []
        if self.levels > 1:
            H, Hk, hd = self.num_heads, self.num_kv_heads, self.head_dim
            xqs, xks = self.level_inputs(query, key)
            projs = self.coarse_projections()
            for l in range(1, self.levels):
                cwq, cbq, cwk, cbk = projs[l - 1]
                qs.append(_heads(F.linear(xqs[l], cwq, cbq), H, hd))
                ks.append(_heads(F.linear(xks[l], cwk, cbk), Hk, hd))
        return qs, ks

    @torch.jit.unused
    def _windowed_attention(self, qs: List[Tensor], ks: List[Tensor], v: Tensor, w: Tensor, mask: Optional[Tensor],
                            causal: bool, dropout_p: float, packs: bool) -> Tensor:
        """hkt_attention with the windows; what they cannot take refused by name."""
        if packs:
            raise ValueError("pack_padding: not supported with windows (its packed call takes no windows)")
        return hkt_attention(qs, ks, v, w, attn_mask=mask, is_causal=causal, dropout_p=dropout_p,
                             windows=self.windows)
