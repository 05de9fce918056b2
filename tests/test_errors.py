"""Bad input raises TypeError/ValueError naming the argument; the interpreter survives."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import hkt
from hkt import _C

from helpers import BAD_CASES as CASES, bad_input_base as base, swap




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
