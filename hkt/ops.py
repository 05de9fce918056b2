"""torch.library custom ops around the kernels: fake (meta) kernels for
torch.compile, and autograd.

hkt::attention_forward  -> (out, lse)           lse is the per-row log-sum-exp
hkt::attention_backward -> dq[0..L) + dk[0..L) + [dv, dw] (+ [dmask] with mask_grad)

attn_mask reaches the ops at its own size, 4-D, each dimension 1 or the full
(B, H, T, S); a float mask's gradient (mask_grad) comes back in that shape.

The autograd context keeps q, k, v, w, out and lse (never the attention
matrix) and the dropout seed, so the backward sees the forward's dropout mask.
"""
from typing import List, Optional

import torch
from torch import Tensor

from . import _kernels

__all__ = ["attention_forward", "attention_backward"]

_SEED_MASK = (1 << 64) - 1


def _seed_value(seed: Tensor) -> int:
    return int(seed.item()) & _SEED_MASK


@torch.library.custom_op("hkt::attention_forward", mutates_args=())
def attention_forward(q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                      is_causal: bool, dropout_p: float, scale: float, seed: Tensor) -> tuple[Tensor, Tensor]:
    return _kernels._forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale, _seed_value(seed))


@attention_forward.register_fake
def _(q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed):
    B, H, T, _ = q[0].shape
    out = q[0].new_empty((B, H, T, v.shape[-1]))
    lse = q[0].new_empty((B, H, T), dtype=_kernels.compute_dtype(q[0].dtype))
    return out, lse


@torch.library.custom_op("hkt::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, out: Tensor,
                       lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float, scale: float,
                       seed: Tensor, mask_grad: bool = False) -> List[Tensor]:
    dq, dk, dv, dw, dmask = _kernels._backward(dout, q, k, v, w, out, lse, attn_mask, is_causal, dropout_p, scale,
                                               _seed_value(seed), mask_grad)
    return dq + dk + [dv, dw] + ([dmask] if mask_grad else [])


@attention_backward.register_fake
def _(dout, q, k, v, w, out, lse, attn_mask, is_causal, dropout_p, scale, seed, mask_grad=False):
    return ([x.new_empty(x.shape) for x in q] + [x.new_empty(x.shape) for x in k]
            + [v.new_empty(v.shape), w.new_empty(w.shape)]
            + ([attn_mask.new_empty(attn_mask.shape)] if mask_grad else []))


def _setup_context(ctx, inputs, output):
    q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed = inputs
    out, lse = output
    ctx.L = len(q)
    ctx.is_causal, ctx.dropout_p, ctx.scale = is_causal, dropout_p, scale
    ctx.save_for_backward(*q, *k, v, w, out, lse, attn_mask, seed)


def _backward(ctx, grad_out, grad_lse):
    L = ctx.L
    saved = ctx.saved_tensors
    q, k = list(saved[:L]), list(saved[L:2 * L])
    v, w, out, lse, attn_mask, seed = saved[2 * L:]
    # a float mask that requires grad gets one; a bool mask never needs one
    mask_grad = bool(ctx.needs_input_grad[4]) and attn_mask is not None and attn_mask.is_floating_point()
    grads = attention_backward(grad_out, q, k, v, w, out, lse, attn_mask, ctx.is_causal, ctx.dropout_p,
                               ctx.scale, seed, mask_grad)
    dq, dk, dv, dw = grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1]
    dmask = grads[2 * L + 2] if mask_grad else None
    return dq, dk, dv, dw, dmask, None, None, None, None


torch.library.register_autograd("hkt::attention_forward", _backward, setup_context=_setup_context)
