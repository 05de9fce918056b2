"""The causal downsampling that makes MultiheadHKT's coarse levels: the
extension's one-pass kernels on the CPU in float32/float64 (the
hkt::downsample_forward op's functions, hkt/ops/downsample.py), the torch
expression everywhere else (and for double backward).

Shapes: x (B, n, C), taps (K, C) -> (B, ceil(n / 2), C).
"""
from torch import Tensor

from .ops import route as _route
from .ops.downsample import downsample_expr

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
    return _route.downsample(x, taps)


_downsample_expr = downsample_expr  # (tests name hkt.downsample._downsample_expr)
