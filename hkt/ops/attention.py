"""The dense attention kernels as torch.library custom ops: fake (meta) kernels
for torch.compile, and autograd.

hkt::attention_forward  -> (out, lse)           lse is the per-row log-sum-exp
hkt::attention_backward -> dq[0..L) + dk[0..L) + [dv, dw] (+ [dmask] with mask_grad)

Both take softcap, a float with 0.0 for none (docs/contract.md section
1.12), then sliding_window, an int with 0 for none (section 1.13), last,
defaulted so that calls made before they existed (TorchScript's) still
match the schema.

attn_mask reaches the ops at its own size, 4-D, each dimension 1 or the full
(B, H, T, S); a float mask's gradient (mask_grad) comes back in that shape.

The autograd context keeps q, k, v, w, out and lse (never the attention
matrix) and the dropout seed, so the backward sees the forward's dropout mask.

An eager call that needs gradients runs the same setup_context and backward
through AttentionFunction (ops/_eager.py), without the dispatcher; a module's
packed self-attention projection through QKVAttentionFunction, the same
pieces around one (B, T, (H + 2 H_kv) hd) tensor whose gradient the kernels
write whole.

hkt::attention_backward has an autograd formula too (double backward, e.g.
gradient penalties, Hessian-vector products, gradgradcheck): it recomputes the
attention in plain PyTorch (hkt._core.maths) from the saved inputs and
differentiates that, so it costs O(B*H*T*S) memory, unlike the kernels; see
:func:`_double_backward`.
"""
from typing import List, Optional

import torch
from torch import Tensor

from .._core import kernels as _kernels
from .._core.maths import compute_dtype, default_scale, dense_attention
from ._eager import eager_autograd, needs_grad
from ._schema import OP_OPTIONS, schema_scale, schema_sliding_window, schema_softcap

__all__ = ["attention_forward", "attention_backward", "AttentionFunction", "QKVAttentionFunction", "dropout_seed", "eager_seed",
           "heads", "op_scale"]

_SEED_MASK = (1 << 64) - 1
_CPU = torch.device("cpu")


def op_scale(scale, q0: Tensor) -> float:
    """The score scale as the dense ops' schemas take it, a float: 1/sqrt(D)
    for None, as the extension computes it when handed None."""
    if scale is None:
        D = q0.shape[-1] if q0.dim() else 0
        return default_scale(D) if D > 0 else 1.0
    return schema_scale(scale)


def dropout_seed(dropout_p: float, device: torch.device) -> Tensor:
    """The dropout seed as the ops' schemas take it, an int64 scalar: where
    dropout_p > 0 drawn from torch's default generator on the CPU, whatever
    torch's default device is (the generator the docs name); else a zero on
    ``device``, never read (on q's device, a traced graph stays free of CPU
    work).  The one place a seed is drawn; TorchScript compiles it too."""
    if dropout_p > 0.0:
        # seeds in [0, 2^62): a literal, as TorchScript takes no global int
        return torch.randint(0, 1 << 62, [], dtype=torch.int64, device=torch.device("cpu"))
    return torch.zeros([], dtype=torch.int64, device=device)


def eager_seed(dropout_p: float) -> int:
    """The dropout seed of an eager call (:func:`dropout_seed`) as the kernels take it, an int."""
    return int(dropout_seed(dropout_p, _CPU)) if dropout_p > 0 else 0


def _seed_value(seed: Tensor) -> int:
    return int(seed.item()) & _SEED_MASK


@torch.library.custom_op("hkt::attention_forward", mutates_args=(), **OP_OPTIONS)
def attention_forward(q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                      is_causal: bool, dropout_p: float, scale: float, seed: Tensor,
                      softcap: float = 0.0, sliding_window: int = 0) -> tuple[Tensor, Tensor]:
    # the seed is read (on the host) only when there is dropout: without, it may
    # be a device tensor (functional.py makes it one), never synchronized on
    return _kernels._forward(q, k, v, w, attn_mask, is_causal, dropout_p, scale,
                             _seed_value(seed) if dropout_p > 0 else 0, softcap, sliding_window or None,
                             like_inputs=False)


@attention_forward.register_fake
def _(q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed, softcap=0.0, sliding_window=0):
    B, H, T, _ = q[0].shape
    out = q[0].new_empty((B, H, T, v.shape[-1]))
    lse = q[0].new_empty((B, H, T), dtype=compute_dtype(q[0].dtype))
    return out, lse


@torch.library.custom_op("hkt::attention_backward", mutates_args=(), **OP_OPTIONS)
def attention_backward(dout: Tensor, q: List[Tensor], k: List[Tensor], v: Tensor, w: Tensor, out: Tensor,
                       lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float, scale: float,
                       seed: Tensor, mask_grad: bool = False, softcap: float = 0.0,
                       sliding_window: int = 0) -> List[Tensor]:
    dq, dk, dv, dw, dmask = _kernels._backward(dout, q, k, v, w, out, lse, attn_mask, is_causal, dropout_p, scale,
                                               _seed_value(seed) if dropout_p > 0 else 0, mask_grad, softcap=softcap,
                                               sliding_window=sliding_window or None)
    return dq + dk + [dv, dw] + ([dmask] if mask_grad else [])


@attention_backward.register_fake
def _(dout, q, k, v, w, out, lse, attn_mask, is_causal, dropout_p, scale, seed, mask_grad=False, softcap=0.0,
      sliding_window=0):
    return ([x.new_empty(x.shape) for x in q] + [x.new_empty(x.shape) for x in k]
            + [v.new_empty(v.shape), w.new_empty(w.shape)]
            + ([attn_mask.new_empty(attn_mask.shape)] if mask_grad else []))


def _setup_context(ctx, inputs, output):
    q, k, v, w, attn_mask, is_causal, dropout_p, scale, seed, softcap, sliding_window = inputs
    out, lse = output
    ctx.L = len(q)
    # softcap and sliding_window: the op's float and int, or an eager call's as
    # the caller gave them (checked by the extension in the forward)
    ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.softcap = is_causal, dropout_p, scale, softcap
    ctx.sliding_window = sliding_window
    # the op's seed is a tensor, saved as one; an eager call's an int (AttentionFunction)
    seed_tensor = isinstance(seed, Tensor)
    ctx.seed = None if seed_tensor else seed
    ctx.save_for_backward(*q, *k, v, w, out, lse, attn_mask, seed if seed_tensor else None)


def _gradients(ctx, dout, q, k, v, w, out, lse, attn_mask, seed, mask_argument=4, into=None):
    """(dq, dk, dv, dw, dmask) of the forward that ctx saw: in an eager call the
    kernels themselves (into: dq[0], dk[0] and dv for them to write in), else,
    and under create_graph, the differentiable hkt::attention_backward op,
    which torch.compile records.  mask_argument: attn_mask's place among the
    forward's arguments; seed: the op's tensor, or an eager call's int."""
    # a float mask that requires grad gets one; a bool mask never needs one
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and needs_grad(ctx, mask_argument)
    if getattr(ctx, "eager", False):
        if not torch.is_grad_enabled():  # no dispatch, the scale as the caller gave it
            return _kernels._backward(dout, q, k, v, w, out, lse, attn_mask, ctx.is_causal, ctx.dropout_p,
                                      ctx.scale, seed, mask_grad, like_inputs=True, into=into, softcap=ctx.softcap,
                                      sliding_window=ctx.sliding_window)
        seed = torch.tensor(seed, dtype=torch.int64, device="cpu")  # create_graph: the op, its seed a tensor
    L = ctx.L
    grads = attention_backward(dout, q, k, v, w, out, lse, attn_mask, ctx.is_causal, ctx.dropout_p,
                               op_scale(ctx.scale, q[0]), seed, mask_grad, schema_softcap(ctx.softcap),
                               schema_sliding_window(ctx.sliding_window or None))  # the op's: 0 for none
    return grads[:L], grads[L:2 * L], grads[2 * L], grads[2 * L + 1], (grads[2 * L + 2] if mask_grad else None)


def _forward_op_gradients(ctx, grad_out, grad_lse):
    L = ctx.L
    saved = ctx.saved_tensors
    q, k = list(saved[:L]), list(saved[L:2 * L])
    v, w, out, lse, attn_mask, seed = saved[2 * L:]
    dq, dk, dv, dw, dmask = _gradients(ctx, grad_out, q, k, v, w, out, lse, attn_mask,
                                       ctx.seed if seed is None else seed)
    grads = (dq, dk, dv, dw, dmask, None, None, None, None)
    # softcap's and sliding_window's slots: an eager call passes both always;
    # the dispatcher drops trailing arguments equal to their defaults
    # (sliding_window=0, then softcap=0.0) from the op's
    if getattr(ctx, "eager", False) or ctx.sliding_window:
        return grads + (None, None)
    return grads + (None,) if ctx.softcap else grads


torch.library.register_autograd("hkt::attention_forward", _forward_op_gradients, setup_context=_setup_context)


# eager calls that need gradients: the registered functions, without the dispatcher,
# around the op's kernel call as an eager call makes it (hkt._core.kernels._forward:
# out laid out in memory like q[0], where the op's is contiguous as its fake
# kernel says; the scale and softcap as the caller gave them, for the extension
# to check; seed an int)
AttentionFunction = eager_autograd("AttentionFunction", _kernels._forward, _setup_context, _forward_op_gradients,
                                   lists=True, first_output=True)


# ---- a module's packed self-attention projection --------------------------------

def heads(x: Tensor, H: int, hd: int) -> Tensor:
    """(B, n, H * hd) -> (B, H, n, hd): projected features split into heads, the
    layout hkt_attention takes (MultiheadHKT and its decoding share it)."""
    return x.reshape(x.shape[0], x.shape[1], H, hd).transpose(1, 2)


def _qkv_heads(qkv: Tensor, H: int, H_kv: int):
    """A packed projection's output (B, T, (H + 2 H_kv) hd) as level 0's q, k and v heads (views)."""
    hd = qkv.shape[-1] // (H + 2 * H_kv)
    q, k, v = qkv.split([H * hd, H_kv * hd, H_kv * hd], dim=-1)
    return heads(q, H, hd), heads(k, H_kv, hd), heads(v, H_kv, hd)


_QKV_MASK = 6  # attn_mask's place among _qkv_forward's arguments (the op's: 4)


def _qkv_forward(q_coarse, k_coarse, H, H_kv, qkv, w, attn_mask, is_causal, dropout_p, scale, seed):
    q0, k0, v = _qkv_heads(qkv, H, H_kv)
    return _kernels._forward([q0, *q_coarse], [k0, *k_coarse], v, w, attn_mask, is_causal, dropout_p, scale,
                             seed)


def _qkv_setup_context(ctx, inputs, output):
    q_coarse, k_coarse, H, H_kv, qkv, w, attn_mask, is_causal, dropout_p, scale, seed = inputs
    out, lse = output
    ctx.L, ctx.heads = len(q_coarse) + 1, (H, H_kv)
    ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.seed, ctx.softcap = is_causal, dropout_p, scale, seed, None
    ctx.sliding_window = None
    # qkv itself, not its three views: a saved-tensors hook (offloading, say) sees one tensor
    ctx.save_for_backward(qkv, *q_coarse, *k_coarse, w, out, lse, attn_mask)


def _qkv_gradients(ctx, grad_out, grad_lse):
    """The gradients of _qkv_forward's arguments: level 0's q, k and v as one
    tensor shaped like qkv, written by the kernels where they write qkv's dtype
    (through split, autograd would concatenate three gradients instead: a copy
    of the projection's whole output, in every training step)."""
    n = ctx.L - 1
    saved = ctx.saved_tensors
    qkv, q_coarse, k_coarse = saved[0], list(saved[1:1 + n]), list(saved[1 + n:1 + 2 * n])
    w, out, lse, attn_mask = saved[1 + 2 * n:]
    q0, k0, v = _qkv_heads(qkv, *ctx.heads)
    q, k = [q0, *q_coarse], [k0, *k_coarse]
    # whole only where the kernels write qkv's dtype now (bfloat16 natively: the
    # choice is the backward's own, hkt._core.kernels.native_bf16 read again)
    if torch.is_grad_enabled() or (qkv.dtype == torch.bfloat16 and not _kernels._native_bf16(q0, v.shape[-1])):
        dq, dk, dv, dw, dmask = _gradients(ctx, grad_out, q, k, v, w, out, lse, attn_mask, ctx.seed, _QKV_MASK)
        B, T = qkv.shape[0], qkv.shape[1]
        dqkv = torch.cat([x.transpose(1, 2).reshape(B, T, -1) for x in (dq[0], dk[0], dv)], dim=-1)
    else:
        # contiguous, whatever layout a saved-tensors hook handed qkv back in: the
        # kernels write the heads of dq, dk, dv with unit feature stride
        dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        dq, dk, dv, dw, dmask = _gradients(ctx, grad_out, q, k, v, w, out, lse, attn_mask, ctx.seed, _QKV_MASK,
                                           into=_qkv_heads(dqkv, *ctx.heads))
    return dq[1:], dk[1:], None, None, dqkv, dw, dmask, None, None, None, None


QKVAttentionFunction = eager_autograd("QKVAttentionFunction", _qkv_forward, _qkv_setup_context, _qkv_gradients,
                                      lists=True, first_output=True)


# ---- double backward ------------------------------------------------------------

def _setup_backward_context(ctx, inputs, output):
    dout, q, k, v, w, out, lse, attn_mask, is_causal, dropout_p, scale, seed, mask_grad, softcap, sliding_window = inputs
    ctx.L = len(q)
    ctx.is_causal, ctx.dropout_p, ctx.scale, ctx.mask_grad = is_causal, dropout_p, scale, mask_grad
    ctx.softcap, ctx.sliding_window = softcap, sliding_window
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
    attn_mask with :func:`hkt._core.maths.dense_attention` (the forward
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
        out = dense_attention(q_, k_, v_, w_, m_, ctx.is_causal, ctx.scale, p, keep, ctx.softcap, ctx.sliding_window)
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
    # the dispatcher drops trailing arguments equal to their defaults
    # (sliding_window=0, softcap=0.0, then mask_grad=False): one slot per argument it kept
    return res + (None,) * (3 if ctx.sliding_window else 2 if ctx.softcap else 1 if ctx.mask_grad else 0)


torch.library.register_autograd("hkt::attention_backward", _double_backward,
                                setup_context=_setup_backward_context)
