"""Decoding with windowed levels (docs/contract.md section 1.11): the attention
of new positions against a LevelCache whose module has ``windows`` -- in C on
the CPU (csrc/cpu/hkt_window_decode_body.h), else in torch, a position t at a time.

Level l sees key j from query t when (t >> l) - (j >> l) < W_l / 2^l (causal:
j <= t), that is when j >= start_l = ((t >> l) - W_l / 2^l + 1) * 2^l.  The
starts cut [0, t] into at most L + 1 runs, and in each run the same levels see
every key.  With m the finest of them, every score of the run is the same
across a level-m block (each seeing level's key is constant there), so one
block of keys counts as one unit: its score, its number of keys, and the sum of
its values.  The cache keeps those sums per level (``LevelCache.v_sums``,
each complete level-l block the sum of its two level-(l - 1) halves, so the
order of the additions is fixed); a step then costs O(W_0 + sum_l (W_l -
W_{l-1}) / 2^l + S / 2^(L-1)) units where the unwindowed step costs O(S) keys.
A piece of a block at a run's edge is summed from the largest complete blocks
it is made of.

What a step reads lies within a bounded distance of the newest position, but
for the levels without a window (a suffix of the levels) and the value sums of
the first of them: so the cache keeps those whole, and every other level's
keys and value sums in a ring of ``cache_rows`` rows, block c in row c % rows
(a whole array is a ring too large to wrap).  Its memory then grows as S /
2^g (g the first level without a window), not as S; with every level
windowed it does not grow at all.
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._core.kernels import _threads, window_decode_kernel
from ..ops.window import _radius
from .._core.maths import level_factor

__all__ = ["append_windowed", "attend_windowed", "attend_windowed_rows", "cache_rows", "decode_windowed",
           "fill_windowed"]


def cache_rows(windows: Sequence[Optional[int]], max_len: int) -> Tuple[List[int], int]:
    """(rows, chunk): the rows the cache keeps of each level's keys and value
    sums (level 0's: the values), and the most new positions one round of a
    decoding call writes and then reads.  A level without a window, and the
    levels above it, keep all ceil(max_len / 2^l) blocks; any other level a
    ring that holds what a round reads: its window, the coarse blocks that
    begin and end the runs, and the round's own positions."""
    L = len(windows)
    chunk = windows[0] if windows[0] is not None else max_len
    reach = max((W for W in windows if W is not None), default=0) + (2 << L) + chunk
    whole = [-(-max_len >> l) for l in range(L)]
    rows = [whole[l] if W is None else min(whole[l], (reach >> l) + 2) for l, W in enumerate(windows)]
    return rows, chunk if rows != whole else max_len  # no ring wraps: one round


def _index(x: Tensor, lo: int, hi: int) -> Tensor:
    """Blocks lo .. hi - 1 of x (dim 2), a ring of x.shape[2] rows: a slice
    where they do not wrap."""
    rows = x.shape[2]
    if lo // rows == (hi - 1) // rows:
        return x[:, :, lo % rows:(hi - 1) % rows + 1]
    return x.index_select(2, torch.arange(lo, hi, device=x.device) % rows)


def _rows(x: Tensor, rows: List[int]) -> Tensor:
    """x[:, :, rows] (dim 2), a slice when the rows are one run (one new token:
    always), without an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return x[:, :, rows[0]:rows[0] + len(rows)]
    return x[:, :, torch.tensor(rows, device=x.device)]


def _starts(windows: Sequence[Optional[int]], t: int) -> List[int]:
    """start_l: the first key level l sees from query t (0 for a level without a window)."""
    return [0 if W is None else max(0, ((t >> l) - (W >> l) + 1) << l) for l, W in enumerate(windows)]


def _range_sum(v_sums: List[Tensor], a: int, b: int) -> Tensor:
    """Sum of the values of keys [a, b) (b <= t + 1), (B, H_kv, 1, Dv), from the
    largest complete aligned blocks that tile the range, left to right."""
    total = None
    top = len(v_sums) - 1
    while a < b:
        l = 0
        while l < top and a % (2 << l) == 0 and a + (2 << l) <= b:
            l += 1
        part = _index(v_sums[l], a >> l, (a >> l) + 1)
        total = part if total is None else total + part
        a += 1 << l
    return total


def _units(a: int, b: int, m: int, v_sums: List[Tensor]) -> Tuple[List[int], List[int], List[Tensor]]:
    """The units of run [a, b) at level m: their level-m block, key count and value sum."""
    size = 1 << m
    first, last = -(-a // size), b // size  # the whole blocks: [first, last)
    blocks, counts, sums = [], [], []
    if first > last:  # the run lies inside one block
        return [a >> m], [b - a], [_range_sum(v_sums, a, b)]
    if a < first * size:
        blocks.append(a >> m), counts.append(first * size - a), sums.append(_range_sum(v_sums, a, first * size))
    if last > first:
        blocks.extend(range(first, last)), counts.extend([size] * (last - first))
        sums.append(_index(v_sums[m], first, last))
    if last * size < b:
        blocks.append(last), counts.append(b - last * size), sums.append(_range_sum(v_sums, last * size, b))
    return blocks, counts, sums


def attend_windowed(q: Sequence[Tensor], k_cache: Sequence[Tensor], v_sums: List[Tensor], w: Tensor, t: int,
                    windows: Sequence[Optional[int]], scale: Optional[float] = None, softcap: float = 0.0) -> Tensor:
    """Row t of the causal windowed hkt_attention, (B, H, 1, Dv): q[l] (B, H, 1, D)
    the level-l query of position t's block, k_cache[l] the level-l keys,
    v_sums[l] the level-l block sums of the values (v_sums[0]: the values).
    softcap: 0.0 for none, else c > 0 (docs/contract.md section 1.12)."""
    L = len(q)
    B, H, _, D = q[0].shape
    Hk, Dv = k_cache[0].shape[1], v_sums[0].shape[-1]
    G = H // Hk
    scale = D ** -0.5 if scale is None else scale
    f = level_factor(scale, w)  # (L,) or (H, L)
    f = f.view(1, 1, 1, L).expand(1, Hk, G, L) if f.dim() == 1 else f.view(1, Hk, G, L)
    starts = _starts(windows, t)
    cuts = sorted(set(s for s in starts if s <= t)) + [t + 1]
    scores, counts, sums = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        seeing = [l for l in range(L) if starts[l] <= a]
        m = seeing[0]
        blocks, n, s = _units(a, b, m, v_sums)
        idx = torch.tensor(blocks, device=q[0].device)
        run = None
        for l in seeing:  # in level order, as the definition sums them
            lo, hi = blocks[0] >> (l - m), (blocks[-1] >> (l - m)) + 1
            dots = torch.matmul(q[l].reshape(B, Hk, G, D), _index(k_cache[l], lo, hi).transpose(-1, -2))
            term = f[..., l:l + 1] * dots[..., (idx >> (l - m)) - lo]
            run = term if run is None else run + term
        scores.append(run)
        counts.extend(n)
        sums.extend(s)
    score = torch.cat(scores, dim=-1)  # (B, H_kv, G, units)
    if softcap > 0:  # a unit's keys share its combined score, so its capped one too
        score = softcap * torch.tanh(score / softcap)
    count = torch.tensor(counts, dtype=score.dtype, device=score.device)
    values = torch.cat(sums, dim=2)  # (B, H_kv, units, Dv)
    top = score.amax(dim=-1, keepdim=True)
    top = torch.where(top == -torch.inf, torch.zeros_like(top), top)  # nothing visible: zeros
    e = torch.exp(score - top)
    den = (e * count).sum(dim=-1, keepdim=True)
    out = torch.matmul(e, values) / torch.where(den == 0, torch.ones_like(den), den)
    return out.reshape(B, H, 1, Dv)


def append_windowed(k_cache: Sequence[Tensor], v_sums: List[Tensor], k: Sequence[Tensor], v: Tensor,
                    t0: int) -> None:
    """Writes new positions t0 .. t0 + n - 1 into the cache: the keys of the
    blocks they begin (k[l][:, :, i], position t0 + i's block's), their values
    (v, (B, H_kv, n, Dv)), and the sum of every level-l block they complete,
    level by level, each the sum of its two halves."""
    n = v.shape[2]
    for l in range(len(k_cache)):
        lo, hi = -(-t0 >> l), ((t0 + n - 1) >> l) + 1  # the blocks begun now: an earlier call wrote the one before
        if lo < hi:
            _put(k_cache[l], lo, hi, _rows(k[l], [(c << l) - t0 for c in range(lo, hi)]))
    _put(v_sums[0], t0, t0 + n, v)
    for l in range(1, len(v_sums)):
        lo, hi = t0 >> l, (t0 + n) >> l  # the level-l blocks complete now, and not before
        if hi <= lo:  # none, so none above either
            break
        halves = _index(v_sums[l - 1], 2 * lo, 2 * hi)
        _put(v_sums[l], lo, hi, halves[:, :, 0::2] + halves[:, :, 1::2])


def fill_windowed(k_cache: Sequence[Tensor], v_sums: Sequence[Tensor], k: Sequence[Tensor], v: Tensor) -> None:
    """Writes positions 0 .. n - 1 of a sequence into an empty cache at once,
    what append_windowed would have left after writing them in rounds: k[l]
    (B, H_kv, ceil(n / 2^l), D) the level-l keys of every block, v (B, H_kv,
    n, Dv) the values; each ring keeps its latest rows.  The block sums are
    each the sum of its two halves, in append_windowed's order."""
    sums = v
    for l, (ring, keys) in enumerate(zip(k_cache, k)):
        if l > 0:  # the complete level-l blocks
            m = sums.shape[2] // 2 * 2
            sums = sums[:, :, 0:m:2] + sums[:, :, 1:m:2]
        for x, y in ((ring, keys), (v_sums[l], sums)):
            hi = y.shape[2]
            lo = max(0, hi - x.shape[2])
            if hi > lo:
                _put(x, lo, hi, y[:, :, lo:hi])


def _put(x: Tensor, lo: int, hi: int, rows: Tensor) -> None:
    """Blocks lo .. hi - 1 of x (a ring, as _index reads it) set to rows."""
    n = x.shape[2]
    if lo // n == (hi - 1) // n:
        x[:, :, lo % n:(hi - 1) % n + 1] = rows
    else:
        x.index_copy_(2, torch.arange(lo, hi, device=x.device) % n, rows)


def attend_windowed_rows(q: Sequence[Tensor], k_cache: Sequence[Tensor], v_sums: List[Tensor], w: Tensor, t0: int,
                         windows: Sequence[Optional[int]], scale: Optional[float] = None,
                         softcap: float = 0.0) -> Tensor:
    """Rows t0 .. t0 + n - 1 of the causal windowed hkt_attention, (B, H, n, Dv),
    the cache holding their keys and block sums (append_windowed): the C kernel
    (csrc/cpu/hkt_window_decode_body.h) for float32 and float64 CPU tensors, else
    attend_windowed a row at a time.  ``scale``: of the scores (None: D^-0.5);
    softcap: 0.0 for none, else c > 0."""
    L, (B, H, n, D) = len(q), q[0].shape
    if q[0].device.type != "cpu" or q[0].dtype not in (torch.float32, torch.float64):
        return torch.cat([attend_windowed([x[:, :, i:i + 1] for x in q], k_cache, v_sums, w, t0 + i, windows, scale,
                                          softcap) for i in range(n)], dim=2)
    out = q[0].new_empty(B, H, n, v_sums[0].shape[-1])
    w2 = w.to(q[0].dtype).expand(H, L).contiguous() if w.dim() == 1 else w.to(q[0].dtype).contiguous()
    window_decode_kernel([x.contiguous() for x in q], list(k_cache), list(v_sums), w2, out, t0, _radius(windows),
                         D ** -0.5 if scale is None else scale, _threads(), softcap=softcap)
    return out


def decode_windowed(k_cache: Sequence[Tensor], v_sums: List[Tensor], q: Sequence[Tensor], k: Sequence[Tensor],
                    v: Tensor, w: Tensor, t0: int, windows: Sequence[Optional[int]], chunk: int,
                    scale: Optional[float] = None, softcap: float = 0.0) -> Tensor:
    """Rows t0 .. t0 + n - 1 of the causal windowed hkt_attention, (B, H, n, Dv),
    their keys and values written into the cache first (append_windowed, then
    attend_windowed_rows), in rounds of at most ``chunk`` positions
    (cache_rows): a round reads ring rows that a larger one would overwrite."""
    n = v.shape[2]
    outs = []
    for i in range(0, n, chunk):
        part = slice(i, i + chunk)
        append_windowed(k_cache, v_sums, [x[:, :, part] for x in k], v[:, :, part], t0 + i)
        outs.append(attend_windowed_rows([x[:, :, part] for x in q], k_cache, v_sums, w, t0 + i, windows, scale,
                                         softcap))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
