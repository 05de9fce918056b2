"""Second derivatives: hkt::attention_backward has its own autograd formula.

gradgradcheck (float64, small sizes, fast mode) on hkt.hkt_attention and on
MultiheadHKT, over masks, causal, shared or per-head w, the float mask's own
gradient and dropout; and the second derivatives compared with those of the
plain-PyTorch reference, which autograd differentiates twice by itself.
"""
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import hkt
from hkt._core import kernels as _kernels
from hkt.reference import hkt_attention_reference

from helpers import assert_close_to_double, sample_inputs

F64 = torch.float64


def _flat(q, k, v, w, *extra):
    return (*q, *k, v, w, *extra)


def _op(L, **kw):
    """hkt_attention as a function of flat tensors (q[0..L), k[0..L), v, w[, mask])."""
    def f(*args):
        q, k, v, w = list(args[:L]), list(args[L:2 * L]), args[2 * L], args[2 * L + 1]
        mask = args[2 * L + 2] if len(args) > 2 * L + 2 else kw.get("attn_mask")
        return hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=kw.get("is_causal", False),
                                 dropout_p=kw.get("dropout_p", 0.0))
    return f


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "shared_w": dict(per_head=False),
    "bool_mask": dict(mask="bool"),
    "bool_mask_causal": dict(mask="bool", is_causal=True),
    "float_mask_fixed": dict(mask="float"),
    "float_mask_grad": dict(mask="float_grad", is_causal=True),
    "empty_rows": dict(mask="empty_rows"),
    "frozen_keys_values": dict(frozen=True),  # only some inputs need second derivatives
}


def _mask(kind, B, H, T, S):
    g = torch.Generator().manual_seed(3)
    if kind == "bool":
        m = torch.rand(B, 1, T, S, generator=g) > 0.3
        m[..., 0] = True
        return m
    if kind == "empty_rows":  # row 1 sees nothing: zeros out, zero gradients
        m = torch.ones(1, 1, T, S, dtype=torch.bool)
        m[..., 1, :] = False
        return m
    m = torch.randn(1, H, T, S, generator=g, dtype=F64)
    m[..., 2, 3] = float("-inf")
    return m.requires_grad_(kind == "float_grad")


@pytest.mark.parametrize("case", list(CASES))
def test_gradgradcheck_functional(case):
    cfg = CASES[case]
    B, H, T, S, D, L = 1, 2, 5, 6, 3, 2
    q, k, v, w = sample_inputs(B, H, T, S, D, D, L, per_head=cfg.get("per_head", True), requires_grad=True,
                               seed=1)
    if cfg.get("frozen"):
        k, v = [x.detach() for x in k], v.detach()
    kw = dict(is_causal=cfg.get("is_causal", False))
    extra = ()
    if "mask" in cfg:
        m = _mask(cfg["mask"], B, H, T, S)
        if m.requires_grad:
            extra = (m,)
        else:
            kw["attn_mask"] = m
    assert gradgradcheck(_op(L, **kw), _flat(q, k, v, w, *extra), fast_mode=True)


def test_gradgradcheck_dropout():
    """The double backward rebuilds the kernels' dropout pattern from the saved
    seed; the generator is reseeded before every call, so each evaluation draws
    the same pattern and the numerical derivatives are those of one function."""
    B, H, T, S, D, L = 1, 2, 5, 5, 3, 2
    q, k, v, w = sample_inputs(B, H, T, S, D, D, L, requires_grad=True, seed=2)
    f = _op(L, dropout_p=0.3, is_causal=True)

    def seeded(*args):
        torch.manual_seed(123)
        return f(*args)

    assert gradgradcheck(seeded, _flat(q, k, v, w), fast_mode=True)


def _reference_second_order(q, k, v, w, dout, gg, **kw):
    """d/d(inputs) of <first-order grads, gg>, all in plain autograd on the reference."""
    out = hkt_attention_reference(q, k, v, w, **kw)
    first = torch.autograd.grad(out, [*q, *k, v, w], dout, create_graph=True)
    return torch.autograd.grad(first, [*q, *k, v, w, dout], gg)


def _kernel_second_order(q, k, v, w, dout, gg, **kw):
    out = hkt.hkt_attention(q, k, v, w, **kw)
    first = torch.autograd.grad(out, [*q, *k, v, w], dout, create_graph=True)
    return torch.autograd.grad(first, [*q, *k, v, w, dout], gg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_second_order_matches_reference_with_dropout(dtype):
    """Hessian-vector products through the kernels' backward equal the reference's,
    dropout included (the pattern of the forward's seed)."""
    B, H, T, S, D, L, p = 2, 2, 9, 7, 4, 3, 0.25
    q, k, v, w = sample_inputs(B, H, T, S, D, D, L, dtype=dtype, requires_grad=True, seed=4)
    dout = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
    gg = [torch.randn_like(x) for x in [*q, *k, v, w]]
    torch.manual_seed(7)
    got = _kernel_second_order(q, k, v, w, dout, gg, dropout_p=p)
    # the seed hkt_attention drew: the same draw after the same reseed
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    keep = _kernels.dropout_keep_mask(seed, p, B, H, T, S)
    want = _reference_second_order(q, k, v, w, dout, gg, dropout_p=p, dropout_mask=keep)
    if dtype == torch.float64:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        return
    # float32: as close to the float64 result as the reference in float32 is
    up = [x.detach().double().requires_grad_() for x in [*q, *k, v, w, dout]]
    exact = _reference_second_order(up[:L], up[L:2 * L], up[2 * L], up[2 * L + 1], up[-1], [x.double() for x in gg],
                                    dropout_p=p, dropout_mask=keep)
    assert_close_to_double(got, want, exact, torch.float32)


def test_gradient_penalty_trains():
    """A typical use: a penalty on the input gradient's norm, minimised through
    the double backward (the loss goes down)."""
    torch.manual_seed(0)
    m = hkt.MultiheadHKT(8, 2, batch_first=True, levels=2)
    x = torch.randn(2, 6, 8, requires_grad=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    losses = []
    for _ in range(5):
        out, _ = m(x, x, x, need_weights=False, is_causal=True)
        (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        loss = gx.square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_same_tensor_in_two_slots():
    """q[0] and k[0] the same tensor: each slot still gets its own partial derivative
    (the sum is what the tensor receives, as autograd adds them)."""
    B, H, T, D = 1, 1, 4, 3
    x = torch.randn(B, H, T, D, dtype=F64, requires_grad=True)
    v = torch.randn(B, H, T, D, dtype=F64, requires_grad=True)
    w = torch.ones(1, dtype=F64, requires_grad=True)

    def f(x, v, w):
        return hkt.hkt_attention([x], [x], v, w, is_causal=True)

    assert gradgradcheck(f, (x, v, w), fast_mode=True)


@pytest.mark.parametrize("packed", [True, False])
def test_gradgradcheck_module(packed):
    """MultiheadHKT end to end (projections, downsampling, level softmax): second
    derivatives with respect to the input and to every parameter."""
    torch.manual_seed(0)
    E, H = 4, 2
    kw = {} if packed else dict(kdim=3, vdim=5)
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=2, dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    x = torch.randn(1, 5, E, dtype=F64, requires_grad=True)
    kv = x if packed else torch.randn(1, 5, 3, dtype=F64, requires_grad=True)
    val = x if packed else torch.randn(1, 5, 5, dtype=F64, requires_grad=True)
    mask = torch.rand(1, 5) > 0.8

    def f(x, kv, val, *ps):
        out, _ = torch.func.functional_call(m, dict(zip(names, ps)), (x, kv, val),
                                            dict(key_padding_mask=mask, need_weights=False, is_causal=True))
        return out

    assert gradcheck(f, (x, kv, val, *params), fast_mode=True)
    assert gradgradcheck(f, (x, kv, val, *params), fast_mode=True)


def test_bfloat16_double_backward_runs():
    """bfloat16 is computed in float32 in the double backward, as in the kernels;
    the result is close to float32's."""
    B, H, T, S, D, L = 1, 2, 6, 6, 4, 2
    q, k, v, w = sample_inputs(B, H, T, S, D, D, L, dtype=torch.float32, seed=5)
    dout = torch.randn(B, H, T, D)
    gg = [torch.randn_like(x) for x in [*q, *k, v, w]]

    def run(dtype):
        args = [x.to(dtype).requires_grad_() for x in [*q, *k, v, w]]
        d = dout.to(dtype).requires_grad_()
        return _kernel_second_order(args[:L], args[L:2 * L], args[2 * L], args[2 * L + 1], d,
                                    [g.to(dtype) for g in gg])

    for a, b in zip(run(torch.bfloat16), run(torch.float32)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, rtol=0.1, atol=0.1)


def test_opcheck_backward_op():
    """torch.library's own checks of hkt::attention_backward (schema, fake kernel,
    autograd registration), with a float mask and its gradient."""
    from hkt import ops
    q, k, v, w = sample_inputs(1, 2, 7, 6, 3, 4, 2, requires_grad=True)
    mask = torch.randn(1, 2, 7, 6, dtype=F64, requires_grad=True)
    seed = torch.tensor(3)
    out, lse = ops.attention_forward(q, k, v, w, mask, True, 0.0, 0.5, seed)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.attention_backward,
                          (dout, q, k, v, w, out.detach(), lse.detach(), mask, True, 0.0, 0.5, seed, True))
