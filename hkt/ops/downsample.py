"""Causal downsampling (hkt.causal_downsample) as torch.library custom ops, over
the extension's one-pass CPU kernels (float32, float64):

hkt::downsample_forward  -> out (B, ceil(n / 2), C)     of x (B, n, C) and taps (K, C)
hkt::downsample_backward -> (grad_x, grad_taps)         grad_x empty (0,) unless want_x

A backward with create_graph=True differentiates the torch expression
(:func:`downsample_expr`, whose bits the forward kernel has) instead, so
double backward works.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from .._core import kernels as _kernels
from ._eager import eager_autograd
from ._schema import OP_OPTIONS, no_derivative

__all__ = ["downsample_forward", "downsample_backward", "downsample_expr", "DownsampleFunction"]


def downsample_expr(x: Tensor, taps: Tensor) -> Tensor:
    """causal_downsample in torch ops: a sum over r in order, each product rounded."""
    K = taps.shape[0]
    m = (x.shape[1] + 1) // 2
    # K - 1 zero rows in front turn index 2p - r into 2p + (K - 1 - r) >= 0; the
    # last index read, 2(m - 1), is < n, so no padding is needed at the end.
    xp = F.pad(x, [0, 0, K - 1, 0])
    out = xp[:, K - 1:K - 1 + 2 * m - 1:2] * taps[0]
    for r in range(1, K):
        start = K - 1 - r
        out = out + xp[:, start:start + 2 * m - 1:2] * taps[r]
    return out


def _forward(x: Tensor, taps: Tensor) -> Tensor:
    return _kernels._downsample_forward(x.detach(), taps.detach())


downsample_forward = torch.library.custom_op("hkt::downsample_forward", _forward, mutates_args=(), **OP_OPTIONS)


@downsample_forward.register_fake
def _(x, taps):
    return x.new_empty((x.shape[0], (x.shape[1] + 1) // 2, x.shape[2]))


def _backward(grad: Tensor, x: Tensor, taps: Tensor, want_x: bool) -> tuple[Tensor, Tensor]:
    gx, gt = _kernels._downsample_backward(grad.detach(), x.detach(), taps.detach(), want_x)
    return (gx if want_x else x.new_empty(0)), gt


downsample_backward = torch.library.custom_op("hkt::downsample_backward", _backward, mutates_args=(),
                                              **OP_OPTIONS)


@downsample_backward.register_fake
def _(grad, x, taps, want_x):
    return (x.new_empty(x.shape) if want_x else x.new_empty(0)), taps.new_empty(taps.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gradients(ctx, grad):
    x, taps = ctx.saved_tensors
    need = ctx.needs_input_grad[:2]  # (x, taps)
    if torch.is_grad_enabled():  # create_graph: gradients that are themselves differentiable
        wrt = [t for t, n in zip((x, taps), need) if n]
        got = iter(torch.autograd.grad(downsample_expr(x, taps), wrt, grad, create_graph=True))
        return tuple(next(got) if n else None for n in need)
    if getattr(ctx, "eager", False):  # the kernels themselves: no dispatch
        gx, gt = _kernels._downsample_backward(grad, x, taps, bool(need[0]))
    else:
        gx, gt = downsample_backward(grad, x, taps, bool(need[0]))
    return (gx if need[0] else None), (gt if need[1] else None)


torch.library.register_autograd("hkt::downsample_forward", _gradients, setup_context=_setup_context)


no_derivative("hkt::downsample_backward", "hkt::downsample_backward: no derivative of its own; a backward with "
              "create_graph=True through hkt.causal_downsample differentiates its torch expression")

# eager calls that need gradients: the same functions, without the dispatcher
DownsampleFunction = eager_autograd("DownsampleFunction", _kernels._downsample_forward, _setup_context, _gradients)
