"""The windowed kernels (csrc/hkt_window.h) as torch.library custom ops:

hkt::window_forward  -> (out, lse)
hkt::window_backward -> dq[0..L) + dk[0..L) + [dv, dw, dmask]

The kernels take each level's values summed over its blocks (vs[0] = v,
vs[l] row c = v rows c*2^l .. c*2^l + 2^l - 1 summed) and return the gradient
of each of those sums; forming the sums and spreading their gradients back onto
v are plain tensor ops here (pairwise sums, fixed order, so deterministic).

windowed_attention is hkt_attention(..., windows=)'s route to them: its
arguments checked, what the windowed CPU kernels cannot take refused by name,
and the call of hkt::window_forward.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._core.checks import check_call, check_windows, kernel_mask_dtype
from .._core.guards import _functorch_active
from .._core.kernels import _threads, window_kernels, window_softcap
from .._core.maths import default_scale, repeat_kv
from ._schema import OP_OPTIONS, no_derivative
from .attention import dropout_seed

__all__ = ["windowed_attention", "window_forward", "window_backward", "block_sums", "spread_block_grads", "pair_sums", "fixed_sum"]


def pair_sums(x: Tensor, dim: int) -> Tensor:
    """x's rows along dim summed in pairs (an odd last row alone): elementwise
    adds, so the same bits for any thread count."""
    if x.shape[dim] % 2:
        pad = list(x.shape)
        pad[dim] = 1
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    pairs = x.unflatten(dim, (x.shape[dim] // 2, 2))
    return (pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)).contiguous()


def block_sums(v: Tensor, L: int):
    """[v, v summed over pairs of rows, over fours, ...]: L tensors (B, H_kv, ceil(S/2^l), Dv),
    each level the sum of the one below in pairs (an odd last row alone)."""
    out = [v]
    for _ in range(1, L):
        out.append(pair_sums(out[-1], 2))
    return out


def fixed_sum(x: Tensor, dims: List[int]) -> Tensor:
    """x summed over dims (kept, as size 1) in pairs: torch's own reductions split
    their sums by thread, which would make a gradient depend on the thread count."""
    for d in dims:
        while x.shape[d] > 1:
            x = pair_sums(x, d)
    return x


def spread_block_grads(dvs, S: int) -> Tensor:
    """The gradient of v from those of its block sums: row j gets dvs[l][j >> l] of every level."""
    acc = dvs[-1]
    for l in range(len(dvs) - 2, -1, -1):
        acc = dvs[l] + acc.repeat_interleave(2, dim=2)[:, :, :dvs[l].shape[2]]
    return acc


def _key_only(mask: Optional[Tensor], dropout_p: float, kv_heads: int) -> bool:
    """A bool mask the same for every query, without dropout, over kv_heads (or
    1) heads: the kernels keep their block sharing with counts of each block's
    visible keys."""
    return (mask is not None and mask.dtype == torch.bool and mask.shape[2] == 1 and dropout_p == 0
            and mask.shape[1] in (1, kv_heads))


def _key_keep(mask: Tensor, v: Tensor) -> Tensor:
    """A key-only bool mask (B or 1, H_kv or 1, 1, S) as (B, H_kv, S, 1)."""
    B, Hk, S = v.shape[:3]
    return mask[:, :, 0, :].expand(B, Hk, S).unsqueeze(-1)


def _kernel_values(v: Tensor, mask: Optional[Tensor], dropout_p: float, L: int):
    """(vs, counts, mask for the kernels): the values' block sums, and with a
    key-only mask only the visible keys' sums and their counts per block."""
    if not _key_only(mask, dropout_p, v.shape[1]):
        return block_sums(v, L), None, mask
    keep = _key_keep(mask, v)
    # a hidden key's NaN stays out; contiguous whatever the mask's layout made of it
    vs = block_sums(torch.where(keep, v, torch.zeros((), dtype=v.dtype)).contiguous(), L)
    counts = [c.squeeze(-1).contiguous() for c in block_sums(keep.to(v.dtype), L)]
    return vs, counts, None


def _seed_of(seed: Tensor) -> int:
    return int(seed.item()) if seed.numel() else 0


# The kernels as torch.library custom ops, as ops/attention.py makes the unwindowed ones:
# torch.compile (fullgraph too) and torch.export then see one op with a fake
# kernel instead of a C function they cannot trace.  w arrives as (H, L), a
# mask 4-D in the compute dtype; the block sums of v are remade in the
# backward (O(S Dv), the same bits) rather than kept.  The dropout seed is a
# tensor, so that a compiled graph draws a new one each call.  softcap: 0.0
# for none (docs/contract.md section 1.12), else c > 0, the binding's to check.

@torch.library.custom_op("hkt::window_forward", mutates_args=(), **OP_OPTIONS)
def window_forward(q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                   radius: List[int], is_causal: bool, scale: float, dropout_p: float,
                   seed: Tensor, softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    # the op runs below autograd, but its inputs still say they require grad, which DLPack refuses
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    mask = attn_mask.detach() if attn_mask is not None else None
    B, H, T, _ = q[0].shape
    out = q[0].new_empty(B, H, T, v.shape[-1])
    lse = q[0].new_empty(B, H, T)
    vs, counts, mask = _kernel_values(v, mask, dropout_p, len(q))
    window_kernels(q, k, vs, w, out, lse, tuple(radius), is_causal, scale, _threads(), attn_mask=mask,
                   dropout_p=dropout_p, seed=_seed_of(seed), counts=counts, softcap=softcap)
    return out, lse


@window_forward.register_fake
def _(q, k, v, w, attn_mask, radius, is_causal, scale, dropout_p, seed, softcap=0.0):
    B, H, T, _ = q[0].shape
    return q[0].new_empty(B, H, T, v.shape[-1]), q[0].new_empty(B, H, T)


@torch.library.custom_op("hkt::window_backward", mutates_args=(), **OP_OPTIONS)
def window_backward(dout: Tensor, q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor,
                    attn_mask: Optional[Tensor], out: Tensor, lse: Tensor, radius: List[int], is_causal: bool,
                    scale: float, dropout_p: float, seed: Tensor, mask_grad: bool,
                    softcap: float = 0.0) -> List[Tensor]:
    """dq..., dk..., dv, dw and the float mask's gradient (summed over the
    dimensions it broadcasts along; an empty tensor unless mask_grad)."""
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    dout, out, lse = dout.detach(), out.detach(), lse.detach()
    mask = attn_mask.detach() if attn_mask is not None else None
    vs, counts, kmask = _kernel_values(v, mask, dropout_p, len(q))
    dq = [torch.empty_like(x) for x in q]
    dk = [torch.empty_like(x) for x in k]
    dvs = [torch.empty_like(x) for x in vs]
    dw = torch.empty_like(w)
    full = out.new_empty(*out.shape[:3], v.shape[2]) if mask_grad else None
    window_kernels(q, k, vs, w, out, lse, tuple(radius), is_causal, scale, _threads(), dout=dout.contiguous(),
                   dq=dq, dk=dk, dvs=dvs, dw=dw, attn_mask=kmask, dropout_p=dropout_p, seed=_seed_of(seed),
                   counts=counts, dmask=full, softcap=softcap)
    dv = spread_block_grads(dvs, v.shape[2])
    if counts is not None:  # the sums were of the visible keys only
        dv = torch.where(_key_keep(mask, v), dv, torch.zeros((), dtype=dv.dtype))
    dmask = out.new_empty(0)
    if mask_grad:  # summed over the broadcast dimensions, in a fixed order
        dims = [d for d in range(4) if mask.shape[d] == 1 and full.shape[d] > 1]
        dmask = fixed_sum(full, dims)
    return dq + dk + [dv, dw, dmask]


@window_backward.register_fake
def _(dout, q, k, v, w, attn_mask, out, lse, radius, is_causal, scale, dropout_p, seed, mask_grad, softcap=0.0):
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else out.new_empty(0)
    return [x.new_empty(x.shape) for x in (*q, *k, v, w)] + [dmask]


def _setup_context(ctx, inputs, output):
    q, k, v, w, attn_mask, radius, is_causal, scale, dropout_p, seed, softcap = inputs
    ctx.L, ctx.radius, ctx.is_causal, ctx.scale, ctx.dropout_p = len(q), radius, is_causal, scale, dropout_p
    ctx.softcap = softcap
    ctx.has_mask = attn_mask is not None
    ctx.mask_grad = attn_mask is not None and attn_mask.is_floating_point() and attn_mask.requires_grad
    ctx.save_for_backward(*q, *k, v, w, *output, seed, *((attn_mask,) if ctx.has_mask else ()))


def _gradients(ctx, dout, _dlse):
    L, saved = ctx.L, ctx.saved_tensors
    q, k, (v, w, out, lse, seed) = list(saved[:L]), list(saved[L:2 * L]), saved[2 * L:2 * L + 5]
    mask = saved[2 * L + 5] if ctx.has_mask else None
    grads = window_backward(dout, q, k, v, w, mask, out, lse, ctx.radius, ctx.is_causal, ctx.scale, ctx.dropout_p,
                            seed, ctx.mask_grad, ctx.softcap)
    dmask = grads[2 * L + 2] if ctx.mask_grad else None
    # one gradient per argument autograd saw: the dispatcher drops a trailing one equal to its default
    # (softcap=0.0), which setup_context still sees filled in
    rest = (None,) * (len(ctx.needs_input_grad) - 5)
    return (grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1], dmask) + rest


torch.library.register_autograd("hkt::window_forward", _gradients, setup_context=_setup_context)


no_derivative("hkt::window_backward", "windows: the windowed kernels have no double backward (a gradient of "
              "their gradient: hkt::window_backward has no derivative); use hkt.reference with windows= for it")


# ---- hkt_attention(..., windows=): the route to the ops above

def _radius(windows):
    return tuple(0 if W is None else W >> l for l, W in enumerate(windows))


def windowed_attention(q, k, v, w, windows, attn_mask, is_causal, dropout_p, scale, backend, softcap=None):
    """hkt_attention with windows: its arguments checked as hkt_attention checks
    them, what the windowed kernels cannot take refused by name; None when no
    level has a window (the caller then makes today's call).  softcap: None
    (or 0.0) for none, else c > 0 (docs/contract.md section 1.12)."""
    windows = check_windows(windows, len(q), growing=True)
    if windows is None:  # no level has a window: today's call, unchanged
        return None
    softcap = window_softcap(softcap)  # the extension's check; 0.0: none
    if backend == "sdpa":
        raise ValueError("backend: 'sdpa' does not take windows (the levels that see a pair vary with it, which no "
                         "one SDPA call expresses); use backend=None or 'kernels'")
    # the mask comes back checked and 4-D: only its dtype is left to make
    attn_mask, dropout_p, scale = check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale,
                                             dropout_allowed=True)
    if _functorch_active():  # whichever backend was asked for
        raise NotImplementedError("windows: the windowed kernels do not run under torch.func transforms (vmap, "
                                  "grad, jacrev, ...)")
    if q[0].device.type not in ("cpu", "meta"):  # meta: the op's fake kernel gives the shapes
        raise ValueError(f"windows: the windowed kernels run on the CPU only, got q[0] on {q[0].device}")
    dtype = q[0].dtype
    if attn_mask is not None:
        attn_mask = kernel_mask_dtype(attn_mask, q[0])
    if scale is None:
        scale = default_scale(q[0].shape[-1])
    scale = float(scale)
    L = len(q)
    if dtype == torch.bfloat16:  # computed in float32, rounded back
        cast = [x.float().contiguous() for x in (*q, *k, v, w)]
    else:
        cast = [x.contiguous() for x in (*q, *k, v, w)]
    q, k, v, w = cast[:L], cast[L:2 * L], cast[2 * L], cast[2 * L + 1]
    H = q[0].shape[1]
    if _key_only(attn_mask, dropout_p, H) and attn_mask.shape[1] > 1 and k[0].shape[1] < H:
        # a key mask per query head over grouped kv heads: the kv heads repeated, so the
        # visible keys' sums are per query head (autograd sums their gradients back)
        k, v = [repeat_kv(x, H) for x in k], repeat_kv(v, H)
    w2 = w.expand(H, L).contiguous() if w.dim() == 1 else w  # autograd sums dw back over the heads
    seed = dropout_seed(dropout_p, torch.device("cpu"))
    out = window_forward(q, k, v, w2, attn_mask, list(_radius(windows)), is_causal, scale, dropout_p, seed,
                         softcap)[0]
    return out.to(dtype) if dtype == torch.bfloat16 else out
