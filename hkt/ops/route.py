"""One route to each kernel family: the function every public entry of the
family calls once its own arguments are made, which picks, once, how the
call meets the kernels: the family's registered op (torch.compile,
torch.export or torch.jit.trace record it; meta tensors take its fake
kernel), its eager autograd (ops/_eager.py: the op's registered functions
without the dispatcher) where a gradient is wanted, or the kernel called
directly.

    attention   hkt_attention, the module's packed projection (qkv_attention)
    scripted_attention   the dense route's TorchScript branch (MultiheadHKT scripted)
    varlen      hkt_attention_varlen (MultiheadHKT's pack_padding too)
    decode      hkt_attention_with_kvcache
    downsample  causal_downsample (MultiheadHKT's coarse levels)

The windowed family's route is ops/window.py's windowed_attention.  The
default scale is _core/maths.py's default_scale (op_scale for the ops'
schemas), the dropout seed ops/attention.py's dropout_seed (eager_seed as
the kernels take it): each made there only, the routes ask.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .._core import kernels as _kernels
from .._core.checks import _check_inputs, _kernel_mask
from .._core.guards import _refuse_meta, _symbolic
from .._core.maths import default_scale
from . import decode as _decode_ops, varlen as _varlen_ops
from ._eager import flat_apply
from ._schema import schema_scale, schema_sliding_window, schema_softcap
from .attention import (AttentionFunction, QKVAttentionFunction, attention_forward, dropout_seed, eager_seed,
                        op_scale)
from .downsample import DownsampleFunction, downsample_expr

__all__ = ["attention", "scripted_attention", "varlen", "decode", "downsample"]


def attention(q, k, v, w, attn_mask, is_causal, dropout_p, scale, recording, softcap=None, sliding_window=None,
              qkv=None):
    """The dense family's call on the kernels: torch's rules here
    (hkt._core.checks: types, devices, bfloat16 upcast before the extension
    sees it, so a mix must be refused first; the scalars' types), the rest
    (shapes, strides, float32/float64 dtypes, the scale's finiteness,
    dropout_p's range, the softcap) the extension's, which names the
    argument.  recording: torch.compile or torch.jit.trace records the call
    (the registered op).  qkv: a module's packed self-attention projection
    whose heads are q[0], k[0] and v, given only by an eager call that needs
    its gradient on kernels that write it in qkv's dtype (qkv_attention): the
    gradient then comes back as one tensor (QKVAttentionFunction).  Every
    scalar goes on, in the same order, to the op, the autograd Function and
    the kernels."""
    grad_mode = torch.is_grad_enabled()
    grad, dropout_p, scale = _check_inputs(q, k, v, w, is_causal, dropout_p, scale, grad_mode)
    q0 = q[0]
    if attn_mask is not None:
        attn_mask = _kernel_mask(attn_mask, q0, k[0])
    if recording or q0.is_meta:
        # torch.compile or torch.jit.trace: the registered custom op, which they
        # record; meta tensors (shapes only) take its fake kernel
        if q0.is_meta:  # no kernel runs on them: the extension's checks, asked without running it
            _kernels.check_forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale, softcap, sliding_window)
        # without dropout the seed is never read: a tensor on q's device keeps the
        # traced graph free of CPU work (CUDA graph partitions)
        seed = dropout_seed(dropout_p, q0.device)
        out, _ = attention_forward(list(q), list(k), v, w, attn_mask, is_causal, dropout_p, op_scale(scale, q0),
                                   seed, schema_softcap(softcap), schema_sliding_window(sliding_window))
        return out
    # eager: straight to the kernels, no dispatcher (same kernels, same arguments as the op)
    seed = eager_seed(dropout_p) if dropout_p > 0 else 0
    if grad_mode and (grad or (attn_mask is not None and attn_mask.requires_grad)):
        # the op's registered autograd, without the dispatcher (ops/attention.py)
        if qkv is not None:
            return flat_apply(QKVAttentionFunction, q[1:], k[1:], q0.shape[1], k[0].shape[1], qkv, w, attn_mask,
                              is_causal, dropout_p, scale, seed)
        return flat_apply(AttentionFunction, q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed, softcap,
                          sliding_window)
    return _kernels._forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed, softcap, sliding_window,
                             want_lse=False)[0]


def scripted_attention(qs: List[Tensor], ks: List[Tensor], v: Tensor, w: Tensor, mask: Optional[Tensor],
                       is_causal: bool, dropout_p: float) -> Tensor:
    """The dense route's one branch that TorchScript compiles (MultiheadHKT
    scripted, its arguments already checked, the mask 4-D): TorchScript cannot
    call :func:`attention` (torch's Python-only checks, the autograd Function),
    so it always takes the registered op, with the default scale and a fresh
    dropout seed from the same places."""
    scale = default_scale(qs[0].shape[-1])
    seed = dropout_seed(dropout_p, torch.device("cpu"))
    return torch.ops.hkt.attention_forward(qs, ks, v, w, mask, is_causal, dropout_p, scale, seed)[0]


def varlen(q, k, v, w, cu_q, cu_k, max_q, max_k, is_causal, scale, grad: bool) -> Tensor:
    """The packed family's call (its arguments checked by hkt.varlen): the op
    where torch.compile or torch.export records; else on the kernels, through
    the op's eager autograd when ``grad`` (an input requires it) and grad mode
    is on."""
    if torch.compiler.is_compiling():  # torch.compile, torch.export: the op, which they record
        return _varlen_ops.varlen_forward(list(q), list(k), v, w, cu_q, cu_k, max_q, max_k, is_causal,
                                          schema_scale(scale))[0]
    _refuse_meta(q[0], "variable-length attention")
    if torch.is_grad_enabled() and grad:
        return flat_apply(_varlen_ops.VarlenFunction, list(q), list(k), v, w, cu_q, cu_k, max_q, max_k, is_causal,
                          scale)[0]
    return _kernels._varlen_forward(q, k, v, w, cu_q, cu_k, max_q, max_k, is_causal, scale)[0]


def decode(q, k_cache, v_cache, w, cache_seqlens, k, v, scale, softcap=None, sliding_window=None) -> Tensor:
    """The decoding family's call (forward only: hkt.kvcache refuses inputs
    that need a gradient): hkt::decode (read only) or hkt::decode_append (k
    and v written into the caches first) where torch.compile or torch.export
    records, cache_seqlens as a tensor or None beside an int; else the kernel."""
    if torch.compiler.is_compiling():  # torch.compile, torch.export: the op, which they record
        lens = (cache_seqlens, 0) if isinstance(cache_seqlens, Tensor) else (None, cache_seqlens)
        if k is None and v is None:
            return _decode_ops.decode(list(q), list(k_cache), v_cache, w, *lens, schema_scale(scale),
                                      schema_softcap(softcap), schema_sliding_window(sliding_window))
        return _decode_ops.decode_append(list(q), list(k_cache), v_cache, w, *lens, list(k), v, schema_scale(scale),
                                         schema_softcap(softcap), schema_sliding_window(sliding_window))
    _refuse_meta(q[0], "decoding")
    return _kernels._decode(q, k_cache, v_cache, w, cache_seqlens, k, v, scale, softcap, sliding_window)


def downsample(x: Tensor, taps: Tensor) -> Tensor:
    """The downsampling family's call: the extension's one-pass kernels where
    they take it (_downsample_in_c), through the op's eager autograd where a
    gradient is wanted; else (and in TorchScript) the torch expression, which
    has the forward kernel's bits."""
    if not torch.jit.is_scripting():
        if _downsample_in_c(x, taps):
            return _downsample_c(x, taps)
    return downsample_expr(x, taps)


_DS_DTYPES = (torch.float32, torch.float64)


@torch.jit.unused
def _downsample_in_c(x: Tensor, taps: Tensor) -> bool:
    """Whether the extension takes this call: CPU float32/float64 of one dtype,
    the ranks it wants (a malformed call goes to the expression, whose error
    torch raises), and not while torch.compile traces (it fuses the expression)
    or torch.jit.trace records (it records ops, not the extension's calls), or
    under torch.func transforms (the extension takes plain arrays)."""
    return (x.dtype in _DS_DTYPES and taps.dtype == x.dtype and x.device.type == "cpu"
            and taps.device.type == "cpu" and x.dim() == 3 and taps.dim() == 2 and taps.shape[0] >= 1
            and taps.shape[1] == x.shape[2] and not _symbolic())


@torch.jit.unused
def _downsample_c(x: Tensor, taps: Tensor) -> Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or taps.requires_grad):
        return _DOWNSAMPLE_APPLY(x, taps)
    return _kernels._downsample_forward(x, taps)


# apply's C entry: never under torch.func transforms (_downsample_in_c)
_DOWNSAMPLE_APPLY = DownsampleFunction.fast_apply
