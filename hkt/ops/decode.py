"""Decoding against a KV cache (hkt.hkt_attention_with_kvcache) as torch.library
custom ops:

hkt::decode         -> out (B, H, Tn, Dv)   reads the caches
hkt::decode_append  -> out (B, H, Tn, Dv)   writes k and v into the caches in place first

softcap: a float, 0.0 for none (docs/contract.md section 1.12), and
sliding_window: an int, 0 for none (section 1.13), defaulted.
cache_seqlens goes in as a CPU int tensor (B,), or as None beside an int
(``cache_seqlen``) that every batch row shares.  The decoding kernels are
forward-only: a backward raises NotImplementedError naming the op (the public
call refuses inputs that require grad before it gets there).
"""
from typing import List, Optional

import torch
from torch import Tensor

from .._core import kernels as _kernels
from ._schema import OP_OPTIONS, no_derivative

__all__ = ["decode", "decode_append"]


def _lens(cache_seqlens: Optional[Tensor], cache_seqlen: int):
    return cache_seqlen if cache_seqlens is None else cache_seqlens


@torch.library.custom_op("hkt::decode", mutates_args=(), **OP_OPTIONS)
def decode(q: List[Tensor], k_cache: List[Tensor], v_cache: Tensor, w: Tensor, cache_seqlens: Optional[Tensor],
           cache_seqlen: int, scale: Optional[float], softcap: float = 0.0, sliding_window: int = 0) -> Tensor:
    return _kernels._decode(q, k_cache, v_cache, w, _lens(cache_seqlens, cache_seqlen), None, None, scale, softcap,
                            sliding_window or None)


@torch.library.custom_op("hkt::decode_append", mutates_args=("k_cache", "v_cache"), **OP_OPTIONS)
def decode_append(q: List[Tensor], k_cache: List[Tensor], v_cache: Tensor, w: Tensor,
                  cache_seqlens: Optional[Tensor], cache_seqlen: int, k: List[Tensor], v: Tensor,
                  scale: Optional[float], softcap: float = 0.0, sliding_window: int = 0) -> Tensor:
    return _kernels._decode(q, k_cache, v_cache, w, _lens(cache_seqlens, cache_seqlen), k, v, scale, softcap,
                            sliding_window or None)


def _out(q, v_cache):
    return q[0].new_empty((*q[0].shape[:3], v_cache.shape[-1]))


@decode.register_fake
def _(q, k_cache, v_cache, w, cache_seqlens, cache_seqlen, scale, softcap=0.0, sliding_window=0):
    return _out(q, v_cache)


@decode_append.register_fake
def _(q, k_cache, v_cache, w, cache_seqlens, cache_seqlen, k, v, scale, softcap=0.0, sliding_window=0):
    return _out(q, v_cache)


no_derivative("hkt::decode", "hkt::decode: the decoding kernel is forward-only (no backward); compute gradients "
              "with hkt.hkt_attention over the whole sequence")
