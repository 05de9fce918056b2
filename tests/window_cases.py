"""What the windowed tests share: float64 leaves, a call's output and
gradients, and the check of both against the dense reference."""
import torch

import hkt
import hkt.nn._mha_levels
from hkt.reference import hkt_attention_reference as reference

from helpers import sample_inputs

TOL = dict(rtol=1e-10, atol=1e-10)


def leaves(B, H, T, S, D, Dv, L, Hk=None, seed=0, dtype=torch.float64, per_head=True):
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, dtype=dtype, seed=seed, kv_heads=Hk, per_head=per_head)
    return [x.detach().clone().requires_grad_() for x in q], [x.detach().clone().requires_grad_() for x in k], \
        v.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()


def results(fn, q, k, v, w, dout, **kw):
    out = fn(q, k, v, w, **kw)
    grads = torch.autograd.grad(out, [*q, *k, v, w], dout)
    return [out.detach(), *grads]


def names(L):
    return ["out"] + [f"dq[{l}]" for l in range(L)] + [f"dk[{l}]" for l in range(L)] + ["dv", "dw"]


def assert_matches(q, k, v, w, windows, causal, scale=None, tol=TOL, **extra):
    """The windowed kernels' output and every gradient against the reference's
    (extra: attn_mask and the like, given to both); returns the kernels'."""
    B, H, T = q[0].shape[:3]
    dout = torch.randn(B, H, T, v.shape[-1], dtype=v.dtype, generator=torch.Generator().manual_seed(5))
    kw = dict(is_causal=causal, windows=windows, scale=scale, **extra)
    got = results(hkt.hkt_attention, q, k, v, w, dout, **kw)
    want = results(reference, q, k, v, w, dout, **kw)
    for name, a, b in zip(names(len(q)), got, want):
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m: f"{name}: {m}")
    return got


def assert_op_matches(got, want, q, k, v, w):
    """An output of the kernels' op against the reference's, and the gradients
    of both over the leaves for one random output gradient."""
    torch.testing.assert_close(got, want, **TOL)
    dout = torch.randn_like(got)
    for name, a, b in zip(names(len(q))[1:], torch.autograd.grad(got, [*q, *k, v, w], dout),
                          torch.autograd.grad(want, [*q, *k, v, w], dout)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def module_matches_reference(m, x, monkeypatch, **kw):
    """A module's output, returned weights and every parameter's gradient for
    m(x, x, x, need_weights=True, **kw), against the same with the reference
    in place of the kernels; returns the kernels'."""
    def step():
        m.zero_grad()
        out, wts = m(x, x, x, need_weights=True, **kw)
        out.square().sum().backward()
        return [out.detach(), wts, *[p.grad.clone() for p in m.parameters()]]
    got = step()
    calls = []
    with monkeypatch.context() as patch:  # where a windowed MultiheadHKT makes its call
        patch.setattr(hkt.nn._mha_levels, "hkt_attention", lambda *a, **k: calls.append(1) or reference(*a, **k))
        want = step()
    assert calls, "the reference did not run: the patch missed the module's call"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    return got
