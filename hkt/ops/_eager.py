"""An op's eager autograd, made from the functions registered with it.

torch.library.register_autograd takes (setup_context, backward) for the
dispatcher; an eager call that needs gradients gets the same two functions
through one generated torch.autograd.Function instead, around the kernel call
the op's implementation makes: no dispatch, and no schema coercion of the
arguments, so a bad one reaches the extension, whose message names it.  The
op's first arguments may be lists of tensors (each tensor a leaf of its own,
so that autograd sees it), the others tensors or anything else (passed
through).
"""
from typing import Callable

import torch

from .._core.guards import _c_apply

__all__ = ["eager_autograd", "flat_apply", "needs_grad"]


def eager_autograd(name: str, impl: Callable, setup_context: Callable, backward: Callable, *, lists: bool = False,
                   first_output: bool = False):
    """The torch.autograd.Function ``name`` that runs impl with the op's
    registered setup_context and backward; impl is the op's kernel call, and
    ``ctx.eager`` tells backward that it may call its kernels directly too (the
    registered path calls the backward op, which torch.compile records).
    ``lists``: the op's first two arguments are lists of tensors (q and k, a
    tensor per level); call it through :func:`flat_apply` then.  Otherwise its apply takes the op's
    arguments as they are.  ``first_output``: the Function returns the op's
    first output alone (the others, such as a log-sum-exp kept for the
    backward, get no gradient: backward is handed None for them), which spares
    autograd an output and a gradient of zeros each."""

    def run_forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        ctx.eager = True
        return output[0] if first_output else output

    def run_forward_lists(ctx, lens, *leaves):
        # lens: the two lists' lengths; their tensors come first among the leaves
        L, n = lens[0], lens[0] + lens[1]
        args = [list(leaves[:L]), list(leaves[L:n]), *leaves[n:]]
        output = impl(*args)
        setup_context(ctx, args, output)
        ctx.lens, ctx.eager = lens, True
        return output[0] if first_output else output

    def run_backward_lists(ctx, *grads):
        dq, dk, *rest = backward(ctx, *((grads[0], None) if first_output else grads))
        L, Lk = ctx.lens
        # lens' gradient, then one per leaf
        return (None, *(dq if dq is not None else (None,) * L), *(dk if dk is not None else (None,) * Lk), *rest)

    forward, backward_ = (run_forward_lists, run_backward_lists) if lists else (run_forward, backward)
    # made by type(), so that autograd names its graph nodes (grad_fn) after name; its
    # module the op's, where setup_context is registered (impl may be the kernel call)
    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward_),
                                                  "__module__": setup_context.__module__})
    # apply's C entry (no Python layer: a fair part of a small call's time); the
    # callers run it only with no torch.func transform active
    fn.fast_apply = _c_apply(fn)
    return fn


def flat_apply(fn, q, k, *args):
    """fn.apply of an eager_autograd Function with lists: each tensor of q and
    k an input of its own, so that autograd sees it."""
    return fn.fast_apply((len(q), len(k)), *q, *k, *args)


def needs_grad(ctx, i: int) -> bool:
    """Whether the op's argument i (a list: any of its tensors) needs a
    gradient, in the registered autograd (needs_input_grad per argument) and in
    an eager_autograd Function with lists (per leaf, after lens) alike."""
    need, lens = ctx.needs_input_grad, getattr(ctx, "lens", None)
    if lens is None:
        g = need[i]
        return any(g) if isinstance(g, (list, tuple)) else bool(g)
    if i < len(lens):  # a list: its leaves, after lens and the lists before it
        j = 1 + sum(lens[:i])
        return any(need[j:j + lens[i]])
    return bool(need[1 + sum(lens) + i - len(lens)])
