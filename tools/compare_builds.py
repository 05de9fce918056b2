"""Another build of hkt._C against this one: the same bits, and the same speed?

For refactors of the kernels (issue 12: "behaviour and speed are unchanged"):
loads a second extension file (e.g. built from an older commit with
`git worktree add /tmp/old REV && cd /tmp/old && python setup.py build_ext --inplace`),
runs both on the same inputs through the raw binding (forward and backward,
with contiguous arrays and with the strided rows a module's heads have;
bfloat16; decoding against a KV cache; packed variable-length sequences;
the causal downsampling; and the windowed kernels through hkt_attention and
windowed decoding, the Python layer calling each build in turn: per-block and
per-key, masks, dropout, grouped heads, soft caps where both builds have
them), checks every output is bitwise identical, then times
them interleaved (the two see the same machine state) and prints the new/old
time ratios.

    python tools/compare_builds.py /tmp/old/hkt/_C.abi3.so [--quick | --bits-only | --pairs N]

--pairs N times only the two calls a restructuring is held to (the L=3
forward+backward at T=2048, and a small call), N interleaved rounds each, and
prints each round's ratio, the median and the spread.

Only calls both builds support (no grouped-query heads, which older builds lack).
bfloat16 inputs (native kernels, where both builds and the CPU have them) take
float32 outputs and gradients, which every build with them writes.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # research/: in the source tree only

import hkt
import hkt._C as new
import hkt._core.kernels as kernels
from hkt.ops.window import block_sums
from hkt.decoding.windowed import attend_windowed_rows
from research.timing import describe_machine, machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from helpers import sample_inputs  # noqa: E402


def load(path):
    spec = importlib.util.spec_from_file_location("hkt._C", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def heads_layout(x):
    """x (B, H, n, D) as a module's heads are: rows of a wider (B, n, 2, H, D)
    array (row stride 2 * H * D), the same values."""
    B, H, n, D = x.shape
    wide = torch.zeros(B, n, 2, H, D, dtype=x.dtype)
    wide[:, :, 0] = x.transpose(1, 2)
    return wide[:, :, 0].transpose(1, 2)


def run(mod, q, k, v, w, causal, dropout_p, threads, backward=True, strided=False):
    """Forward (and backward) through the raw binding; strided: every array
    with rows (inputs, out, dO and the gradients) in heads_layout."""
    B, H, T, _ = q[0].shape
    lay = heads_layout if strided else (lambda x: x)
    q, k, v = [lay(x) for x in q], [lay(x) for x in k], lay(v)
    real = torch.float32 if q[0].dtype == torch.bfloat16 else q[0].dtype  # bfloat16 computes in float32
    out = lay(torch.empty(B, H, T, v.shape[3], dtype=real))
    lse = torch.empty(B, H, T, dtype=real)
    mod.forward(q, k, v, w, out, lse, None, causal, None, dropout_p, 7, threads)
    if not backward:
        return [out, lse]
    dq, dk = [lay(torch.empty(x.shape, dtype=real)) for x in q], [lay(torch.empty(x.shape, dtype=real)) for x in k]
    dv, dw = lay(torch.empty(v.shape, dtype=real)), torch.empty_like(w)
    dout = lay(torch.ones(out.shape, dtype=q[0].dtype))
    mod.backward(dout, q, k, v, w, lay(out.to(q[0].dtype)), lse, dq, dk, dv, dw, None, causal, None, dropout_p, 7,
                 threads)
    return [out, lse, *dq, *dk, dv, dw]


def run_decode(mod, q, kc, vc, w, lens, new_k, new_v, threads):
    """One decoding step through the raw binding on copies of the caches (the
    step writes new_k, new_v into them): out and both caches after it."""
    kc, vc = [x.clone() for x in kc], vc.clone()
    B, H, Tn, _ = q[0].shape
    out = torch.empty(B, H, Tn, vc.shape[3], dtype=q[0].dtype)
    mod.decode(q, kc, vc, w, lens, out, new_k, new_v, None, threads)
    return [out, *kc, vc]


def decode_calls(dtype):
    """(q, k_cache, v_cache, w, cache_seqlens, k, v) of a few decoding steps:
    one new row and several, equal and ragged cache lengths, grouped heads."""
    calls = []
    for B, H, H_kv, Tn, S_max, D, L, lens in [(2, 4, 4, 1, 300, 32, 3, 200), (3, 4, 2, 5, 130, 16, 2, [0, 57, 125]),
                                              (1, 2, 1, 3, 1000, 64, 4, [700])]:
        g = torch.Generator().manual_seed(B * 7 + Tn)
        q = [torch.randn(B, H, Tn, D, generator=g, dtype=dtype) for _ in range(L)]
        kc = [torch.randn(B, H_kv, (S_max - 1 >> l) + 1, D, generator=g, dtype=dtype) for l in range(L)]
        vc = torch.randn(B, H_kv, S_max, D, generator=g, dtype=dtype)
        nk = [torch.randn(B, H_kv, Tn, D, generator=g, dtype=dtype) for _ in range(L)]
        nv = torch.randn(B, H_kv, Tn, D, generator=g, dtype=dtype)
        w = torch.randn(H, L, generator=g, dtype=dtype)
        seq = lens if isinstance(lens, int) else torch.tensor(lens, dtype=torch.int64)
        calls += [(q, kc, vc, w, seq, None, None), (q, kc, vc, w, seq, nk, nv)]
    return calls


def run_varlen(mod, lens, H, D, L, causal, dtype, threads):
    """Packed forward and backward over sequences of the given lengths."""
    g = torch.Generator().manual_seed(sum(lens) + L)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    rows = [sum((n - 1 >> l) + 1 for n in lens) for l in range(L)]
    q = [torch.randn(r, H, D, generator=g).to(dtype) for r in rows]
    k = [torch.randn(r, H, D, generator=g).to(dtype) for r in rows]
    v = torch.randn(rows[0], H, D, generator=g).to(dtype)
    real = torch.float32 if dtype == torch.bfloat16 else dtype
    w = torch.randn(H, L, generator=g).to(real)
    out, lse = torch.empty(rows[0], H, D, dtype=real), torch.empty(H * rows[0], dtype=real)
    mod.varlen_forward(q, k, v, w, out, lse, cu, cu, None, None, causal, None, threads)
    dq, dk = [torch.empty(x.shape, dtype=real) for x in q], [torch.empty(x.shape, dtype=real) for x in k]
    dv, dw = torch.empty(v.shape, dtype=real), torch.empty_like(w)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    mod.varlen_backward(dout, q, k, v, w, out.to(dtype), lse, dq, dk, dv, dw, cu, cu, None, None, causal, None,
                        threads)
    return [out, lse, *dq, *dk, dv, dw]


def run_downsample(mod, x, taps, threads):
    out = torch.empty(x.shape[0], (x.shape[1] + 1) // 2, x.shape[2], dtype=x.dtype)
    mod.downsample_forward(x, taps, out, threads)
    dx, dtaps = torch.empty_like(x), torch.empty_like(taps)
    dout = torch.ones_like(out)
    mod.downsample_backward(dout, x, taps, dx, dtaps, threads)
    return [out, dx, dtaps]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", help="path of the other build's _C*.so")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bits-only", action="store_true", help="compare the bits, time nothing")
    ap.add_argument("--pairs", type=int, default=0, metavar="N", help="time only the two held calls, N rounds")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    old = load(args.old)
    print(describe_machine(machine_info()))
    same = True
    for dtype in (torch.float32, torch.float64):
        for B, H, T, S, D, L in [(1, 2, 300, 300, 64, 3), (2, 3, 130, 70, 13, 2), (1, 1, 1000, 1000, 32, 4)]:
            for causal in (False, True):
                for dp in (0.0, 0.2):
                    for strided in (False, True):
                        q, k, v, w = sample_inputs(B, H, T, S, D, D, L, dtype=dtype)
                        a = run(old, q, k, v, w, causal, dp, 2, strided=strided)
                        b = run(new, q, k, v, w, causal, dp, 2, strided=strided)
                        same &= all(torch.equal(x, y) for x, y in zip(a, b))
    calls = 48
    if new.cpu_has_bf16() and old.cpu_has_bf16():
        # native bfloat16: both backward schedules (B * H >= threads, and one head)
        for B, H, T, D, L in [(1, 4, 300, 64, 3), (1, 1, 257, 32, 2)]:
            for causal in (False, True):
                for dp in (0.0, 0.2):
                    for strided in (False, True):
                        q, k, v, w = sample_inputs(B, H, T, T, D, D, L, dtype=torch.float32)
                        q, k, v = [x.to(torch.bfloat16) for x in q], [x.to(torch.bfloat16) for x in k], \
                            v.to(torch.bfloat16)
                        a = run(old, q, k, v, w, causal, dp, 2, strided=strided)
                        b = run(new, q, k, v, w, causal, dp, 2, strided=strided)
                        same &= all(torch.equal(x, y) for x, y in zip(a, b))
                        calls += 1
    calls, same = other_calls(old, new, calls, same)
    calls, same = windowed_calls(old, new, calls, same)
    print(f"bitwise identical outputs and gradients on {calls} calls (contiguous and strided rows, bfloat16, "
          f"decoding, varlen, downsampling, windows): {same}")
    if args.pairs:
        pairs(old, new, args.pairs, args.threads)
    elif not args.bits_only:
        timings(old, new, 3 if args.quick else 9, args.quick, args.threads)
    if not same:
        raise SystemExit("the builds differ")


def other_calls(old, new, calls, same):
    """Decoding, varlen and downsampling: (calls, same) updated."""
    for dtype in (torch.float32, torch.float64):
        for q, kc, vc, w, lens, nk, nv in decode_calls(dtype):
            for threads in (1, 2):
                a = run_decode(old, q, kc, vc, w, lens, nk, nv, threads)
                b = run_decode(new, q, kc, vc, w, lens, nk, nv, threads)
                same &= all(torch.equal(x, y) for x, y in zip(a, b))
                calls += 1
    dtypes = [torch.float32, torch.float64] + ([torch.bfloat16] if new.cpu_has_bf16() and old.cpu_has_bf16() else [])
    for dtype in dtypes:
        for lens, H, D, L in [([37, 1, 200, 64], 2, 16, 3), ([300], 3, 32, 2), ([5, 129, 130], 1, 64, 4)]:
            for causal in (False, True):
                a = run_varlen(old, lens, H, D, L, causal, dtype, 2)
                b = run_varlen(new, lens, H, D, L, causal, dtype, 2)
                same &= all(torch.equal(x, y) for x, y in zip(a, b))
                calls += 1
    for dtype in (torch.float32, torch.float64):
        for B, n, C, K in [(2, 37, 24, 3), (1, 1000, 64, 4)]:
            g = torch.Generator().manual_seed(n)
            x, taps = torch.randn(B, n, C, generator=g, dtype=dtype), torch.randn(K, C, generator=g, dtype=dtype)
            a, b = run_downsample(old, x, taps, 2), run_downsample(new, x, taps, 2)
            same &= all(torch.equal(x, y) for x, y in zip(a, b))
            calls += 1
    return calls, same


class NoCapBuild:
    """A build from before soft caps (0.2.0): its window kernels take no
    softcap argument and it has no window_softcap; calls without a cap pass.
    Nor has it check_forward, the argument checks the Python layer asks for:
    this build's, which compute nothing."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        if name == "check_forward" and not hasattr(self.mod, name):
            return new.check_forward
        return getattr(self.mod, name)

    def _uncapped(self, args, kw, pos):
        args, cap = list(args), kw.pop("softcap", None)
        if len(args) > pos:
            cap = args.pop(pos)
        assert cap is None or cap == 0, "a build without soft caps"
        return args, kw

    def window(self, *args, **kw):
        args, kw = self._uncapped(args, kw, 20)
        return self.mod.window(*args, **kw)

    def window_decode(self, *args, **kw):
        args, kw = self._uncapped(args, kw, 9)
        return self.mod.window_decode(*args, **kw)

    def window_softcap(self, cap):
        assert cap is None or cap == 0, "a build without soft caps"
        return 0.0


class NoBandBuild:
    """A build from before the sliding-window band: its check_forward takes no
    sliding_window; calls without a band pass."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def check_forward(self, *args, **kw):
        args, band = list(args), kw.pop("sliding_window", None)
        if len(args) > 11:
            band = args.pop(11)
        assert band is None, "a build without the band"
        return self.mod.check_forward(*args, **kw)


def through(mod, fn):
    """fn() with the Python layer calling mod (hkt._core.kernels' extension)."""
    kernels._C = mod
    try:
        torch.manual_seed(123)  # the dropout seed the layer draws
        return fn()
    finally:
        kernels._C = new


def window_call(B, H, Hk, T, D, Dv, L, windows, causal, dtype, mask=None, dropout=0.0, cap=None):
    """hkt_attention with windows, forward and every gradient (a float mask's too)."""
    def fn():
        q, k, v, w = sample_inputs(B, H, T, T, D, Dv, L, dtype=dtype, seed=T, kv_heads=Hk, per_head=True)
        q, k = [x.detach().requires_grad_() for x in q], [x.detach().requires_grad_() for x in k]
        v, w = v.detach().requires_grad_(), w.detach().requires_grad_()
        m = mask
        if m is not None and m.dtype.is_floating_point:
            m = m.to(dtype).clone().requires_grad_()
        out = hkt.hkt_attention(q, k, v, w, windows=windows, is_causal=causal, attn_mask=m, dropout_p=dropout,
                                softcap=cap)
        dout = torch.randn(out.shape, dtype=dtype, generator=torch.Generator().manual_seed(5))
        leaves = [*q, *k, v, w] + ([m] if m is not None and m.requires_grad else [])
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)]
    return fn


def window_decode_call(B, H, Hk, D, L, windows, t0, n, dtype, cap=None):
    """Windowed decoding of rows t0 .. t0 + n - 1 against a cache of keys and block sums."""
    def fn():
        g = torch.Generator().manual_seed(t0 + n)
        size = t0 + n + 4
        k = [torch.randn(B, Hk, -(-size >> l), D, generator=g, dtype=dtype) for l in range(L)]
        v = torch.zeros(B, Hk, size, D, dtype=dtype)
        v[:, :, :t0 + n] = torch.randn(B, Hk, t0 + n, D, generator=g, dtype=dtype)
        full = block_sums(v[:, :, :t0 + n], L)
        sums = [v] + [torch.zeros(B, Hk, -(-size >> l), D, dtype=dtype) for l in range(1, L)]
        for l in range(1, L):
            sums[l][:, :, :(t0 + n) >> l] = full[l][:, :, :(t0 + n) >> l]
        q = [torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(L)]
        w = torch.randn(H, L, generator=g, dtype=dtype)
        return [attend_windowed_rows(q, k, sums, w, t0, windows, softcap=0.0 if cap is None else cap)]
    return fn


def bitwise(x, y):
    """x and y the same bits (torch.equal holds 0.0 and -0.0 equal)."""
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.contiguous().view(ints[x.dtype]),
                                                                      y.contiguous().view(ints[y.dtype]))


def windowed_calls(old, new, calls, same):
    """The windowed kernels through the Python layer, 2 threads: (calls, same) updated."""
    capped = hasattr(old, "window_softcap")
    old = old if hasattr(old, "sliding_window") else NoBandBuild(old)
    old = old if capped else NoCapBuild(old)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    keys = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    keys[0, ..., 250:], keys[1, ..., :7] = False, False
    bools = torch.rand(2, 4, 150, 150, generator=torch.Generator().manual_seed(3)) > 0.3
    floats = torch.randn(1, 4, 150, 150, generator=torch.Generator().manual_seed(4))
    fns = []
    for cap in (None, 2.0) if capped else (None,):
        for dtype in (torch.float32, torch.float64):
            for causal in (True, False):
                fns += [window_call(2, 4, 2, 300, 32, 32, 3, [16, 64, None], causal, dtype, cap=cap),
                        window_call(2, 2, 2, 257, 17, 9, 4, [4, 8, 32, 64], causal, dtype, cap=cap),
                        window_call(1, 2, 1, 200, 64, 64, 1, [32], causal, dtype, cap=cap),
                        window_call(2, 4, 2, 300, 32, 32, 3, [16, 64, None], causal, dtype, keys, cap=cap),
                        window_call(2, 4, 2, 150, 16, 24, 3, [8, 32, None], causal, dtype, bools, cap=cap),
                        window_call(1, 4, 4, 150, 16, 16, 3, [8, 32, None], causal, dtype, floats, cap=cap),
                        window_call(2, 2, 2, 160, 32, 32, 3, [8, 32, None], causal, dtype, dropout=0.3, cap=cap)]
            for L, windows, H, Hk, t0, n in [(3, [4, 8, None], 2, 2, 0, 37), (4, [2, 8, 16, None], 4, 2, 5, 40),
                                             (6, [2, 4, 8, 16, 32, None], 2, 1, 200, 61)]:
                for D in (5, 64):
                    fns.append(window_decode_call(2, H, Hk, D, L, windows, t0, n, dtype, cap))
    differ = 0
    for fn in fns:
        a, b = through(old, fn), through(new, fn)
        differ += not (len(a) == len(b) and all(bitwise(x, y) for x, y in zip(a, b)))
    if differ:
        print(f"{differ} of {len(fns)} windowed calls differ")
    torch.set_num_threads(threads)
    calls, same = calls + len(fns), same and not differ
    return calls, same


def timed(mod, call):
    t0 = time.perf_counter()
    call(mod)
    return time.perf_counter() - t0


def pairs(old, new, rounds, threads):
    """The two calls a restructuring is held to, in rounds of (old, new) then
    (new, old): each round's new/old ratio, their median and spread."""
    big = sample_inputs(1, 8, 2048, 2048, 64, 64, 3, dtype=torch.float32)
    small = sample_inputs(1, 2, 16, 16, 32, 32, 2, dtype=torch.float32)

    def small_call(mod):
        for _ in range(200):
            run(mod, *small, False, 0.0, threads, True)
    for label, call in [("T=2048 L=3 full fwd+bwd", lambda m: run(m, *big, False, 0.0, threads, True)),
                        ("T=16 L=2 fwd+bwd x200", small_call)]:
        call(old), call(new)  # warm
        ratios, olds, news = [], [], []
        for r in range(rounds):
            order = (old, new) if r % 2 == 0 else (new, old)
            t = {id(m): timed(m, call) for m in order}
            olds.append(t[id(old)]), news.append(t[id(new)])
            ratios.append(t[id(new)] / t[id(old)])
        ratios.sort()
        print(f"{label:26s} old {statistics.median(olds) * 1e3:8.2f} ms  new {statistics.median(news) * 1e3:8.2f} ms  "
              f"new/old median {statistics.median(ratios):.4f}  (min {ratios[0]:.4f}, max {ratios[-1]:.4f}, "
              f"quartiles {ratios[len(ratios) // 4]:.4f}..{ratios[3 * len(ratios) // 4]:.4f}, {rounds} rounds)")


def timings(old, new, reps, quick, threads):
    print(f"{'call':38s} {'old ms':>8s} {'new ms':>8s} {'new/old':>8s}   (medians of {reps}, interleaved)")
    Ts = [512] if quick else [512, 2048]
    for T in Ts:
        for L in (1, 3):
            for causal in (False, True):
                for backward in (False, True):
                    q, k, v, w = sample_inputs(1, 8, T, T, 64, 64, L, dtype=torch.float32)
                    times = {"old": [], "new": []}
                    for _ in range(reps):
                        for name, mod in (("old", old), ("new", new)):
                            t0 = time.perf_counter()
                            run(mod, q, k, v, w, causal, 0.0, threads, backward)
                            times[name].append(time.perf_counter() - t0)
                    o, n = statistics.median(times["old"]), statistics.median(times["new"])
                    label = f"T={T} L={L} {'causal' if causal else 'full'} {'fwd+bwd' if backward else 'fwd'}"
                    print(f"{label:38s} {o * 1e3:8.1f} {n * 1e3:8.1f} {n / o:8.3f}")
    # a module's heads: B=8, 4 heads, T=1024, rows of a wider array (MultiheadHKT's layout)
    for L in (1, 3):
        for backward in (False, True):
            q, k, v, w = sample_inputs(8, 4, 1024, 1024, 64, 64, L, dtype=torch.float32)
            times = {"old": [], "new": []}
            for _ in range(reps):
                for name, mod in (("old", old), ("new", new)):
                    t0 = time.perf_counter()
                    run(mod, q, k, v, w, False, 0.0, threads, backward, strided=True)
                    times[name].append(time.perf_counter() - t0)
            o, n = statistics.median(times["old"]), statistics.median(times["new"])
            label = f"heads layout B=8 H=4 T=1024 L={L} {'fwd+bwd' if backward else 'fwd'}"
            print(f"{label:38s} {o * 1e3:8.1f} {n * 1e3:8.1f} {n / o:8.3f}")


if __name__ == "__main__":
    main()
