"""hkt: Hierarchical Kernel Transformer attention for PyTorch.

    hkt.hkt_attention(q, k, v, w, *, attn_mask=None, is_causal=False, dropout_p=0.0, scale=None)
    hkt.reference.hkt_attention_reference(...)   plain-PyTorch definition, for checking

See HKT_SPEC.md for the exact math.
"""
from . import reference
from .functional import hkt_attention
from .modules import MultiheadHKT, swap_attention

__all__ = ["hkt_attention", "reference", "MultiheadHKT", "swap_attention"]
__version__ = "0.1.0"
