"""Threads and processes: concurrent calls give the serial results bitwise, the GIL
is released while a kernel runs, and a forked child computes what its parent did."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import hkt
from hkt import _C

from helpers import level_len, sample_inputs, with_threads
from hostile_cases import child_env

N_THREADS = 8


def job_inputs(i):
    """Inputs of job i: sizes, masks and causality differ from job to job."""
    T, S = 40 + 13 * (i % 4), 37 + 11 * (i % 3)
    q, k, v, w = sample_inputs(1 + i % 2, 2, T, S, 8 + i % 3, 5, 1 + i % 4, seed=i)
    leaves = [x.requires_grad_() for x in [*q, *k, v, w]]
    L = len(q)
    mask = None
    if i % 3 == 1:
        mask = torch.rand(T, S, generator=torch.Generator().manual_seed(i)) > 0.3
    elif i % 3 == 2:
        mask = torch.randn(1, 2, T, S, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        mask[..., ::4, 1::3] = float("-inf")
        mask.requires_grad_()
        leaves.append(mask)
    dout = torch.randn(q[0].shape[:3] + (5,), dtype=torch.float64, generator=torch.Generator().manual_seed(100 + i))
    return leaves[:L], leaves[L:2 * L], leaves[2 * L], leaves[2 * L + 1], mask, dout, leaves, i % 2 == 0


def job(i, inputs):
    q, k, v, w, mask, dout, leaves, causal = inputs
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=causal)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_concurrent_calls_give_the_serial_results(torch_threads):
    n_jobs = 16
    inputs = [job_inputs(i) for i in range(n_jobs)]
    serial = with_threads(torch_threads, lambda: [job(i, inputs[i]) for i in range(n_jobs)])
    results = [[None] * n_jobs for _ in range(N_THREADS)]
    errors = []
    start = threading.Barrier(N_THREADS)

    def worker(t):
        try:
            torch.set_num_threads(torch_threads)  # per thread in torch
            start.wait()
            for r in range(2):
                for i in range(n_jobs):
                    j = (i + 3 * t + r) % n_jobs  # threads run different jobs at any one time, and share inputs
                    results[t][j] = job(j, inputs[j])
        except BaseException as exc:  # noqa: B902
            errors.append(exc)

    old = torch.get_num_threads()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
    finally:
        torch.set_num_threads(old)
    assert not any(th.is_alive() for th in threads), "a thread did not finish in 300 s"
    assert not errors, errors[0]
    for t in range(N_THREADS):
        for j in range(n_jobs):
            for a, b in zip(results[t][j], serial[j]):
                assert torch.equal(a, b), f"thread {t}, job {j}: differs from the serial run"


def test_concurrent_extension_calls_on_shared_numpy_arrays():
    # Pure kernels, no torch: 8 threads share the same inputs, each with its own outputs.
    rng = np.random.default_rng(0)
    B, H, T, S, D, Dv, L = 2, 3, 150, 130, 16, 8, 3
    q = [rng.standard_normal((B, H, level_len(T, l), D)) for l in range(L)]
    k = [rng.standard_normal((B, H, level_len(S, l), D)) for l in range(L)]
    v, w = rng.standard_normal((B, H, S, Dv)), rng.standard_normal((H, L))
    mask = rng.random((B, H, T, S)) > 0.2
    dout = rng.standard_normal((B, H, T, Dv))

    def call(num_threads):
        out, lse = np.empty((B, H, T, Dv)), np.empty((B, H, T))
        _C.forward(q, k, v, w, out, lse, mask, True, None, 0.0, 0, num_threads)
        dq, dk = [np.empty_like(x) for x in q], [np.empty_like(x) for x in k]
        dv, dw = np.empty_like(v), np.empty_like(w)
        _C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, mask, True, None, 0.0, 0, num_threads)
        return [out, lse, *dq, *dk, dv, dw]

    serial = call(1)
    results, errors = [None] * N_THREADS, []

    def worker(t):
        try:
            res = [call(1 + t % 2) for _ in range(3)]
            results[t] = res
        except BaseException as exc:  # noqa: B902
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors[0]
    for res in results:
        for run in res:
            for a, b in zip(run, serial):
                assert np.array_equal(a, b)


class _Announce:
    """Exports ``arr``; the moment the binding imports it (GIL held, just before the
    kernel), sets flag[0] = 1.  The capsule is made first: after the flag is set no
    bytecode can switch threads before control is back in C."""

    def __init__(self, arr, flag):
        self.arr, self.flag = arr, flag

    def __dlpack__(self, *args, **kwargs):
        cap = self.arr.__dlpack__()
        self.flag[0] = 1
        return cap


def _progress_during_call(T, backward):
    """How many loop iterations another Python thread made while one kernel call ran."""
    rng = np.random.default_rng(1)
    B, H, D, L = 1, 2, 64, 2
    q = [rng.standard_normal((B, H, level_len(T, l), D)) for l in range(L)]
    k = [rng.standard_normal((B, H, level_len(T, l), D)) for l in range(L)]
    v, w = rng.standard_normal((B, H, T, D)), rng.standard_normal((H, L))
    out, lse = np.empty((B, H, T, D)), np.empty((B, H, T))
    inside, count, stop = [0], [0], [False]

    def spin():
        while not stop[0]:
            if inside[0]:
                count[0] += 1
            time.sleep(0.0002)  # lets the caller have the GIL back the moment it asks

    th = threading.Thread(target=spin)
    th.start()
    try:
        if backward:
            _C.forward(q, k, v, w, out, lse, None, False, None, 0.0, 0, 1)
            dq, dk = [np.empty_like(x) for x in q], [np.empty_like(x) for x in k]
            _C.backward(rng.standard_normal(out.shape), q, k, v, w, out, lse, dq, dk, np.empty_like(v),
                        _Announce(np.empty_like(w), inside), None, False, None, 0.0, 0, 1)
        else:
            _C.forward(q, k, v, w, out, _Announce(lse, inside), None, False, None, 0.0, 0, 1)
        inside[0] = 0  # no bytecode in between can hand the GIL over (see the switch interval)
    finally:
        stop[0] = True
        th.join()
    return count[0]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_gil_is_released_while_the_kernel_runs(backward):
    # With a 60 s switch interval the interpreter never takes the GIL from the calling
    # thread by force during the test: the other thread runs while the call is inside
    # the extension only if the extension let go of the GIL.  A held GIL gives exactly
    # 0; a released one gives > 0 unless the OS starved the thread for the whole call,
    # so a zero is retried with a longer call.
    old = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        counts = []
        for T in (2048, 4096, 8192):
            counts.append(_progress_during_call(T, backward))
            if counts[-1] > 0:
                break
    finally:
        sys.setswitchinterval(old)
    assert counts[-1] > 0, f"another thread made no progress during the kernel calls: {counts}"


FORK_SCRIPT = r"""
import os, pickle, select, signal, sys, time
import torch, hkt
sys.path.insert(0, TESTS)
from helpers import sample_inputs

torch.set_num_threads(2)

def compute():
    q, k, v, w = sample_inputs(2, 2, 150, 140, 16, 8, 3, requires_grad=True, seed=4)
    mask = torch.randn(150, 140, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mask[::7] = float("-inf")
    mask.requires_grad_()
    leaves = [*q, *k, v, w, mask]
    out = hkt.hkt_attention(q, k, v, w, attn_mask=mask, is_causal=True)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return [x.detach().numpy().copy() for x in [out, *grads]]

parent = compute()  # OpenMP's thread pool is up in the parent now
r, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    code = 1
    try:
        torch.set_num_threads(2)
        data = pickle.dumps(compute())
        with os.fdopen(wfd, "wb") as f:
            f.write(data)
        code = 0
    finally:
        os._exit(code)
os.close(wfd)
chunks, deadline = [], time.monotonic() + CHILD_TIMEOUT
while True:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([r], [], [], left)[0]:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("child hung")
        sys.exit(3)
    chunk = os.read(r, 1 << 20)
    if not chunk:
        break
    chunks.append(chunk)
_, status = os.waitpid(pid, 0)
if status != 0:
    print("child failed with status", status)
    sys.exit(4)
child = pickle.loads(b"".join(chunks))
import numpy as np
same = all(np.array_equal(a, b) for a, b in zip(parent, child))
print("same" if same else "different")
"""


def test_forked_child_computes_what_the_parent_did():
    script = FORK_SCRIPT.replace("TESTS", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))).replace(
        "CHILD_TIMEOUT", "60")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=child_env())
    assert res.returncode == 0 and res.stdout.strip() == "same", res.stdout + res.stderr[-4000:]


def test_forked_child_via_multiprocessing():
    # multiprocessing's "fork" context, as a DataLoader worker would be made
    script = textwrap.dedent("""
        import multiprocessing as mp, sys
        import numpy as np, torch, hkt
        sys.path.insert(0, %r)
        from helpers import sample_inputs

        def compute(_=None):
            torch.set_num_threads(2)
            q, k, v, w = sample_inputs(1, 3, 130, 120, 8, 4, 2, requires_grad=True, seed=9)
            out = hkt.hkt_attention(q, k, v, w, is_causal=True)
            grads = torch.autograd.grad(out.sum(), [*q, *k, v, w])
            return [x.detach().numpy().copy() for x in [out, *grads]]

        if __name__ == "__main__":
            parent = compute()
            with mp.get_context("fork").Pool(2) as pool:
                children = pool.map_async(compute, range(2)).get(60)
            print(all(np.array_equal(a, b) for child in children for a, b in zip(parent, child)))
    """ % os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=child_env())
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stdout + res.stderr[-4000:]


def test_more_torch_threads_than_the_extension_takes():
    """torch.set_num_threads takes counts over the extension's most (1024);
    every call then raised 'num_threads: must be at most 1024', an argument
    the user never passed, where SDPA and nn.MultiheadAttention run.  The count
    is capped now, with the same bits as on any other count."""
    q, k, v, w = sample_inputs(1, 2, 16, 16, 8, 8, 3, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in [*q, *k, v, w]]
    m = hkt.MultiheadHKT(16, 2, batch_first=True, levels=3).double()
    x = torch.randn(1, 16, 16, dtype=torch.float64)

    def run():
        out = hkt.hkt_attention(q, k, v, w)
        return [out, *torch.autograd.grad(out.sum(), leaves), m(x, x, x)[0]]

    want = run()
    got = with_threads(hkt._C.max_threads + 1, run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


STACK_SCRIPT = """
import hashlib, torch, hkt
torch.set_num_threads(2)
torch.manual_seed(0)
B, H, T, D, L = 2, 4, 300, 64, 3  # over the one-thread size: the backward runs on two threads
q = [torch.randn(B, H, -(-T // 2**l), D, dtype=torch.float64, requires_grad=True) for l in range(L)]
k = [torch.randn(B, H, -(-T // 2**l), D, dtype=torch.float64, requires_grad=True) for l in range(L)]
v = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
out = hkt.hkt_attention(q, k, v, torch.full((L,), 1 / L, dtype=torch.float64), is_causal=True)
out.sum().backward()
print(hashlib.sha256(b"".join(x.detach().numpy().tobytes() for x in [out] + [y.grad for y in q + k + [v]])).hexdigest())
"""


@pytest.mark.parametrize("stack", ["16K", "48K"])
def test_small_openmp_stacks_run_on_one_thread(stack):
    """OMP_STACKSIZE=16K gave OpenMP's workers less stack than the backward's
    frames take (about 16 KiB): the process died of SIGSEGV, where torch's own
    ops run.  With less than 64 KiB the kernels now run on one thread (same
    bits, a warning says why)."""
    def run(size):
        env = dict(child_env(), OMP_STACKSIZE=size) if size else child_env()
        res = subprocess.run([sys.executable, "-c", STACK_SCRIPT], capture_output=True, text=True, timeout=300,
                             env=env)
        assert res.returncode == 0, (size, res.returncode, res.stderr[-3000:])
        return res.stdout.split()[-1], res.stderr

    small, warned = run(stack)
    assert "RuntimeWarning: OpenMP's worker threads have" in warned and "they run on one thread" in warned, warned
    usual, quiet = run(None)
    assert small == usual and "RuntimeWarning" not in quiet, quiet
