"""Decoding with windows (docs/contract.md section 1.11): the C kernel that
reads a row's units from the cache (hkt._C.window_decode) against the torch
one (hkt.decoding.windowed.attend_windowed), the cache's vectorised append
against its definition, and the kernel's argument checks."""
import pytest
import torch

import hkt
from hkt import _C
from hkt.ops.window import block_sums
from hkt.decoding.windowed import append_windowed, attend_windowed, attend_windowed_rows

from helpers import with_threads


def cache_of(B, Hk, cap, D, Dv, L, length, seed=0, dtype=torch.float64):
    """A cache holding `length` positions: random keys per level (one per block
    begun), values and their block sums, as a decode would have written them."""
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(B, Hk, -(-cap >> l), D, generator=g, dtype=dtype) for l in range(L)]
    v = torch.zeros(B, Hk, cap, Dv, dtype=dtype)
    v[:, :, :length] = torch.randn(B, Hk, length, Dv, generator=g, dtype=dtype)
    sums = [v] + [torch.zeros(B, Hk, -(-cap >> l), Dv, dtype=dtype) for l in range(1, L)]
    full = block_sums(v[:, :, :length], L)
    for l in range(1, L):
        done = length >> l  # the complete blocks
        sums[l][:, :, :done] = full[l][:, :, :done]
    return k, sums


def queries(B, H, n, D, L, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(L)]


CASES = [
    # L, windows, H, Hk, t0, n
    (3, [4, 8, None], 2, 2, 0, 37),           # from the start, a global top level
    (3, [4, 8, 16], 4, 1, 21, 9),             # every level windowed (keys no level sees), multi-query
    (4, [2, 8, 16, None], 4, 2, 5, 40),       # unaligned start, grouped heads
    (1, [6], 2, 2, 30, 3),                    # sliding-window attention
    (6, [2, 4, 8, 16, 32, None], 2, 1, 200, 61),
]


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("L,windows,H,Hk,t0,n", CASES)
def test_the_kernel_is_the_torch_rows(L, windows, H, Hk, t0, n, per_head):
    B, D, Dv = 2, 5, 3
    k, sums = cache_of(B, Hk, t0 + n + 4, D, Dv, L, t0 + n, seed=t0)
    q = queries(B, H, n, D, L, seed=n)
    w = torch.randn(H, L, dtype=torch.float64) if per_head else torch.randn(L, dtype=torch.float64)
    got = attend_windowed_rows(q, k, sums, w, t0, windows)
    want = torch.cat([attend_windowed([x[:, :, i:i + 1] for x in q], k, sums, w, t0 + i, windows)
                      for i in range(n)], dim=2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def ring_of(x, rows, length, l):
    """x (every level-l block) as a ring of `rows` rows holding its newest
    blocks: block c in row c % rows."""
    ring = torch.full((*x.shape[:2], rows, x.shape[3]), float("nan"), dtype=x.dtype)
    last = -(-length >> l)
    for c in range(max(0, last - rows), last):
        ring[:, :, c % rows] = x[:, :, c]
    return ring


@pytest.mark.parametrize("L,windows,H,Hk,t0,n", CASES[:3] + CASES[4:])
def test_rings_read_as_every_block(L, windows, H, Hk, t0, n):
    """The cache a windowed module keeps (hkt.decoding.windowed.cache_rows): rings
    for the windowed levels, holding only the newest blocks (the rest NaN,
    which must not be read), give the rows of a cache that holds every block."""
    B, D, Dv, cap = 2, 5, 3, 600
    k, sums = cache_of(B, Hk, cap, D, Dv, L, t0 + n, seed=t0)
    rows, chunk = hkt.decoding.windowed.cache_rows(windows, cap)
    assert any(r < -(-cap >> l) for l, r in enumerate(rows))  # some level is a ring
    n = min(n, chunk)
    rk = [ring_of(x, r, t0 + n, l) for l, (x, r) in enumerate(zip(k, rows))]
    rs = [ring_of(x, r, t0 + n, l) for l, (x, r) in enumerate(zip(sums, rows))]
    q = queries(B, H, n, D, L, seed=n)
    w = torch.randn(H, L, dtype=torch.float64)
    want = attend_windowed_rows(q, k, sums, w, t0, windows)
    torch.testing.assert_close(attend_windowed_rows(q, rk, rs, w, t0, windows), want, rtol=1e-12, atol=1e-12)
    torch_rows = torch.cat([attend_windowed([x[:, :, i:i + 1] for x in q], rk, rs, w, t0 + i, windows)
                            for i in range(n)], dim=2)
    torch.testing.assert_close(torch_rows, want, rtol=1e-12, atol=1e-12)


def test_the_cache_grows_with_the_global_level_only():
    """A million-token cache of a module whose windows end at a global top
    level: rings for the windowed levels, every block only at the top."""
    m = hkt.MultiheadHKT(16, 2, levels=4, batch_first=True, windows=[64, 128, 256, None])
    cache = m.init_cache(1, 2**20)
    rows, _ = hkt.decoding.windowed.cache_rows([64, 128, 256, None], 2**20)
    assert [x.shape[2] for x in cache.k] == rows and cache.v.shape[2] == rows[0]
    assert [x.shape[2] for x in cache.v_sums] == rows[1:]
    assert rows[3] == 2**17 and max(rows[:3]) < 512  # the top keeps every block; the rest a few hundred rows
    full = sum(-(-2**20 >> l) for l in range(4)) * 2 + 2**20  # keys, sums and values of every block
    assert sum(rows) * 2 < full / 6


def test_float32_and_bitwise_on_one_and_two_threads():
    k, sums = cache_of(2, 2, 300, 16, 8, 5, 290, dtype=torch.float32)
    q = queries(2, 4, 33, 16, 5, dtype=torch.float32)
    w, win = torch.rand(4, 5), [4, 8, 16, 32, None]
    one = with_threads(1, lambda: attend_windowed_rows(q, k, sums, w, 257, win))
    two = with_threads(2, lambda: attend_windowed_rows(q, k, sums, w, 257, win))
    assert torch.equal(one, two)
    want = torch.cat([attend_windowed([x[:, :, i:i + 1].double() for x in q], [x.double() for x in k],
                                      [x.double() for x in sums], w.double(), 257 + i, win) for i in range(33)], dim=2)
    torch.testing.assert_close(one, want.float(), rtol=1e-5, atol=1e-5)


def test_other_dtypes_take_the_torch_rows():
    k, sums = cache_of(1, 1, 40, 4, 4, 2, 40, dtype=torch.bfloat16)
    q = queries(1, 1, 3, 4, 2, dtype=torch.bfloat16)
    w = torch.rand(2, dtype=torch.bfloat16)
    got = attend_windowed_rows(q, k, sums, w, 37, [4, None])
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, 3, 4)
    for i in range(3):
        assert torch.equal(got[:, :, i:i + 1], attend_windowed([x[:, :, i:i + 1] for x in q], k, sums, w, 37 + i,
                                                               [4, None]))


def test_append_writes_what_one_position_at_a_time_would():
    """The vectorised append: keys of each block begun, values, and the sums of
    the blocks completed, the same bits as the definition's pairwise sums."""
    L, B, Hk, D, Dv = 4, 2, 2, 3, 5
    g = torch.Generator().manual_seed(9)
    x_v = torch.randn(B, Hk, 50, Dv, generator=g, dtype=torch.float64)
    x_k = [torch.randn(B, Hk, -(-50 >> l), D, generator=g, dtype=torch.float64) for l in range(L)]
    k = [torch.zeros(B, Hk, -(-52 >> l), D, dtype=torch.float64) for l in range(L)]
    sums = [torch.zeros(B, Hk, 52, Dv, dtype=torch.float64)] + \
        [torch.zeros(B, Hk, -(-52 >> l), Dv, dtype=torch.float64) for l in range(1, L)]
    t = 0
    for n in (3, 1, 10, 7, 29):  # chunks that start and end inside blocks
        rows = [torch.stack([x_k[l][:, :, (t + i) >> l] for i in range(n)], dim=2) for l in range(L)]
        append_windowed(k, sums, rows, x_v[:, :, t:t + n], t)
        t += n
    want = block_sums(x_v, L)
    for l in range(L):
        done = 50 >> l
        assert torch.equal(sums[l][:, :, :done], want[l][:, :, :done]), l
        assert torch.equal(k[l][:, :, :-(-50 >> l)], x_k[l]), l


@pytest.mark.parametrize("windows,max_len,rounds", [([8, 16, None], 32, [25, 1, 4]),
                                                    ([4, 8, None], 400, [4] * 6 + [1, 1, 4])])
def test_a_prompt_is_one_kernel_call_a_round(monkeypatch, windows, max_len, rounds):
    """A cache short enough to keep every block takes a decode call's positions
    in one kernel call; with rings, in rounds of W_0 positions (what a ring
    holds beyond what the rows read)."""
    calls = []
    real = _C.window_decode

    def spy(*args, **kw):
        calls.append(args[4].shape[2])  # out (B, H, n, Dv): the rows of one call
        return real(*args, **kw)
    monkeypatch.setattr(_C, "window_decode", spy)
    m = hkt.MultiheadHKT(16, 2, levels=3, batch_first=True, windows=windows).double().eval()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = m.init_cache(1, max_len)
        got = torch.cat([m.decode(x[:, :25], cache), m.decode(x[:, 25:26], cache), m.decode(x[:, 26:], cache)], 1)
        want = m(x, x, x, is_causal=True, need_weights=False)[0]
    assert calls == rounds
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_kernel_names_its_arguments():
    k, sums = cache_of(1, 1, 16, 4, 4, 2, 16)
    q = queries(1, 1, 2, 4, 2)
    w, out = torch.rand(1, 2, dtype=torch.float64), torch.empty(1, 1, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"t0: must be in \[0, 2\^48\], got -1"):
        _C.window_decode(q, k, sums, w, out, -1, (2, 0))
    with pytest.raises(ValueError, match=r"k\[1\]: expected \(B, H_kv, rows, D\) with at least one row"):
        _C.window_decode(q, [k[0], k[1][:, :, :0]], sums, w, out, 3, (2, 0))
    with pytest.raises(ValueError, match=r"t0: must be in \[0, 2\^48\]"):
        _C.window_decode(q, k, sums, w, out, 2**62, (2, 0))
    with pytest.raises(ValueError, match=r"k\[1\]: a level without a window keeps every block: expected at "
                                         r"least 9 rows for positions through 17, got 8"):
        _C.window_decode(q, k, sums, w, out, 16, (2, 0))
    with pytest.raises(ValueError, match=r"radius\[1\]: 1 does not make the windows grow"):
        _C.window_decode(q, k, sums, w, out, 3, (2, 1))
    with pytest.raises(ValueError, match=r"vs\[1\]"):
        _C.window_decode(q, k, [sums[0], sums[1][:, :, :3]], w, out, 3, (2, 0))
    with pytest.raises(TypeError, match=r"q\[0\]: the windowed kernels take 4-D float32 or float64 CPU arrays"):
        _C.window_decode([x.bfloat16() for x in q], k, sums, w, out, 3, (2, 0))
    with pytest.raises(ValueError, match="out"):
        _C.window_decode(q, k, sums, w, out[:, :, :1], 3, (2, 0))


def test_a_call_that_fails_after_overwriting_rings_leaves_the_cache_refused(monkeypatch):
    """A call in several rounds writes each round's tokens into the rings over
    rows the first round read: if a later round fails, a retry would read them,
    so the cache refuses further calls (a call in one round may be retried)."""
    m = hkt.MultiheadHKT(16, 2, levels=3, batch_first=True, windows=[4, 8, None]).double().eval()
    x = torch.randn(1, 60, 16, dtype=torch.float64)
    real = _C.window_decode
    with torch.no_grad():
        want = m(x, x, x, is_causal=True, need_weights=False)[0]
        cache = m.init_cache(1, 400)  # rings: calls of more than 4 tokens take several rounds
        m.decode(x[:, :30], cache)
        calls = [0]

        def fail_later(*args, **kw):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return real(*args, **kw)
        monkeypatch.setattr(_C, "window_decode", fail_later)
        with pytest.raises(KeyboardInterrupt):
            m.decode(x[:, 30:50], cache)
        monkeypatch.setattr(_C, "window_decode", real)
        with pytest.raises(RuntimeError, match="cache: a decode call failed after writing some of its tokens"):
            m.decode(x[:, 30:50], cache)
        cache = m.init_cache(1, 400)
        m.decode(x[:, :30], cache)
        calls[0] = 2  # one round of one token fails, before any later round: a retry is exact
        monkeypatch.setattr(_C, "window_decode", fail_later)
        with pytest.raises(KeyboardInterrupt):
            m.decode(x[:, 30:31], cache)
        monkeypatch.setattr(_C, "window_decode", real)
        got = torch.cat([m.decode(x[:, 30:31], cache), m.decode(x[:, 31:], cache)], dim=1)
    torch.testing.assert_close(got, want[:, 30:], rtol=1e-10, atol=1e-10)
