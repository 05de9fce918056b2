"""The only Python file that calls into the C extension (hkt._C).

Private _forward / _backward take torch tensors, allocate the outputs the
destination-passing kernels expect, and hand everything over through DLPack.
"""
from typing import List, Optional, Sequence, Tuple

import contextlib

import torch
from torch import Tensor

from torch.utils.dlpack import to_dlpack

from . import _C

__all__ = ["_forward", "_backward", "dropout_keep_mask", "has_cuda"]

has_cuda = bool(_C.has_cuda)


def _dl(x: Optional[Tensor]):
    # CPU tensors go over as bare capsules (Tensor.__dlpack__ costs microseconds of
    # Python checks per array); CUDA ones through __dlpack__, which syncs streams.
    if x is None or x.is_cuda:
        return x
    return to_dlpack(x)


def _dls(xs: Sequence[Tensor]) -> List:
    return [_dl(x) for x in xs]


def _lastdim_contiguous(x: Tensor) -> Tensor:
    # The kernels take any batch/head/row strides but need unit feature stride.
    x = x.detach()
    if x.dim() > 0 and x.size(-1) > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _mask_arg(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    if mask is None:
        return None
    mask = mask.detach()
    return mask if mask.dtype == torch.bool else mask.to(dtype)


def _on_device(x: Tensor):
    # torch only exports CUDA tensors of the current device through DLPack
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels run in float32 or float64; bfloat16 inputs are computed in float32."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _upcast(xs: Sequence[Tensor]) -> List[Tensor]:
    return [_lastdim_contiguous(x.to(compute_dtype(x.dtype))) for x in xs]


def _forward(q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, attn_mask: Optional[Tensor],
             is_causal: bool, dropout_p: float, scale: float, seed: int) -> Tuple[Tensor, Tensor]:
    """Returns (out (B, H, T, Dv) in q's dtype, lse (B, H, T) in the compute dtype)."""
    in_dtype = q[0].dtype
    q, k = _upcast(q), _upcast(k)
    v, w = _upcast([v, w])
    B, H, T, _ = q[0].shape
    out = torch.empty((B, H, T, v.shape[-1]), dtype=q[0].dtype, device=q[0].device)
    lse = torch.empty((B, H, T), dtype=q[0].dtype, device=q[0].device)
    with _on_device(out):
        _C.forward(_dls(q), _dls(k), _dl(v), _dl(w), _dl(out), _dl(lse), _dl(_mask_arg(attn_mask, q[0].dtype)),
                   bool(is_causal), float(scale), float(dropout_p), int(seed), torch.get_num_threads())
    return out.to(in_dtype), lse


def _backward(dout: Tensor, q: Sequence[Tensor], k: Sequence[Tensor], v: Tensor, w: Tensor, out: Tensor,
              lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool, dropout_p: float, scale: float,
              seed: int, mask_grad: bool = False
              ) -> Tuple[List[Tensor], List[Tensor], Tensor, Tensor, Optional[Tensor]]:
    """Returns (dq per level, dk per level, dv, dw, dmask), in the inputs' dtype;
    dmask (shaped like the float attn_mask) only with mask_grad, else None."""
    in_dtype = q[0].dtype
    q, k = _upcast(q), _upcast(k)
    v, w, dout, out = _upcast([v, w, dout, out])
    dq = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in q]
    dk = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in k]
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    dmask = torch.empty(attn_mask.shape, dtype=q[0].dtype, device=q[0].device) if mask_grad else None
    with _on_device(dv):
        _C.backward(_dl(dout), _dls(q), _dls(k), _dl(v), _dl(w), _dl(out.contiguous()),
                    _dl(lse.detach().contiguous()), _dls(dq), _dls(dk), _dl(dv), _dl(dw),
                    _dl(_mask_arg(attn_mask, q[0].dtype)), bool(is_causal), float(scale), float(dropout_p),
                    int(seed), torch.get_num_threads(), _dl(dmask))
    if in_dtype != q[0].dtype:
        dq, dk = [x.to(in_dtype) for x in dq], [x.to(in_dtype) for x in dk]
        dv, dw = dv.to(in_dtype), dw.to(in_dtype)
    if dmask is not None:
        dmask = dmask.to(attn_mask.dtype)
    return dq, dk, dv, dw, dmask


def dropout_keep_mask(seed: int, dropout_p: float, B: int, H: int, T: int, S: int) -> Tensor:
    """The kernels' dropout pattern for ``seed`` as a bool tensor (B, H, T, S), True = kept."""
    keep = torch.empty((B, H, T, S), dtype=torch.bool)
    _C.dropout_mask(_dl(keep), int(seed), float(dropout_p))
    return keep
