"""Bad input raises TypeError/ValueError naming the argument; the interpreter survives."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import hkt
from hkt import _C

from conftest import sample_inputs


def base(dtype=torch.float64):
    return sample_inputs(2, 3, 10, 7, 4, 5, 3, dtype=dtype)


def swap(seq, i, x):
    seq = list(seq)
    seq[i] = x
    return seq


def bad_cases():
    q, k, v, w = base()
    f32 = base(torch.float32)
    yield "q-not-seq", TypeError, "q", dict(q=q[0])
    yield "q-empty", ValueError, "q", dict(q=[])
    yield "q-item-not-tensor", TypeError, "q[1]", dict(q=swap(q, 1, "x"))
    yield "q-rank", ValueError, "q[0]", dict(q=swap(q, 0, q[0][0]))
    yield "q-level-length", ValueError, "q[1]", dict(q=swap(q, 1, torch.randn(2, 3, 4, 4, dtype=torch.float64)))
    yield "q-level-head-dim", ValueError, "q[2]", dict(q=swap(q, 2, torch.randn(2, 3, 3, 6, dtype=torch.float64)))
    yield "k-level-length", ValueError, "k[2]", dict(k=swap(k, 2, torch.randn(2, 3, 3, 4, dtype=torch.float64)))
    yield "k-head-dim", ValueError, "k[0]", dict(k=swap(k, 0, torch.randn(2, 3, 7, 3, dtype=torch.float64)))
    yield "k-batch", ValueError, "k[0]", dict(k=swap(k, 0, torch.randn(1, 3, 7, 4, dtype=torch.float64)))
    yield "k-levels", ValueError, "k", dict(k=k[:2])
    yield "v-length", ValueError, "v", dict(v=torch.randn(2, 3, 8, 5, dtype=torch.float64))
    yield "v-rank", ValueError, "v", dict(v=torch.randn(3, 7, 5, dtype=torch.float64))
    yield "v-type", TypeError, "v", dict(v=np.zeros((2, 3, 7, 5)))
    yield "w-length", ValueError, "w", dict(w=torch.randn(4, dtype=torch.float64))
    yield "w-heads", ValueError, "w", dict(w=torch.randn(2, 3, dtype=torch.float64))
    yield "mixed-dtype", TypeError, "k[1]", dict(k=swap(k, 1, f32[1][1]))
    yield "mixed-dtype-w", TypeError, "w", dict(w=f32[3])
    yield "half", TypeError, "q[0]", dict(q=[x.half() for x in q], k=[x.half() for x in k], v=v.half(), w=w.half())
    yield "int", TypeError, "q[0]", dict(q=[x.long() for x in q])
    yield "device", ValueError, "v", dict(v=torch.empty(2, 3, 7, 5, dtype=torch.float64, device="meta"))
    yield "nan-scale", ValueError, "scale", dict(scale=float("nan"))
    yield "inf-scale", ValueError, "scale", dict(scale=float("inf"))
    yield "str-scale", TypeError, "scale", dict(scale="0.5")
    yield "mask-shape", ValueError, "attn_mask", dict(attn_mask=torch.ones(10, 8, dtype=torch.bool))
    yield "mask-dtype", TypeError, "attn_mask", dict(attn_mask=torch.ones(10, 7, dtype=torch.int32))
    yield "mask-type", TypeError, "attn_mask", dict(attn_mask=[[True]])
    yield "dropout", ValueError, "dropout_p", dict(dropout_p=1.5)
    yield "dropout-neg", ValueError, "dropout_p", dict(dropout_p=-0.1)
    yield "causal-type", TypeError, "is_causal", dict(is_causal="yes")
    yield "head-dim-zero", ValueError, "q[0]", dict(q=[torch.randn(2, 3, -(-10 // 2**l), 0, dtype=torch.float64)
                                                     for l in range(3)],
                                                  k=[torch.randn(2, 3, -(-7 // 2**l), 0, dtype=torch.float64)
                                                     for l in range(3)])
    yield "too-many-levels", ValueError, "q", dict(
        q=[torch.randn(1, 1, 1, 2, dtype=torch.float64)] * 30, k=[torch.randn(1, 1, 1, 2, dtype=torch.float64)] * 30,
        v=torch.randn(1, 1, 1, 2, dtype=torch.float64), w=torch.randn(30, dtype=torch.float64))


CASES = list(bad_cases())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_argument(case):
    _, exc, name, override = case
    q, k, v, w = base()
    args = dict(q=q, k=k, v=v, w=w)
    kwargs = {}
    for key, val in override.items():
        (args if key in args else kwargs)[key] = val
    with pytest.raises(exc) as info:
        hkt.hkt_attention(args["q"], args["k"], args["v"], args["w"], **kwargs)
    assert str(info.value).startswith(name + ":"), str(info.value)


def test_extension_checks_outputs_and_arrays():
    q, k, v, w = [[x.numpy() for x in xs] for xs in base()[:2]] + [x.numpy() for x in base()[2:]]
    B, H, T, Dv = 2, 3, 10, 5
    good_out, good_lse = np.empty((B, H, T, Dv)), np.empty((B, H, T))
    with pytest.raises(ValueError, match="^out:"):
        _C.forward(q, k, v, w, np.empty((B, H, T, Dv + 1)), good_lse)
    with pytest.raises(ValueError, match="^out: output arrays must be C-contiguous"):
        _C.forward(q, k, v, w, np.empty((H, B, T, Dv)).transpose(1, 0, 2, 3), good_lse)
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
        import test_errors as t, hkt
        n = 0
        for name, exc, argname, override in t.CASES:
            q, k, v, w = t.base()
            args = dict(q=q, k=k, v=v, w=w); kw = {}
            for key, val in override.items():
                (args if key in args else kw)[key] = val
            try:
                hkt.hkt_attention(args["q"], args["k"], args["v"], args["w"], **kw)
            except (TypeError, ValueError):
                n += 1
        print("survived", n)
    """ % (str(__import__("pathlib").Path(__file__).parent),))
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
