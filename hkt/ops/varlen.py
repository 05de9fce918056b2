"""Packed variable-length attention (hkt.hkt_attention_varlen) as torch.library
custom ops:

hkt::varlen_forward  -> (out, lse)   out (total_q, H, Dv) in q's dtype, lse (H * total_q,) in the compute dtype
hkt::varlen_backward -> dq[0..L) + dk[0..L) + [dv, dw]

The autograd formula is registered once and serves eager calls, torch.compile
and torch.export alike.  A backward with create_graph=True (double backward,
gradient penalties) differentiates the dense formula instead, sequence by
sequence (hkt._core.maths.dense_attention: O(T_s S_s) memory), so its gradients are
differentiable too.  The custom ops' own inputs are plain tensors, offsets
included (int32 or int64 on the CPU); the scale is None (1 / sqrt(D)) or a
float.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .._core import kernels as _kernels
from .._core.maths import compute_dtype, dense_attention
from ._eager import eager_autograd
from ._schema import OP_OPTIONS, no_derivative

__all__ = ["varlen_forward", "varlen_backward", "VarlenFunction", "level_offsets"]


def level_offsets(cu_seqlens: Tensor, levels: int) -> List[Tensor]:
    """The row offsets of each level of a packed batch: level l packs each
    sequence's ceil(len / 2^l) rows one after another (hkt.varlen_level_offsets)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    zero = torch.zeros(1, dtype=torch.int64, device=cu_seqlens.device)
    return [torch.cat([zero, torch.cumsum((lens + (2 ** l - 1)) // 2 ** l, 0)]).to(cu_seqlens.dtype)
            for l in range(levels)]


def _forward(q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, cu_seqlens_q: Tensor,
                   cu_seqlens_k: Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], is_causal: bool,
                   scale: Optional[float]) -> tuple[Tensor, Tensor]:
    # the op runs below autograd, but its inputs still say they require grad, which DLPack refuses
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    return _kernels._varlen_forward(q, k, v, w, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                    scale)


varlen_forward = torch.library.custom_op("hkt::varlen_forward", _forward, mutates_args=(), **OP_OPTIONS)


@varlen_forward.register_fake
def _(q, k, v, w, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale):
    total_q, H = q[0].shape[:2]
    out = q[0].new_empty((total_q, H, v.shape[-1]))
    lse = q[0].new_empty((total_q * H,), dtype=compute_dtype(q[0].dtype))
    return out, lse


def _backward(dout: Tensor, q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, out: Tensor, lse: Tensor,
                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: Optional[int],
                    max_seqlen_k: Optional[int], is_causal: bool, scale: Optional[float]) -> List[Tensor]:
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    dq, dk, dv, dw = _kernels._varlen_backward(dout.detach(), q, k, v, w, out.detach(), lse.detach(), cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    return dq + dk + [dv, dw]


varlen_backward = torch.library.custom_op("hkt::varlen_backward", _backward, mutates_args=(), **OP_OPTIONS)


@varlen_backward.register_fake
def _(dout, q, k, v, w, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale):
    return [x.new_empty(x.shape) for x in (*q, *k, v, w)]


def _setup_context(ctx, inputs, output):
    q, k, v, w, cu_q, cu_k, max_q, max_k, is_causal, scale = inputs
    ctx.L, ctx.args = len(q), (max_q, max_k, is_causal, scale)
    ctx.save_for_backward(*q, *k, v, w, *output, cu_q, cu_k)


def _gradients(ctx, dout, _dlse):
    L, saved = ctx.L, ctx.saved_tensors
    q, k = list(saved[:L]), list(saved[L:2 * L])
    v, w, out, lse, cu_q, cu_k = saved[2 * L:]
    if torch.is_grad_enabled():  # create_graph: a backward that is itself differentiable
        _, _, is_causal, scale = ctx.args
        dq, dk, dv, dw = _differentiable_grads(dout, q, k, v, w, cu_q, cu_k, is_causal, scale)
    elif getattr(ctx, "eager", False):  # the kernels themselves: no dispatch
        dq, dk, dv, dw = _kernels._varlen_backward(dout, q, k, v, w, out, lse, cu_q, cu_k, *ctx.args)
    else:
        grads = varlen_backward(dout, q, k, v, w, out, lse, cu_q, cu_k, *ctx.args)
        dq, dk, dv, dw = grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1]
    return dq, dk, dv, dw, None, None, None, None, None, None


torch.library.register_autograd("hkt::varlen_forward", _gradients, setup_context=_setup_context)
# eager calls that need gradients: the same functions, without the dispatcher
VarlenFunction = eager_autograd("VarlenFunction", _kernels._varlen_forward, _setup_context, _gradients, lists=True)


no_derivative("hkt::varlen_backward", "hkt::varlen_backward: no derivative of its own; a backward with "
              "create_graph=True through hkt.hkt_attention_varlen differentiates the dense formula instead")


def _differentiable_grads(dout, q, k, v, w, cu_q, cu_k, is_causal, scale):
    """The packed gradients as differentiable tensors (create_graph): each
    sequence's attention recomputed in the compute dtype (its (T_s, S_s)
    scores and probabilities: O(T_s S_s) memory, as the padded call's double
    backward), then differentiated by autograd with create_graph=True."""
    L, cd = len(q), compute_dtype(q[0].dtype)
    oq = [x.tolist() for x in level_offsets(cu_q, L)]
    ok = [x.tolist() for x in level_offsets(cu_k, L)]
    with torch.enable_grad():
        qc, kc, vc, wc = [x.to(cd) for x in q], [x.to(cd) for x in k], v.to(cd), w.to(cd)
        outs = []
        for s in range(len(oq[0]) - 1):
            if ok[0][s + 1] == ok[0][s]:  # no keys: zeros, which depend on nothing
                outs.append(vc.new_zeros((oq[0][s + 1] - oq[0][s], qc[0].shape[1], vc.shape[2])))
                continue
            qs = [x[oq[l][s]:oq[l][s + 1]].transpose(0, 1).unsqueeze(0) for l, x in enumerate(qc)]
            ks = [x[ok[l][s]:ok[l][s + 1]].transpose(0, 1).unsqueeze(0) for l, x in enumerate(kc)]
            vs = vc[ok[0][s]:ok[0][s + 1]].transpose(0, 1).unsqueeze(0)
            outs.append(dense_attention(qs, ks, vs, wc, None, is_causal, scale)[0].transpose(0, 1))
        out = torch.cat(outs, 0) if outs else vc.new_zeros((0, qc[0].shape[1], vc.shape[2]))
        inputs = [*q, *k, v, w]
        wrt = [x for x in inputs if x.requires_grad]  # the rest need no gradient
        got = iter(torch.autograd.grad(out, wrt, dout.to(cd), create_graph=True, allow_unused=True) if wrt else ())
        grads = [next(got) if x.requires_grad else None for x in inputs]
    grads = [torch.zeros_like(x) if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
    return grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1]
