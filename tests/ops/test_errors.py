"""Bad input raises TypeError/ValueError naming the argument; the interpreter survives."""
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import hkt
from hkt import _C

from helpers import BAD_CASES as CASES, bad_input_base as base, requiring_grad, swap




@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_argument(case, grad):
    """Each case without and with its tensors requiring grad: the eager
    autograd Function flattens its tensor arguments, and must hand the
    extension the lists as given (k with another level count than q: named k,
    not an IndexError)."""
    _, exc, name, _ = case
    args, kwargs = spoilt_call(case, grad)
    with pytest.raises(exc) as info:
        hkt.hkt_attention(*args, **kwargs)
    assert str(info.value).startswith(name + ":"), str(info.value)


def spoilt_call(case, grad=False):
    """(q, k, v, w) and the keyword arguments of a BAD_CASES entry's call."""
    q, k, v, w = base()
    args = dict(q=q, k=k, v=v, w=w)
    kwargs = {}
    for key, val in case[3].items():
        (args if key in args else kwargs)[key] = val
    if grad:
        args = {key: requiring_grad(val) for key, val in args.items()}
    return [args[key] for key in "qkvw"], kwargs


def _meta(x):
    if isinstance(x, (list, tuple)):
        return [_meta(y) for y in x]
    return x.to("meta") if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_calls_that_run_no_kernel_refuse_in_the_kernels_words(case):
    """backend="sdpa" and meta tensors never reach the kernels: their checks
    are the extension's own, asked without a kernel run (hkt._C.check_forward),
    so each bad case is refused there with the kernels' exception and message,
    word for word."""
    args, kwargs = spoilt_call(case)
    with pytest.raises(case[1]) as want:
        hkt.hkt_attention(*args, **kwargs)
    message = "^" + re.escape(str(want.value)) + "$"
    with pytest.raises(type(want.value), match=message):
        hkt.hkt_attention(*args, backend="sdpa", **kwargs)
    if case[0] != "device":  # on meta, that case's tensors are all on one device
        with pytest.raises(type(want.value), match=message):
            hkt.hkt_attention(*_meta(args), **{key: _meta(val) for key, val in kwargs.items()})


def test_check_forward_runs_no_kernel_and_refuses_as_forward_does():
    """The check-only entry point over described arrays: a valid description
    passes (None), a bad one is refused with forward's message."""
    q = [((2, 3, 10, 4), 2, 64), ((2, 3, 5, 4), 2, 64)]
    k = [((2, 3, 7, 4), 2, 64), ((2, 3, 4, 4), 2, 64)]
    v, w, out = ((2, 3, 7, 5), 2, 64), ((2,), 2, 64), ((2, 3, 10, 5), 2, 64)
    assert _C.check_forward(q, k, v, w, out, None) is None
    with pytest.raises(ValueError, match=re.escape("k[1]: expected shape (2, 3, 4, 4) = (B, H_kv, ceil(S/2), D), "
                                                   "got (2, 3, 5, 4)")):
        _C.check_forward(q, [k[0], ((2, 3, 5, 4), 2, 64)], v, w, out, None)
    with pytest.raises(TypeError, match=re.escape("w: dtype float32 does not match q[0]'s float64")):
        _C.check_forward(q, k, v, ((2,), 2, 32), out, None)
    with pytest.raises(TypeError, match=r"^q\[0\]: expected a tensor or array"):  # forward takes no descriptions
        _C.forward(q, k, v, w, out, None)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_names_the_argument_too(case):
    """hkt.reference takes hkt_attention's arguments and checks them as it
    does: before, most bad cases computed something (a dropout_p of 1.5 gave
    zeros, a level one row too long was sliced away) or failed unnamed."""
    _, exc, name, _ = case
    args, kwargs = spoilt_call(case)
    with pytest.raises(exc) as info:
        hkt.reference.hkt_attention_reference(*args, **kwargs)
    assert str(info.value).startswith(name + ":"), str(info.value)


def test_reference_helpers_refuse_what_they_cannot_do():
    q, k, v, w = base()
    with pytest.raises(ValueError, match="^H: the 3 kv heads"):
        hkt.reference.repeat_kv(v, 4)  # 4 heads cannot share 3 kv heads
    assert hkt.reference.repeat_kv(v, 6).shape == (2, 6, 7, 5)
    with pytest.raises(ValueError, match="^dropout_mask: expected a tensor of shape"):
        hkt.reference.hkt_attention_reference(q, k, v, w, dropout_p=0.5, dropout_mask=torch.ones(10, 7))


def test_extension_checks_outputs_and_arrays():
    q, k, v, w = [[x.numpy() for x in xs] for xs in base()[:2]] + [x.numpy() for x in base()[2:]]
    B, H, T, Dv = 2, 3, 10, 5
    good_out, good_lse = np.empty((B, H, T, Dv)), np.empty((B, H, T))
    with pytest.raises(ValueError, match="^out:"):
        _C.forward(q, k, v, w, np.empty((B, H, T, Dv + 1)), good_lse)
    # an output may lie in memory in any order of its dimensions, but no two of its elements may share memory
    with pytest.raises(ValueError, match="^out: is an output, so its elements must not overlap each other"):
        _C.forward(q, k, v, w, torch.empty((B, 1, T, Dv), dtype=torch.float64).expand(B, H, T, Dv), good_lse)
    with pytest.raises(ValueError, match="^out: is an output, so its elements must not overlap each other"):
        _C.forward(q, k, v, w, torch.empty((B, H, 1, Dv), dtype=torch.float64).expand(B, H, T, Dv), good_lse)
    _C.forward(q, k, v, w, good_out, good_lse)
    permuted = np.empty((H, T, B, Dv)).transpose(2, 0, 1, 3)
    _C.forward(q, k, v, w, permuted, good_lse)
    assert np.array_equal(permuted, good_out)
    with pytest.raises(TypeError, match="^lse:"):
        _C.forward(q, k, v, w, good_out, np.empty((B, H, T), np.float32))
    with pytest.raises(TypeError, match="^v: expected a tensor or array that supports DLPack"):
        _C.forward(q, k, [1, 2], w, good_out, good_lse)
    with pytest.raises(ValueError, match="^q\\[1\\]: the last dimension must be contiguous"):
        _C.forward(swap(q, 1, np.empty((2, 3, 5, 8))[..., ::2]), k, v, w, good_out, good_lse)
    with pytest.raises(TypeError, match="^k: expected a list or tuple"):
        _C.forward(q, None, v, w, good_out, good_lse)
    with pytest.raises(ValueError, match="^attn_mask: expected 4 dimensions, each 1 or"):
        _C.forward(q, k, v, w, good_out, good_lse, np.ones((B, H, T, 6), bool))
    with pytest.raises(ValueError, match="^dq: expected 3 levels"):
        _C.backward(good_out, q, k, v, w, good_out, good_lse, q[:2], k, v, w)
    with pytest.raises(ValueError, match="cannot be exported through DLPack"):
        _C.forward(q, k, v, w, good_out, good_lse, torch.ones(B, H, T, 7, dtype=torch.float64, requires_grad=True))


def test_interpreter_survives_bad_input():
    # Run every bad call in a fresh interpreter: a crash would kill it, not raise.
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        import helpers as t, hkt
        n = 0
        for name, exc, argname, override in t.BAD_CASES:
            q, k, v, w = t.bad_input_base()
            args = dict(q=q, k=k, v=v, w=w); kw = {}
            for key, val in override.items():
                (args if key in args else kw)[key] = val
            try:
                hkt.hkt_attention(args["q"], args["k"], args["v"], args["w"], **kw)
            except (TypeError, ValueError):
                n += 1
        print("survived", n)
    """ % (str(__import__("pathlib").Path(__file__).resolve().parents[1]),))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"survived {len(CASES)}"


def test_extension_takes_capsules_and_rejects_consumed_ones():
    from torch.utils.dlpack import from_dlpack, to_dlpack
    q, k, v, w = base()
    out, lse = torch.empty(2, 3, 10, 5, dtype=torch.float64), torch.empty(2, 3, 10, dtype=torch.float64)
    _C.forward([to_dlpack(x) for x in q], [to_dlpack(x) for x in k], to_dlpack(v), to_dlpack(w),
               to_dlpack(out), to_dlpack(lse))
    torch.testing.assert_close(out, hkt.hkt_attention(q, k, v, w), rtol=0, atol=0)
    used = to_dlpack(v)
    from_dlpack(used)  # consumes it: the capsule is renamed "used_dltensor"
    with pytest.raises(TypeError, match="^v: a DLPack capsule must be an unconsumed"):
        _C.forward(q, k, used, w, out, lse)


def test_scalar_arguments_as_sdpa_takes_them():
    """NumPy real scalars for scale and dropout_p work as the floats they are
    (SDPA takes them); a NumPy bool is not a bool for is_causal (nor for SDPA),
    and the message says whose type it is; a dropout_p just out of range is
    written in full."""
    q, k, v, w = base()
    for backend in ("kernels", "sdpa"):
        want = hkt.hkt_attention(q, k, v, w, scale=0.5, backend=backend)
        assert torch.equal(hkt.hkt_attention(q, k, v, w, scale=np.float32(0.5), backend=backend), want)
        assert torch.equal(hkt.hkt_attention(q, k, v, w, scale=0.5, dropout_p=np.float32(0), backend=backend), want)
        with pytest.raises(TypeError, match="^is_causal: expected a bool, got numpy.bool"):
            hkt.hkt_attention(q, k, v, w, is_causal=np.bool_(True), backend=backend)
        with pytest.raises(ValueError, match=r"^dropout_p: must be in \[0, 1\], got 1.0000001$"):
            hkt.hkt_attention(q, k, v, w, dropout_p=1.0000001, backend=backend)
        with pytest.raises(ValueError, match="^dropout_p: must be in \\[0, 1\\], got an int beyond the float range"):
            hkt.hkt_attention(q, k, v, w, dropout_p=10**400, backend=backend)


def test_bfloat16_next_to_another_dtype_is_named_as_it_was_passed():
    """The kernels see bfloat16 upcast to float32; the message names the dtype
    the caller passed, on either side."""
    q, k, v, w = base()
    with pytest.raises(TypeError, match="^w: dtype torch.bfloat16 does not match q\\[0\\]'s torch.float64"):
        hkt.hkt_attention(q, k, v, w.bfloat16())
    with pytest.raises(TypeError, match="^v: dtype torch.float64 does not match q\\[0\\]'s torch.bfloat16"):
        hkt.hkt_attention([x.bfloat16() for x in q], [x.bfloat16() for x in k], v, w.bfloat16())


def test_meta_tensors_give_shapes():
    """Meta tensors (shapes only, e.g. a model built under torch.device("meta"))
    get meta results shaped as real ones would be, gradients too, with the
    same argument checks; the decoding and variable-length kernels, which have
    no such path, say so by name."""
    q, k, v, w = [[x.to("meta").requires_grad_() for x in xs] for xs in base()[:2]] + \
        [x.to("meta").requires_grad_() for x in base()[2:]]
    for kw in ({}, dict(is_causal=True, dropout_p=0.1), dict(attn_mask=torch.zeros(10, 7, device="meta"))):
        out = hkt.hkt_attention(q, k, v, w, **kw)
        assert out.is_meta and out.shape == (2, 3, 10, 5)
        grads = torch.autograd.grad(out.sum(), [*q, *k, v, w])
        assert all(g.is_meta and g.shape == x.shape for g, x in zip(grads, [*q, *k, v, w]))
    with pytest.raises(ValueError, match="^q\\[1\\]: expected shape"):
        hkt.hkt_attention(swap(q, 1, q[1][:, :, :-1]), k, v, w)
    with pytest.raises(ValueError, match="^dropout_p: must be in"):
        hkt.hkt_attention(q, k, v, w, dropout_p=2.0)
    with pytest.raises(ValueError, match="^k\\[0\\]: is on cpu but q\\[0\\] is on meta"):
        hkt.hkt_attention(q, swap(k, 0, torch.zeros(k[0].shape)), v, w)
    with torch.no_grad():
        with pytest.raises(ValueError, match="^q\\[0\\]: decoding needs tensors with data"):
            hkt.hkt_attention_with_kvcache([x[:, :, :1] for x in q], k, v, w, 1)
        cu = torch.tensor([0, 10], device="meta")
        with pytest.raises(ValueError, match="^q\\[0\\]: variable-length attention needs tensors with data"):
            hkt.hkt_attention_varlen([x[0].transpose(0, 1) for x in q], [x[0].transpose(0, 1) for x in k],
                                     v[0].transpose(0, 1), w, cu, cu)
    with torch.device("meta"):
        m = hkt.MultiheadHKT(16, 4, batch_first=True, levels=3, pack_padding=True)
        x = torch.randn(2, 9, 16)
        out, weights = m(x, x, x, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool), is_causal=True)
        assert out.shape == (2, 9, 16) and weights.shape == (2, 9, 9)
        out.sum().backward()
        assert m.in_proj_weight.grad.shape == (48, 16)
        # query, key and value not one object (cross-attention, or a view): whether
        # they are one input was asked of is_set_to, which has no meta kernel
        kv = torch.randn(2, 5, 16)
        pad = torch.zeros(2, 5, dtype=torch.bool)
        for module in (m, torch.jit.script(hkt.MultiheadHKT(16, 4, batch_first=True, levels=3))):
            assert module(x, kv, kv)[0].shape == (2, 9, 16)
            assert module(x, x.view_as(x), x)[0].shape == (2, 9, 16)
        assert m(kv, kv.view_as(kv), kv, key_padding_mask=pad)[0].shape == (2, 5, 16)
