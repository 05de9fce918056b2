"""Native bfloat16 (AMX tiles or AVX512_BF16 dot products, float32 accumulation), forward and
backward on the bfloat16 arrays as they are: as accurate as SDPA's own bfloat16 kernels against float64, the same
as the upcast path up to P's and dS's rounding, every option of the float32
kernel, bitwise the same for any thread count, and bad calls refused by name.  Skipped where the CPU lacks the instructions (the
upcast path then serves bfloat16, and test_attention covers it)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack

import hkt
from hkt import _C
from hkt._core import kernels as _kernels
from hkt.reference import hkt_attention_reference as reference

from helpers import MASKS, assert_close_to_double, assert_within_lowp_error, make_mask, sample_inputs

pytestmark = pytest.mark.skipif(not _C.cpu_has_bf16(), reason="this CPU has no AVX512_BF16")

BF = torch.bfloat16


# The native kernels take their products on AMX tiles where the CPU has them,
# else with AVX512_BF16's vdpbf16ps.  HKT_BF16 is read once per process, so the
# tests run on the products this process took (HKT_BF16=avx512bf16 in the
# environment runs them on vdpbf16ps where AMX is there); the two are compared
# with each other by a child process (test_amx_and_vdpbf16ps_products_agree).
PRODUCTS = ["amx"] if _C.cpu_has_bf16() and _C.cpu_bf16_amx() else ["avx512bf16"]


@pytest.fixture(autouse=True, params=PRODUCTS)
def native_path(request):
    """These tests are of the native kernels, which run wherever the CPU has the
    instructions, also where hkt would rather upcast (cpu_bf16_preferred false)."""
    old = _kernels.native_bf16
    _kernels.native_bf16 = True
    yield request.param
    _kernels.native_bf16 = old


def bf16_inputs(B, H, T, S, D, Dv, L, seed=0, kv_heads=None, requires_grad=False):
    """Inputs whose values are bfloat16 numbers, as float64 and as bfloat16."""
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, seed=seed, kv_heads=kv_heads)
    q64, k64 = [x.to(BF).double() for x in q], [x.to(BF).double() for x in k]
    v64, w64 = v.to(BF).double(), w.to(BF).double()
    lo = [x.to(BF).requires_grad_(requires_grad) for x in q64], [x.to(BF).requires_grad_(requires_grad) for x in k64], \
        v64.to(BF).requires_grad_(requires_grad), w64.to(BF).requires_grad_(requires_grad)
    return (q64, k64, v64, w64), lo


def upcast_path(fn):
    """fn() with the native path switched off: bfloat16 computed in float32."""
    old = _kernels.native_bf16
    _kernels.native_bf16 = False
    try:
        return fn()
    finally:
        _kernels.native_bf16 = old


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,S,D,Dv", [(64, 64, 64, 64), (97, 130, 32, 48), (300, 300, 64, 64), (1, 77, 16, 5)])
def test_levels_1_as_accurate_as_sdpa_bfloat16(T, S, D, Dv, causal):
    """L = 1 is standard attention: the native forward must be within 2x the
    error of SDPA's bfloat16 kernel on the same data (+ 4 ulps)."""
    if causal and T > S:
        pytest.skip("SDPA's causal mask is top-left aligned")
    (q64, k64, v64, w64), (q, k, v, w) = bf16_inputs(2, 3, T, S, D, Dv, 1)
    want = reference(q64, k64, v64, w64, is_causal=causal)
    sdpa = F.scaled_dot_product_attention(q[0], k[0], v, is_causal=causal)
    got = hkt.hkt_attention(q, k, v, w, is_causal=causal)
    assert_close_to_double([got], [sdpa], [want], BF, names=["out"], factor=2.0)


@pytest.mark.parametrize("causal", [False, True])
def test_levels_1_gradients_as_accurate_as_sdpa_bfloat16(causal):
    """The backward's gradients of q, k and v within 2x the error of SDPA's
    bfloat16 backward on the same data (+ 4 ulps)."""
    (q64, k64, v64, w64), _ = bf16_inputs(2, 3, 97, 97, 64, 48, 1)
    g = torch.randn(2, 3, 97, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(BF).double()

    def grads(fn, dtype):
        xs = [x.to(dtype).requires_grad_() for x in (q64[0], k64[0], v64)]
        out = fn(*xs)
        return list(torch.autograd.grad(out, xs, g.to(dtype)))

    want = grads(lambda q, k, v: reference([q], [k], v, w64, is_causal=causal), torch.float64)
    sdpa = grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), BF)
    got = grads(lambda q, k, v: hkt.hkt_attention([q], [k], v, w64.to(BF), is_causal=causal), BF)
    assert_close_to_double(got, sdpa, want, BF, names=["dq", "dk", "dv"], factor=2.0)


@pytest.mark.parametrize("causal", [False, True])
def test_three_levels_within_plain_pytorch_bfloat16_error(causal):
    """Output and gradients (the backward upcasts) against float64, within the
    error of the plain-PyTorch reference run in bfloat16 throughout."""
    q, k, v, w = sample_inputs(1, 2, 150, 150, 32, 32, 3)
    q, k, v, w = [x.to(BF).double() for x in q], [x.to(BF).double() for x in k], v.to(BF).double(), \
        w.to(BF).double()
    assert_within_lowp_error(hkt.hkt_attention, reference, q, k, v, w, BF, factor=1.0, is_causal=causal)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_agrees_with_the_upcast_path(mask, causal):
    """Scores, softmax and sums are the float32 kernel's: the two paths differ
    only by P's rounding to bfloat16 before P @ V, a few bfloat16 ulps of the
    output (both results are rounded to bfloat16 at the end)."""
    _, (q, k, v, w) = bf16_inputs(2, 4, 130, 97, 64, 40, 3, kv_heads=2)
    m = make_mask(mask, 2, 4, 130, 97, torch.float32)
    native = hkt.hkt_attention(q, k, v, w, attn_mask=m, is_causal=causal)
    upcast = upcast_path(lambda: hkt.hkt_attention(q, k, v, w, attn_mask=m, is_causal=causal))
    assert native.dtype == BF
    scale = upcast.float().abs().max().item()
    assert (native.float() - upcast.float()).abs().max().item() <= 4 * torch.finfo(BF).eps * scale
    assert not torch.equal(native, upcast) or mask == "bool4d"  # the native path did run


@pytest.mark.parametrize("mask", [None, "float"])
def test_gradients_agree_with_the_upcast_path(mask):
    """The backward's products in bfloat16 differ from the float32 backward only
    by the rounding of P and dS: within 2 bfloat16 ulps of each gradient's size
    (the float mask's gradient, dS itself, included)."""
    _, (q, k, v, w) = bf16_inputs(2, 4, 130, 97, 64, 40, 3, kv_heads=2, requires_grad=True)
    m = make_mask(mask, 2, 4, 130, 97, torch.float32)
    g = torch.randn(2, 4, 130, 40, generator=torch.Generator().manual_seed(3)).to(BF)
    leaves = [*q, *k, v, w]
    if m is not None:  # the float mask's own gradient too
        m = m.to(BF).requires_grad_()
        leaves.append(m)

    def run():
        return torch.autograd.grad(hkt.hkt_attention(q, k, v, w, attn_mask=m, is_causal=True), leaves, g)

    native, upcast = run(), upcast_path(run)
    for n, a, b in zip(range(len(leaves)), native, upcast):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2 * torch.finfo(BF).eps * scale, n
    assert any(not torch.equal(a, b) for a, b in zip(native, upcast))  # the native products did run


def test_dropout_drops_the_same_entries():
    """Same seed, same dropped entries, forward and backward."""
    _, (q, k, v, w) = bf16_inputs(1, 2, 70, 70, 16, 16, 2, requires_grad=True)
    leaves = [*q, *k, v, w]

    def run():
        torch.manual_seed(5)
        out = hkt.hkt_attention(q, k, v, w, dropout_p=0.3)
        return [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]

    native, upcast = run(), upcast_path(run)
    for a, b in zip(native, upcast):
        assert (a.float() - b.float()).abs().max().item() <= 4 * torch.finfo(BF).eps * b.float().abs().max().item()


def test_strided_inputs_read_as_they_are():
    """Rows an odd number of bfloat16 apart (pairs then start off a 4-byte
    boundary) and every level a view: the same bits as contiguous copies."""
    _, (q, k, v, w) = bf16_inputs(2, 2, 67, 67, 16, 10, 3, requires_grad=False)

    def widened(x):  # x as a view into rows of length D + 1
        big = torch.zeros(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype)
        big[..., :-1] = x
        return big[..., :-1]

    qs, ks, vs = [widened(x).requires_grad_() for x in q], [widened(x).requires_grad_() for x in k], \
        widened(v).requires_grad_()
    qc, kc, vc = [x.clone().requires_grad_() for x in q], [x.clone().requires_grad_() for x in k], \
        v.clone().requires_grad_()
    assert qs[0].stride(2) % 2 == 1
    g = torch.randn(2, 2, 67, 10).to(BF)
    a = hkt.hkt_attention(qs, ks, vs, w, is_causal=True)
    b = hkt.hkt_attention(qc, kc, vc, w, is_causal=True)
    assert torch.equal(a, b)
    ga = torch.autograd.grad(a, [*qs, *ks, vs], g)
    gb = torch.autograd.grad(b, [*qc, *kc, vc], g)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def raw_forward(q, k, v, w, *, threads=2, key_cache_bytes=-1, causal=False, out_dtype=torch.float32,
                keep_lse=True):
    B, H, T, _ = q[0].shape
    out, lse = torch.empty(B, H, T, v.shape[-1], dtype=out_dtype), torch.empty(B, H, T) if keep_lse else None
    _C.forward([to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v), to_dlpack(w.float()),
               to_dlpack(out), None if lse is None else to_dlpack(lse), None, causal, None, 0.0, 0, threads, None,
               key_cache_bytes)
    return out, lse


@pytest.mark.parametrize("out_dtype", [torch.float32, BF])
def test_forward_without_lse_writes_the_same_out(out_dtype):
    # lse=None (hkt_attention under no_grad): the kernels keep it in their workspace
    _, (q, k, v, w) = bf16_inputs(2, 4, 150, 140, 32, 24, 3, kv_heads=2)
    for threads in (1, 2):
        want, _ = raw_forward(q, k, v, w, threads=threads, causal=True, out_dtype=out_dtype)
        got, _ = raw_forward(q, k, v, w, threads=threads, causal=True, out_dtype=out_dtype, keep_lse=False)
        assert torch.equal(got, want) and torch.isfinite(got).all()


@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_same_for_any_thread_count_and_key_cache(causal):
    """Per (b, kv head) packed keys and values, or packed tile by tile when they
    do not fit the key cache: the same bits, for 1, 2 or 3 threads."""
    _, (q, k, v, w) = bf16_inputs(2, 4, 200, 200, 32, 24, 3, kv_heads=2)
    out, lse = raw_forward(q, k, v, w, threads=1, causal=causal)
    for threads, budget in ((2, -1), (3, -1), (2, 0), (1, 0)):
        o, s = raw_forward(q, k, v, w, threads=threads, key_cache_bytes=budget, causal=causal)
        assert torch.equal(o, out) and torch.equal(s, lse), (threads, budget)


def raw_backward(q, k, v, w, out, lse, dout, *, threads=2, causal=False, grad=torch.empty):
    """The extension's backward on bfloat16 q, k, v, dout and out (out as the
    forward's float32 rounded, as hkt saves it); dq, dk and dv made by
    grad(shape) (float32 by default), dw float32."""
    dq, dk = [grad(x.shape) for x in q], [grad(x.shape) for x in k]
    dv, dw = grad(v.shape), torch.empty(w.shape)
    _C.backward(to_dlpack(dout), [to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v),
                to_dlpack(w.float()), to_dlpack(out.to(BF)), to_dlpack(lse), [to_dlpack(x) for x in dq],
                [to_dlpack(x) for x in dk], to_dlpack(dv), to_dlpack(dw), None, causal, None, 0.0, 0, threads)
    return [*dq, *dk, dv, dw]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,kv", [(2, 2), (1, 1)])
def test_backward_bitwise_same_for_any_thread_count(causal, B, kv):
    """Both backward schedules (a task per (b, kv head) with B=2, two kv heads;
    key and query chunks with one) give the same bits for 1, 2 and 3 threads."""
    _, (q, k, v, w) = bf16_inputs(B, 4, 150, 150, 32, 24, 3, kv_heads=kv)
    out, lse = raw_forward(q, k, v, w, causal=causal)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF)
    ref = raw_backward(q, k, v, w, out, lse, dout, threads=1, causal=causal)
    for threads in (2, 3):
        got = raw_backward(q, k, v, w, out, lse, dout, threads=threads, causal=causal)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), threads


def test_backward_arrays_are_checked():
    """bfloat16 inputs (and dout, out); dq, dk and dv all float32 or all
    bfloat16, dw float32; an odd Dv, which the products take in pairs, is
    refused by name (hkt upcasts it instead)."""
    _, (q, k, v, w) = bf16_inputs(1, 2, 16, 16, 8, 6, 2)
    out, lse = raw_forward(q, k, v, w)
    dout = torch.randn(out.shape).to(BF)
    raw_backward(q, k, v, w, out, lse, dout)  # even D and Dv: fine
    with pytest.raises(ValueError, match=r"^v: the native bfloat16 backward needs an even value dimension"):
        raw_backward(q, k, v[..., :5], w, out[..., :5].contiguous(), lse, dout[..., :5])
    f = torch.empty
    # fresh capsules for each call: a call consumes those it is given
    base = lambda: [to_dlpack(dout), [to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v),  # noqa: E731
                    to_dlpack(w.float())]
    grads = lambda dt: [[to_dlpack(f(x.shape, dtype=dt)) for x in q], [to_dlpack(f(x.shape, dtype=dt)) for x in k],
                        to_dlpack(f(v.shape, dtype=dt)), to_dlpack(f(w.shape, dtype=dt))]
    with pytest.raises(TypeError, match=r"^out: "):
        _C.backward(*base(), to_dlpack(out), to_dlpack(lse), *grads(torch.float32))
    with pytest.raises(TypeError, match=r"^dw: dtype bfloat16 does not match q\[0\]'s float32"):
        _C.backward(*base(), to_dlpack(out.to(BF)), to_dlpack(lse), *grads(BF))
    mixed = grads(BF)
    mixed[1] = grads(torch.float32)[1]  # dk float32 after a bfloat16 dq
    with pytest.raises(TypeError, match=r"^dk\[0\]: dtype float32 does not match q\[0\]'s bfloat16"):
        _C.backward(*base(), to_dlpack(out.to(BF)), to_dlpack(lse), *mixed)
    with pytest.raises(TypeError, match=r"^dq\[0\]: dtype float16 does not match q\[0\]'s float32"):
        _C.backward(*base(), to_dlpack(out.to(BF)), to_dlpack(lse), *grads(torch.float16))
    ok = grads(BF)
    ok[3] = to_dlpack(f(w.shape))
    _C.backward(*base(), to_dlpack(out.to(BF)), to_dlpack(lse), *ok)


def test_odd_value_dimension_backward_is_upcast():
    """Dv odd: the forward runs natively, the backward in float32; gradients as
    close to float64 as plain PyTorch's bfloat16 gets."""
    q, k, v, w = sample_inputs(1, 2, 40, 40, 8, 5, 2)
    q, k, v, w = [x.to(BF).double() for x in q], [x.to(BF).double() for x in k], v.to(BF).double(), \
        w.to(BF).double()
    assert_within_lowp_error(hkt.hkt_attention, reference, q, k, v, w, BF, factor=1.0)


def test_non_finite_values():
    """NaN in a visible key makes its rows NaN; a row with nothing visible gives zeros."""
    _, (q, k, v, w) = bf16_inputs(1, 2, 20, 20, 8, 8, 2)
    k = [x.clone() for x in k]
    k[0][0, 1, 5, 3] = float("nan")
    mask = torch.ones(20, 20, dtype=torch.bool)
    mask[7] = False
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask)
    assert out[0, 1][torch.arange(20) != 7].isnan().all()
    assert not out[0, 0].isnan().any()
    assert (out[0, :, 7] == 0).all()


def test_odd_head_dimension_is_upcast():
    """The dot products take D in pairs: an odd D runs the upcast path, and the
    extension refuses it by name when called directly."""
    (q64, k64, v64, w64), (q, k, v, w) = bf16_inputs(1, 2, 33, 33, 7, 6, 2)
    out = hkt.hkt_attention(q, k, v, w)
    assert out.dtype == BF
    assert (out.double() - reference(q64, k64, v64, w64)).abs().max().item() < 0.05
    with pytest.raises(ValueError, match=r"^q\[0\]: native bfloat16 needs an even head dimension"):
        raw_forward(q, k, v, w)


def test_float32_arrays_are_checked():
    """w and lse of a native call are float32, out float32 or bfloat16:
    anything else is refused by name."""
    _, (q, k, v, w) = bf16_inputs(1, 2, 16, 16, 8, 8, 2)
    out, lse = torch.empty(1, 2, 16, 8), torch.empty(1, 2, 16)
    # fresh capsules for each call: a call consumes those it is given
    args = lambda: [[to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v)]  # noqa: E731
    with pytest.raises(TypeError, match=r"^w: dtype bfloat16"):
        _C.forward(*args(), to_dlpack(w), to_dlpack(out), to_dlpack(lse))
    with pytest.raises(TypeError, match=r"^out: dtype float16"):
        _C.forward(*args(), to_dlpack(w.float()), to_dlpack(out.half()), to_dlpack(lse))
    with pytest.raises(TypeError, match=r"^lse: dtype bfloat16"):
        _C.forward(*args(), to_dlpack(w.float()), to_dlpack(out.to(BF)), to_dlpack(lse.to(BF)))
    _C.forward(*args(), to_dlpack(w.float()), to_dlpack(out.to(BF)), to_dlpack(lse))
    with pytest.raises(TypeError, match=r"^v: "):
        _C.forward(*args()[:2], to_dlpack(v.float()), to_dlpack(w.float()), to_dlpack(out), to_dlpack(lse))


def test_module_in_bfloat16():
    m = hkt.MultiheadHKT(64, 4, batch_first=True, levels=3, dtype=BF)
    x = torch.randn(2, 50, 64, dtype=BF, requires_grad=True)
    out = m(x, x, x, need_weights=False, is_causal=True)[0]
    out.float().sum().backward()
    m32 = hkt.MultiheadHKT(64, 4, batch_first=True, levels=3)
    m32.load_state_dict({name: p.float() for name, p in m.state_dict().items()})
    ref = m32(x.float(), x.float(), x.float(), need_weights=False, is_causal=True)[0]
    assert out.dtype == BF and x.grad is not None and x.grad.dtype == BF
    assert (out.float() - ref).abs().max().item() < 0.05


@pytest.mark.skipif(not _C.cpu_has_bf16() or not _C.cpu_bf16_amx(), reason="this CPU has no AMX")
def test_amx_and_vdpbf16ps_products_agree(native_path, tmp_path):
    """The two product engines sum in different orders, so their bits may differ,
    but only by float32 rounding of the sums: forward and gradients agree to a
    few float32 ulps of each output's scale, at sizes with ragged edges (rows
    and columns past whole 16s, value dimension 24, odd lengths).  HKT_BF16 is
    read once per process: the vdpbf16ps side runs in a child with
    HKT_BF16=avx512bf16."""
    _, (q, k, v, w) = bf16_inputs(2, 3, 150, 173, 32, 24, 3, requires_grad=True)
    dout = torch.randn(2, 3, 150, 24, generator=torch.Generator().manual_seed(5)).to(BF)
    out = hkt.hkt_attention(q, k, v, w)
    amx = [out.float()] + [g.float() for g in torch.autograd.grad(out, [*q, *k, v, w], dout)]
    src, dst = tmp_path / "inputs.pt", tmp_path / "dp.pt"
    torch.save([[x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach(), dout], src)
    code = ("import torch, hkt\n"
            f"q, k, v, w, dout = torch.load({str(src)!r})\n"
            "assert hkt._C.cpu_has_bf16() and not hkt._C.cpu_bf16_amx()\n"
            "hkt._core.kernels.native_bf16 = True\n"
            "xs = [x.requires_grad_(True) for x in [*q, *k, v, w]]\n"
            "out = hkt.hkt_attention(xs[:len(q)], xs[len(q):2 * len(q)], xs[-2], xs[-1])\n"
            "res = [out.float()] + [g.float() for g in torch.autograd.grad(out, xs, dout)]\n"
            f"torch.save(res, {str(dst)!r})\n")
    env = {**os.environ, "HKT_BF16": "avx512bf16"}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    dp = torch.load(dst)
    assert not all(torch.equal(a, b) for a, b in zip(amx, dp)), "AMX did not run"
    for i, (a, b) in enumerate(zip(amx, dp)):
        # out and the gradients are rounded to bfloat16 on the way out: a sum
        # that lands next to a rounding boundary may round either way
        assert (a - b).abs().max() <= 2 ** -7 * b.abs().max(), i


@pytest.mark.skipif(not _C.cpu_has_bf16() or not _C.cpu_bf16_amx(), reason="this CPU has no AMX")
def test_amx_survives_other_amx_code_on_the_thread(native_path):
    """AMX's tile configuration belongs to the OS thread, and torch's own bfloat16
    kernels (oneDNN) configure and release it too.  Calls interleaved with
    torch's bfloat16 matmuls on the same threads give the same bits."""
    if native_path != "amx":
        pytest.skip("of the AMX path")
    _, (q, k, v, w) = bf16_inputs(1, 4, 256, 256, 64, 64, 3)
    first = raw_forward(q, k, v, w, threads=2)
    a = torch.randn(256, 512).to(BF)
    for _ in range(3):
        (a @ a.T).sum()  # oneDNN, which takes AMX on this CPU
        again = raw_forward(q, k, v, w, threads=2)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_concurrent_calls_give_the_serial_bits(native_path):
    """Python threads calling the native kernels at once (each call on two
    threads of its own, the tiles configured per OS thread), next to a thread
    running torch's bfloat16 matmuls (oneDNN, which takes AMX where the CPU has
    it): every call gives the bits it gives alone, forward and backward."""
    import threading
    jobs = []
    for i in range(6):
        T = 64 + 37 * i  # whole and ragged tiles, 8-pair and 16-pair reductions
        _, (q, k, v, w) = bf16_inputs(1, 2, T, T, 32, 32, 1 + i % 3, seed=i, requires_grad=True)
        dout = torch.randn(1, 2, T, 32, generator=torch.Generator().manual_seed(50 + i)).to(BF)
        jobs.append((q, k, v, w, dout, i % 2 == 1))

    def run(job):
        q, k, v, w, dout, causal = job
        out = hkt.hkt_attention(q, k, v, w, is_causal=causal)
        return [out, *torch.autograd.grad(out, [*q, *k, v, w], dout)]

    serial = [run(j) for j in jobs]
    results, errors, stop = {}, [], threading.Event()

    def worker(t):
        try:
            torch.set_num_threads(2)
            for r in range(3):
                for i in range(len(jobs)):
                    j = (i + t + r) % len(jobs)
                    results[(t, r, j)] = run(jobs[j])
        except BaseException as exc:  # noqa: B902
            errors.append(exc)

    def matmuls():
        a = torch.randn(128, 256).to(BF)
        while not stop.is_set():
            (a @ a.T).sum()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    other = threading.Thread(target=matmuls)
    other.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    stop.set()
    other.join(60)
    assert not errors, errors[0]
    assert len(results) == 4 * 3 * len(jobs)
    for (t, r, j), got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, serial[j])), (t, r, j)


# ---- packed variable-length calls (hkt_attention_varlen, MultiheadHKT's pack_padding) ----

@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("H_kv", [2, 1])
@pytest.mark.parametrize("D,Dv", [(8, 6), (8, 5), (5, 6)])
def test_packed_calls_are_each_sequence_alone(D, Dv, H_kv, is_causal):
    """The packed kernels run on views of the packed arrays, so bfloat16 goes the way
    hkt_attention takes it: natively (an odd D: upcast; an odd Dv: a native forward, an
    upcast backward), and every row and gradient is bitwise what that sequence gets
    alone; dw sums the same terms in another order."""
    from test_varlen import LENS, grads_of, packed_inputs, run_alone, varlen
    q, k, v, w = packed_inputs(LENS, LENS, 2, D, Dv, 3, H_kv=H_kv, dtype=BF, seed=4, requires_grad=True)
    leaves = [*q, *k, v, w]
    dout = torch.randn(sum(LENS), 2, Dv, generator=torch.Generator().manual_seed(5)).to(BF)
    with torch.no_grad():
        got = varlen(q, k, v, w, LENS, LENS, is_causal)
        assert got.dtype == BF
        assert torch.equal(got, run_alone(q, k, v, w, LENS, LENS, is_causal))
    got = grads_of(lambda: varlen(q, k, v, w, LENS, LENS, is_causal), leaves, dout)
    want = grads_of(lambda: run_alone(q, k, v, w, LENS, LENS, is_causal), leaves, dout)
    for g, r in zip(got[:-1], want[:-1]):
        assert g.dtype == BF and torch.equal(g, r)
    # dw: each sequence's term, as hkt_attention gives it (rounded to bfloat16 once),
    # summed in float32; the packed call sums the float32 terms and rounds once
    terms = []
    for s, n in enumerate(LENS):
        ws = w.detach().clone().requires_grad_()
        rows = slice(sum(LENS[:s]), sum(LENS[:s + 1]))
        (run_alone(q, k, v, ws, LENS, LENS, is_causal)[rows] * dout[rows]).sum().backward()
        terms.append(ws.grad.float())
    want_dw = torch.stack(terms).sum(0)
    bound = (torch.stack(terms).abs().sum(0) + want_dw.abs()) * torch.finfo(BF).eps
    assert ((got[-1].float() - want_dw).abs() <= bound).all(), (got[-1], want_dw)


def test_packed_out_is_the_float32_one_rounded():
    """The packed forward writes its bfloat16 out itself, rounded as torch rounds
    the float32 one (hkt asks for it in bfloat16 since the native kernels round)."""
    from test_varlen import LENS, cu_of, packed_inputs
    q, k, v, w = packed_inputs(LENS, LENS, 2, 8, 6, 3, H_kv=1, dtype=BF, seed=6)
    outs = []
    for dtype in (torch.float32, BF):
        out, lse = torch.empty(sum(LENS), 2, 6, dtype=dtype), torch.empty(2 * sum(LENS))
        _C.varlen_forward(q, k, v, w.float(), out, lse, cu_of(LENS, torch.int64), cu_of(LENS, torch.int64),
                          None, None, True)
        outs.append((out, lse))
    (o32, l32), (o16, l16) = outs
    assert torch.equal(bits(o16), bits(o32.to(BF))) and torch.equal(l16, l32)
    got = hkt.hkt_attention_varlen(q, k, v, w, cu_of(LENS), cu_of(LENS), is_causal=True)
    assert torch.equal(bits(got), bits(o16))


def test_module_packed_padding_as_padded():
    """MultiheadHKT(pack_padding=True) in bfloat16: the packed call and the padded one
    compute each real row with the same native kernels, so they agree to the last bit
    but where float32 sums ordered differently round to neighbouring bfloat16 numbers
    (computed in float32, the packed call differed in a third of them, by a bfloat16 ulp
    or more)."""
    from test_varlen import padded_batch, randomized
    E, lens = 64, [5, 40, 1, 33, 64]
    m = randomized(hkt.MultiheadHKT(E, 4, batch_first=True, levels=3, pack_padding=True)).to(BF)
    x, kpm = padded_batch(E, lens, dtype=BF, seed=2)
    real = ~kpm
    with torch.no_grad():
        packed = m(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)[0][real].float()
        m.pack_padding = False
        padded = m(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)[0][real].float()
    differ = packed != padded
    assert differ.float().mean() <= 0.01, differ.float().mean()
    ulp = torch.finfo(BF).eps * padded.abs().clamp_min(torch.finfo(BF).tiny)
    assert ((packed - padded).abs() <= ulp).all()


def heads_layout(shape):
    """A bfloat16 (B, H, T, D) array in (B, T, H, D) memory, as a module's heads lie."""
    B, H, T, D = shape
    return torch.empty(B, T, H, D, dtype=BF).transpose(1, 2)


def bits(x):
    return x.view(torch.int16)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,kv", [(2, 2), (1, 1)])
def test_bfloat16_outputs_are_the_float32_ones_rounded(causal, B, kv):
    """out, dq, dk and dv written in bfloat16 by the kernels (summed in float32,
    each row rounded once) are bitwise torch's rounding of the float32 ones, in
    both backward schedules (B=2 with two kv heads: a task per (b, kv head);
    B=1 with one: key and query chunks), for 1 and 2 threads, into strided
    (module-layout) gradients."""
    _, (q, k, v, w) = bf16_inputs(B, 4, 150, 150, 32, 24, 3, kv_heads=kv)
    out, lse = raw_forward(q, k, v, w, causal=causal)
    for threads in (1, 2):
        o16, lse16 = raw_forward(q, k, v, w, causal=causal, threads=threads, out_dtype=BF)
        assert o16.dtype == BF and torch.equal(bits(o16), bits(out.to(BF))) and torch.equal(lse16, lse)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF)
    ref = raw_backward(q, k, v, w, out, lse, dout, causal=causal)
    for threads in (1, 2):
        got = raw_backward(q, k, v, w, out, lse, dout, causal=causal, threads=threads, grad=heads_layout)
        for a, b in zip(got[:-1], ref[:-1]):
            assert b.dtype == torch.float32 and a.dtype == BF and torch.equal(bits(a), bits(b.to(BF)))
        assert torch.equal(got[-1], ref[-1])  # dw: float32 either way


def test_bfloat16_outputs_keep_subnormals_ties_and_nan():
    """The kernels' rounding is torch's: ties to even, subnormal results kept
    (AVX512_BF16's own conversion would flush them to zero), NaN as torch's
    vectorised conversion writes it.  With q = 0 both keys weigh 1/2, so out
    and dv are exact averages of v's and dO's two rows, made to land on ties,
    some below the normal range (out's division by the softmax sum takes it
    there: the products themselves flush subnormals)."""
    n = 2.0 ** -126  # float32's (and bfloat16's) least normal
    q = [torch.zeros(1, 1, 2, 2, dtype=BF)]
    k = [torch.randn(1, 1, 2, 2).to(BF)]
    w = torch.ones(1)
    v = torch.tensor([[n * (1 + 2 ** -7), n * (1 + 3 * 2 ** -7), 1 + 2 ** -7, float("nan")],
                      [0.0, 0.0, 1.0, 1.0]]).to(BF).view(1, 1, 2, 4)
    out, lse = raw_forward(q, k, v, w)
    o16, _ = raw_forward(q, k, v, w, out_dtype=BF)
    # float32 holds the exact averages, each halfway between two bfloat16 numbers
    assert out[0, 0, 0, :3].tolist() == [n / 2 + 2 ** -134, n / 2 + 1.5 * 2 ** -133, 1 + 2 ** -8]
    assert torch.equal(bits(o16), bits(out.to(BF)))
    # ties to even: the subnormal's last bit 0, then up to it, 1.0
    assert o16[0, 0, 0, :3].tolist() == [n / 2, n / 2 + 2 ** -132, 1.0] and o16[0, 0, :, 3].isnan().all()
    dout = torch.tensor([[1 + 2 ** -7, 1 + 3 * 2 ** -7, float("nan"), 1.0],
                         [1.0, 1.0, 1.0, 1.0]]).to(BF).view(1, 1, 2, 4)
    ref = raw_backward(q, k, v, w, out.to(BF), lse, dout)
    got = raw_backward(q, k, v, w, out.to(BF), lse, dout, grad=lambda s: torch.empty(s, dtype=BF))
    assert ref[2][0, 0, 0, :2].tolist() == [1 + 2 ** -8, 1 + 1.5 * 2 ** -7]  # dv = P^T dO, P = 1/2 everywhere
    for a, b in zip(got[:-1], ref[:-1]):
        assert torch.equal(bits(a), bits(b.to(BF)))
    assert got[2][0, 0, 0, :2].tolist() == [1.0, 1 + 2 ** -6] and got[2][0, 0, :, 2].isnan().all()


def test_hkt_attention_gradients_are_bfloat16_from_the_kernels(monkeypatch):
    """hkt_attention's native backward asks the kernels for bfloat16 dq, dk and
    dv (no float32 copies rounded afterwards); the values are those of the
    float32 route rounded."""
    _, (q, k, v, w) = bf16_inputs(1, 2, 70, 70, 16, 16, 2, requires_grad=True)
    out = hkt.hkt_attention(q, k, v, w)
    g = torch.randn(out.shape).to(BF)
    seen = []
    real = _C.backward
    monkeypatch.setattr(_C, "backward", lambda *a, **kw: (seen.append(a), real(*a, **kw))[1])
    grads = torch.autograd.grad(out, [*q, *k, v, w], g)
    monkeypatch.undo()
    assert len(seen) == 1 and all(x.dtype == BF for x in grads)
    _, lse = raw_forward(q, k, v, w)
    ref = raw_backward(q, k, v, w, out.detach(), lse, g)
    for a, b in zip(grads, ref):
        assert torch.equal(bits(a), bits(b.to(BF)))


def test_row_hidden_by_finite_mask_gets_the_uniform_gradient():
    """A row every key of which carries finfo(float32).min (the native kernels
    take the mask in float32): its gradient is the average's, each value row
    weighing 1/5, as in float32 and float64 (test_views_and_masks)."""
    _, (q, k, v, w) = bf16_inputs(1, 1, 3, 5, 2, 2, 1, requires_grad=True)
    mask = torch.zeros(3, 5)
    mask[1] = torch.finfo(torch.float32).min
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask)
    dout = torch.zeros_like(out)
    dout[0, 0, 1] = 1.0
    (dv,) = torch.autograd.grad(out, v, dout)
    assert dv.dtype == BF
    torch.testing.assert_close(dv[0, 0].float(), torch.full((5, 2), 0.2), rtol=0, atol=2e-3)
