"""hkt_attention(..., windows=...) on the windowed CPU kernels (csrc/hkt_window.h).

The kernels take each level's values summed over its blocks (vs[0] = v,
vs[l] row c = v rows c*2^l .. c*2^l + 2^l - 1 summed) and return the gradient
of each of those sums; forming the sums and spreading their gradients back onto
v are plain tensor ops here (pairwise sums, fixed order, so deterministic).
"""
import math
from typing import List, Tuple

import torch
from torch import Tensor

from ._checks import check_call
from ._guards import _functorch_active
from ._kernels import _threads, window_kernels
from .reference import check_windows

__all__ = ["windowed_attention", "window_forward", "window_backward", "block_sums", "spread_block_grads"]


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


# The kernels as torch.library custom ops, as hkt/ops.py makes the unwindowed ones:
# torch.compile (fullgraph too) and torch.export then see one op with a fake
# kernel instead of a C function they cannot trace.  w arrives as (H, L); the
# block sums of v are remade in the backward (O(S Dv), the same bits) rather
# than kept.

@torch.library.custom_op("hkt::window_forward", mutates_args=())
def window_forward(q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, radius: List[int], is_causal: bool,
                   scale: float) -> Tuple[Tensor, Tensor]:
    # the op runs below autograd, but its inputs still say they require grad, which DLPack refuses
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    B, H, T, _ = q[0].shape
    out = q[0].new_empty(B, H, T, v.shape[-1])
    lse = q[0].new_empty(B, H, T)
    window_kernels(q, k, block_sums(v, len(q)), w, out, lse, tuple(radius), is_causal, scale, _threads())
    return out, lse


@window_forward.register_fake
def _(q, k, v, w, radius, is_causal, scale):
    B, H, T, _ = q[0].shape
    return q[0].new_empty(B, H, T, v.shape[-1]), q[0].new_empty(B, H, T)


@torch.library.custom_op("hkt::window_backward", mutates_args=())
def window_backward(dout: Tensor, q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, out: Tensor, lse: Tensor,
                    radius: List[int], is_causal: bool, scale: float) -> List[Tensor]:
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    dout, out, lse = dout.detach(), out.detach(), lse.detach()
    vs = block_sums(v, len(q))
    dq = [torch.empty_like(x) for x in q]
    dk = [torch.empty_like(x) for x in k]
    dvs = [torch.empty_like(x) for x in vs]
    dw = torch.empty_like(w)
    window_kernels(q, k, vs, w, out, lse, tuple(radius), is_causal, scale, _threads(), dout=dout.contiguous(),
                   dq=dq, dk=dk, dvs=dvs, dw=dw)
    return dq + dk + [spread_block_grads(dvs, v.shape[2]), dw]


@window_backward.register_fake
def _(dout, q, k, v, w, out, lse, radius, is_causal, scale):
    return [x.new_empty(x.shape) for x in (*q, *k, v, w)]


def _setup_context(ctx, inputs, output):
    q, k, v, w, radius, is_causal, scale = inputs
    ctx.L, ctx.radius, ctx.is_causal, ctx.scale = len(q), radius, is_causal, scale
    ctx.save_for_backward(*q, *k, v, w, *output)


def _gradients(ctx, dout, _dlse):
    L, saved = ctx.L, ctx.saved_tensors
    q, k, (v, w, out, lse) = list(saved[:L]), list(saved[L:2 * L]), saved[2 * L:]
    grads = window_backward(dout, q, k, v, w, out, lse, ctx.radius, ctx.is_causal, ctx.scale)
    return grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1], None, None, None


torch.library.register_autograd("hkt::window_forward", _gradients, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("windows: the windowed kernels have no double backward (a gradient of their "
                              "gradient); use hkt.reference with windows= for it")


def _keep_nothing(ctx, inputs, output):
    pass


torch.library.register_autograd("hkt::window_backward", _no_double_backward, setup_context=_keep_nothing)


def windowed_attention(q, k, v, w, windows, attn_mask, is_causal, dropout_p, scale, backend):
    """hkt_attention with windows: its arguments checked as hkt_attention checks
    them, what the windowed kernels cannot take refused by name; None when no
    level has a window (the caller then makes today's call)."""
    windows = check_windows(windows, len(q), growing=True)
    if windows is None:  # no level has a window: today's call, unchanged
        return None
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
    if _functorch_active():  # whichever backend was asked for
        raise NotImplementedError("windows: the windowed kernels do not run under torch.func transforms (vmap, "
                                  "grad, jacrev, ...)")
    if q[0].device.type not in ("cpu", "meta"):  # meta: the op's fake kernel gives the shapes
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
    q, k, v, w = cast[:L], cast[L:2 * L], cast[2 * L], cast[2 * L + 1]
    H = q[0].shape[1]
    w2 = w.expand(H, L).contiguous() if w.dim() == 1 else w  # autograd sums dw back over the heads
    out = window_forward(q, k, v, w2, list(_radius(windows)), is_causal, scale)[0]
    return out.to(dtype) if dtype == torch.bfloat16 else out
