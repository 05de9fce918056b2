"""The causal downsampling that makes MultiheadHKT's coarse levels: the
extension's one-pass kernels on the CPU in float32/float64 (the
hkt::downsample_forward op's functions, hkt/ops/downsample.py), the torch
expression everywhere else (and for double backward).

Shapes: x (B, n, C), taps (K, C) -> (B, ceil(n / 2), C).
"""
import torch
from torch import Tensor

from ._core import kernels as _kernels
from ._core.guards import _symbolic
from .ops.downsample import DownsampleFunction, downsample_expr

__all__ = ["causal_downsample"]


def causal_downsample(x: Tensor, taps: Tensor) -> Tensor:
    """Trainable causal depthwise downsampling, stride 2 (docs/contract.md section 2.2).

        out[b, p, c] = sum_{r < K} taps[r, c] * x[b, 2p - r, c]    (x = 0 before the start)

    On the CPU in float32/float64 the extension computes it in one pass, to
    the bits of the torch expression (:func:`_downsample_expr`), which runs
    everywhere else (other devices and dtypes, torch.compile, TorchScript),
    and its gradients in one pass each, equal to the expression's within
    rounding (the taps' sums are taken in another order).

    Args:
        x: (B, n, C).
        taps: (K, C).

    Returns:
        (B, ceil(n / 2), C); row p depends only on rows <= 2p of ``x``.
    """
    if not torch.jit.is_scripting():
        if _downsample_in_c(x, taps):
            return _downsample_c(x, taps)
    return _downsample_expr(x, taps)


_downsample_expr = downsample_expr  # (tests name hkt.downsample._downsample_expr)


_DS_DTYPES = (torch.float32, torch.float64)


@torch.jit.unused
def _downsample_in_c(x: Tensor, taps: Tensor) -> bool:
    """Whether the extension takes this call: CPU float32/float64 of one dtype,
    the ranks it wants (a malformed call goes to the expression, whose error
    torch raises), and not while torch.compile traces (it fuses the expression)
    or torch.jit.trace records (it records ops, not the extension's calls), or
    under torch.func transforms (the extension takes plain arrays)."""
    return (x.dtype in _DS_DTYPES and taps.dtype == x.dtype and x.device.type == "cpu"
            and taps.device.type == "cpu" and x.dim() == 3 and taps.dim() == 2 and taps.shape[0] >= 1
            and taps.shape[1] == x.shape[2] and not _symbolic())


@torch.jit.unused
def _downsample_c(x: Tensor, taps: Tensor) -> Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or taps.requires_grad):
        return _DOWNSAMPLE_APPLY(x, taps)
    return _kernels._downsample_forward(x, taps)


# apply's C entry: never under torch.func transforms (_downsample_in_c)
_DOWNSAMPLE_APPLY = DownsampleFunction.fast_apply
