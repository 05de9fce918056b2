"""hkt: Hierarchical Kernel Transformer attention for PyTorch.

    hkt.hkt_attention(q, k, v, w, *, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None, backend=None)
                                             (k, v may have fewer heads than q: grouped-query attention)
    hkt.hkt_attention_varlen(q, k, v, w, cu_seqlens_q, cu_seqlens_k, ...)   packed variable-length batches
    hkt.hkt_attention_with_kvcache(q, k_cache, v_cache, w, cache_seqlens, k=None, v=None)   decoding with a KV cache
    hkt.MultiheadHKT(embed_dim, num_heads, ..., levels=3, downsample_kernel=2, num_kv_heads=None,
                     pack_padding=False)   drop-in nn.MultiheadAttention; .init_cache / .decode for generation
    hkt.swap_attention(model, levels=3)      replace every nn.MultiheadAttention in a model
    hkt.reference                            plain-PyTorch definition, for checking
    hkt.analysis                             the paper's claims as functions (cost, PSD, splits, error curves)
    hkt.data                                 ListOps generator, sequential CIFAR-10 and byte-level IMDB loaders

The exact contract (maths, masks, dropout, gradients, non-finite values, API):
docs/contract.md in the source repository.
"""
from . import analysis, data, reference
from .functional import hkt_attention
from .kvcache import hkt_attention_with_kvcache
from .modules import MultiheadHKT, swap_attention
from .varlen import hkt_attention_varlen, pack_levels, varlen_level_offsets

__all__ = ["hkt_attention", "hkt_attention_with_kvcache", "hkt_attention_varlen", "varlen_level_offsets", "pack_levels",
           "MultiheadHKT", "swap_attention", "reference", "analysis", "data"]
__version__ = "0.1.0"
