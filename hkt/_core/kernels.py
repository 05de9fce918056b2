"""The only Python file that calls into the C extension (hkt._C).

Private _forward / _backward take torch tensors, allocate the outputs the
destination-passing kernels expect, and hand everything over through DLPack.
"""
import os
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torch.utils.dlpack import to_dlpack

from .. import _C
from .maths import compute_dtype, float_mask_in

__all__ = ["_forward", "_backward", "check_forward", "_decode", "_varlen_forward", "_varlen_backward", "_downsample_forward",
           "_downsample_backward", "window_kernels", "window_decode_kernel", "window_softcap", "schema_sliding_window", "dropout_keep_mask",
           "has_cuda", "cpu_tile"]

has_cuda = bool(_C.has_cuda)
# the CPU kernels' query and key tile size, as the extension was built with it
# (hkt.analysis counts the kernels' work by tiles)
cpu_tile = _C.cpu_tile


# Every tensor goes over as a bare DLPack capsule (to_dlpack): Tensor.__dlpack__
# costs microseconds of Python checks per array, and does not synchronize
# anything unless asked to (torch 2.13: its default stream=-1 means "no
# synchronization").  Ordering on CUDA comes from streams instead: the kernels
# are queued on torch's current stream of the device (_stream below), the
# stream on which torch queued the work that wrote these tensors and will
# queue the work that reads the results -- the rule every torch op follows.
# Tensors allocated here and freed on return (outputs' temporaries, the
# backward's scratch) were allocated on that same stream, so the caching
# allocator hands their memory to later work on it only in stream order.

def _threads() -> int:
    """torch's thread count for the kernels, capped at the extension's most
    (torch.set_num_threads takes more; the extension refuses more when asked
    by name, so a cap is what the docs' "at most" means)."""
    n = torch.get_num_threads()
    return n if n <= _C.max_threads else _C.max_threads


def _dl(x: Optional[Tensor]):
    if x is None:
        return None
    return to_dlpack(x)


_BF16 = torch.bfloat16


def _mask_arg(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    # a float mask in the compute dtype; any other dtype goes as it is, for the
    # extension to accept (bool) or refuse
    if mask is not None and mask.is_floating_point() and mask.dtype != dtype:
        mask = float_mask_in(mask, dtype)
    return None if mask is None else _read(mask)


def _stream(x: Tensor) -> Optional[int]:
    """The cudaStream_t (an int) of torch's current stream on x's CUDA device: the
    kernels are queued there, in order with torch's own work (None on the CPU;
    is_cuda, cheaper than reading x.device and its type)."""
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None


def _scratch(B: int, H: int, T: int, L: int, dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
    """The CUDA backward's device workspace (delta and dw partials,
    _C.cuda_scratch_bytes), from torch's caching allocator: the kernels never
    allocate, so they stay capturable in a CUDA graph (None on the CPU, whose
    kernels get a host workspace from the extension)."""
    if device.type != "cuda":
        return None
    n = _C.cuda_scratch_bytes(B, H, T, L, 8 if dtype == torch.float64 else 4)
    return torch.empty(n, dtype=torch.uint8, device=device)


# bfloat16 runs natively (bfloat16 dot products, float32 accumulation) where the
# CPU has AVX512_BF16 and either issues vdpbf16ps at full rate or has AMX tiles
# for the products (_C.cpu_bf16_preferred: AMD's yes, Intel's with AMX yes;
# HKT_BF16=native|avx512bf16|upcast overrides) and D is even (the
# backward: Dv too): the kernels take the bfloat16 arrays as they are, with w, a
# float mask, lse and the gradients in float32.  Elsewhere bfloat16 is upcast and
# computed in float32.  A module attribute so tests can switch it.
native_bf16 = bool(_C.cpu_bf16_preferred())


def _capped(softcap) -> bool:
    """Whether a softcap, as the caller gave it, may be a cap (anything but
    None and 0: a bad one too, which the extension refuses by name)."""
    return softcap is not None and not (isinstance(softcap, (int, float)) and softcap == 0)


def _native_bf16(q0: Tensor, dv: int = 0, ndim: int = 4) -> bool:
    """Whether bfloat16 q0 runs natively: ndim 4 for hkt_attention's (B, H, T, D),
    3 for the packed calls' (rows, H, D); dv: the backward's value dimension."""
    return (q0.dtype == torch.bfloat16 and native_bf16 and q0.device.type == "cpu" and q0.dim() == ndim
            and q0.shape[-1] % 2 == 0 and dv % 2 == 0)


# CUDA: bfloat16 q, k, v go to the tensor-core kernels (csrc/cuda/hkt_attention_cuda.cu)
# within their limits (_C.cuda_tc_refusal; the backward's are narrower, and
# past them it runs in float32).  Off unless asked for (HKT_CUDA_TENSOR_CORES=1,
# or set this to True) until benchmarks/gpu_session.sh has passed with them on a
# GPU: they have run only in the CPU emulation of tests/kernels/test_cuda.py.  Off:
# bfloat16 is upcast to float32.
cuda_tensor_cores = os.environ.get("HKT_CUDA_TENSOR_CORES", "0") == "1"


def _cuda_tc(q: Sequence[Tensor], v: Tensor, dropout_p: float, backward: bool = False,
             mask_grad: bool = False) -> bool:
    q0 = q[0]
    return (cuda_tensor_cores and q0.dtype == torch.bfloat16 and q0.is_cuda and q0.dim() == 4 and v.dim() == 4
            and _C.cuda_tc_refusal(q0.shape[-1], v.shape[-1], len(q), dropout_p, backward, mask_grad) is None)


def _forward(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
             is_causal: bool, dropout_p: float, scale: float, seed: int, softcap=None, sliding_window=None,
             like_inputs: bool = True, want_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """Returns (out (B, H, T, Dv) in q's dtype, lse (B, H, T) in the compute dtype).
    like_inputs: out laid out in memory like q[0] (see _empty_like), as an
    eager call's is; False: contiguous (what the custom op's fake kernel
    says).  want_lse=False, on the CPU: lse is None, never allocated (a
    forward nobody will differentiate: a fair part of a small call's time).
    softcap: as the caller gave it, the extension's to check; bfloat16 with a
    cap is computed in float32 (the native bfloat16 kernels take no cap).
    sliding_window: None or the band's W, as the caller gave it (the
    extension's to check)."""
    q0 = q[0]
    if dropout_p > 0 and q0.is_cuda and torch.cuda.is_current_stream_capturing():
        # the seed is read here, on the host: every replay would drop the same entries
        raise RuntimeError("dropout_p: hkt's dropout cannot be captured in a CUDA graph (each replay would "
                           "repeat the captured dropout mask); capture with dropout_p=0")
    # (q0's attributes read once each, compute_dtype inline: a small call's
    # forward is mostly such reads and calls)
    in_dtype = q0.dtype
    bf16 = in_dtype is _BF16
    dtype = torch.float32 if bf16 else in_dtype  # compute_dtype
    native = bf16 and not _capped(softcap) and _native_bf16(q0)
    # native bfloat16 writes its out in bfloat16 (summed in float32, rounded once in the kernel)
    out_dtype = in_dtype if native else dtype
    lead = q0.shape[:3]  # (B, H, T); a wrong rank is the extension's to name
    # empty_like, cheaper than new_empty; new_empty without dtype=, cheaper than with it
    if like_inputs and v.dim() == 4 and q0.dim() == 4 and v.shape[-1] == q0.shape[-1]:
        if not q0.is_contiguous():
            out = _empty_like((q0,), out_dtype, True)[0]
        else:  # dtype= only where it differs: it costs a fair part of the call
            out = torch.empty_like(q0) if out_dtype is in_dtype else torch.empty_like(q0, dtype=out_dtype)
    else:
        shape = (*lead, v.shape[-1] if v.dim() else 0)
        out = q0.new_empty(shape) if out_dtype is in_dtype else q0.new_empty(shape, dtype=out_dtype)
    cuda = q0.is_cuda
    lse = None
    if want_lse or cuda:
        lse = q0.new_empty(lead) if dtype is in_dtype else q0.new_empty(lead, dtype=dtype)
    # native (and float32/float64): q, k, v as they are; w, mask, lse in the compute dtype
    # not bfloat16: the checks refused a bfloat16 input beside it (one that got past them reaches the
    # extension in bfloat16, which refuses it by name), so no dtype is read
    a = _arrays((*q, *k, v), w, (not (native or _cuda_tc(q, v, dropout_p))) if bf16 else None)
    L, n = len(q), len(q) + len(k)
    # the scalars, in the binding's order: one place for one more
    _C.forward(a[:L], a[L:n], a[n], a[n + 1], to_dlpack(out), None if lse is None else to_dlpack(lse),
               None if attn_mask is None else _mask_arg(attn_mask, dtype), is_causal, scale, dropout_p, seed,
               min(torch.get_num_threads(), _C.max_threads), _stream(q0) if cuda else None, -1, softcap,
               sliding_window)  # _threads
    return (out if out_dtype is in_dtype else out.to(in_dtype)), lse


def _described(x: Tensor, dtype: Optional[torch.dtype] = None) -> tuple:
    """x as check_forward takes an array: (shape, DLPack dtype code, bits), of
    dtype where given; bfloat16 as float32, in which the checks see it."""
    dtype = dtype or x.dtype
    if dtype == _BF16:
        dtype = torch.float32
    code = 6 if dtype == torch.bool else 2 if dtype.is_floating_point else 0
    return tuple(x.shape), code, dtype.itemsize * 8


def check_forward(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
                  is_causal: bool, dropout_p: float, scale, softcap=None, sliding_window=None) -> None:
    """The extension's checks of a forward over these arguments, without
    running it: for the calls that never reach the kernels (meta tensors, the
    "sdpa" backend), each array described by its shape and dtype (its device
    and the other torch-level rules are hkt._core.checks').  Raises what the
    forward would, naming the argument.  Under torch.compile it is not
    called (dynamo cannot trace into the extension): the recorded ops' fake
    kernels see the shapes there."""
    if torch.compiler.is_compiling():
        return
    q0 = q[0]
    dtype = compute_dtype(q0.dtype)
    out = ((*q0.shape[:3], v.shape[-1] if v.dim() else 0), *_described(q0, dtype)[1:])
    mask = None if attn_mask is None else _described(attn_mask, dtype if attn_mask.is_floating_point() else None)
    _C.check_forward([_described(x) for x in q], [_described(x) for x in k], _described(v), _described(w),
                     out, None, mask, is_causal, scale, dropout_p, softcap, sliding_window)


def _backward(dout: Tensor, q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, out: Tensor,
              lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float, scale: float,
              seed: int, mask_grad: bool = False, like_inputs: bool = False,
              into: Optional[Tuple[Tensor, Tensor, Tensor]] = None, softcap=None, sliding_window=None
              ) -> Tuple[List[Tensor], List[Tensor], Tensor, Tensor, Optional[Tensor]]:
    """Returns (dq per level, dk per level, dv, dw, dmask), in the inputs' dtype;
    dmask (shaped like the float attn_mask) only with mask_grad, else None.
    like_inputs: dq, dk, dv laid out in memory like q, k, v (see _empty_like), else
    contiguous (what the custom op's fake kernel says).  into: arrays (shaped
    like q[0], k[0], v, of the dtype the kernels write gradients in: the
    compute dtype, or bfloat16 natively) that dq[0], dk[0] and dv are written
    in, instead of new ones."""
    # (tensor attributes read once each, is_cuda rather than device.type: a
    # small call's backward is mostly such reads and calls)
    q0 = q[0]
    in_dtype = q0.dtype
    bf16 = in_dtype is _BF16
    dtype = torch.float32 if bf16 else in_dtype  # compute_dtype
    native = bf16 and not _capped(softcap) and _native_bf16(q0, v.shape[-1] if v.dim() else 1)
    # native bfloat16 on the CPU writes dq, dk and dv in bfloat16 (summed in float32 in the kernel)
    same = dout.dtype == out.dtype == in_dtype
    L, n = len(q), len(q) + len(k)
    gdtype = in_dtype if native and same else dtype
    if into is None:
        g = _empty_like((*q, *k, v), gdtype, like_inputs)
    else:  # the caller's dq[0], dk[0] and dv, in their places
        g = _empty_like((*q[1:], *k[1:]), gdtype, like_inputs)
        g = [into[0], *g[:L - 1], into[1], *g[L - 1:], into[2]]
    dq, dk, dv = g[:L], g[L:n], g[n]
    dw = torch.empty_like(w, dtype=dtype, memory_format=torch.contiguous_format)
    dmask = torch.empty(attn_mask.shape, dtype=dtype, device=q0.device) if mask_grad else None
    cuda = q0.is_cuda
    scratch = _scratch(*lse.shape, L, dtype, q0.device) if cuda else None
    # q, k, v, dout and out as they are (float32, float64, or bfloat16 where it
    # runs natively, with w, a mask, lse and the gradients float32), else all
    # upcast to float32
    a = _arrays((*q, *k, v, dout, out), w, not same or (bf16 and not (native or _cuda_tc(
        q, v, dropout_p, True, mask_grad))))
    # the scalars, in the binding's order: one place for one more
    _C.backward(a[n + 1], a[:L], a[L:n], a[n], a[n + 3], a[n + 2], to_dlpack(lse.contiguous()),
                list(map(to_dlpack, dq)), list(map(to_dlpack, dk)), to_dlpack(dv), to_dlpack(dw),
                None if attn_mask is None else _mask_arg(attn_mask, dtype), is_causal, scale, dropout_p, seed,
                min(torch.get_num_threads(), _C.max_threads), None if dmask is None else to_dlpack(dmask),
                _stream(q0) if cuda else None, None if scratch is None else to_dlpack(scratch), softcap,
                sliding_window)  # _threads
    if dv.dtype is not in_dtype or dw.dtype is not in_dtype:
        dq, dk, dv, dw = _in_dtype(dq, dk, dv, dw, in_dtype)
    if dmask is not None:
        dmask = dmask.to(attn_mask.dtype)
    return dq, dk, dv, dw, dmask


def _arrays(xs: Sequence[Tensor], w: Tensor, upcast: Optional[bool]) -> List:
    """xs, then w, as the kernels read them, through DLPack: bfloat16 upcast
    to float32 where upcast (the kernels then compute in float32), w always
    (the kernels take it in the compute dtype); upcast None: no dtype read,
    for a call with no bfloat16 input (one there goes on as it is); with unit stride along the
    features (any other strides are fine) and a negated view resolved (see
    _feat).  A plain loop over every input of a call: a Python call per array
    is a fair part of a small call's time, so the common case (contiguous,
    not negated) is inline."""
    if upcast is None:  # no bfloat16 among them: dtypes unread, a list comprehension (the common case)
        return [to_dlpack(x) if x.is_contiguous() and not x.is_neg() else _feat(x) for x in (*xs, w)]
    last = len(xs)
    caps = []
    for i, x in enumerate((*xs, w)):
        if x.dtype is _BF16 and (upcast or i == last):
            x = x.float()
        caps.append(to_dlpack(x) if x.is_contiguous() and not x.is_neg() else _feat(x))
    return caps


def _empty_like(xs: Sequence[Tensor], dtype: torch.dtype, like_inputs: bool) -> List[Tensor]:
    """Uninitialised arrays shaped like each of xs, in dtype, on its device,
    for the kernels to overwrite.  like_inputs: each laid out in memory like
    its x (torch.preserve_format) where x's features have unit stride, which
    the kernels need, else contiguous.  The heads a module splits off its
    projections, (B, T, H, D) memory seen as (B, H, T, D), are the case that
    matters: gradients and outputs in that layout turn the module's reshapes
    back to (B, T, H * D) into views, where contiguous ones cost a transposing
    copy each (a sizeable part of a ListOps-size training step).  For an x
    whose rows overlap (sliding windows from Tensor.unfold), preserve_format
    makes up dense strides in x's stride order, which may put another
    dimension innermost: contiguous then.  Without like_inputs, strictly
    contiguous_format, as the custom ops' fake kernels say (a size-1
    dimension's stride included)."""
    cf = torch.contiguous_format
    out = []
    for x in xs:
        if like_inputs and x.dtype is dtype and x.is_contiguous():
            y = torch.empty_like(x)  # no arguments: the cheapest, eight or more per backward
        elif like_inputs and x.dim() > 0 and (x.stride(-1) == 1 or x.size(-1) <= 1):
            y = torch.empty_like(x, dtype=dtype)
            if y.stride(-1) != 1 and y.size(-1) > 1:
                y = torch.empty_like(x, dtype=dtype, memory_format=cf)
        else:
            y = torch.empty_like(x, dtype=dtype, memory_format=cf)
        out.append(y)
    return out


def _in_dtype(dq: List[Tensor], dk: List[Tensor], dv: Tensor, dw: Tensor, in_dtype: torch.dtype):
    """The gradients rounded back to the inputs' dtype (bfloat16 runs in float32;
    natively, dq, dk and dv come out in bfloat16 already)."""
    if dv.dtype == in_dtype:
        return dq, dk, dv, (dw if dw.dtype == in_dtype else dw.to(in_dtype))
    return [x.to(in_dtype) for x in dq], [x.to(in_dtype) for x in dk], dv.to(in_dtype), dw.to(in_dtype)


def dropout_keep_mask(seed: int, dropout_p: float, B: int, H: int, T: int, S: int) -> Tensor:
    """The kernels' dropout pattern for ``seed`` as a bool tensor (B, H, T, S), True = kept."""
    keep = torch.empty((B, H, T, S), dtype=torch.bool, device="cpu")  # the extension fills it
    _C.dropout_mask(_dl(keep), int(seed), float(dropout_p))
    return keep


def _feat(x: Tensor):
    """A read-only input with unit stride along features (any other strides are
    fine), through DLPack, never upcast: the decoding kernels take float32 and
    float64 only, and a bfloat16 query next to a float32 cache must be refused.
    A negated view (Tensor.is_neg(): x.conj().imag of a complex x, say) is
    resolved first: DLPack carries the memory, not the sign bit."""
    if x.is_neg():
        x = x.resolve_neg()
    if x.is_contiguous() or x.stride(-1) == 1 or x.size(-1) <= 1:
        return to_dlpack(x)
    return to_dlpack(x.contiguous())


def _read(x: Tensor):
    """A read-only input of any layout (offsets, lengths) through DLPack, a
    negated view resolved first (see _feat)."""
    return to_dlpack(x.resolve_neg() if x.is_neg() else x)


def _written(x: Tensor, name: str):
    """An array the kernels write in place (the decoding caches): as it is; a
    negated view cannot be (its memory holds -x, a copy would take the writes)."""
    if x.is_neg():
        raise ValueError(f"{name}: a negated view (Tensor.is_neg()) cannot be written in place; pass "
                         f"{name}.resolve_neg() and keep using that")
    return to_dlpack(x)


def _decode(q: Sequence[Tensor], k_cache: Sequence[Tensor], v_cache: Tensor, w: Tensor, cache_seqlens,
            k: Optional[Sequence[Tensor]], v: Optional[Tensor], scale: Optional[float], softcap=None,
            sliding_window=None) -> Tensor:
    """One decoding step (CPU): returns out (B, H, Tn, Dv) in q's dtype.  With k
    and v, the kernel first writes them into k_cache / v_cache in place, so the
    caches go over exactly as they are (a copy would take the writes)."""
    q0 = q[0]
    out = torch.empty((*q0.shape[:3], v_cache.shape[-1] if v_cache.dim() else 0), dtype=q0.dtype, device=q0.device)
    lens = _read(cache_seqlens) if isinstance(cache_seqlens, Tensor) else cache_seqlens
    if k is None and v is None:  # only read
        kc, vc = [_read(x) for x in k_cache], _read(v_cache)
    else:
        kc, vc = [_written(x, f"k_cache[{l}]") for l, x in enumerate(k_cache)], _written(v_cache, "v_cache")
    _C.decode([_feat(x) for x in q], kc, vc, _feat(w), lens, _dl(out),
              None if k is None else [_feat(x) for x in k], None if v is None else _feat(v), scale,
              _threads(), softcap, sliding_window)
    return out


def _varlen_forward(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], is_causal: bool,
                    scale: Optional[float]) -> Tuple[Tensor, Tensor]:
    """Packed variable-length forward (CPU).  Returns (out (total_q, H, Dv) in q's
    dtype, lse (H * total_q,) in the compute dtype: sequence s's (H, T_s) block at
    H * cu_seqlens_q[s])."""
    q0 = q[0]
    dtype = compute_dtype(q0.dtype)
    native = _native_bf16(q0, ndim=3)  # q, k, v as they are; w and lse float32, out bfloat16 (rounded by the kernels)
    lead = q0.shape[:2]  # (total_q, H); a wrong rank is the extension's to name
    out = torch.empty((*lead, v.shape[-1] if v.dim() else 0), dtype=q0.dtype if native else dtype, device=q0.device)
    lse = torch.empty((lead[0] * lead[1] if len(lead) == 2 else 0,), dtype=dtype, device=q0.device)
    a = _arrays((*q, *k, v), w, not native)
    L, n = len(q), len(q) + len(k)
    _C.varlen_forward(a[:L], a[L:n], a[n], a[n + 1], _dl(out), _dl(lse),
                      _read(cu_seqlens_q), _read(cu_seqlens_k), max_seqlen_q, max_seqlen_k, is_causal, scale,
                      _threads())
    return (out if out.dtype == q0.dtype else out.to(q0.dtype)), lse


def _varlen_backward(dout: Tensor, q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, out: Tensor,
                     lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: Optional[int],
                     max_seqlen_k: Optional[int], is_causal: bool, scale: Optional[float]
                     ) -> Tuple[List[Tensor], List[Tensor], Tensor, Tensor]:
    """Returns (dq per level, dk per level, dv, dw) of the packed forward, in the inputs' dtype."""
    in_dtype = q[0].dtype
    dtype = compute_dtype(in_dtype)
    L, n = len(q), len(q) + len(k)
    g = _empty_like((*q, *k, v), dtype, False)
    dq, dk, dv = g[:L], g[L:n], g[n]
    dw = torch.empty_like(w, dtype=dtype, memory_format=torch.contiguous_format)
    # q, k, v, dout and out as they are where they all run natively, else upcast (see _backward)
    native = dout.dtype == out.dtype == in_dtype and (in_dtype != _BF16 or _native_bf16(
        q[0], v.shape[-1] if v.dim() else 1, ndim=3))
    a = _arrays((*q, *k, v, dout, out), w, not native)
    _C.varlen_backward(a[n + 1], a[:L], a[L:n], a[n], a[n + 3], a[n + 2],
                       _dl(lse), list(map(to_dlpack, dq)), list(map(to_dlpack, dk)), _dl(dv), _dl(dw),
                       _read(cu_seqlens_q), _read(cu_seqlens_k), max_seqlen_q, max_seqlen_k, is_causal, scale,
                       _threads())
    return _in_dtype(dq, dk, dv, dw, in_dtype)


def _downsample_forward(x: Tensor, taps: Tensor) -> Tensor:
    """hkt.downsample.causal_downsample of a CPU float32/float64 x (B, n, C) with
    taps (K, C) of its dtype, in one pass: (B, ceil(n / 2), C), the expression's bits."""
    out = x.new_empty((x.shape[0], (x.shape[1] + 1) // 2, x.shape[2]))
    _C.downsample_forward(_feat(x), _feat(taps), _dl(out), _threads())
    return out


def _downsample_backward(grad: Tensor, x: Tensor, taps: Tensor, want_x: bool = True
                         ) -> Tuple[Optional[Tensor], Tensor]:
    """(grad_x, grad_taps) of _downsample_forward, in one pass; grad_x None
    unless want_x (a module's level-1 input is its data, which needs none)."""
    cf = torch.contiguous_format
    gx = torch.empty_like(x, memory_format=cf) if want_x else None
    gt = torch.empty_like(taps, memory_format=cf)
    _C.downsample_backward(_feat(grad), _feat(x), _feat(taps), _dl(gx), _dl(gt), _threads())
    return gx, gt


def window_decode_kernel(*args, **kwargs) -> None:
    """Decoding with windows (hkt._C.window_decode; hkt/decoding/windowed.py makes
    the call)."""
    _C.window_decode(*args, **kwargs)


def window_kernels(*args, **kwargs) -> None:
    """The windowed kernels, forward or backward (hkt._C.window; hkt/ops/window.py
    forms their block sums and spreads their gradients)."""
    _C.window(*args, **kwargs)


def window_softcap(softcap) -> float:
    """softcap as the windowed kernels and every op's schema take it, checked
    by the extension (hkt._C.window_softcap; also under torch.jit.trace,
    which records the ops): 0.0 for None or 0.0, else a positive finite
    float.  Under torch.compile, as softcap_traced lets it through."""
    if torch.compiler.is_compiling():
        return 0.0 if softcap is None else float(softcap_traced(softcap))
    return _C.window_softcap(softcap)


def schema_sliding_window(sliding_window) -> int:
    """sliding_window as the ops' schemas take it, an int, 0 for none, checked
    by the extension (hkt._C.sliding_window: None or an int W >= 1, kept at
    2^60 past it).  Under torch.compile, where dynamo cannot trace into the
    extension, None as 0 and a plain int >= 1 as it is; anything else is
    checked by the extension outside the graph (a graph break), which raises
    its own error as eager does."""
    if torch.compiler.is_compiling():
        if sliding_window is None:
            return 0
        if type(sliding_window) is not int or sliding_window < 1:
            return _sliding_window_eagerly(sliding_window)
        return min(sliding_window, 1 << 60)
    return _C.sliding_window(sliding_window)


@torch.compiler.disable
def _sliding_window_eagerly(sliding_window) -> int:
    return _C.sliding_window(sliding_window)


@torch.compiler.disable
def _check_softcap_eagerly(softcap) -> None:
    _C.window_softcap(softcap)


def softcap_traced(softcap):
    """softcap as torch.compile records it: dynamo cannot trace into the
    extension, so a number goes on to the op (as a float: the kernels' call
    checks its range when it runs), and what float() would take as a number
    but the extension refuses, a bool or a string, is checked by the
    extension now, outside the graph: a graph break, so that a compile
    without fullgraph raises the extension's own error, as eager does, and
    one with fullgraph reports the break.  (Anything else float() refuses:
    the same break, from inside the trace.)  Dynamo hands a NumPy scalar
    over as its own kind of number, not an instance of numbers.Real: only
    the two refused kinds are named here."""
    if isinstance(softcap, (bool, str, bytes, bytearray)):
        _check_softcap_eagerly(softcap)
    return softcap
