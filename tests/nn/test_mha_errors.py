"""Malformed input: MultiheadHKT raises errors that name the argument.  For a
malformed shape, where nn.MultiheadAttention (torch 2.13) raises AssertionError
(or RuntimeError), it raises ShapeError, which is a ValueError and an
AssertionError, so callers written for either catch it; dtypes are TypeError.
The module docstring lists these."""
import subprocess
import sys

import pytest
import torch
from torch import nn

import hkt
from hkt.functional import ShapeError

E, H = 8, 2
X = torch.randn(2, 5, E)


def _pair(**kw):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, **kw)
    return mha, hkt.MultiheadHKT.from_mha(mha, levels=2)


# name: (module options, call args, call kwargs, MultiheadHKT's exception, word in its message)
CASES = {
    "query_4d": ({}, (X[None], X[None], X[None]), {}, ShapeError, "query"),
    "key_rank_differs": ({}, (X, X[0], X[0]), {}, ShapeError, "key, value"),
    "query_features": ({}, (X[..., :4], X, X), {}, ShapeError, "query"),
    "key_value_lengths_differ": ({}, (X, X, X[:, :3]), {}, ShapeError, "key, value"),
    "kdim_key_value_lengths_differ": (dict(kdim=3, vdim=4), (X, torch.randn(2, 5, 3), torch.randn(2, 4, 4)), {},
                                      ShapeError, "key, value"),
    "kdim_key_features": (dict(kdim=3, vdim=4), (X, torch.randn(2, 5, 2), torch.randn(2, 5, 4)), {},
                          ShapeError, "key"),
    "padding_mask_rank": ({}, (X, X, X), dict(key_padding_mask=torch.zeros(2, 5, 1, dtype=torch.bool)),
                          ShapeError, "key_padding_mask"),
    "padding_mask_dtype": ({}, (X, X, X), dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)),
                           TypeError, "key_padding_mask"),
    "attn_mask_rank": ({}, (X, X, X), dict(attn_mask=torch.zeros(1, 1, 5, 5, dtype=torch.bool)),
                       ShapeError, "attn_mask"),
    "attn_mask_dtype": ({}, (X, X, X), dict(attn_mask=torch.zeros(5, 5, dtype=torch.int32)), TypeError, "attn_mask"),
    "attn_mask_2d_shape": ({}, (X, X, X), dict(attn_mask=torch.zeros(5, 4, dtype=torch.bool)), ShapeError,
                           "attn_mask"),
    "attn_mask_3d_shape_unbatched": ({}, (X[0], X[0], X[0]), dict(attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
                                     ShapeError, "attn_mask"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clear_error_types(case):
    opts, args, kwargs, exc, word = CASES[case]
    mha, mhkt = _pair(**opts)
    with pytest.raises((AssertionError, RuntimeError)):  # what MHA does, for the record
        mha(*args, **kwargs)
    with pytest.raises(exc, match=word) as info:
        mhkt(*args, **kwargs)
    if exc is ShapeError:
        # both kinds of caller: one written for nn.MultiheadAttention, one for hkt's ValueError
        with pytest.raises(AssertionError, match=word):
            mhkt(*args, **kwargs)
        with pytest.raises(ValueError, match=word):
            mhkt(*args, **kwargs)
    else:
        assert not isinstance(info.value, (AssertionError, ValueError))


def test_constructor_errors():
    with pytest.raises(AssertionError):
        nn.MultiheadAttention(10, 3)
    for kind in (AssertionError, ValueError):  # MHA asserts here; ShapeError is both
        with pytest.raises(kind, match="divisible"):
            hkt.MultiheadHKT(10, 3)
    with pytest.raises(ValueError, match="levels"):
        hkt.MultiheadHKT(8, 2, levels=0)


def test_nested_tensor_input():
    mha, mhkt = _pair()
    nt = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])
    mha.train()  # outside MHA's fast path
    with pytest.raises(AssertionError):
        mha(nt, nt, nt)
    with pytest.raises(ShapeError, match="nested"):
        mhkt(nt, nt, nt)


def test_shape_error_is_one_class_of_both_kinds():
    assert issubclass(ShapeError, ValueError) and issubclass(ShapeError, AssertionError)
    # the divisibility check and a forward's shape check raise the same class
    with pytest.raises(ShapeError) as ctor:
        hkt.MultiheadHKT(10, 3)
    _, mhkt = _pair()
    with pytest.raises(ShapeError) as call:
        mhkt(X[..., :4], X, X)
    assert type(ctor.value) is type(call.value) is ShapeError


SCRIPT_UNDER_O = """
import torch, hkt
assert not __debug__, "not running under -O"
m = hkt.MultiheadHKT(8, 2, batch_first=True, levels=2)
x = torch.randn(2, 5, 8)
for bad in (x[None], x[..., :4]):
    try:
        m(bad, bad, bad)
    except AssertionError as e:
        assert "query" in str(e), e
    else:
        raise SystemExit("no error for a malformed query under -O")
print("ok")
"""


def test_shape_checks_survive_python_O():
    """An AssertionError that is raised, not asserted: python -O keeps it."""
    res = subprocess.run([sys.executable, "-O", "-c", SCRIPT_UNDER_O], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
