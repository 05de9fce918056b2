"""HKT attention in Hugging Face transformers models (docs/transformers.md).

Importing this module registers ``"hkt"`` with transformers' ``AttentionInterface``
(and its mask interface, so that models build the boolean causal-and-padding mask
for it).  Then:

    convert(model, levels=3, downsample_kernel=2, level0_weight=0.5) -> model
        gives every attention module of a loaded model (a decoder: causal HKT;
        an encoder: bidirectional) HKT's trainable parts, initialised so that
        the model computes what it computed before, and switches it to
        attn_implementation="hkt";
    from_pretrained(ModelClass, path, **kwargs) -> model
        loads a converted model saved with save_pretrained, HKT parameters included.

The attention function receives the projected, rotary-embedded query and key of
each head.  Level 0 is them; level l >= 1 causally downsamples the previous
level's query (key) sequence, per channel, with trainable taps
(:func:`hkt.downsample.causal_downsample`) and maps each head's downsampled vector
with its own trainable (head_dim x head_dim) matrix (:meth:`HKTLevels.coarse_levels`,
each layer's levels an :class:`hkt.Levels` in the layout of projected heads).  The attention itself is
:func:`hkt.hkt_attention`; decoding steps with a cache run
:func:`hkt.hkt_attention_with_kvcache` (CPU, float32/float64, no grad; with
windows the windowed decoding kernel over the rings of
its :class:`hkt.decoding.level_cache.LevelStore`) or :func:`hkt.hkt_attention` one new
token at a time (with windows, over the whole sequence).
"""
try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # the extra is optional: say how to get it
    raise ImportError('hkt.integrations.transformers needs transformers 5: pip install "hkt[transformers]"') from e

# one file per concern: masks.py (the model's mask read, the rows' layout), levels.py
# (HKTLevels and its prefill), decoding.py (its decoding steps with a cache),
# attention.py (the attention function transformers calls), conversion.py (convert,
# from_pretrained)
from .attention import hkt_attention_forward
from .conversion import NAME, convert, from_pretrained
from .levels import HKTLevels

__all__ = ["convert", "from_pretrained", "hkt_attention_forward", "HKTLevels", "NAME"]

AttentionInterface.register(NAME, hkt_attention_forward)
# the boolean causal mask with padding that sdpa takes (or None when there is none)
AttentionMaskInterface.register(NAME, sdpa_mask)
