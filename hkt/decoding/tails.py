"""The downsampling state a decoding step keeps per level
(:class:`BlockTails`): the latest ``downsample_kernel`` elements of level
l-1's query and key streams, from which level l's next block is made when a
row's newest position begins one (position t begins level l's block t / 2^l
when 2^l divides t).  A step then makes only the blocks its token begins -
on average fewer than one per stream - instead of downsampling a window of
recent positions at every level."""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["BlockTails"]


def _latest_rows(x: Tensor, last: Tensor, K: int) -> Tensor:
    """Rows last - K + 1 .. last of x (B, N, C) per row, oldest first, (B, K, C);
    a row before 0 is zeros, as causal downsampling pads."""
    index = last[:, None] - torch.arange(K - 1, -1, -1, device=x.device)  # (B, K)
    rows = x.gather(1, index.clamp(min=0)[:, :, None].expand(-1, -1, x.shape[2]))
    return rows.masked_fill((index < 0)[:, :, None], 0.0)


def _next_element(tail: Tensor, taps: Tensor) -> Tensor:
    """causal_downsample's element whose newest input is tail's last row:
    sum_r taps[r] * x[2p - r], r = 0 first, each product rounded, then added,
    as causal_downsample sums them (tail (B, K, C) oldest first, taps (K, C))."""
    K = taps.shape[0]
    out = tail[:, K - 1] * taps[0]
    for r in range(1, K):
        out = out + tail[:, K - 1 - r] * taps[r]
    return out


class BlockTails:
    """Per level l >= 1 the latest K elements of level l-1's query and key
    streams side by side (``x[l-1]`` (B, K, Cq + Ck), the query stream's Cq
    channels first), oldest first, each row at its own position: one
    product and sum per level make both streams' next element."""

    def __init__(self, x: List[Tensor], split: int) -> None:
        self.x, self.split = x, split

    @classmethod
    def of_levels(cls, q_levels: Sequence[Tensor], k_levels: Sequence[Tensor], counts: Tensor, K: int
                  ) -> "BlockTails":
        """The state after a prompt: ``q_levels[l]`` and ``k_levels[l]`` (B,
        N_l, C), l = 0 .. L-2, level l's query and key streams (before any
        projection), row b's tokens its first ``counts[b]`` positions."""
        last = counts.to(q_levels[0].device) - 1
        x = [torch.cat([_latest_rows(q, last >> l, K), _latest_rows(k, last >> l, K)], dim=2)
             for l, (q, k) in enumerate(zip(q_levels, k_levels))]
        return cls(x, q_levels[0].shape[2])

    @property
    def q(self) -> List[Tensor]:
        return [x[:, :, :self.split] for x in self.x]

    @property
    def k(self) -> List[Tensor]:
        return [x[:, :, self.split:] for x in self.x]

    def push(self, xq: Tensor, xk: Tensor, t: List[int], taps_q: Tensor, taps_k: Tensor
             ) -> List[Optional[Tuple[Tensor, Tensor, Optional[Tensor]]]]:
        """Each row's new position t[b] with its level-0 elements xq (B, Cq)
        and xk (B, Ck); ``taps_q`` / ``taps_k`` (L-1, K, C) the streams' taps.
        Returns per level l >= 1 None when no row begins a block there, else
        (the new level-l elements (B, Cq) and (B, Ck), which rows begin one:
        None for all, else a (B,) bool tensor; the other rows' elements are
        meaningless)."""
        out: List[Optional[Tuple[Tensor, Tensor, Optional[Tensor]]]] = []
        new = torch.cat([xq, xk], dim=1)
        gained: Optional[Tensor] = None  # rows whose level l-1 gained an element (None: all)
        for l in range(1, len(self.x) + 1):
            self.x[l - 1] = self._append(self.x[l - 1], new, gained)
            begins = [tb % (1 << l) == 0 for tb in t]
            if not any(begins):  # and none at any level above
                out.extend([None] * (len(self.x) - l + 1))
                break
            gained = None if all(begins) else torch.tensor(begins, device=new.device)
            new = _next_element(self.x[l - 1], torch.cat([taps_q[l - 1], taps_k[l - 1]], dim=1))
            out.append((new[:, :self.split], new[:, self.split:], gained))
        return out

    @staticmethod
    def _append(tail: Tensor, x: Tensor, rows: Optional[Tensor]) -> Tensor:
        """tail with x (B, C) its newest element, in ``rows`` (None: all)."""
        moved = torch.cat([tail[:, 1:], x[:, None]], dim=1)
        return moved if rows is None else torch.where(rows[:, None, None], moved, tail)

    def reorder(self, index: Tensor) -> None:
        """Rows ``index`` of the batch (beam search's reordering)."""
        self.x = [x[index.to(x.device)] for x in self.x]
