"""The eager autograd Functions over the attention kernels: hkt_attention's
(_Attention) and the one for a module's packed self-attention projection
(_QKVAttention), whose level-0 gradients the kernels write as one tensor.  They
call the kernels directly, without the custom op's dispatch (hkt.ops, which
torch.compile traces, runs the same kernels on the same arguments); a backward
with create_graph=True goes through the differentiable hkt::attention_backward
op.
"""
import math

import torch
from torch import Tensor

from . import _kernels, ops
from ._guards import _c_apply

_SEED_HIGH = 2**62


def _eager_seed(dropout_p: float) -> int:
    """The dropout seed of an eager call, from torch's default generator."""
    # on the CPU, whatever torch's default device is: the generator the docs name
    return int(torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device="cpu")) if dropout_p > 0 else 0


def _scale_value(scale, q0: Tensor) -> float:
    """The score scale as a float (the custom ops' schema wants one): 1/sqrt(D) by
    default, as the extension computes it when handed None."""
    if scale is None:
        D = q0.shape[-1] if q0.dim() else 0
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    try:
        return float(scale)
    except OverflowError:  # an int beyond the float range; the extension says so
        return math.inf


def _heads(x: Tensor, H: int, hd: int) -> Tensor:
    """(B, n, H * hd) -> (B, H, n, hd): projected features split into heads, the
    layout hkt_attention takes (MultiheadHKT and its decoding share it)."""
    return x.reshape(x.shape[0], x.shape[1], H, hd).transpose(1, 2)


def _save_forward(ctx, q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed):
    """The eager forward's kernels: (out, results), results what its backward
    needs (out, lse and the mask) for save_for_backward after the inputs.  Never
    kept on ctx itself: out's grad_fn is ctx, so ctx -> out -> ctx would be a
    cycle, and each call's graph (with everything upstream that it saved) would
    wait for Python's cycle collector, or, with gc off, never be freed."""
    out, lse = _kernels._forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed, like_inputs=True)
    ctx.L, ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.seed = len(q), is_causal, dropout_p, scale, seed
    return out, (out, lse, attn_mask)


def _run_backward(ctx, dout, q, k, v, w, results, mask_needs_grad, into=None):
    """(dq, dk, dv, dw, dmask) of the eager autograd Functions: the kernels, or,
    under create_graph, the differentiable hkt::attention_backward op.  into:
    (dq[0], dk[0], dv) arrays for the kernels to write those gradients in."""
    out, lse, attn_mask = results
    L = len(q)
    # a float mask that requires grad gets one; a bool mask never needs one
    mask_grad = bool(mask_needs_grad) and attn_mask is not None and attn_mask.is_floating_point()
    if torch.is_grad_enabled():  # create_graph: a backward that is itself differentiable
        args = (ctx.is_causal, ctx.dropout_p, _scale_value(ctx.scale, q[0]))
        grads = ops.attention_backward(dout, q, k, v, w, out, lse, attn_mask, *args,
                                       torch.tensor(ctx.seed, dtype=torch.int64, device="cpu"), mask_grad)
        return grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1], (grads[2 * L + 2] if mask_grad else None)
    return _kernels._backward(dout, q, k, v, w, out, lse, attn_mask, ctx.is_causal, ctx.dropout_p, ctx.scale,
                              ctx.seed, mask_grad, like_inputs=True, into=into)


class _Attention(torch.autograd.Function):
    """Autograd for eager calls: the kernels directly, without the custom op's
    dispatch (the op, ``hkt::attention_forward``, is what ``torch.compile``
    traces; both run the same kernels on the same arguments).  A backward run
    with ``create_graph=True`` goes through the ``hkt::attention_backward`` op,
    whose own derivative is registered, so double backward works too."""

    @staticmethod
    def forward(ctx, L, Lk, is_causal, dropout_p, scale, seed, attn_mask, *qkvw):
        # Lk: k's own count, which the extension checks against q's and names
        q, k, v, w = list(qkvw[:L]), list(qkvw[L:L + Lk]), qkvw[L + Lk], qkvw[L + Lk + 1]
        out, results = _save_forward(ctx, q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed)
        ctx.save_for_backward(*qkvw, *results)
        return out

    @staticmethod
    def backward(ctx, dout):
        L, saved = ctx.L, ctx.saved_tensors
        q, k = list(saved[:L]), list(saved[L:2 * L])
        v, w = saved[2 * L:2 * L + 2]
        dq, dk, dv, dw, dmask = _run_backward(ctx, dout, q, k, v, w, saved[2 * L + 2:], ctx.needs_input_grad[6])
        return (None, None, None, None, None, None, dmask, *dq, *dk, dv, dw)


_ATTENTION_APPLY = _c_apply(_Attention)


def _qkv_heads(qkv: Tensor, H: int, H_kv: int, hd: int):
    """A packed projection's output (B, T, (H + 2 H_kv) hd) as level 0's q, k and v heads (views)."""
    q, k, v = qkv.split([H * hd, H_kv * hd, H_kv * hd], dim=-1)
    return _heads(q, H, hd), _heads(k, H_kv, hd), _heads(v, H_kv, hd)


class _QKVAttention(torch.autograd.Function):
    """_Attention for a module's packed self-attention projection: level 0's
    q, k and v are heads of one (B, T, (H + 2 H_kv) hd) tensor, whose gradient
    the kernels write as one such tensor.  Through split, autograd would
    concatenate the three gradients instead: a copy of the projection's whole
    output into fresh memory, in every training step."""

    @staticmethod
    def forward(ctx, H, H_kv, is_causal, dropout_p, scale, seed, attn_mask, qkv, w, *coarse):
        hd = qkv.shape[-1] // (H + 2 * H_kv)
        q0, k0, v = _qkv_heads(qkv, H, H_kv, hd)
        n = len(coarse) // 2
        out, results = _save_forward(ctx, [q0, *coarse[:n]], [k0, *coarse[n:]], v, w, attn_mask, is_causal,
                                     dropout_p, scale, seed)
        ctx.heads = (H, H_kv, hd)
        ctx.save_for_backward(qkv, w, *coarse, *results)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        qkv, w = saved[0], saved[1]
        coarse, results = saved[2:-3], saved[-3:]
        n = len(coarse) // 2
        q0, k0, v = _qkv_heads(qkv, *ctx.heads)
        q, k = [q0, *coarse[:n]], [k0, *coarse[n:]]
        # whole only where the kernels write qkv's dtype now (bfloat16 natively: the
        # choice is the backward's own, hkt._kernels.native_bf16 read again)
        if torch.is_grad_enabled() or (qkv.dtype == torch.bfloat16 and not _kernels._native_bf16(q0, v.shape[-1])):
            dq, dk, dv, dw, dmask = _run_backward(ctx, dout, q, k, v, w, results, ctx.needs_input_grad[6])
            B, T = qkv.shape[0], qkv.shape[1]
            dqkv = torch.cat([x.transpose(1, 2).reshape(B, T, -1) for x in (dq[0], dk[0], dv)], dim=-1)
        else:
            # contiguous, whatever layout a saved-tensors hook handed qkv back in: the
            # kernels write the heads of dq, dk, dv with unit feature stride
            dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
            dq, dk, dv, dw, dmask = _run_backward(ctx, dout, q, k, v, w, results, ctx.needs_input_grad[6],
                                                  into=_qkv_heads(dqkv, *ctx.heads))
        return (None, None, None, None, None, None, dmask, dqkv, dw, *dq[1:], *dk[1:])


_QKV_APPLY = _c_apply(_QKVAttention)
