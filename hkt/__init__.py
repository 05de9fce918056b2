"""hkt: Hierarchical Kernel Transformer attention for PyTorch.

    hkt.hkt_attention(q, k, v, w, *, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None)
    hkt.MultiheadHKT(embed_dim, num_heads, ..., levels=3, downsample_kernel=2)   drop-in nn.MultiheadAttention
    hkt.swap_attention(model, levels=3)      replace every nn.MultiheadAttention in a model
    hkt.reference                            plain-PyTorch definition, for checking
    hkt.analysis                             the paper's claims as functions (cost, PSD, splits, error curves)
    hkt.data                                 ListOps generator, sequential CIFAR-10 and byte-level IMDB loaders

The exact contract (maths, masks, dropout, gradients, non-finite values, API):
docs/contract.md in the source repository.
"""
from . import analysis, data, reference
from .functional import hkt_attention
from .modules import MultiheadHKT, swap_attention

__all__ = ["hkt_attention", "MultiheadHKT", "swap_attention", "reference", "analysis", "data"]
__version__ = "0.1.0"
