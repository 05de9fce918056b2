"""Timing and checking helpers shared by ``python -m research.demo`` and benchmarks/
(research code: not part of the installed package).

Every comparison checks the kernel against the plain-PyTorch reference before it
times anything; timings are medians of interleaved runs, so the candidates see
the same machine state.
"""
import math
import os
import re
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from hkt.analysis import cost_ratio
from hkt.functional import hkt_attention
from hkt.reference import hkt_attention_reference

__all__ = ["make_inputs", "max_error", "time_interleaved", "time_rounds", "paired_ratio", "attention_callables",
           "score_flops", "machine_info", "machine_slug", "results_dir", "sgemm_gflops", "report_targets"]


def machine_info() -> Dict[str, object]:
    """The CPU a figure was measured on: model, family/model, the ISA flags the
    kernels care about, which build of their hot loops runs, threads, torch."""
    from hkt import _C
    info: Dict[str, object] = {"cpu": "unknown", "family": None, "model": None, "flags": [],
                               "logical_cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "vendor_id" and "vendor" not in info:
                    info["vendor"] = val
                elif key == "model name" and info["cpu"] == "unknown":
                    info["cpu"] = val
                elif key == "cpu family" and info["family"] is None:
                    info["family"] = int(val)
                elif key == "model" and info["model"] is None:
                    info["model"] = int(val)
                elif key == "flags" and not info["flags"]:
                    want = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
                            "amx_bf16", "amx_tile")
                    have = set(val.split())
                    info["flags"] = [x for x in want if x in have]
    except OSError:
        pass
    info["hkt_cpu_kernels"] = _C.cpu_kernels()
    # bfloat16: the native kernels (their products on AMX tiles or vdpbf16ps) or
    # upcast to float32 (hkt._C.cpu_bf16_preferred, cpu_bf16_amx)
    info["hkt_bf16"] = (("native, AMX" if _C.cpu_bf16_amx() else "native, AVX512_BF16")
                        if _C.cpu_bf16_preferred() else "upcast")
    info["threads"] = torch.get_num_threads()
    info["torch"] = torch.__version__
    info["hkt_commit"] = _commit()
    info["date"] = time.strftime("%Y-%m-%d")
    # instruction sets narrowed for the run (hkt's kernels, torch's, MKL's): a
    # figure taken so stands for a smaller CPU, and must say so
    info["isa_limits"] = {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)}
    return info


ISA_LIMITS = ("HKT_CPU_KERNELS", "HKT_BF16", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def isa_limits_text(info: Dict[str, object], quote: str = "") -> str:
    """'' or ', instruction sets restricted by HKT_CPU_KERNELS=avx2 ...' for a
    run with narrowed instruction sets (each setting between ``quote``s)."""
    limits = info.get("isa_limits") or {}
    return (", instruction sets restricted by " + " ".join(f"{quote}{k}={v}{quote}" for k, v in limits.items())
            if limits else "")


def _commit() -> Optional[str]:
    """The checkout's commit (with "+" when it has uncommitted changes), so a
    figure says which code it measured; None unless the hkt imported is the one
    of a git checkout of hkt (an hkt installed elsewhere, or one inside another
    project's checkout, was not built from this commit)."""
    import subprocess
    import hkt
    here = os.path.dirname(os.path.abspath(hkt.__file__))
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        if top.returncode != 0 or os.path.realpath(os.path.join(top.stdout.strip(), "hkt")) != os.path.realpath(here):
            return None
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "csrc", "hkt"],
                               cwd=here + "/..", capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


def machine_slug(info: Dict[str, object]) -> str:
    """The folder name of a CPU's results: vendor, model words, family and model
    (``amd-epyc-25-17``, ``intel-xeon-6-167``), ``-avx2`` where the run held the
    instruction sets to AVX2, so runs of different CPUs never overwrite each other."""
    words = re.sub(r"\((?:R|TM)\)|\b(?:processor|cpu|\d+-core)\b", " ", str(info.get("cpu", "unknown")), flags=re.I)
    words = [w for w in re.split(r"[^a-z0-9]+", words.lower()) if w][:2] or ["cpu"]
    slug = "-".join(words + [str(info.get("family")), str(info.get("model"))])
    return slug + ("-avx2" if info.get("isa_limits") else "")


def results_dir(info: Dict[str, object]) -> str:
    """benchmarks/results/<machine_slug>/: where a benchmark writes by default."""
    return os.path.join(RESULTS, machine_slug(info))


def describe_machine(info: Dict[str, object]) -> str:
    return (f"{info['cpu']} (family {info['family']} model {info['model']}; {' '.join(info['flags'])}); "
            f"hkt kernels: {info['hkt_cpu_kernels']}, bfloat16 {info['hkt_bf16']}; {info['threads']} threads; "
            f"torch {info['torch']}{isa_limits_text(info)}")


def sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 matrix-multiply rate with torch's own BLAS, at the
    current thread count: torch.mm of two n x n matrices, best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2.0 * n ** 3 / best / 1e9


def _seconds(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def report_targets(targets: List[tuple]) -> List[Dict[str, object]]:
    """Prints (measure, value, comparison, target[, why not]) rows with met / NOT
    MET, and returns them as dicts for the results file.  A fifth element says
    why the target does not apply on this machine (bfloat16's on a CPU without
    native bfloat16): the row then reads "n/a" and its "met" is None."""
    rows = []
    print("\ntargets:")
    for measure, value, op, target, *why in targets:
        if why and why[0]:
            rows.append({"measure": measure, "value": value, "target": f"{op} {target}", "met": None,
                         "not_applicable": why[0]})
            print(f"  n/a      {measure:70s} {value:8.3f}  (target {op} {target}; {why[0]})")
            continue
        met = value <= target if op == "<=" else value >= target
        rows.append({"measure": measure, "value": value, "target": f"{op} {target}", "met": met})
        print(f"  {'met    ' if met else 'NOT MET'}  {measure:70s} {value:8.3f}  (target {op} {target})")
    return rows


def random_inputs(B, H, T, S, D, Dv, L, *, dtype=torch.float64, per_head=True, requires_grad=False, device="cpu",
                  seed=0, kv_heads=None, convex_w=False):
    """Random HKT inputs from one seeded generator: q, k (lists of L levels), v
    and w ((H, L), or (L,) without per_head; a softmax over levels with
    convex_w, as MultiheadHKT passes, else plain normal); k and v with kv_heads
    heads (default H).  The one generator of the benchmarks (make_inputs) and
    the tests (tests/helpers.sample_inputs)."""
    g = torch.Generator().manual_seed(seed)
    Hk = H if kv_heads is None else kv_heads

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device).requires_grad_(requires_grad)

    q = [rnd(B, H, -(-T // 2**l), D) for l in range(L)]
    k = [rnd(B, Hk, -(-S // 2**l), D) for l in range(L)]
    v = rnd(B, Hk, S, Dv)
    shape = (H, L) if per_head else (L,)
    if convex_w:
        w = torch.softmax(torch.randn(*shape, generator=g, dtype=dtype), -1).to(device).requires_grad_(requires_grad)
    else:
        w = rnd(*shape)
    return q, k, v, w


def make_inputs(B, H, T, S, D, L, *, Dv=None, dtype=torch.float32, requires_grad=True, seed=0, kv_heads=None):
    """The benchmarks' inputs: :func:`random_inputs` with convex per-head level
    weights, requiring grad by default."""
    return random_inputs(B, H, T, S, D, D if Dv is None else Dv, L, dtype=dtype, requires_grad=requires_grad,
                         seed=seed, kv_heads=kv_heads, convex_w=True)


def max_error(L, *, is_causal=False, B=1, H=2, T=97, S=None, D=13, dtype=torch.float64) -> float:
    """Largest |kernel - reference| over the output and every gradient."""
    q, k, v, w = make_inputs(B, H, T, S or T, D, L, dtype=dtype)
    leaves = [*q, *k, v, w]
    out = hkt_attention(q, k, v, w, is_causal=is_causal)
    ref = hkt_attention_reference(q, k, v, w, is_causal=is_causal)
    g = torch.randn_like(out)
    errs = [(out - ref).abs().max().item()]
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        errs.append(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return max(errs)


def time_rounds(fns: Dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                min_time: float = 0.0) -> Dict[str, List[float]]:
    """Seconds of every call of each callable, running them round-robin:
    ``times[name][r]`` is its call in round r, made next to the others' calls of
    that round.  At least ``repeats`` rounds, and rounds until ``min_time``
    seconds have passed."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    r = 0
    while r < repeats or time.perf_counter() - start < min_time:
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
        r += 1
    return times


def time_interleaved(fns: Dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                     min_time: float = 0.0) -> Dict[str, float]:
    """Median seconds per call of each callable, running them round-robin."""
    return {name: statistics.median(ts) for name, ts in time_rounds(fns, repeats, warmup, min_time).items()}


def paired_ratio(times: Dict[str, List[float]], a: str, b: str) -> float:
    """The median over rounds of ``times[a][r] / times[b][r]`` (time_rounds):
    each ratio is of two calls made side by side.  On a VM whose speed moves
    in phases (its host's other load), the ratio of the two medians can pair
    one's fast rounds with the other's slow ones; a ratio per round cannot."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def attention_callables(B, H, T, D, levels, *, is_causal=False, backward=False, dtype=torch.float32,
                        include_reference=False) -> Dict[str, Callable[[], object]]:
    """Callables for SDPA and HKT at each L in ``levels`` (forward, or forward+backward)."""
    fns = {}

    def wrap(run, leaves):
        if not backward:
            def f():
                with torch.no_grad():
                    return run()
            return f

        def fb():
            out = run()
            out.backward(torch.ones_like(out))
            for x in leaves:
                x.grad = None
        return fb

    q, k, v, _ = make_inputs(B, H, T, T, D, 1, dtype=dtype)
    fns["sdpa"] = wrap(lambda: F.scaled_dot_product_attention(q[0], k[0], v, is_causal=is_causal), [q[0], k[0], v])
    for L in levels:
        qL, kL, vL, wL = make_inputs(B, H, T, T, D, L, dtype=dtype)
        fns[f"hkt L={L}"] = wrap(lambda qL=qL, kL=kL, vL=vL, wL=wL: hkt_attention(qL, kL, vL, wL, is_causal=is_causal),
                                 [*qL, *kL, vL, wL])
        if include_reference and L == max(levels):
            fns[f"reference L={L}"] = wrap(
                lambda qL=qL, kL=kL, vL=vL, wL=wL: hkt_attention_reference(qL, kL, vL, wL, is_causal=is_causal),
                [*qL, *kL, vL, wL])
    return fns


def score_flops(B, H, T, D, L, *, is_causal=False, backward=False) -> float:
    """Nominal floating-point operations of attention with L levels (2 per multiply-add):
    scores T*T*D*sum_l 4^-l, P@V T*T*D; the backward about 2.5x the forward."""
    levels = cost_ratio(L)
    fwd = 2.0 * B * H * T * T * D * (levels + 1)
    if is_causal:
        fwd /= 2
    return fwd * (3.5 if backward else 1.0)
