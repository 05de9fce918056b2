"""An op's eager autograd, made from the functions registered with it.

torch.library.register_autograd takes (setup_context, backward) for the
dispatcher; an eager call that needs gradients gets the same two functions
through one generated torch.autograd.Function instead, around the kernel call
the op's implementation makes: no dispatch, and no schema coercion of the
arguments, so a bad one reaches the extension, whose message names it.  Arguments are tensors,
lists of tensors (one leaf each) or anything else (passed through).
"""
from typing import Callable, Tuple

import torch

from .._guards import _c_apply

__all__ = ["eager_autograd", "flat_apply"]


def _flatten(args) -> Tuple[list, list]:
    """(leaves, layout): each list argument's tensors become leaves of their own;
    layout holds, per argument, its length (a list) or -1 (anything else)."""
    leaves, layout = [], []
    for a in args:
        if isinstance(a, (list, tuple)):
            leaves.extend(a)
            layout.append(len(a))
        else:
            leaves.append(a)
            layout.append(-1)
    return leaves, layout


def _unflatten(leaves, layout) -> list:
    args, i = [], 0
    for n in layout:
        if n < 0:
            args.append(leaves[i])
            i += 1
        else:
            args.append(list(leaves[i:i + n]))
            i += n
    return args


def eager_autograd(name: str, impl: Callable, setup_context: Callable, backward: Callable, *, lists: bool = True):
    """The torch.autograd.Function ``name`` that runs impl with the op's
    registered setup_context and backward; impl is the op's kernel call, and
    ``ctx.eager`` tells backward that it may call its kernels directly too (the
    registered path calls the backward op, which torch.compile records).  ``lists``: some arguments are lists of
    tensors; call it through :func:`flat_apply` then.  Otherwise its apply
    takes the op's arguments as they are."""

    def run_forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        ctx.eager = True
        return output

    def run_forward_lists(ctx, layout, *leaves):
        args = _unflatten(leaves, layout)
        output = impl(*args)
        setup_context(ctx, args, output)
        ctx.layout, ctx.eager = layout, True
        return output

    def run_backward_lists(ctx, *grads):
        out = [None]
        for n, g in zip(ctx.layout, backward(ctx, *grads)):
            if n < 0:
                out.append(g)
            else:
                out.extend(g if g is not None else [None] * n)
        return tuple(out)

    forward, backward_ = (run_forward_lists, run_backward_lists) if lists else (run_forward, backward)
    # made by type(), so that autograd names its graph nodes (grad_fn) after name
    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward_),
                                                  "__module__": impl.__module__})
    # apply's C entry (no Python layer: a fair part of a small call's time); the
    # callers run it only with no torch.func transform active
    fn.fast_apply = _c_apply(fn)
    return fn


def flat_apply(fn, *args):
    """fn.apply of an eager_autograd Function with lists: each tensor of a list
    argument an input of its own, so that autograd sees it."""
    leaves, layout = _flatten(args)
    return fn.fast_apply(layout, *leaves)
