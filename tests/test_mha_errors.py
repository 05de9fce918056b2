"""Malformed input: MultiheadHKT raises ValueError / TypeError where
nn.MultiheadAttention (torch 2.13) raises AssertionError (or RuntimeError), with
a message that names the argument.  The module docstring lists these."""
import pytest
import torch
from torch import nn

import hkt

E, H = 8, 2
X = torch.randn(2, 5, E)


def _pair(**kw):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, **kw)
    return mha, hkt.MultiheadHKT.from_mha(mha, levels=2)


# name: (module options, call args, call kwargs, MultiheadHKT's exception, word in its message)
CASES = {
    "query_4d": ({}, (X[None], X[None], X[None]), {}, ValueError, "query"),
    "key_rank_differs": ({}, (X, X[0], X[0]), {}, ValueError, "key, value"),
    "query_features": ({}, (X[..., :4], X, X), {}, ValueError, "query"),
    "key_value_lengths_differ": ({}, (X, X, X[:, :3]), {}, ValueError, "key, value"),
    "kdim_key_value_lengths_differ": (dict(kdim=3, vdim=4), (X, torch.randn(2, 5, 3), torch.randn(2, 4, 4)), {},
                                      ValueError, "key, value"),
    "kdim_key_features": (dict(kdim=3, vdim=4), (X, torch.randn(2, 5, 2), torch.randn(2, 5, 4)), {},
                          ValueError, "key"),
    "padding_mask_rank": ({}, (X, X, X), dict(key_padding_mask=torch.zeros(2, 5, 1, dtype=torch.bool)),
                          ValueError, "key_padding_mask"),
    "padding_mask_dtype": ({}, (X, X, X), dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)),
                           TypeError, "key_padding_mask"),
    "attn_mask_rank": ({}, (X, X, X), dict(attn_mask=torch.zeros(1, 1, 5, 5, dtype=torch.bool)),
                       ValueError, "attn_mask"),
    "attn_mask_dtype": ({}, (X, X, X), dict(attn_mask=torch.zeros(5, 5, dtype=torch.int32)), TypeError, "attn_mask"),
    "attn_mask_2d_shape": ({}, (X, X, X), dict(attn_mask=torch.zeros(5, 4, dtype=torch.bool)), ValueError,
                           "attn_mask"),
    "attn_mask_3d_shape_unbatched": ({}, (X[0], X[0], X[0]), dict(attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
                                     ValueError, "attn_mask"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clear_error_types(case):
    opts, args, kwargs, exc, word = CASES[case]
    mha, mhkt = _pair(**opts)
    with pytest.raises((AssertionError, RuntimeError)):  # what MHA does, for the record
        mha(*args, **kwargs)
    with pytest.raises(exc, match=word) as info:
        mhkt(*args, **kwargs)
    assert not isinstance(info.value, AssertionError)


def test_constructor_errors():
    with pytest.raises(AssertionError):
        nn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="divisible"):
        hkt.MultiheadHKT(10, 3)
    with pytest.raises(ValueError, match="levels"):
        hkt.MultiheadHKT(8, 2, levels=0)


def test_nested_tensor_input():
    mha, mhkt = _pair()
    nt = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)])
    mha.train()  # outside MHA's fast path
    with pytest.raises(AssertionError):
        mha(nt, nt, nt)
    with pytest.raises(ValueError, match="nested"):
        mhkt(nt, nt, nt)
