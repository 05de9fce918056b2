"""hkt_attention(..., windows=...) on the windowed CPU kernels (csrc/hkt_window.h).

The kernels take each level's values summed over its blocks (vs[0] = v,
vs[l] row c = v rows c*2^l .. c*2^l + 2^l - 1 summed) and return the gradient
of each of those sums; forming the sums and spreading their gradients back onto
v are plain tensor ops here (pairwise sums, fixed order, so deterministic).
"""
import math

import torch
from torch import Tensor

from ._checks import check_call
from ._guards import _refuse_trace
from ._kernels import _threads, window_kernels
from .reference import check_windows

__all__ = ["windowed_attention", "block_sums", "spread_block_grads"]


def block_sums(v: Tensor, L: int):
    """[v, v summed over pairs of rows, over fours, ...]: L tensors (B, H_kv, ceil(S/2^l), Dv),
    each level the sum of the one below in pairs (an odd last row alone)."""
    out = [v]
    for _ in range(1, L):
        x = out[-1]
        if x.shape[2] % 2:
            x = torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], 1, x.shape[3])], dim=2)
        out.append((x[:, :, 0::2] + x[:, :, 1::2]).contiguous())
    return out


def spread_block_grads(dvs, S: int) -> Tensor:
    """The gradient of v from those of its block sums: row j gets dvs[l][j >> l] of every level."""
    acc = dvs[-1]
    for l in range(len(dvs) - 2, -1, -1):
        acc = dvs[l] + acc.repeat_interleave(2, dim=2)[:, :, :dvs[l].shape[2]]
    return acc


def _radius(windows):
    return tuple(0 if W is None else W >> l for l, W in enumerate(windows))


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, radius, is_causal, scale, L, *qkvw):
        qkvw = [x.detach() for x in qkvw]
        q, k, v, w = list(qkvw[:L]), list(qkvw[L:2 * L]), qkvw[2 * L], qkvw[2 * L + 1]
        B, H, T, _ = q[0].shape
        w2 = (w.unsqueeze(0).expand(H, L) if w.dim() == 1 else w).contiguous()
        vs = block_sums(v, L)
        out = q[0].new_empty(B, H, T, v.shape[-1])
        lse = q[0].new_empty(B, H, T)
        window_kernels(q, k, vs, w2, out, lse, radius, is_causal, scale, _threads())
        ctx.radius, ctx.is_causal, ctx.scale, ctx.L, ctx.w_dim = radius, is_causal, scale, L, w.dim()
        ctx.save_for_backward(*q, *k, *vs, w2, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        L = ctx.L
        saved = [x.detach() for x in ctx.saved_tensors]
        q, k, vs = list(saved[:L]), list(saved[L:2 * L]), list(saved[2 * L:3 * L])
        w2, out, lse = saved[3 * L:]
        dq = [torch.empty_like(x) for x in q]
        dk = [torch.empty_like(x) for x in k]
        dvs = [torch.empty_like(x) for x in vs]
        dw = torch.empty_like(w2)
        window_kernels(q, k, vs, w2, out, lse, ctx.radius, ctx.is_causal, ctx.scale, _threads(),
                  dout=dout.contiguous(), dq=dq, dk=dk, dvs=dvs, dw=dw)
        dv = spread_block_grads(dvs, vs[0].shape[2])
        if ctx.w_dim == 1:
            dw = dw.sum(0)
        return (None, None, None, None, *dq, *dk, dv, dw)


def windowed_attention(q, k, v, w, windows, attn_mask, is_causal, dropout_p, scale, backend):
    """hkt_attention with windows: its arguments checked as hkt_attention checks
    them, what the windowed kernels cannot take refused by name; None when no
    level has a window (the caller then makes today's call)."""
    windows = check_windows(windows, len(q), growing=True)
    if windows is None:  # no level has a window: today's call, unchanged
        return None
    _refuse_trace("windows")
    if attn_mask is not None:
        raise ValueError("attn_mask: not supported with windows (a mask would break the sharing of one probability "
                         "by a block's keys); pass windows=None, or use hkt.reference for the dense definition")
    if backend == "sdpa":
        raise ValueError("backend: 'sdpa' does not take windows (the levels that see a pair vary with it, which no "
                         "one SDPA call expresses); use backend=None or 'kernels'")
    _, dropout_p, scale = check_call(q, k, v, w, None, is_causal, dropout_p, scale, dropout_allowed=True)
    if dropout_p > 0:
        raise ValueError("dropout_p: dropout is not supported with windows (it drops single keys, which would "
                         "break the sharing of one probability by a block's keys); use dropout_p=0")
    if torch._C._are_functorch_transforms_active():  # whichever backend was asked for
        raise NotImplementedError("windows: the windowed kernels do not run under torch.func transforms (vmap, "
                                  "grad, jacrev, ...)")
    if q[0].device.type != "cpu":
        raise ValueError(f"windows: the windowed kernels run on the CPU only, got q[0] on {q[0].device}")
    dtype = q[0].dtype
    if scale is None:
        scale = 1.0 / math.sqrt(q[0].shape[-1])
    scale = float(scale)
    L = len(q)
    if dtype == torch.bfloat16:  # computed in float32, rounded back
        cast = [x.float().contiguous() for x in (*q, *k, v, w)]
    else:
        cast = [x.contiguous() for x in (*q, *k, v, w)]
    out = _WindowAttention.apply(_radius(windows), is_causal, scale, L, *cast)
    return out.to(dtype) if dtype == torch.bfloat16 else out
