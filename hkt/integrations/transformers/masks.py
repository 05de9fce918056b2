"""The masks a model hands the "hkt" attention function, read into which keys
of each row are tokens and, for packed sequences, which of them belong
together (:func:`_read_mask`, once per mask object: :func:`_real_tokens`),
and the rows' layout that follows: each row's tokens first, in order, then
its padding.  Where a row's tokens are one run the layout is a shift by its
padding before them (:func:`_row_layout`, :func:`_shift_index`); where they
are not (a pad token inside a prompt) a gather (:func:`_compact_index`,
:func:`_placed_index`); either way :func:`_layout_index` gives a stretch of
it, :func:`_take` takes it.  Packed sequences are split into a row each
(:func:`_split_documents`).  What hkt cannot take is refused by
:func:`_unsupported`'s message."""
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor



def _unsupported(what: str, instead: str = "") -> NotImplementedError:
    return NotImplementedError(f"attn_implementation='hkt': {what} is not supported" + (f"; {instead}" if instead
                                                                                          else ""))


# the last mask _real_tokens read and what it found: a model hands every layer the same mask
_last_mask = (lambda: None, None, None)


def _real_tokens(mask: Optional[Tensor], B: int, T: int, S: int,
                 causal: bool = True) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """:func:`_read_mask`, once per mask object (and version) a model builds."""
    global _last_mask
    if mask is None:
        return _read_mask(mask, B, T, S, causal)
    ref, key, found = _last_mask
    if ref() is mask and key == (mask._version, B, T, S, causal):
        return found
    found = _read_mask(mask, B, T, S, causal)
    _last_mask = (weakref.ref(mask), (mask._version, B, T, S, causal), found)
    return found


def _window_mask(T: int, S: int, window: int, device) -> Tensor:
    """(T, S) bool: query i (position S - T + i) sees key j when j is not after
    it and less than ``window`` back, transformers' sliding window (masking_utils:
    q - kv < sliding_window)."""
    q = torch.arange(S - T, S, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    return (k <= q) & (q - k < window)


def _band(positions: Tensor, window: int) -> Tensor:
    """(B, 1, T, T) bool: in a layout whose row b holds the model's positions
    ``positions`` (B, T), increasing over its tokens, query i sees key j when j
    is not after i there and the model's positions are less than ``window``
    apart: transformers' sliding window, in the model's positions, not the
    layout's."""
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool, device=positions.device).tril()
    return (causal & (positions[:, :, None] - positions[:, None, :] < window))[:, None]


def _read_mask(mask: Optional[Tensor], B: int, T: int, S: int, causal: bool = True, window: Optional[int] = None,
               known: Optional[Tensor] = None) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(real, docs) from the 4-D mask the model built (None: no padding):
    ``real`` (B, S) bool which of the S keys of each row are tokens (the keys
    some query sees; None: all), ``docs`` (B, S) long the packed sequence
    each position belongs to (a prefill's block-diagonal mask; None: each row
    is one sequence), after checking that the mask is causal (``causal``;
    else bidirectional) attention over each row's tokens, or over each of its
    packed sequences, within the layer's sliding ``window`` if it has one
    (causal layers only, in the model's positions), and nothing else: the
    coarse levels average neighbouring tokens, which another mask (chunked
    attention, bidirectional blocks, a custom mask) would have to cut, and
    they cannot.  A decoding step's queries see only the latest keys of a
    window, so its tokens are ``known`` (B, S), kept by the layer's decoding
    state (absent, the keys some query sees)."""
    if mask is None:
        if T != S and T != 1:  # transformers' prefill into a static cache (its later slots empty)
            raise _unsupported("a static cache (cache_implementation='static') with levels > 1, since every call "
                               "gets all of its slots, the unfilled ones after the new tokens too, where HKT's "
                               "coarse levels need each row's keys up to its newest token",
                               "use the default dynamic cache (generate without cache_implementation), or convert "
                               "with levels=1")
        return None, None
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
    if window is not None and T != S and known is not None and known.shape == (B, S):
        real = known.to(mask.device)
    else:
        # causal: the last query sees every token of its row; a window's, each token is seen by its own query
        real = visible.any(dim=1)
    if window is not None:
        allowed = _window_mask(T, S, window, mask.device)
    elif causal:  # query i is position S - T + i
        allowed = torch.ones(T, S, dtype=torch.bool, device=mask.device).tril(S - T)
    else:
        allowed = torch.ones(T, S, dtype=torch.bool, device=mask.device)
    # every row, padding queries too: packed sequences' mask looks like left padding from its last row alone
    expected = allowed & real[:, None, :]
    docs = None
    if not torch.equal(visible, expected):
        docs = _documents(visible, real, window) if T == S else None
        if docs is not None:
            expected = expected & (docs[:, :, None] == docs[:, None, :])
        if docs is None or not torch.equal(visible, expected):
            raise _unsupported(_other_mask(visible, expected, S - T, causal, window), "convert with levels=1")
    return (None if bool(real.all()) else real), docs


def _documents(visible: Tensor, real: Tensor, window: Optional[int]) -> Optional[Tensor]:
    """(B, T) each position's packed sequence in a prefill's mask ``visible``
    (B, T, T), counted from 0 in each row: one begins at a token that does
    not see the token before it though it could (that token within the
    ``window``; a wider gap is a row's padding); None where none does."""
    pos = torch.arange(visible.shape[-1], device=visible.device)
    latest = torch.where(real, pos, -1).cummax(dim=1).values
    before = torch.nn.functional.pad(latest[:, :-1], (1, 0), value=-1)  # each position's token before it
    sees = visible.gather(2, before.clamp(min=0)[:, :, None])[:, :, 0]
    near = before >= 0 if window is None else (before >= 0) & (pos - before < window)
    starts = real & near & ~sees
    if not bool(starts.any()):
        return None
    return starts.long().cumsum(dim=1)


def _other_mask(visible: Tensor, expected: Tensor, offset: int, causal: bool, window: Optional[int]) -> str:
    """The refusal of a mask that is not one :func:`_read_mask` takes, naming
    the first (row, query, key) where it differs from the nearest one it takes."""
    b, i, j = (visible != expected).nonzero()[0].tolist()
    kind = (f"causal attention over each row's tokens within the layer's sliding window ({window} positions)"
            if window is not None else f"{'causal' if causal else 'bidirectional'} attention over each row's tokens")
    return (f"an attention mask other than {kind} or over each of its packed sequences (found: row {b}'s query at "
            f"position {offset + i} {'sees' if bool(visible[b, i, j]) else 'does not see'} the key at position {j}, "
            "which such a mask would not let it; chunked attention, bidirectional blocks, a window the layer does "
            "not have, a static cache's unfilled slots and custom 4-D masks are of this kind) with levels > 1")


def _row_layout(real: Optional[Tensor], B: int, S: int, device):
    """(pad, count): each row's padding before its tokens and its token count (B,)."""
    if real is None:
        return torch.zeros(B, dtype=torch.long, device=device), torch.full((B,), S, dtype=torch.long, device=device)
    count = real.sum(dim=1)
    pad = torch.where(count > 0, real.int().argmax(dim=1), 0)
    return pad, count


def _one_run(real: Tensor, pad: Tensor, count: Tensor) -> bool:
    """Whether each row's tokens (``real`` (B, S)) are one run, ``count`` of
    them after ``pad`` (:func:`_row_layout`): padding on the left and/or the
    right only, the layout a shift."""
    pos = torch.arange(real.shape[1], device=real.device)
    return torch.equal(real, (pos >= pad[:, None]) & (pos < (pad + count)[:, None]))


def _compact_index(real: Tensor) -> Tensor:
    """(B, S) the model's positions of each row's tokens (``real`` (B, S)), in
    order, then of its padding: the row's layout where its tokens are not one run."""
    return torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices


def _placed_index(real: Tensor) -> Tensor:
    """(B, S) where each of the model's positions lies in :func:`_compact_index`'s layout."""
    tokens, gaps = real.long().cumsum(dim=1), (~real).long().cumsum(dim=1)
    return torch.where(real, tokens - 1, tokens[:, -1:] + gaps - 1)


def _layout_index(pad: Tensor, layout: Optional[Tensor], start: Tensor, n: int) -> Tensor:
    """(B, n) the model's positions of n positions of each row's layout from
    ``start`` (B,): after its padding ``pad`` where ``layout`` is None (each
    row's tokens one run), else read from ``layout`` (:func:`_compact_index`;
    past its end, its last, after every token)."""
    if layout is None:
        return _shift_index(pad + start, n)
    return layout.gather(1, _shift_index(start, n).clamp(0, layout.shape[1] - 1))


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


def _split_documents(docs: Tensor, real: Optional[Tensor]):
    """Packed sequences as rows of their own: (rows, index, tokens), each
    (N, n) for the N sequences of the batch (``docs`` (B, T), from
    :func:`_read_mask`), the longest n positions long: the batch row each
    sequence lies in, the model's positions of its own (right-padded with
    its last), and which of them are tokens (``real`` (B, T), None: all);
    and (row, slot), each (B, T): where each of the model's positions went."""
    B, T = docs.shape
    pos = torch.arange(T, device=docs.device).expand(B, T)
    first = torch.where(torch.nn.functional.pad(docs.diff(dim=1), (1, 0), value=1) != 0, pos, 0).cummax(dim=1).values
    slot = pos - first  # each position's place in its sequence
    offset = torch.nn.functional.pad((docs[:, -1] + 1).cumsum(0)[:-1], (1, 0))
    row = offset[:, None] + docs  # each position's sequence, over the batch
    N, n = int(docs[:, -1].sum()) + B, int(slot.max()) + 1
    index = torch.full((N, n), -1, dtype=torch.long, device=docs.device)
    index[row.flatten(), slot.flatten()] = pos.flatten()
    tokens = index >= 0
    index = torch.where(tokens, index, index.max(dim=1, keepdim=True).values)
    rows = torch.arange(B, device=docs.device).repeat_interleave(docs[:, -1] + 1)[:, None].expand(N, n)
    if real is not None:
        tokens = tokens & real[rows, index]
    return rows, index, tokens, (row, slot)
