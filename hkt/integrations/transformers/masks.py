"""The masks a model hands the "hkt" attention function, read into which keys
of each row are tokens (:func:`_read_mask`, once per mask object:
:func:`_real_tokens`), and the rows' layout that follows: each row's padding
before its tokens and their count (:func:`_row_layout`), a row's positions
taken from a start (:func:`_shift_index`, :func:`_take`).  What hkt cannot
take is refused by :func:`_unsupported`'s message."""
import weakref
from typing import Optional

import torch
from torch import Tensor



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


def _row_layout(real: Optional[Tensor], B: int, S: int, device):
    """(pad, count): each row's padding before its tokens and its token count (B,)."""
    if real is None:
        return torch.zeros(B, dtype=torch.long, device=device), torch.full((B,), S, dtype=torch.long, device=device)
    count = real.sum(dim=1)
    pad = torch.where(count > 0, real.int().argmax(dim=1), 0)
    return pad, count


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
