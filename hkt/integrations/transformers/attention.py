"""The function transformers calls for attn_implementation="hkt"
(:func:`hkt_attention_forward`): the module's levels, its mask read, then
the prefill or a decoding step; levels=1 the model's own attention on hkt's
kernels (:func:`_level0`).  And the forward pre-hook a converted module gets
(:func:`_note_cache`): whether a call has a cache a later call appends to."""
from typing import Optional

import torch
from torch import Tensor, nn

import hkt

from .decoding import PackedPrompt, _kernel_decodes
from .levels import HKTLevels, prefill_documents
from .masks import _read_mask, _real_tokens, _unsupported



def hkt_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                          **kwargs):
    """The function transformers calls for attn_implementation="hkt": query
    (B, H, T, D), key and value (B, H_kv, S, D) with S - T cached positions
    before the T new ones, ``attention_mask`` the model's 4-D boolean mask (or
    None: causal, no padding).  Returns (output (B, T, H, D), None)."""
    levels = getattr(module, "hkt", None)
    if not isinstance(levels, HKTLevels):
        raise RuntimeError(f"{type(module).__name__}: has no HKT parameters; run "
                           "hkt.integrations.transformers.convert(model) before attn_implementation='hkt'")
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise _unsupported(name)
    softcap = kwargs.get("softcap")  # Gemma 2's attn_logit_softcapping: hkt caps the combined score
    # the layer's sliding window: at levels=1 the model's own mask carries it
    window = kwargs.get("sliding_window")
    if window is None:
        window = _windowed(module)
    if kwargs.get("output_attentions"):
        raise _unsupported("output_attentions=True (the kernels never form the attention weights)")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    B, H, T, D = query.shape
    S = key.shape[2]
    if (H, key.shape[1], D) != (levels.num_heads, levels.num_kv_heads, levels.head_dim):
        raise ValueError(f"{type(module).__name__}: the attention function received {H} query heads, "
                         f"{key.shape[1]} key heads of {D} features, but convert read {levels.num_heads}, "
                         f"{levels.num_kv_heads} and {levels.head_dim} from the module")
    w = levels.scaled_level_weights().to(query.dtype)
    if levels.levels == 1:  # the model's own attention: any mask it builds
        return (_level0(query, key, value, w, attention_mask, scaling, dropout, causal, softcap, window)
                .transpose(1, 2), None)
    if not causal and S != T:
        raise _unsupported("non-causal attention with keys other than the queries' own (cross-attention, or a "
                           "bidirectional model's cache) with levels > 1", "convert with levels=1")
    if window is not None and not causal:
        raise _unsupported("a sliding window on bidirectional attention with levels > 1", "convert with levels=1")
    state = levels.decode_state
    if S != T and state is not None and state.packed:
        raise _unsupported("decoding after packed sequences (a prompt whose mask keeps several sequences apart) "
                           "with levels > 1", "generate from each sequence on its own (a batch of them, padded), "
                           "or convert with levels=1")
    if window is None:
        real, docs = _real_tokens(attention_mask, B, T, S, causal)
    else:
        # not cached per mask as _real_tokens does: a decoding step's reading depends on the layer's state
        real, docs = _read_mask(attention_mask, B, T, S, causal, window,
                                None if state is None or S == T else state.tokens(S))
    if S == T:
        keep = causal and (levels.cached_call or bool(kwargs.get("use_cache")))
        if docs is not None and _chunked(module) is not None:
            # its blocks are the model's own attention pattern, not separate sequences a row each
            raise _unsupported(f"chunked attention (a layer that attends within chunks of {_chunked(module)} "
                               "positions, Llama 4's chunked_attention) over a sequence longer than a chunk with "
                               "levels > 1", "convert with levels=1")
        if docs is None:
            out = levels.prefill(query, key, value, w, real, scaling, dropout, keep, causal, window, softcap)
        else:
            out = prefill_documents(levels, query, key, value, w, real, docs, scaling, dropout, causal, window,
                                    softcap)
            if keep:
                levels.decode_state = PackedPrompt()
    else:
        out = levels.decode_cached(query, key, value, w, real, scaling, dropout, window, softcap)
    return out.transpose(1, 2), None


def _level0(query, key, value, w, mask, scaling, dropout, causal, softcap=None, window=None):
    """levels=1: the model's attention, on hkt's kernels, with its own mask.
    Where a causal layer's sliding ``window`` hides, over a prompt (T = S),
    every key the mask hides beyond it (transformers' own sliding-window
    masks; not a 4-D mask handed in without the window), the kernels also
    take it as their band, so that they skip those key tiles: T x window
    work."""
    T, S = query.shape[2], key.shape[2]
    if mask is None and T == 1 and S > 1 and _kernel_decodes(query, w, dropout, key, value):
        # one new token against the cache (generate's step): the decoding kernel, which reads each key
        # once per query head, where the attention kernel would transpose the cache's key tiles first
        with torch.no_grad():
            return hkt.hkt_attention_with_kvcache([query], [key], value, w.detach(), S - 1, scale=scaling,
                                                  softcap=softcap)
    if mask is None:  # no padding; causal: T = S, a static cache's first T of S, or one new token
        return hkt.hkt_attention([query], [key], value, w, is_causal=causal and T > 1, dropout_p=dropout,
                                 scale=scaling, softcap=softcap)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    # the band hides keys on both sides of a query (no is_causal here): the mask must hide them all already
    band = (window if causal and T == S and window is not None and not bool(mask.tril(-window).any())
            and not bool(mask.triu(window).any()) else None)
    return hkt.hkt_attention([query], [key], value, w, attn_mask=mask, dropout_p=dropout, scale=scaling,
                             softcap=softcap, sliding_window=band)


def _windowed(m: nn.Module) -> Optional[int]:
    """The sliding window an attention module passes to the attention function:
    its own attribute where it has one (per layer, as Qwen2 and Gemma 2/3
    alternate), else its config's (Mistral, Phi-3, Starcoder2 read it there)."""
    if hasattr(m, "sliding_window"):
        return m.sliding_window
    return getattr(getattr(m, "config", None), "sliding_window", None)


def _chunked(m: nn.Module) -> Optional[int]:
    """The chunk size of an attention module whose layer attends within
    chunks (its config's layer_types says "chunked_attention", as Llama 4's
    do), else None."""
    config = getattr(m, "config", None)
    types, index = getattr(config, "layer_types", None), getattr(m, "layer_idx", None)
    if not isinstance(types, (list, tuple)) or not isinstance(index, int) or not 0 <= index < len(types):
        return None
    return getattr(config, "attention_chunk_size", None) if types[index] == "chunked_attention" else None


# the names under which transformers' attention classes take the cache
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _note_cache(module: nn.Module, args, kwargs) -> None:
    """A converted attention module's forward pre-hook: records whether this
    call has a cache to which a later call appends (then its prefill keeps the
    coarse levels' decoding state).  With levels > 1 a layer with a sliding
    window gets a cache layer that keeps every key (transformers' keeps the
    last window's only): the coarse levels' decoding reads the keys of the
    blocks it forms in the row's own layout, which may lie before the window."""
    caches = [kwargs[name] for name in _CACHE_ARGS if kwargs.get(name) is not None]
    module.hkt.cached_call = bool(caches)
    if caches and module.hkt.levels > 1 and _windowed(module) is not None:
        _keep_every_key(caches[0], getattr(module, "layer_idx", None))


def _keep_every_key(cache, index: Optional[int]) -> None:
    """Replaces a cache's sliding-window layer ``index``, while still empty, by
    a layer that keeps every key (transformers' mask then covers them all)."""
    layers = getattr(cache, "layers", None)
    if index is None or not isinstance(layers, list) or not 0 <= index < len(layers):
        return
    if not getattr(layers[index], "is_sliding", False):
        return
    if getattr(layers[index], "is_initialized", False):
        raise _unsupported("a cache that keeps only a sliding window of keys, already filled, with levels > 1",
                           "start from an empty cache: the model's converted layers then keep every key")
    from transformers.cache_utils import DynamicLayer
    layers[index] = DynamicLayer()
