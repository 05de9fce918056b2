"""The public functional API: hkt.hkt_attention."""
from typing import Optional, Sequence

import torch
from torch import Tensor

from ._core import kernels as _kernels
from .ops import sdpa as _sdpa
from ._core.checks import ShapeError  # noqa: F401 (hkt.functional.ShapeError: the name the docs give)
from ._core.checks import _real, check_call, check_windows
from ._core.guards import _autocast_inputs, _call_mode, _unwrap_dead
from .ops import route as _route
from .ops._schema import schema_sliding_window, schema_softcap
from .ops.window import windowed_attention

__all__ = ["hkt_attention"]


# backend=None / "auto" on CUDA tensors: the "sdpa" backend until hkt's CUDA
# kernels have beaten it on a real GPU in benchmarks/gpu_session.sh (today's
# kernels are written to be plainly right, not fast, and have not run on one).
# Set to True once they have; dropout (which "sdpa" refuses) always takes the
# kernels.
_CUDA_KERNELS_PREFERRED = False
_BACKENDS = (None, "auto", "kernels", "sdpa")


def _pick_backend(backend, q, dropout_p, softcap=None) -> str:
    """The way this call goes (backend already validated): "sdpa", or hkt's
    kernels, "kernels" called directly (eager) or "op" through the registered
    custom op (torch.compile and torch.jit.trace record ops, never the
    extension's direct calls: a trace of a direct call would replay whatever
    memory the output had).  Under torch.func transforms (vmap, grad, jacrev,
    ...) the kernels, which take plain arrays, cannot run: "sdpa", plain
    differentiable torch ops, does the same maths there."""
    mode = _call_mode()
    if mode == "transform":
        if backend == "kernels":
            raise NotImplementedError(
                "backend: hkt's kernels do not run under torch.func transforms (vmap, grad, jacrev, ...); "
                "backend=None or 'sdpa' computes the same attention with differentiable torch ops there")
        if _real(dropout_p) and dropout_p > 0:
            raise NotImplementedError(
                "dropout_p: dropout runs only in hkt's kernels, which do not run under torch.func transforms "
                "(vmap, grad, jacrev, ...); use dropout_p=0 there (for example the module in eval mode)")
        return "sdpa"
    if backend == "sdpa":
        return "sdpa"
    q0 = q[0] if backend != "kernels" and isinstance(q, (list, tuple)) and len(q) else None
    if (isinstance(q0, Tensor) and q0.is_cuda and not _CUDA_KERNELS_PREFERRED and _real(dropout_p) and dropout_p == 0
            and softcap is None):  # a cap: the kernels, which name it where they cannot take it
        return "sdpa"
    return "op" if mode == "recording" else "kernels"


def hkt_attention(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    v: Tensor,
    w: Tensor,
    *,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    backend: Optional[str] = None,
    windows: Optional[Sequence[Optional[int]]] = None,
    softcap: Optional[float] = None,
    sliding_window: Optional[int] = None,
) -> Tensor:
    r"""Hierarchical Kernel Transformer attention.

    For L levels::

        score[i, j] = scale * sum_l w[l] * <q[l][i >> l], k[l][j >> l]>   (+ float attn_mask)
        out[i]      = sum_j softmax_j(score[i, j] over visible j) * v[j]

    Args:
        q: L tensors, ``q[l]`` of shape (B, H, ceil(T / 2^l), D).
        k: L tensors, ``k[l]`` of shape (B, H_kv, ceil(S / 2^l), D).  H_kv
            may be smaller than H if it divides it (grouped-query attention,
            H_kv = 1 multi-query): query head h reads kv head h // (H // H_kv),
            without copies; the gradient of a kv head is summed over its query
            heads in a fixed order (bitwise the same for any thread count).
        v: (B, H_kv, S, Dv) values at full resolution.
        w: level weights, (L,) or (H, L); used as given (not normalised).
        attn_mask: as in ``scaled_dot_product_attention``: bool (True = may
            attend) or float (added to the score), broadcastable to (B, H, T, S).
            May be combined with ``is_causal`` (both apply).
        is_causal: key j is visible to query i only when j <= i.
        dropout_p: dropout on the attention probabilities (apply it only in
            training); the mask is drawn from torch's default generator.
        scale: score scale, default 1 / sqrt(D).  ``scale`` and ``dropout_p``
            take any real number but a bool (NumPy scalars too, as in SDPA).
            Meta tensors give meta results of the right shapes (the custom
            op's fake kernel), after the same argument checks.  Under
            ``torch.autocast`` the inputs are cast as SDPA's are: to bfloat16,
            or to float32 where autocast asks for float16 (float64 stays).
        backend: how to compute it.  ``"kernels"``: hkt's own kernels (CPU;
            CUDA in a build made with ``HKT_CUDA=1``): O(T) memory, exact 4/3
            score cost on the CPU, bitwise deterministic, bfloat16 native
            on CPUs with AVX512_BF16 at full rate (else computed in float32).  ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``
            on the concatenated level vectors (L times one attention's score
            work, in the inputs' dtype, on whatever kernel SDPA picks; its
            determinism is SDPA's); no dropout (``ValueError``).  ``None`` or
            ``"auto"``: the kernels on the CPU, and on CUDA "sdpa" unless
            ``dropout_p > 0`` (hkt's CUDA kernels are not fast yet); under
            ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``,
            per-sample gradients, ...) "sdpa", since the kernels cannot run
            there (``"kernels"`` and ``dropout_p > 0`` raise
            ``NotImplementedError`` under them).
        softcap: None (or 0.0) for none, else c > 0: each combined score s
            becomes ``c * tanh(s / c)`` before the mask (docs/contract.md
            section 1.12; Gemma 2's ``attn_logit_softcapping``), gradients
            through it.  The CPU kernels compute it (bfloat16 in float32);
            ``backend="sdpa"`` (so also under torch.func transforms), the CUDA
            kernels and ``windows`` raise ``NotImplementedError`` naming it.
        sliding_window: None for none, else an int W >= 1: key j is visible
            to query i only when i - j < W (and, without ``is_causal``, also
            j - i < W), for the combined score of every level, on top of
            ``is_causal`` and ``attn_mask`` (docs/contract.md section 1.13;
            ``is_causal=True`` with W is transformers' sliding-window
            layer).  The CPU kernels skip the key tiles outside the band, so
            time grows as T * W; ``backend="sdpa"`` applies it as a bool
            mask; the CUDA kernels raise ``NotImplementedError`` naming it,
            and so does ``windows`` with a window on any level.  A bad W (0,
            negative, not an int, a bool) raises naming ``sliding_window``.

    Returns:
        (B, H, T, Dv), laid out in memory like ``q[0]`` when Dv = D and
        ``q[0]`` is dense with unit feature stride (the gradients of ``q``,
        ``k`` and ``v`` likewise follow their inputs), else contiguous.  A
        query row with no visible key gives zeros (and zero gradients).  Gradients flow to every ``q[l]``, ``k[l]``, ``v``, ``w``
        and a float ``attn_mask`` that requires grad (its gradient is the
        score's, summed over the dimensions it is broadcast along; computing it
        costs one more pass over the scores in the backward).

    Non-finite values: NaN (or +inf) in ``q``, ``k``, ``w`` or a float mask
    entry that a query row can see makes that row's output NaN, and the
    gradients that flow through it NaN, as in plain arithmetic.  A hidden entry
    (bool mask False, above the diagonal under ``is_causal``, or -inf in a float
    mask over a score that is not NaN) contributes nothing, even to a NaN row;
    -inf added to a NaN score is NaN, as in SDPA, so that entry is visible.  NaN in ``v`` reaches every
    row that sees that key.  A non-finite value that only hidden entries see
    may or may not show up elsewhere (0 * NaN inside a tile).  A level's factor
    ``scale * w[l]`` never rounds to 0 from two nonzero numbers (it is kept at
    the smallest subnormal of its sign), so an inf in ``q`` or ``k`` gives a
    +-inf score however small the factor.

    Raises:
        TypeError / ValueError naming the argument for wrong types, ranks,
        shapes (``q[l]`` must have ceil(T/2^l) rows), mixed dtypes or devices,
        dtypes other than float32/float64/bfloat16, a non-finite scale, a
        dropout_p outside [0, 1], an unknown backend, or dropout_p > 0 with
        backend="sdpa"; NotImplementedError for backend="kernels" or
        dropout_p > 0 under torch.func transforms.

    float32 and float64 run in their own precision.  bfloat16 on a CPU with
    AVX512_BF16 whose cores run its dot products at full rate or that has AMX
    (``hkt._C.cpu_bf16_preferred()``: AMD's, and Intel's with AMX, whose tiles
    take the products, ``hkt._C.cpu_bf16_amx()``; ``HKT_BF16=native``,
    ``avx512bf16`` (no AMX) or ``upcast`` overrides) and an even D runs natively:
    every matrix product takes bfloat16 operands and sums in float32, the
    softmax and its gradient are float32, and P and dS are rounded to bfloat16
    where they enter a product, as flash-attention kernels do (the backward
    needs an even Dv too, else it runs in float32).  bfloat16 anywhere else is
    computed in float32 (upcast on entry, results rounded back to bfloat16).

    ``windows``: None, or one entry per level, None (the level sees every
    key) or W_l tokens, a positive multiple of 2^l, growing with the level:
    level l then sees key j from query i only when |(i >> l) - (j >> l)| <
    W_l / 2^l, a key no level sees is hidden, and the cost is near linear in
    T (docs/contract.md section 1.11).  CPU kernels only, not
    ``backend="sdpa"``; bfloat16 is computed in float32.  ``attn_mask`` and
    ``dropout_p`` apply as without windows: a bool mask the same for every
    query (key padding, T dimension 1) keeps the cost near linear; any other
    mask, and dropout, make the kernels visit every key the windows let
    through, O(T * S) work like dense attention.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected None, 'auto', 'kernels' or 'sdpa', got {backend!r}")
    if windows is not None and sliding_window is not None and isinstance(q, (list, tuple)):
        if check_windows(windows, len(q)) is not None:
            raise NotImplementedError("sliding_window: not taken together with windows (the windowed kernels have "
                                      "no band); pass one of sliding_window and windows")
        windows = None  # no level has a window: the dense kernels, with the band
    if windows is not None and isinstance(q, (list, tuple)):  # a window per level (contract 1.11): its own kernels
        if torch._C._is_any_autocast_enabled():
            q, k, v, w = _autocast_inputs(q, k, v, w)
        out = windowed_attention(q, k, v, w, windows, attn_mask, is_causal, dropout_p, scale, backend, softcap)
        if out is not None:
            return out
    try:
        if torch._C._is_any_autocast_enabled():  # cheap; the device's own check, dearer, only then
            q, k, v, w = _autocast_inputs(q, k, v, w)
        way = _pick_backend(backend, q, dropout_p, softcap)
        if way == "sdpa":
            return _sdpa_path(q, k, v, w, attn_mask, is_causal, dropout_p, scale, softcap, sliding_window)
        return _route.attention(q, k, v, w, attn_mask, is_causal, dropout_p, scale, way == "op", softcap,
                                    sliding_window)
    except (RuntimeError, BufferError):
        # not a check: a dead torch.func wrapper (a tensor kept from inside a
        # finished transform) fails in DLPack, before any kernel ran; the call
        # again on the tensors it wraps (with dropout: a new seed)
        dead = _unwrap_dead(q, k, v, w, attn_mask)
        if dead is None:
            raise
        return hkt_attention(*dead[:4], attn_mask=dead[4], is_causal=is_causal, dropout_p=dropout_p, scale=scale,
                             backend=backend, softcap=softcap, sliding_window=sliding_window)


def _sdpa_path(q, k, v, w, attn_mask, is_causal, dropout_p, scale, softcap=None, sliding_window=None):
    """backend="sdpa" (hkt.ops.sdpa): every argument checked in Python first, as
    the extension would for the kernels, then plain differentiable torch ops."""
    attn_mask, dropout_p, scale = check_call(q, k, v, w, attn_mask, is_causal, dropout_p, scale,
                                             dropout_allowed=False, softcap=softcap,
                                             sliding_window=sliding_window)
    if schema_softcap(softcap):  # checked by the extension: None, 0.0 or a cap
        raise NotImplementedError("softcap: the 'sdpa' backend (which torch.func transforms run) takes no cap "
                                  "(SDPA has no score modifier); use backend='kernels', outside torch.func")
    return _sdpa.sdpa_attention(q, k, v, w, attn_mask, is_causal, scale,
                                schema_sliding_window(sliding_window) or None)


def qkv_attention(qkv: Tensor, q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor,
                  attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float) -> Tensor:
    """hkt_attention(q, k, v, w, ...) for a module's packed self-attention
    projection ``qkv`` (B, T, (H + 2 H_kv) hd), whose heads are q[0], k[0] and v.
    In eager calls on the kernels that need gradients, whose kernels write the
    gradients in qkv's dtype (float32, float64, native bfloat16), their
    gradient is written as one tensor, qkv's (ops.attention.QKVAttentionFunction); anywhere else
    hkt_attention itself, the same values."""
    if torch._C._is_any_autocast_enabled():
        # the inputs hkt_attention would compute with (w cast too); q[0], k[0] and v
        # stay qkv's heads where they already are in autocast's dtype
        q, k, v, w = _autocast_inputs(q, k, v, w)
    own_dtype = qkv.dtype in (torch.float32, torch.float64) or _kernels._native_bf16(q[0], v.shape[-1])
    own_dtype = own_dtype and q[0].dtype == k[0].dtype == v.dtype == qkv.dtype
    if (own_dtype and torch.is_grad_enabled() and qkv.requires_grad
            and not qkv.is_meta and _pick_backend(None, q, dropout_p) == "kernels"):
        # q, k, v: the module's own heads; its mask and the rest checked as hkt_attention checks them
        return _route.attention(q, k, v, w, attn_mask, is_causal, dropout_p, None, False, qkv=qkv)
    return hkt_attention(q, k, v, w, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)
