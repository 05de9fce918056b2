"""hkt's kernels as torch.library custom ops, one module per kernel family:

    attention.py   hkt::attention_forward, hkt::attention_backward   (dense hkt_attention)
    window.py      hkt::window_forward, hkt::window_backward         (hkt_attention with windows)
    varlen.py      hkt::varlen_forward, hkt::varlen_backward         (hkt_attention_varlen)
    downsample.py  hkt::downsample_forward, hkt::downsample_backward (causal_downsample)
    decode.py      hkt::decode, hkt::decode_append                   (hkt_attention_with_kvcache)

Each module registers its ops, their fake (meta) kernels and their autograd
once; torch.compile and torch.export record the ops, and an eager call that
needs gradients runs the same registered functions without the dispatcher
(_eager.py).  Importing this package registers every op.

route.py holds the one route to each family (attention, varlen, decode,
downsample): the function every public entry of the family calls, which
picks the op, the eager autograd or the kernel called directly; window.py
holds the windowed family's (windowed_attention, what hkt_attention(...,
windows=) calls); sdpa.py is the "sdpa" backend, HKT through
scaled_dot_product_attention (no op of its own).
"""
from . import attention, decode, downsample, varlen, window  # noqa: F401
from .attention import attention_backward, attention_forward  # noqa: F401

__all__ = ["attention_forward", "attention_backward"]
