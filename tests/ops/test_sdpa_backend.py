"""hkt_attention(..., backend="sdpa"): HKT through torch's scaled_dot_product_attention
on concatenated level vectors (hkt/ops/sdpa.py), against the float64 reference:
forward and every gradient (q[l], k[l], v, w and a float mask's), masks of every
kind with and without is_causal, shared and per-head w, rows with no visible key;
each variant of handing the level vectors to SDPA (hkt.ops.sdpa.variant)."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import hkt
from hkt import functional
from hkt.ops import sdpa as _sdpa
from hkt.reference import hkt_attention_reference as reference

from helpers import MASKS, assert_within_lowp_error, make_mask, sample_inputs

# (B, H, T, S, D, Dv, L): T = 1, S != T both ways, L up to 5, odd D and Dv
SIZES = [
    (1, 1, 1, 1, 3, 5, 1),
    (2, 3, 1, 7, 5, 3, 3),
    (1, 2, 7, 7, 4, 9, 2),
    (2, 2, 97, 130, 13, 7, 3),
    (1, 3, 130, 97, 9, 11, 5),
    (1, 2, 64, 64, 16, 16, 4),
]


def outputs_and_grads(fn, q, k, v, w, mask, seed=3, **kw):
    out = fn(q, k, v, w, attn_mask=mask, **kw)
    leaves = [*q, *k, v, w] + ([mask] if mask is not None and mask.requires_grad else [])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return [out, *torch.autograd.grad(out, leaves, g)]


def sdpa(*args, **kw):
    return hkt.hkt_attention(*args, backend="sdpa", **kw)


def assert_close_all(got, want, tol):
    assert len(got) == len(want)
    for x, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"output {x} (out, dq.., dk.., dv, dw"
                                   f"[, dmask]): {m}")


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_matches_reference_float64(size, mask, causal, per_head):
    B, H, T, S, D, Dv, L = size
    q, k, v, w = sample_inputs(*size, per_head=per_head, requires_grad=True)
    am = make_mask(mask, B, H, T, S, torch.float64)
    if mask == "float":
        am.requires_grad_()  # (1, H, T, S): its gradient is summed over B
    got = outputs_and_grads(sdpa, q, k, v, w, am, is_causal=causal)
    want = outputs_and_grads(reference, q, k, v, w, am, is_causal=causal)
    assert_close_all(got, want, 1e-10)
    if mask == "float":
        assert got[-1].shape == am.shape


@pytest.mark.parametrize("scale", [None, 0.3])
def test_scale_and_lower_rank_masks(scale):
    B, H, T, S, D, Dv, L = 2, 2, 21, 18, 6, 5, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, requires_grad=True)
    g = torch.Generator().manual_seed(4)
    for am in (torch.rand(T, S, generator=g) > 0.4,                                          # 2-D bool
               torch.randn(S, generator=g, dtype=torch.float64).requires_grad_(),           # 1-D float (per key)
               torch.randn(B, 1, 1, S, generator=g, dtype=torch.float64).requires_grad_()):  # key padding
        for causal in (False, True):
            got = outputs_and_grads(sdpa, q, k, v, w, am, is_causal=causal, scale=scale)
            want = outputs_and_grads(reference, q, k, v, w, am, is_causal=causal, scale=scale)
            assert_close_all(got, want, 1e-10)


@pytest.mark.parametrize("scale", [-0.4, 0.0, -0.0])
@pytest.mark.parametrize("L, dtype", [(1, torch.float64), (2, torch.float64), (1, torch.float32)])
def test_causal_with_a_scale_not_above_zero(scale, L, dtype):
    """is_causal with scale <= 0 (any finite scale is allowed): torch's CPU SDPA
    kernel for is_causal gave NaN rows there where Dv = L * D, so the backend
    gives it the causal mask explicitly; the reference's values and gradients."""
    B, H, T, D = 1, 2, 16, 8
    q, k, v, w = sample_inputs(B, H, T, T, D, L * D, L, dtype=dtype, requires_grad=True)
    got = outputs_and_grads(sdpa, q, k, v, w, None, is_causal=True, scale=scale)
    want = outputs_and_grads(reference, q, k, v, w, None, is_causal=True, scale=scale)
    assert_close_all(got, want, 1e-10 if dtype == torch.float64 else 2e-5)


def test_rows_with_no_visible_key_give_zeros():
    B, H, T, S, D, Dv, L = 2, 2, 20, 24, 4, 3, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, requires_grad=True)
    bool_mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    bool_mask[0, :, 3] = False          # one row of batch 0 sees nothing
    bool_mask[1, :, :, 0] = False       # with is_causal, row 0 of batch 1 sees nothing
    float_mask = torch.zeros(1, H, T, S, dtype=torch.float64)
    float_mask[0, 1, 5] = float("-inf")  # one row of head 1
    float_mask[..., 0] = float("-inf")   # key 0 hidden: with is_causal, row 0 is empty
    float_mask.requires_grad_()
    for am, causal, empty in ((bool_mask, False, [(0, slice(None), 3)]),
                              (bool_mask, True, [(0, slice(None), 3), (1, slice(None), 0)]),
                              (float_mask, False, [(slice(None), 1, 5)]),
                              (float_mask, True, [(slice(None), 1, 5), (slice(None), slice(None), 0)])):
        got = outputs_and_grads(sdpa, q, k, v, w, am, is_causal=causal)
        want = outputs_and_grads(reference, q, k, v, w, am, is_causal=causal)
        assert all(torch.isfinite(x).all() for x in got[:-1] + ([got[-1]] if am.dtype == torch.bool else
                                                                 [got[-1].nan_to_num(posinf=0, neginf=0)]))
        for at in empty:
            assert (got[0][at] == 0).all()
        assert_close_all(got, want, 1e-10)


def test_every_row_masked_and_no_keys():
    q, k, v, w = sample_inputs(1, 2, 9, 6, 4, 3, 2, requires_grad=True)
    am = torch.zeros(1, 1, 9, 6, dtype=torch.bool)
    got = outputs_and_grads(sdpa, q, k, v, w, am)
    assert (got[0] == 0).all() and all((x == 0).all() for x in got[1:])
    q, k, v, w = sample_inputs(1, 1, 5, 0, 4, 3, 2, requires_grad=True)  # S = 0
    out = sdpa(q, k, v, w, is_causal=True)
    assert out.shape == (1, 1, 5, 3) and (out == 0).all()
    assert (torch.autograd.grad(out.sum(), q[0])[0] == 0).all()


def test_nan_row_stays_nan():
    q, k, v, w = sample_inputs(1, 1, 10, 10, 4, 3, 2)
    q[0][0, 0, 4, 1] = float("nan")
    out = sdpa(q, k, v, w)
    assert out[0, 0, 4].isnan().all() and out[0, 0, :4].isfinite().all() and out[0, 0, 5:].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_bfloat16(dtype):
    # in the inputs' dtype, as close to float64 as plain PyTorch in that dtype
    q, k, v, w = sample_inputs(2, 2, 45, 38, 8, 8, 3)

    def run(q, k, v, w, **kw):  # a float mask of zeros: the mask path, changing nothing
        return sdpa(q, k, v, w, attn_mask=torch.zeros(45, 38, dtype=q[0].dtype), **kw)

    assert_within_lowp_error(run, reference, q, k, v, w, dtype, is_causal=True)


def test_deterministic_and_same_as_kernels():
    q, k, v, w = sample_inputs(2, 2, 50, 50, 8, 8, 3, dtype=torch.float32, requires_grad=True)
    runs = [outputs_and_grads(sdpa, q, k, v, w, None, is_causal=True) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    kern = outputs_and_grads(hkt.hkt_attention, q, k, v, w, None, is_causal=True, backend="kernels")
    assert_close_all(runs[0], kern, 2e-5)


def test_auto_backend_choice():
    q, k, v, w = sample_inputs(1, 1, 4, 4, 2, 2, 2)
    assert functional._pick_backend(None, q, 0.0) == "kernels"          # CPU
    assert functional._pick_backend("auto", q, 0.0) == "kernels"
    assert functional._pick_backend("sdpa", q, 0.3) == "sdpa"          # refused later, by name
    meta = [x.to("meta") for x in q]
    assert functional._pick_backend(None, meta, 0.0) == "kernels"
    if torch.cuda.is_available():
        cuda = [x.cuda() for x in q]
        assert functional._pick_backend(None, cuda, 0.0) == "sdpa"
        assert functional._pick_backend(None, cuda, 0.1) == "kernels"  # dropout: only the kernels have it


def test_errors():
    q, k, v, w = sample_inputs(2, 2, 9, 7, 4, 3, 2)
    with pytest.raises(ValueError, match="backend"):
        hkt.hkt_attention(q, k, v, w, backend="flash")
    with pytest.raises(ValueError, match="dropout_p: the 'sdpa' backend"):
        sdpa(q, k, v, w, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"q\[1\]: expected shape \(2, 2, 5, 4\) = \(B, H, ceil\(T/2\), D\)"):
        sdpa([q[0], q[1][:, :, :4]], k, v, w)
    with pytest.raises(ValueError, match=r"k\[1\]"):
        sdpa(q, [k[0], torch.cat([k[1], k[1]], 2)], v, w)
    with pytest.raises(ValueError, match="k: expected 2 levels"):
        sdpa(q, k[:1], v, w)
    with pytest.raises(ValueError, match="v: expected shape"):
        sdpa(q, k, v[:, :, :5], w)
    with pytest.raises(ValueError, match="w: expected shape"):
        sdpa(q, k, v, torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q, k, v, w, attn_mask=torch.ones(9, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa(q, k, v, w, attn_mask=torch.ones(9, 7, dtype=torch.int32))
    with pytest.raises(TypeError, match="v"):
        sdpa(q, k, v.float(), w)
    with pytest.raises(ValueError, match="scale"):
        sdpa(q, k, v, w, scale=float("inf"))
    with pytest.raises(TypeError, match="is_causal"):
        sdpa(q, k, v, w, is_causal=1)


def test_compiles_fullgraph():
    q, k, v, w = sample_inputs(1, 2, 33, 33, 8, 8, 3, dtype=torch.float32)
    mask = torch.rand(33, 33, generator=torch.Generator().manual_seed(2)) > 0.3

    def f(q0, q1, q2, k0, k1, k2, v, w):
        return hkt.hkt_attention([q0, q1, q2], [k0, k1, k2], v, w, attn_mask=mask, is_causal=True, backend="sdpa")

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*q, *k, v, w)
    torch.testing.assert_close(got, f(*q, *k, v, w), rtol=1e-6, atol=1e-6)


# ---- variants (hkt.ops.sdpa.variant): how Q~, K~ and v are handed to SDPA

def sdpa_calls(monkeypatch):
    """The (q, k, v) head sizes of every F.scaled_dot_product_attention call."""
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_pad_v_matches_reference_float64(monkeypatch, size, mask, causal):
    """v zero-padded to L*D (or Q~ and K~ to Dv where Dv is wider: 1x2x7x7x4x9x2):
    the reference's values and every gradient, the padding's sliced away."""
    monkeypatch.setattr(_sdpa, "variant", "pad_v")
    seen = sdpa_calls(monkeypatch)
    B, H, T, S, D, Dv, L = size
    q, k, v, w = sample_inputs(*size, requires_grad=True)
    am = make_mask(mask, B, H, T, S, torch.float64)
    if mask == "float":
        am.requires_grad_()
    got = outputs_and_grads(sdpa, q, k, v, w, am, is_causal=causal)
    want = outputs_and_grads(reference, q, k, v, w, am, is_causal=causal)
    assert_close_all(got, want, 1e-10)
    assert seen == [(max(L * D, Dv),) * 3]
    assert got[0].shape == (B, H, T, Dv)


def test_pad_v_rows_with_no_visible_key_and_grouped_heads(monkeypatch):
    monkeypatch.setattr(_sdpa, "variant", "pad_v")
    B, H, T, S, D, Dv, L = 2, 4, 20, 24, 4, 3, 3
    q, k, v, w = sample_inputs(B, H, T, S, D, Dv, L, requires_grad=True, kv_heads=2)
    am = torch.ones(B, 1, T, S, dtype=torch.bool)
    am[0, :, 3] = False
    got = outputs_and_grads(sdpa, q, k, v, w, am, is_causal=True)
    want = outputs_and_grads(reference, q, k, v, w, am, is_causal=True)
    assert (got[0][0, :, 3] == 0).all()
    assert_close_all(got, want, 1e-10)


def test_concat_hands_sdpa_the_level_vectors_as_they_are(monkeypatch):
    monkeypatch.setattr(_sdpa, "variant", "concat")
    seen = sdpa_calls(monkeypatch)
    q, k, v, w = sample_inputs(1, 2, 16, 16, 8, 8, 3)
    sdpa(q, k, v, w, is_causal=True)
    assert seen == [(24, 24, 8)]


def test_auto_follows_the_measured_variant(monkeypatch):
    """"auto" takes MEASURED_FASTEST's variant for the call's device, dtype and
    mode (forward+backward when a gradient is to be taken), "concat" where none
    is recorded."""
    monkeypatch.setattr(_sdpa, "variant", "auto")
    key = _sdpa.variant_key(torch.device("cpu"), torch.float64, True)
    assert key == "cpu float64 forward+backward"
    monkeypatch.setattr(_sdpa, "MEASURED_FASTEST", {key: "pad_v"})
    seen = sdpa_calls(monkeypatch)
    q, k, v, w = sample_inputs(1, 2, 16, 16, 8, 8, 3, requires_grad=True)
    sdpa(q, k, v, w)
    with torch.no_grad():  # forward: nothing recorded for it
        sdpa(q, k, v, w)
    sdpa([x.detach() for x in q], [x.detach() for x in k], v.detach(), w.detach())
    assert seen == [(24, 24, 24), (24, 24, 8), (24, 24, 8)]


def test_unknown_variant_is_named(monkeypatch):
    q, k, v, w = sample_inputs(1, 1, 4, 4, 2, 2, 2)
    monkeypatch.setattr(_sdpa, "variant", "flash")
    with pytest.raises(ValueError, match=r"HKT_SDPA_VARIANT.*'flash'"):
        sdpa(q, k, v, w)
    monkeypatch.setattr(_sdpa, "variant", "auto")
    monkeypatch.setattr(_sdpa, "MEASURED_FASTEST", {"cpu float64 forward": "padded"})
    with pytest.raises(ValueError, match=r"'padded'"):
        sdpa(q, k, v, w)


def test_variant_comes_from_the_environment():
    code = "import hkt.ops.sdpa as s; print(s.variant)"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, HKT_SDPA_VARIANT="pad_v"),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "pad_v"


def test_auto_with_a_measurement_compiles_whole(monkeypatch):
    """"auto"'s lookup and pad_v trace into one graph (no break, no warning)."""
    monkeypatch.setattr(_sdpa, "variant", "auto")
    monkeypatch.setattr(_sdpa, "MEASURED_FASTEST", {"cpu float64 forward+backward": "pad_v"})
    q, k, v, w = sample_inputs(1, 2, 16, 16, 8, 8, 3, requires_grad=True)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, w: sdpa(q, k, v, w, is_causal=True), fullgraph=True, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = outputs_and_grads(lambda q, k, v, w, attn_mask: f(q, k, v, w), q, k, v, w, None)
    want = outputs_and_grads(reference, q, k, v, w, None, is_causal=True)
    assert_close_all(got, want, 1e-10)
