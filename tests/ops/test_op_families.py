"""One torch.library op family per kernel family (hkt/ops/): every family is in
torch.ops.hkt, torch.library.opcheck passes for every op, a double backward
works or raises NotImplementedError naming the op, and hkt_attention_varlen and
hkt_attention_with_kvcache run under torch.compile(fullgraph=True) and
torch.export, bitwise equal to eager."""
import pytest
import torch

import hkt
from hkt import ops
from hkt.downsample import causal_downsample
from hkt.ops import decode as decode_op
from hkt.ops import downsample as downsample_op
from hkt.ops import varlen as varlen_op
from hkt.ops import window as window_op
from helpers import sample_inputs

F64 = torch.float64
OPS = ["attention_forward", "attention_backward", "window_forward", "window_backward", "varlen_forward",
       "varlen_backward", "downsample_forward", "downsample_backward", "decode", "decode_append"]


def test_every_kernel_family_has_its_ops():
    for name in OPS:
        assert hasattr(torch.ops.hkt, name), name


def packed(lens_q, lens_k, H=2, H_kv=2, D=3, Dv=4, L=3, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int64).cumsum(0)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).to(torch.int32)
    oq, ok = hkt.varlen_level_offsets(cu_q, L), hkt.varlen_level_offsets(cu_k, L)
    q = [torch.randn(int(o[-1]), H, D, generator=g, dtype=F64) for o in oq]
    k = [torch.randn(int(o[-1]), H_kv, D, generator=g, dtype=F64) for o in ok]
    v = torch.randn(int(cu_k[-1]), H_kv, Dv, generator=g, dtype=F64)
    w = torch.randn(H, L, generator=g, dtype=F64)
    for x in (*q, *k, v, w):
        x.requires_grad_(requires_grad)
    return q, k, v, w, cu_q, cu_k


def _decode_inputs(B=2, H=4, H_kv=2, S_max=19, D=3, Dv=5, L=3, Tn=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(B, H, Tn, D, generator=g, dtype=F64) for _ in range(L)]
    k_cache = [torch.randn(B, H_kv, -(-S_max // 2 ** l), D, generator=g, dtype=F64) for l in range(L)]
    v_cache = torch.randn(B, H_kv, S_max, Dv, generator=g, dtype=F64)
    w = torch.randn(L, generator=g, dtype=F64)
    k = [torch.randn(B, H_kv, Tn, D, generator=g, dtype=F64) for _ in range(L)]
    v = torch.randn(B, H_kv, Tn, Dv, generator=g, dtype=F64)
    return q, k_cache, v_cache, w, k, v


# ---- opcheck ----

@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_varlen(causal):
    q, k, v, w, cu_q, cu_k = packed([3, 0, 5], [4, 2, 5], requires_grad=True)
    args = (q, k, v, w, cu_q, cu_k, None, 5, causal, 0.5)
    torch.library.opcheck(varlen_op.varlen_forward, args)
    out, lse = varlen_op.varlen_forward(*args)
    # the backward op has no derivative of its own (test below): inputs that need none
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    torch.library.opcheck(varlen_op.varlen_backward, (torch.randn_like(out), q, k, v, w, out.detach(),
                                                     lse.detach(), cu_q, cu_k, None, 5, causal, None))


def test_opcheck_decode():
    q, k_cache, v_cache, w, k, v = _decode_inputs()
    lens = torch.tensor([3, 10], dtype=torch.int64)
    torch.library.opcheck(decode_op.decode, (q, k_cache, v_cache, w, lens, 0, None))
    torch.library.opcheck(decode_op.decode, (q, k_cache, v_cache, w, None, 7, 0.25))
    torch.library.opcheck(decode_op.decode_append, (q, k_cache, v_cache, w, lens, 0, k, v, None))


@pytest.mark.parametrize("K", [1, 3])
def test_opcheck_downsample(K):
    x = torch.randn(2, 7, 5, dtype=F64, requires_grad=True)
    taps = torch.randn(K, 5, dtype=F64, requires_grad=True)
    torch.library.opcheck(downsample_op.downsample_forward, (x, taps))
    grad = torch.randn(2, 4, 5, dtype=F64)
    for want_x in (False, True):
        torch.library.opcheck(downsample_op.downsample_backward, (grad, x.detach(), taps.detach(), want_x))


def test_opcheck_window():
    q, k, v, w = sample_inputs(1, 2, 9, 9, 3, 3, 2, requires_grad=True)
    seed = torch.zeros((), dtype=torch.int64)
    args = ([*q], [*k], v, w, None, [2, 2], True, 0.5, 0.0, seed)
    torch.library.opcheck(window_op.window_forward, args)
    out, lse = window_op.window_forward(*args)
    q, k, v, w = [x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach()
    torch.library.opcheck(window_op.window_backward, (torch.randn_like(out), [*q], [*k], v, w, None, out.detach(),
                                                     lse.detach(), [2, 2], True, 0.5, 0.0, seed, False))


def test_opcheck_attention():
    q, k, v, w = sample_inputs(1, 2, 7, 6, 3, 4, 2, requires_grad=True)
    torch.library.opcheck(ops.attention_forward, ([*q], [*k], v, w, None, True, 0.0, 0.5, torch.tensor(0)))


# ---- double backward: works, or NotImplementedError naming the op ----

def test_double_backward_of_each_family():
    q, k, v, w, cu_q, cu_k = packed([3, 4], [5, 2], requires_grad=True)
    torch.autograd.gradgradcheck(lambda *a: hkt.hkt_attention_varlen(list(a[:3]), list(a[3:6]), a[6], a[7], cu_q,
                                                                     cu_k, is_causal=True), (*q, *k, v, w))
    x = torch.randn(2, 5, 3, dtype=F64, requires_grad=True)
    taps = torch.randn(2, 3, dtype=F64, requires_grad=True)
    torch.autograd.gradgradcheck(causal_downsample, (x, taps))
    qd, kd, vd, wd = sample_inputs(1, 2, 6, 6, 3, 3, 2, requires_grad=True)
    torch.autograd.gradgradcheck(lambda *a: hkt.hkt_attention(list(a[:2]), list(a[2:4]), a[4], a[5]),
                                 (*qd, *kd, vd, wd))


@pytest.mark.parametrize("name,run", [
    ("hkt::window_backward", "window"), ("hkt::varlen_backward", "varlen"),
    ("hkt::downsample_backward", "downsample"), ("hkt::decode", "decode")])
def test_a_backward_op_without_a_derivative_names_itself(name, run):
    if run == "window":
        q, k, v, w = sample_inputs(1, 2, 9, 9, 3, 3, 2, requires_grad=True)
        seed = torch.zeros((), dtype=torch.int64)
        out, lse = window_op.window_forward([*q], [*k], v, w, None, [2, 2], True, 0.5, 0.0, seed)
        dout = torch.randn_like(out, requires_grad=True)
        grads = window_op.window_backward(dout, [*q], [*k], v, w, None, out, lse, [2, 2], True, 0.5, 0.0, seed,
                                          False)
    elif run == "varlen":
        q, k, v, w, cu_q, cu_k = packed([3, 4], [5, 2], requires_grad=True)
        out, lse = varlen_op.varlen_forward(q, k, v, w, cu_q, cu_k, None, None, False, None)
        dout = torch.randn_like(out, requires_grad=True)
        grads = varlen_op.varlen_backward(dout, q, k, v, w, out, lse, cu_q, cu_k, None, None, False, None)
    elif run == "downsample":
        x = torch.randn(2, 5, 3, dtype=F64, requires_grad=True)
        taps = torch.randn(2, 3, dtype=F64, requires_grad=True)
        grads = downsample_op.downsample_backward(torch.randn(2, 3, 3, dtype=F64, requires_grad=True), x, taps,
                                                  True)
    else:
        q, k_cache, v_cache, w, _, _ = _decode_inputs()
        grads = [decode_op.decode([x.requires_grad_() for x in q], k_cache, v_cache, w, None, 5, None)]
    with pytest.raises(NotImplementedError, match=name):
        sum(g.sum() for g in grads).backward()


# ---- torch.compile and torch.export of varlen and decoding ----

def _varlen_call(q0, q1, q2, k0, k1, k2, v, w, cu_q, cu_k):
    return hkt.hkt_attention_varlen([q0, q1, q2], [k0, k1, k2], v, w, cu_q, cu_k, is_causal=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_varlen_compiles_fullgraph_bitwise(backend):
    q, k, v, w, cu_q, cu_k = packed([3, 0, 6], [5, 2, 6], requires_grad=True, seed=1)
    args = (*q, *k, v, w, cu_q, cu_k)
    want = _varlen_call(*args)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [*q, *k, v, w], dout)
    torch._dynamo.reset()
    got = torch.compile(_varlen_call, fullgraph=True, backend=backend)(*args)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, [*q, *k, v, w], dout), want_grads):
        assert torch.equal(a, b)


def test_varlen_exports_bitwise():
    q, k, v, w, cu_q, cu_k = packed([3, 0, 6], [5, 2, 6], seed=2)

    class M(torch.nn.Module):
        def forward(self, *a):
            return _varlen_call(*a)
    args = (*q, *k, v, w, cu_q, cu_k)
    ep = torch.export.export(M(), args)
    assert any("hkt.varlen_forward" in str(n.target) for n in ep.graph.nodes)
    assert torch.equal(ep.module()(*args), _varlen_call(*args))


def _decode_read(q0, q1, q2, c0, c1, c2, v_cache, w, lens):
    return hkt.hkt_attention_with_kvcache([q0, q1, q2], [c0, c1, c2], v_cache, w, lens, scale=0.3)


def _decode_write(q0, q1, q2, c0, c1, c2, v_cache, w, lens, k0, k1, k2, v):
    return hkt.hkt_attention_with_kvcache([q0, q1, q2], [c0, c1, c2], v_cache, w, lens, [k0, k1, k2], v)


@pytest.mark.parametrize("lens", [torch.tensor([3, 10]), 6], ids=["tensor", "int"])
@pytest.mark.parametrize("write", [False, True])
def test_decoding_compiles_fullgraph_bitwise(lens, write):
    q, k_cache, v_cache, w, k, v = _decode_inputs(seed=3)
    fn = _decode_write if write else _decode_read
    tail = (k[0], k[1], k[2], v) if write else ()

    def args_of(caches):
        return (*q, *caches[:3], caches[3], w, lens, *tail)
    eager_caches = [x.clone() for x in (*k_cache, v_cache)]
    want = fn(*args_of(eager_caches))
    torch._dynamo.reset()
    compiled_caches = [x.clone() for x in (*k_cache, v_cache)]
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args_of(compiled_caches))
    assert torch.equal(got, want)
    for a, b in zip(compiled_caches, eager_caches):  # the writes into the caches too
        assert torch.equal(a, b)
    if write:
        assert not torch.equal(eager_caches[3], v_cache)  # the call wrote something


@pytest.mark.parametrize("write", [False, True])
def test_decoding_exports_bitwise(write):
    q, k_cache, v_cache, w, k, v = _decode_inputs(seed=4)
    lens = torch.tensor([2, 9])
    fn = _decode_write if write else _decode_read
    tail = (k[0], k[1], k[2], v) if write else ()

    class M(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)
    eager_caches = [x.clone() for x in (*k_cache, v_cache)]
    want = fn(*q, *eager_caches[:3], eager_caches[3], w, lens, *tail)
    ep = torch.export.export(M(), (*q, *k_cache, v_cache, w, lens, *tail))
    assert any("hkt.decode" in str(n.target) for n in ep.graph.nodes)
    exported_caches = [x.clone() for x in (*k_cache, v_cache)]
    got = ep.module()(*q, *exported_caches[:3], exported_caches[3], w, lens, *tail)
    assert torch.equal(got, want)
    for a, b in zip(exported_caches, eager_caches):
        assert torch.equal(a, b)
