"""MultiheadHKT's inputs as nn.MultiheadAttention takes them, made into
hkt_attention's: the batch-first view, the masks (MHA's conventions to
hkt_attention's), and pack_padding's rows of real tokens and its packed call.

Shapes below: B batch, T query length, S key length, H heads, hd head size.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core.checks import ShapeError, float_mask_in
from .._core.guards import _symbolic
from ..varlen import hkt_attention_varlen, pack_levels


def _to_float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """bool (True = may attend) -> additive float (0 / -inf)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _fmt(shape: List[int]) -> str:
    """A shape as Python prints a tuple, "(2, 3)" (TorchScript has no tuple(shape))."""
    return "(" + ", ".join([str(n) for n in shape]) + ("," if len(shape) == 1 else "") + ")"


def _pad_keys(m: Tensor, n: int) -> Tensor:
    """n more key columns that hide nothing: True for a bool mask, 0 for a float one."""
    shape = list(m.shape[:-1]) + [n]
    return torch.cat([m, m.new_ones(shape) if m.dtype == torch.bool else m.new_zeros(shape)], dim=-1)


def batch_first_view(query: Tensor, key: Tensor, value: Tensor, batch_first: bool, embed_dim: int, kdim: int,
                     vdim: int) -> Tuple[Tensor, Tensor, Tensor, bool]:
    """forward's inputs, checked, as (B, T, E), (B, S, kdim), (B, S, vdim)
    views, and whether they were unbatched."""
    if query.is_nested or key.is_nested or value.is_nested:
        raise ShapeError("query/key/value: nested tensors are not supported.  An nn.TransformerEncoder built "
                         "around nn.MultiheadAttention creates them in eval mode with a key padding mask; set "
                         "its use_nested_tensor = False (hkt.swap_attention does this)")
    if query.dim() not in (2, 3):
        raise ShapeError(f"query: expected 2 (unbatched) or 3 dimensions, got shape {_fmt(query.shape)}")
    unbatched = query.dim() == 2
    if key.dim() != query.dim() or value.dim() != query.dim():
        raise ShapeError(f"key, value: expected {query.dim()}-D like query, got {key.dim()}-D and "
                         f"{value.dim()}-D")
    # Keep `query is key is value` through the reshape: self-attention then takes
    # one packed projection.
    same_kv, same_qk = key is value, query is key
    if unbatched:
        query = query.unsqueeze(0)
        key = query if same_qk else key.unsqueeze(0)
        value = key if same_kv else value.unsqueeze(0)
    elif not batch_first:
        query = query.transpose(0, 1)
        key = query if same_qk else key.transpose(0, 1)
        value = key if same_kv else value.transpose(0, 1)
    B, E = query.shape[0], query.shape[2]
    if E != embed_dim:
        raise ShapeError(f"query: expected {embed_dim} features (embed_dim), got {E}")
    if key.shape[2] != kdim:
        raise ShapeError(f"key: expected {kdim} features (kdim), got {key.shape[2]}")
    if value.shape[2] != vdim:
        raise ShapeError(f"value: expected {vdim} features (vdim), got {value.shape[2]}")
    if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
        raise ShapeError(f"key, value: batch and length must match each other and query's batch {B}; got "
                         f"key {_fmt(key.shape)}, value {_fmt(value.shape)} (batch-first view)")
    return query, key, value, unbatched


def build_mask(num_heads: int, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], is_causal: bool,
               B: int, T: int, S: int, n_extra: int, unbatched: bool, dtype: torch.dtype,
               device: torch.device) -> Tuple[Optional[Tensor], bool]:
    """MHA's masks -> (mask for hkt_attention, is_causal for hkt_attention).

    The returned mask is None, bool (True = may attend) when no float mask
    was given, or float (additive); it is 4-D and broadcasts to
    (B, H, T, S + n_extra).
    """
    H = num_heads
    masks: List[Tensor] = []
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask: only bool and floating point masks are supported, got {attn_mask.dtype}")
        if attn_mask.dim() == 2:
            if list(attn_mask.shape) != [T, S]:
                raise ShapeError(f"attn_mask: 2-D shape must be (T, S) = {_fmt([T, S])}, got "
                                 f"{_fmt(attn_mask.shape)}")
            m = attn_mask.reshape(1, 1, T, S)
        elif attn_mask.dim() == 3:
            want = [H, T, S] if unbatched else [B * H, T, S]
            if list(attn_mask.shape) != want:
                raise ShapeError(f"attn_mask: 3-D shape must be {_fmt(want)}, got {_fmt(attn_mask.shape)}")
            m = attn_mask.reshape(1 if unbatched else B, H, T, S)
        else:
            raise ShapeError(f"attn_mask: expected 2 or 3 dimensions, got shape {_fmt(attn_mask.shape)}")
        masks.append(m)
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool and not key_padding_mask.is_floating_point():
            raise TypeError("key_padding_mask: only bool and floating point masks are supported, got "
                            f"{key_padding_mask.dtype}")
        want = [S] if unbatched else [B, S]
        if list(key_padding_mask.shape) != want:
            raise ShapeError(f"key_padding_mask: shape must be {_fmt(want)}, got "
                             f"{_fmt(key_padding_mask.shape)}")
        masks.append(key_padding_mask.reshape(-1, 1, 1, S))
    use_float = False
    for m in masks:
        if m.is_floating_point():
            use_float = True
    # MHA conventions -> hkt_attention's: bool True = may attend; float added.
    conv: List[Tensor] = []
    for m in masks:
        if m.dtype == torch.bool:
            m = ~m
            if use_float:
                m = _to_float_mask(m, dtype)
        else:
            m = float_mask_in(m, dtype)  # finite stays finite: a conversion must not hide an entry
        if n_extra > 0:  # appended key slots are never masked (MHA pads with 0 / False)
            m = _pad_keys(m, n_extra)
        conv.append(m)
    if is_causal and n_extra > 0:
        # The kernel's causal rule would hide the appended slots from queries i < S + slot.
        vis = torch.ones((T, S + n_extra), dtype=torch.bool, device=device)
        vis[:, :S].tril_()
        vis = vis.reshape(1, 1, T, S + n_extra)
        conv.append(_to_float_mask(vis, dtype) if use_float else vis)
        is_causal = False
    mask: Optional[Tensor] = None
    for m in conv:
        if mask is None:
            mask = m
        else:
            mask = mask + m if use_float else mask & m
    return mask, is_causal


def padding_rows(key_padding_mask: Tensor, B: int, S: int) -> Tensor:
    """With ``pack_padding``, for a self-attention call with a (checked)
    ``key_padding_mask``: which tokens are real, (B, S) bool; else None.
    Refuses padding that is not at the end of its sequence (the packed
    computation keeps each sequence's first tokens) and a float mask with
    entries other than 0 and -inf (packing cannot add them)."""
    kpm = key_padding_mask.reshape(B, S)
    if kpm.dtype == torch.bool:
        real = ~kpm
    else:
        real = kpm != float("-inf")
    if not torch.jit.is_scripting():
        if _symbolic() or kpm.is_meta:
            # recorded, shapes only, or under torch.func: no data-dependent checks (the padded path runs)
            return real
    if kpm.dtype != torch.bool and bool((real & (kpm != 0.0)).any()):
        raise ValueError("key_padding_mask: with pack_padding a float mask may hold only 0 (keep) and -inf "
                         "(padding)")
    trailing = torch.arange(S, device=real.device).unsqueeze(0) < real.sum(dim=1, keepdim=True)
    if not bool(torch.equal(real, trailing)):
        raise ValueError("key_padding_mask: with pack_padding the padding must be at the end of every "
                         "sequence (True / -inf after the last real token only)")
    return real


def packed_attention(qs: List[Tensor], ks: List[Tensor], v: Tensor, w: Tensor, real: Tensor,
                     is_causal: bool) -> Tensor:
    """pack_padding's attention (B, H, T, hd): each sequence's real tokens
    only, packed level by level (the causal downsampling makes a right-padded
    sequence's first ceil(len / 2^l) level-l rows those of the sequence
    alone), through :func:`hkt.hkt_attention_varlen`, then scattered back
    with zeros at the padded rows.

    MultiheadHKT runs the padded computation instead, with the same zeros,
    under TorchScript, ``torch.jit.trace``, ``torch.export`` /
    ``torch.compile``, ``torch.func`` transforms (where the mask's layout
    goes unchecked: the checks read its values), on CUDA, with
    ``attn_mask``, ``add_bias_kv`` / ``add_zero_attn``, dropout in training,
    or a float ``key_padding_mask`` that requires grad (which then gets its
    gradient: the packed call never reads the mask).  Under torch.compile and
    torch.func a hooked self-attention call (its inputs stand-ins for one
    tensor) is taken as cross-attention."""
    lengths = real.sum(dim=1)
    cu = F.pad(torch.cumsum(lengths, 0), [1, 0]).cpu()
    out = hkt_attention_varlen(pack_levels(qs, lengths), pack_levels(ks, lengths), pack_levels([v], lengths)[0],
                               w, cu, cu, is_causal=is_causal)
    B, T = real.shape
    full = out.new_zeros((B, T, out.shape[1], out.shape[2])).index_put((real,), out)
    return full.transpose(1, 2)


def merge_masks(num_heads: int, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                query: Tensor) -> Tuple[Optional[Tensor], Optional[int]]:
    """MultiheadHKT.merge_masks, as ``nn.MultiheadAttention.merge_masks``: the
    masks of a batch-first self-attention call in one, with its type (0
    attn_mask (T, T), 1 key_padding_mask (B, T), 2 both, as (B, H, T, T);
    None without masks).

    The module's own forward does not use it; ``nn.TransformerEncoderLayer``'s
    fused fast path calls it, which ``_qkv_same_embed_dim = False`` keeps from
    running, but TorchScript compiles that call, so it must exist.
    """
    if attn_mask is None:
        if key_padding_mask is None:
            return None, None
        return key_padding_mask, 1
    B, T = query.shape[0], query.shape[1]
    if attn_mask.dim() == 3:
        merged = attn_mask.view(B, -1, T, T)
    else:
        merged = attn_mask.view(1, 1, T, T).expand(B, num_heads, -1, -1)
    if key_padding_mask is not None:
        merged = merged + key_padding_mask.view(B, 1, 1, T).expand(-1, num_heads, -1, -1)
    return merged, 2
