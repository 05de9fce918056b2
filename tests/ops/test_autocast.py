"""Under torch.autocast: MultiheadHKT is a drop-in for nn.MultiheadAttention in
mixed-precision training and inference (its projections come out of autocast in
bfloat16 or float16 while its level weights stay float32), and hkt_attention
casts its inputs as autocast casts SDPA's: to bfloat16, or to float32 where
autocast asks for float16, which hkt does not compute."""
import pytest
import torch

import hkt

from helpers import sample_inputs

F32, BF16 = torch.float32, torch.bfloat16


def leaves(q, k, v, w):
    return [x.detach().requires_grad_() for x in q], [x.detach().requires_grad_() for x in k], \
        v.detach().requires_grad_(), w.detach().requires_grad_()


@pytest.mark.parametrize("amp, computed, backend", [(torch.bfloat16, BF16, "kernels"), (torch.float16, F32, "kernels"),
                                                     (torch.bfloat16, BF16, "sdpa")])
def test_functional_casts_its_inputs(amp, computed, backend):
    """The same bits as the call on inputs cast by hand, gradients included
    (they reach the float32 inputs in float32).  (Under float16 autocast the
    "sdpa" backend hands SDPA float32, which autocast then runs in float16.)"""
    q, k, v, w = sample_inputs(2, 3, 19, 19, 8, 8, 3, dtype=F32)
    a, b = leaves(q, k, v, w), leaves(q, k, v, w)
    with torch.autocast("cpu", dtype=amp):
        got = hkt.hkt_attention(*a[:3], a[3], is_causal=True, backend=backend)
    want = hkt.hkt_attention([x.to(computed) for x in b[0]], [x.to(computed) for x in b[1]], b[2].to(computed),
                             b[3].to(computed), is_causal=True, backend=backend)
    assert got.dtype == computed and torch.equal(got, want)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(computed)
    ga = torch.autograd.grad(got, [*a[0], *a[1], a[2], a[3]], g)
    gb = torch.autograd.grad(want, [*b[0], *b[1], b[2], b[3]], g)
    assert all(x.dtype == F32 and torch.equal(x, y) for x, y in zip(ga, gb))


def test_functional_leaves_float64_alone():
    q, k, v, w = sample_inputs(1, 2, 9, 9, 4, 4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hkt.hkt_attention(q, k, v, w)
    assert got.dtype == torch.float64 and torch.equal(got, hkt.hkt_attention(q, k, v, w))


def step(m, x, **kw):
    out, weights = m(x, x, x, **kw)
    m.zero_grad()
    out.float().square().sum().backward()
    return out, weights, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_module_trains_under_autocast_as_mha_does(amp, is_causal):
    """A training step runs under autocast where nn.MultiheadAttention's does,
    with the dtypes MHA gives, float32 gradients for every parameter, and values
    within the lower precision's error of the float32 step."""
    torch.manual_seed(0)
    E, H, T = 32, 4, 24
    m = hkt.MultiheadHKT(E, H, batch_first=True, levels=3)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, T, E)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1) if is_causal else None
    want, _, want_g = step(m, x, is_causal=is_causal)
    with torch.autocast("cpu", dtype=amp):
        got, weights, got_g = step(m, x, is_causal=is_causal)
        ref, ref_weights = mha(x, x, x, attn_mask=mask)
    assert got.dtype == ref.dtype == amp and weights.dtype == ref_weights.dtype
    tol = 3e-2 if amp == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # (the key biases' gradients are 0 in exact arithmetic: rounding noise, so an absolute tolerance)
    big = max(g.abs().max().item() for g in want_g.values())
    for n, g in got_g.items():
        assert g is not None and g.dtype == F32, n
        torch.testing.assert_close(g, want_g[n], rtol=tol, atol=tol * big, msg=n)


def test_module_pack_padding_and_decoding_under_autocast():
    """The packed (variable-length) path and KV-cache decoding run under
    autocast too; decoding computes in the cache's dtype."""
    torch.manual_seed(0)
    E, T = 32, 12
    m = hkt.MultiheadHKT(E, 4, batch_first=True, levels=3, pack_padding=True)
    x = torch.randn(2, T, E)
    kpm = torch.zeros(2, T, dtype=torch.bool)
    kpm[1, 7:] = True
    want, _ = m(x, x, x, key_padding_mask=kpm, need_weights=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = m(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == F32 for p in m.parameters() if p.requires_grad)
    m.eval()
    with torch.no_grad():
        full, _ = m(x, x, x, is_causal=True, need_weights=False)
        cache = m.init_cache(2, T)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            steps = [m.decode(x[:, :5], cache)] + [m.decode(x[:, t:t + 1], cache) for t in range(5, T)]
    torch.testing.assert_close(torch.cat(steps, 1).float(), full, rtol=3e-2, atol=3e-2)
