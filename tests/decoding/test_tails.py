"""hkt.decoding.tails.BlockTails: each level's next block from the latest
inputs of the level below, as causal_downsample makes the whole sequence."""
import pytest
import torch

from hkt.decoding.tails import BlockTails
from hkt.downsample import causal_downsample


def _levels(x, taps):
    out = [x]
    for t in taps:
        out.append(causal_downsample(out[-1], t))
    return out


@pytest.mark.parametrize("K", [1, 2, 3])
def test_blocks_equal_the_downsampled_sequence(K):
    """Rows of different lengths (each begins blocks at its own steps),
    stepped one position at a time after a prompt: every block any row begins
    is, to the last bit, the block causal_downsample makes of the whole
    sequence, and a level where no row begins one reports none."""
    g = torch.Generator().manual_seed(0)
    B, N, C, L = 3, 40, 5, 4
    x = torch.randn(B, N, C, dtype=torch.float64, generator=g)
    taps = torch.randn(L - 1, K, C, dtype=torch.float64, generator=g)
    whole = _levels(x, taps)
    counts = torch.tensor([9, 16, 1])
    prompt = [_levels(x[:, :17], taps)[l] for l in range(L - 1)]
    tails = BlockTails.of_levels(prompt, prompt, counts, K)
    t = counts.tolist()
    for _ in range(N - 17):
        new = tails.push(x[range(B), t], x[range(B), t], t, taps, taps)
        for l, got in enumerate(new, start=1):
            begins = [tb % 2 ** l == 0 for tb in t]
            if not any(begins):
                assert got is None
                continue
            assert got[2] is None if all(begins) else got[2].tolist() == begins
            for b in range(B):
                if begins[b]:
                    assert torch.equal(got[0][b], whole[l][b, t[b] >> l])
                    assert torch.equal(got[1][b], whole[l][b, t[b] >> l])
        t = [tb + 1 for tb in t]


def test_reorder_follows_the_rows():
    x = torch.randn(3, 8, 2, dtype=torch.float64)
    tails = BlockTails.of_levels([x], [x], torch.tensor([8, 8, 8]), 2)
    tails.reorder(torch.tensor([2, 2, 0]))
    assert torch.equal(tails.q[0], x[[2, 2, 0], 6:8])
