"""The dense attention kernels as torch.library custom ops: fake (meta) kernels
for torch.compile, and autograd.

hkt::attention_forward  -> (out, lse)           lse is the per-row log-sum-exp
hkt::attention_backward -> dq[0..L) + dk[0..L) + [dv, dw] (+ [dmask] with mask_grad)

attn_mask reaches the ops at its own size, 4-D, each dimension 1 or the full
(B, H, T, S); a float mask's gradient (mask_grad) comes back in that shape.

The autograd context keeps q, k, v, w, out and lse (never the attention
matrix) and the dropout seed, so the backward sees the forward's dropout mask.

hkt::attention_backward has an autograd formula too (double backward, e.g.
gradient penalties, Hessian-vector products, gradgradcheck): it recomputes the
attention in plain PyTorch (hkt._maths) from the saved inputs and
differentiates that, so it costs O(B*H*T*S) memory, unlike the kernels; see
:func:`_double_backward`.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .. import _kernels
from .._checks import compute_dtype
from .._maths import dense_attention
from ._schema import OP_OPTIONS

__all__ = ["attention_forward", "attention_backward"]

_SEED_MASK = (1 << 64) - 1

def _seed_value(seed: Tensor) -> int:
    return int(seed.item()) & _SEED_MASK


@torch.library.custom_op("hkt::attention_forward", mutates_args=(), **OP_OPTIONS)
def attention_forward(q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                      is_causal: bool, dropout_p: float, scale: float, seed: Tensor) -> tuple[Tensor, Tensor]:
    # the seed is read (on the host) only when there is dropout: without, it may
    # be a device tensor (functional.py makes it one), never synchronized on
    return _kernels._forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale,
                             _seed_value(seed) if dropout_p > 0 else 0)


@attention_forward.register_fake
def _(q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed):
    B, H, T, _ = q[0].shape
    out = q[0].new_empty((B, H, T, v.shape[-1]))
    lse = q[0].new_empty((B, H, T), dtype=compute_dtype(q[0].dtype))
    return out, lse


@torch.library.custom_op("hkt::attention_backward", mutates_args=(), **OP_OPTIONS)
def attention_backward(dout: Tensor, q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, out: Tensor,
                       lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float, scale: float,
                       seed: Tensor, mask_grad: bool = False) -> List[Tensor]:
    dq, dk, dv, dw, dmask = _kernels._backward(dout, q, k, v, w, out, lse, attn_mask, is_causal, dropout_p, scale,
                                               _seed_value(seed) if dropout_p > 0 else 0, mask_grad)
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


def _forward_op_gradients(ctx, grad_out, grad_lse):
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


torch.library.register_autograd("hkt::attention_forward", _forward_op_gradients, setup_context=_setup_context)


# ---- double backward ------------------------------------------------------------

def _setup_backward_context(ctx, inputs, output):
    dout, q, k, v, w, out, lse, attn_mask, is_causal, dropout_p, scale, seed, mask_grad = inputs
    ctx.L = len(q)
    ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.mask_grad = is_causal, dropout_p, scale, mask_grad
    # out and lse are not kept: the formula recomputes the attention from the inputs
    ctx.save_for_backward(dout, *q, *k, v, w, attn_mask, seed)


def _slot(x: Tensor, dtype: torch.dtype, grad: bool) -> Tensor:
    """A tensor of its own for one argument slot, in the compute dtype.  It is
    attached to x's graph when x requires grad (so the result stays
    differentiable, to any order), otherwise a fresh leaf that requires grad when
    ``grad``.  Each slot is a new node, so a tensor passed in two slots (q[0] is
    k[0]) still gets each slot's own partial derivative."""
    if x.requires_grad:
        y = x.to(dtype)
        return y.view_as(y) if y is x else y
    return x.detach().to(dtype).requires_grad_(grad)


def _flags(need, n):
    """needs_input_grad of a list argument, as n bools."""
    if isinstance(need, (list, tuple)):
        return [bool(x) for x in need]
    return [bool(need)] * n


def _double_backward(ctx, grads):
    """Autograd formula of hkt::attention_backward, in plain PyTorch.

    The first-order gradients are rebuilt from the saved dout, q, k, v, w and
    attn_mask with :func:`hkt._maths.dense_attention` (the forward
    recomputed: full (B, H, T, S) scores and probabilities, O(B*H*T*S) memory
    and time, several such buffers) and differentiated once more by autograd.
    ``out`` and ``lse`` are taken to be the forward's outputs for these inputs
    (as they always are when the op runs inside hkt's autograd): they get no
    gradient of their own, the one through them is in q's, k's, v's, w's and
    the mask's.  Masks (bool or float, the float mask's own gradient with
    ``mask_grad``), causal, per-head or shared w and dropout (the kernels'
    pattern, rebuilt from the saved seed) are all handled; bfloat16 is computed
    in float32, or natively where hkt.hkt_attention says.  Rows with no visible key and NaN follow the contract's rules,
    which are the kernels'.
    """
    L = ctx.L
    saved = ctx.saved_tensors
    dout, q, k = saved[0], list(saved[1:1 + L]), list(saved[1 + L:1 + 2 * L])
    v, w, attn_mask, seed = saved[1 + 2 * L:]
    p = ctx.dropout_p
    need = ctx.needs_input_grad
    # grads of the outputs dq[0..L) + dk[0..L) + [dv, dw] (+ [dmask])
    ggrads = list(grads[0]) if isinstance(grads[0], (list, tuple)) else list(grads)
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask_needs = float_mask and bool(need[7])

    keep = None
    if p > 0:
        B, H, T = q[0].shape[:3]
        S = k[0].shape[2]
        keep = _kernels.dropout_keep_mask(_seed_value(seed), p, B, H, T, S).to(q[0].device)

    cd = compute_dtype(q[0].dtype)
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        dout_ = _slot(dout, cd, True)
        q_ = [_slot(x, cd, True) for x in q]
        k_ = [_slot(x, cd, True) for x in k]
        v_, w_ = _slot(v, cd, True), _slot(w, cd, True)
        m_ = None
        if attn_mask is not None:
            m_ = _slot(attn_mask, cd, ctx.mask_grad or mask_needs) if float_mask else attn_mask
        out = dense_attention(q_, k_, v_, w_, m_, ctx.is_causal, ctx.scale, p, keep)
        # first-order gradients only where a gradient of them came in
        first_all = q_ + k_ + [v_, w_] + ([m_] if ctx.mask_grad else [])
        pairs = [(x, g) for x, g in zip(first_all, ggrads) if g is not None]
        # second-order gradients only for the inputs that need one
        need_flat = [bool(need[0])] + _flags(need[1], L) + _flags(need[2], L) + [bool(need[3]), bool(need[4])]
        wrt_all = [dout_] + q_ + k_ + [v_, w_] + ([m_] if mask_needs else [])
        need_flat += [True] if mask_needs else []
        wrt = [x for x, n in zip(wrt_all, need_flat) if n]
        res_needed = [None] * len(wrt)
        if pairs and wrt:
            first = torch.autograd.grad(out, [x for x, _ in pairs], dout_, create_graph=True, allow_unused=True)
            outs, gouts = [], []
            for f, (_, g) in zip(first, pairs):
                if f is not None and f.requires_grad:
                    outs.append(f)
                    gouts.append(g.to(f.dtype))
            if outs:
                res_needed = list(torch.autograd.grad(outs, wrt, gouts, create_graph=create_graph,
                                                      allow_unused=True))
        it = iter(res_needed)
        res = [next(it) if n else None for n in need_flat]

    def back(g, x):
        return torch.zeros_like(x) if g is None else g.to(x.dtype)

    d_dout = back(res[0], dout)
    d_q = [back(g, x) for g, x in zip(res[1:1 + L], q)]
    d_k = [back(g, x) for g, x in zip(res[1 + L:1 + 2 * L], k)]
    d_v, d_w = back(res[1 + 2 * L], v), back(res[2 + 2 * L], w)
    d_mask = back(res[3 + 2 * L], attn_mask) if mask_needs else None
    res = (d_dout, d_q, d_k, d_v, d_w, None, None, d_mask, None, None, None, None)
    # the dispatcher drops a trailing argument equal to its default (mask_grad=False)
    return res + (None,) if ctx.mask_grad else res


torch.library.register_autograd("hkt::attention_backward", _double_backward,
                                setup_context=_setup_backward_context)
