import math

import pytest
import torch


def level_len(n, l):
    return -(-n // 2**l)


def sample_inputs(B, H, T, S, D, Dv, L, *, dtype=torch.float64, per_head=True, requires_grad=False,
                  device="cpu", seed=0):
    """Random HKT inputs: q, k lists of L levels, v, w."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_(requires_grad)

    q = [rnd(B, H, level_len(T, l), D) for l in range(L)]
    k = [rnd(B, H, level_len(S, l), D) for l in range(L)]
    v = rnd(B, H, S, Dv)
    w = rnd(H, L) if per_head else rnd(L)
    return q, k, v, w


@pytest.fixture
def inputs():
    return sample_inputs
