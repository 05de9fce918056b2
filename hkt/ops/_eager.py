"""An op's eager autograd, made from the functions registered with it.

torch.library.register_autograd takes (setup_context, backward) for the
dispatcher; an eager call that needs gradients gets the same two functions
through this one generated torch.autograd.Function instead, around the op's
own implementation: no dispatch, and no schema coercion of the arguments, so a
bad one reaches the extension, whose message names it.  Arguments are tensors,
lists of tensors (one leaf each) or anything else (passed through).
"""
from typing import Callable, Tuple

import torch

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
    registered setup_context and backward.  ``lists``: some arguments are lists of
    tensors; call it through :func:`flat_apply` then.  Otherwise its apply
    takes the op's arguments as they are."""

    def run_forward(ctx, *args):
        layout = None
        if lists:
            layout, args = args[0], _unflatten(args[1:], args[0])
        output = impl(*args)
        setup_context(ctx, args, output)
        ctx.layout = layout
        return output

    def run_backward(ctx, *grads):
        got = backward(ctx, *grads)
        if ctx.layout is None:
            return got
        out = [None]
        for n, g in zip(ctx.layout, got):
            if n < 0:
                out.append(g)
            else:
                out.extend(g if g is not None else [None] * n)
        return tuple(out)

    # made by type(), so that autograd names its graph nodes (grad_fn) after name
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward),
                 "__module__": impl.__module__})


def flat_apply(fn, *args):
    """fn.apply of an eager_autograd Function with lists: each tensor of a list
    argument an input of its own, so that autograd sees it."""
    leaves, layout = _flatten(args)
    return fn.apply(layout, *leaves)
