"""torch.func transforms over hkt: vmap, grad, jacrev, jacfwd, hessian and
per-sample gradients.

The kernels take plain arrays, which the transforms' wrapped tensors are not,
so under a transform hkt_attention (backend None or "auto") computes the same
attention with differentiable torch ops (the "sdpa" backend), and
MultiheadHKT's downsampling its torch expression.  Each result here is checked
against the plain reference (or plain autograd) in float64.
"""
import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vmap

import hkt
from hkt.reference import hkt_attention_reference as reference

from helpers import sample_inputs

TOL = dict(rtol=1e-10, atol=1e-12)
# torch 2.13 has no vmap rule for SDPA's CPU kernel and says so each time it loops instead
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def inputs(B=2, H=2, T=11, D=4, L=3, seed=0):
    return sample_inputs(B, H, T, T, D, D, L, dtype=torch.float64, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
def test_grad_of_every_argument_matches_the_reference(causal):
    q, k, v, w = inputs()
    mask = torch.rand(11, 11, generator=torch.Generator().manual_seed(1)) > 0.3

    def loss(fn, q, k, v, w):
        return (fn(q, k, v, w, attn_mask=mask, is_causal=causal) ** 2).sum()
    got = grad(lambda *a: loss(hkt.hkt_attention, *a), argnums=(0, 1, 2, 3))(q, k, v, w)
    want = grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(q, k, v, w)
    for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(g, r, **TOL)


def test_vmap_over_a_batch_of_every_input():
    N = 3
    batch = [inputs(seed=s) for s in range(N)]
    q = [torch.stack([b[0][l] for b in batch]) for l in range(3)]
    k = [torch.stack([b[1][l] for b in batch]) for l in range(3)]
    v, w = torch.stack([b[2] for b in batch]), torch.stack([b[3] for b in batch])
    got = vmap(lambda q, k, v, w: hkt.hkt_attention(q, k, v, w, is_causal=True))(q, k, v, w)
    want = torch.stack([reference(*b, is_causal=True) for b in batch])
    torch.testing.assert_close(got, want, **TOL)


def test_vmap_over_values_only():
    q, k, _, w = inputs()
    vs = torch.randn(4, 2, 2, 11, 4, dtype=torch.float64)
    got = vmap(lambda v: hkt.hkt_attention(q, k, v, w))(vs)
    torch.testing.assert_close(got, torch.stack([reference(q, k, v, w) for v in vs]), **TOL)


def test_jacrev_of_the_level_weights():
    q, k, v, w = inputs(B=1, T=6)
    got = jacrev(lambda w: hkt.hkt_attention(q, k, v, w, is_causal=True))(w)
    want = jacrev(lambda w: reference(q, k, v, w, is_causal=True))(w)
    torch.testing.assert_close(got, want, **TOL)


def test_forward_mode_and_hessian_of_the_level_weights():
    q, k, v, w = inputs(B=1, T=6)
    got = jacfwd(lambda w: hkt.hkt_attention(q, k, v, w))(w)
    torch.testing.assert_close(got, jacfwd(lambda w: reference(q, k, v, w))(w), **TOL)
    got = hessian(lambda w: hkt.hkt_attention(q, k, v, w, is_causal=True).square().sum())(w)
    want = hessian(lambda w: reference(q, k, v, w, is_causal=True).square().sum())(w)
    torch.testing.assert_close(got, want, **TOL)


def test_per_sample_gradients_of_a_module():
    # the torch.func recipe: vmap over the batch of grad of one sample's loss
    torch.manual_seed(0)
    model = hkt.MultiheadHKT(8, 2, batch_first=True, levels=3).double().eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(4, 9, 8, dtype=torch.float64)

    def loss(params, xi):
        out = functional_call(model, params, (xi[None], xi[None], xi[None]), {"need_weights": False,
                                                                              "is_causal": True})[0]
        return out.square().sum()
    got = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        model.zero_grad()
        model(x[i:i + 1], x[i:i + 1], x[i:i + 1], need_weights=False, is_causal=True)[0].square().sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n][i], p.grad, **TOL, msg=lambda m: f"{n}, sample {i}: {m}")


def test_per_sample_gradients_of_a_packed_module():
    """pack_padding under vmap: the packed call (and its checks of the mask's
    values) cannot run there, so the padded call does, with the same zeros."""
    torch.manual_seed(0)
    model = hkt.MultiheadHKT(8, 2, batch_first=True, levels=3, pack_padding=True).double().eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(3, 9, 8, dtype=torch.float64)
    kpm = torch.arange(9)[None] >= torch.tensor([9, 4, 6])[:, None]

    def loss(params, xi, mi):
        y = xi[None]  # one tensor as query, key and value: self-attention, which pack_padding packs
        out = functional_call(model, params, (y, y, y), {"key_padding_mask": mi[None], "need_weights": False})[0]
        return out.square().sum()
    got = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, kpm)
    for i in range(x.shape[0]):
        model.zero_grad()
        y = x[i:i + 1]
        model(y, y, y, key_padding_mask=kpm[i:i + 1], need_weights=False)[0].square().sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(got[n][i], p.grad, **TOL, msg=lambda m: f"{n}, sample {i}: {m}")


def test_the_kernels_outside_transforms_still():
    # outside a transform the kernels run: their float32 result is not SDPA's bits
    # (a different sum order), and a bool is all this asks
    assert not torch._C._are_functorch_transforms_active()
    q, k, v, w = sample_inputs(1, 2, 64, 64, 16, 16, 2, dtype=torch.float32)
    out = hkt.hkt_attention(q, k, v, w)
    assert torch.equal(out, hkt.hkt_attention(q, k, v, w, backend="kernels"))


def test_kernels_backend_under_a_transform_is_refused_by_name():
    q, k, v, w = inputs()
    with pytest.raises(NotImplementedError, match="^backend: hkt's kernels do not run under torch.func"):
        vmap(lambda v: hkt.hkt_attention(q, k, v, w, backend="kernels"))(v[None])


@pytest.mark.parametrize("p", [0.1, np.float32(0.1)], ids=["float", "numpy-float32"])
def test_dropout_under_a_transform_is_refused_by_name(p):
    q, k, v, w = inputs()
    with pytest.raises(NotImplementedError, match="^dropout_p: dropout runs only in hkt's kernels"):
        grad(lambda v: hkt.hkt_attention(q, k, v, w, dropout_p=p).sum())(v)


def test_module_in_training_mode_with_dropout_is_refused_under_grad():
    model = hkt.MultiheadHKT(8, 2, dropout=0.1, batch_first=True).double().train()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="^dropout_p:"):
        grad(lambda p: functional_call(model, p, (x, x, x), {"need_weights": False})[0].sum())(params)


def test_nn_multihead_attention_recipe_runs_the_same_way():
    # the same per-sample recipe over nn.MultiheadAttention, for comparison: MultiheadHKT
    # with levels=1 and MHA's weights gives MHA's per-sample gradients
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    ours = hkt.MultiheadHKT.from_mha(mha, levels=1).double().eval()
    x = torch.randn(3, 7, 8, dtype=torch.float64)

    def per_sample(model):
        params = {n: p.detach() for n, p in model.named_parameters()}

        def loss(params, xi):
            return functional_call(model, params, (xi[None],) * 3, {"need_weights": False})[0].square().sum()
        return vmap(grad(loss), in_dims=(None, 0))(params, x)
    a, b = per_sample(mha), per_sample(ours)
    for n in ("in_proj_weight", "out_proj.weight"):
        torch.testing.assert_close(b[n], a[n], **TOL)


def _dead_wrapper(x):
    """x as a dead torch.func wrapper: a tensor kept from inside a transform
    that has finished (torch's own ops unwrap such a tensor and go on)."""
    kept = []

    def f(y):
        kept.append(y * 1)
        return y.sum()
    grad(f)(x)
    assert torch._C._functorch.is_functorch_wrapped_tensor(kept[0])
    return kept[0]


@pytest.mark.parametrize("needs_grad", [False, True])
def test_a_dead_wrapper_among_the_inputs_is_taken_as_its_tensor(needs_grad):
    # the eager paths skip torch.autograd.Function.apply's unwrapping (a small
    # call's time) and unwrap only when the kernels could not take an input
    q, k, v, w = sample_inputs(1, 2, 9, 9, 4, 4, 2, dtype=torch.float32, requires_grad=needs_grad)
    want = hkt.hkt_attention(q, k, v, w)
    dead = _dead_wrapper(v.detach())
    got = hkt.hkt_attention(q, k, dead, w)
    assert torch.equal(got, want)
    assert got.requires_grad == needs_grad
    if needs_grad:
        g = torch.randn_like(want)
        want_dq = torch.autograd.grad(want, q[0], g)[0]
        assert torch.equal(torch.autograd.grad(got, q[0], g)[0], want_dq)


def test_the_eager_functions_skip_apply_s_python_layer_only_where_it_does_nothing_for_them():
    import types
    from hkt._core.guards import _c_apply
    from hkt.ops import route
    from hkt.ops import attention
    # with torch 2.13, the C apply itself (what makes the unwrapping above hkt's to do)
    for fast in (attention.AttentionFunction.fast_apply, attention.QKVAttentionFunction.fast_apply,
                 route._DOWNSAMPLE_APPLY):
        assert isinstance(fast, types.BuiltinMethodType)

    class WithSetup(torch.autograd.Function):  # its defaults must be bound: Function.apply kept
        @staticmethod
        def forward(x, scale=2.0):
            return x * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx, g):
            return g * ctx.scale, None
    apply = _c_apply(WithSetup)
    # fn.apply kept: with torch 2.13 the Python function; from 2.14 on torch's
    # Function.apply is C itself, and binds the defaults there
    assert apply == WithSetup.apply
    x = torch.ones(3, requires_grad=True)
    assert torch.equal(apply(x), 2 * torch.ones(3))
