"""The Python half of benchmarks/gpu_session.sh (run that): correctness of hkt's CUDA
paths against the float64 reference, then timings against SDPA, written to
gpu.json after every step (a run cut short by its time limit still leaves what it
measured).

    python benchmarks/gpu_check.py --out $OUT/gpu.json [--deadline SECONDS] [--tests-summary tests.json]
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu.json   # smoke test of the script

Correctness (float64, on the device, against hkt.reference on the same device):
the "kernels" backend and each variant of the "sdpa" backend (hkt.ops.sdpa.VARIANTS),
out and every gradient (q[l], k[l], v, w and a float mask's), no mask / bool mask
/ float mask, causal or not; bitwise repeatability of the kernels' forward+backward
(float64, and bfloat16 with the tensor-core kernels); bfloat16 at the timed size
(kernels, tensor-core kernels, each sdpa variant) against a float32 result; and
the summary of tests/kernels/test_cuda.py's run (benchmarks/gpu_tests.py).  Any failure
makes the exit status 1.

Timing (bfloat16, B=4 H=16 T=S=4096 D=Dv=64 L=3 unless --quick), causal and not,
forward and forward+backward: plain SDPA on one level (q[0], k[0], v), with the
kernel torch picks, as the yardstick (and with each of flash, cuDNN and
memory-efficient alone, for the record); hkt_attention(backend="kernels") with
the bfloat16 tensor-core kernels on and off; backend="sdpa" in each variant.
The variant with the least time is recorded per mode under
"sdpa_fastest_variant" (what hkt.ops.sdpa.MEASURED_FASTEST is to copy).  Medians of
CUDA-event timings; each candidate gets a share of the time left.
"""
import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hkt  # noqa: E402
from hkt import _C, functional  # noqa: E402
from hkt._core import kernels as _kernels  # noqa: E402
from hkt.ops import sdpa as _sdpa  # noqa: E402
from hkt.reference import hkt_attention_reference as reference  # noqa: E402

START = time.monotonic()


def log(msg):
    print(f"[gpu_check.py {time.monotonic() - START:6.1f}s] {msg}", flush=True)


class Report:
    def __init__(self, path):
        self.path, self.data, self.ok = path, {}, True

    def set(self, key, value):
        self.data[key] = value
        self.write()

    def fail(self, what):
        self.ok = False
        self.data.setdefault("failures", []).append(what)
        log(f"FAIL: {what}")
        self.write()

    def write(self):
        self.data["ok"] = self.ok
        self.data["elapsed_s"] = round(time.monotonic() - START, 1)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2)
        os.replace(tmp, self.path)


def machine(device):
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
            "hkt_has_cuda": bool(_C.has_cuda), "hkt_extension": _C.__file__,
            "cuda_kernels_preferred": functional._CUDA_KERNELS_PREFERRED,
            "cuda_tensor_cores_default": _kernels.cuda_tensor_cores, "sdpa_variant_setting": _sdpa.variant,
            "sdpa_measured_fastest": dict(_sdpa.MEASURED_FASTEST)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    try:
        ldd = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True, timeout=20).stdout
        info["ldd"] = [line.strip() for line in ldd.splitlines()]
        info["links_shared_cudart"] = "libcudart" in ldd
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def inputs(B, H, T, S, D, Dv, L, dtype, device, seed=0, grad=True):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_(grad)

    q = [rnd(B, H, -(-T // 2**l), D) for l in range(L)]
    k = [rnd(B, H, -(-S // 2**l), D) for l in range(L)]
    return q, k, rnd(B, H, S, Dv), torch.softmax(rnd(H, L).detach(), -1).requires_grad_(grad)


def out_and_grads(fn, q, k, v, w, mask, causal, gout):
    out = fn(q, k, v, w, attn_mask=mask, is_causal=causal)
    leaves = [*q, *k, v, w] + ([mask] if mask is not None and mask.requires_grad else [])
    return [out, *torch.autograd.grad(out, leaves, gout)]


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if not torch.equal(a.isnan(), b.isnan()):
        return math.inf
    a, b = a.nan_to_num(), b.nan_to_num()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if a.numel() else 0.0


def check_correctness(rep, device, quick):
    B, H, T, S, D, Dv, L = (1, 2, 70, 50, 8, 8, 3) if quick else (2, 4, 600, 520, 64, 64, 3)
    q, k, v, w = inputs(B, H, T, S, D, Dv, L, torch.float64, device, seed=1)
    gen = torch.Generator(device="cpu").manual_seed(2)
    gout = torch.randn(B, H, T, Dv, generator=gen, dtype=torch.float64).to(device)
    masks = {"none": None,
             "bool": (torch.rand(1, 1, T, S, generator=gen) > 0.3).to(device),
             "float": torch.randn(1, H, T, S, generator=gen, dtype=torch.float64).to(device)}
    masks["float"][..., ::5, 1::3] = float("-inf")
    results = {}
    for mname, mask in masks.items():
        for causal in (False, True):
            m = mask.clone().requires_grad_() if mname == "float" else mask
            want = out_and_grads(reference, q, k, v, w, m, causal, gout)
            for backend in ("kernels", *(f"sdpa, {name}" for name in _sdpa.VARIANTS)):
                if backend == "kernels" and device.type == "cuda" and not _C.has_cuda:
                    continue
                name, setting = backend_under(backend)
                fn = lambda *a, **kw: hkt.hkt_attention(*a, backend=name, **kw)  # noqa: E731
                with setting:
                    got = out_and_grads(fn, q, k, v, w, m, causal, gout)
                err = max(rel_err(a, b) for a, b in zip(got, want))
                key = f"{backend} mask={mname} causal={causal}"
                results[key] = err
                if not err < 1e-9:
                    rep.fail(f"float64 {key}: max relative error {err:.3g} (out and every gradient)")
    rep.set("correctness_float64", {"size": dict(B=B, H=H, T=T, S=S, D=D, Dv=Dv, L=L), "max_rel_err": results})
    log(f"float64 correctness: worst {max(results.values()):.3g} over {len(results)} cases")

    if _C.has_cuda or device.type == "cpu":  # bitwise repeatability of the kernels' forward + backward
        fn = lambda *a, **kw: hkt.hkt_attention(*a, backend="kernels", **kw)  # noqa: E731
        runs = [out_and_grads(fn, q, k, v, w, None, True, gout) for _ in range(2)]
        same = all(torch.equal(a, b) for a, b in zip(*runs))
        rep.set("kernels_bitwise_repeatable", same)
        if not same:
            rep.fail("the kernels' forward+backward differ between two identical runs")


def check_bf16_at_size(rep, device, size):
    B, H, T, S, D, Dv, L = size
    q, k, v, w = inputs(B, H, T, S, D, Dv, L, torch.bfloat16, device, seed=3, grad=False)
    with torch.no_grad():
        want = _sdpa.sdpa_attention([x.float() for x in q], [x.float() for x in k], v.float(), w.float(), None,
                                    True, None)
        res = {}
        for backend in ("kernels", "kernels, tensor cores", *(f"sdpa, {name}" for name in _sdpa.VARIANTS)):
            if backend.startswith("kernels") and device.type == "cuda" and not _C.has_cuda:
                continue
            if backend == "kernels, tensor cores" and not _tensor_cores_apply(q, v, device):
                continue
            name, setting = backend_under(backend)
            with setting:
                got = hkt.hkt_attention(q, k, v, w, is_causal=True, backend=name)
            res[backend] = rel_err(got, want)
            if not res[backend] < 5e-2:
                rep.fail(f"bfloat16 {backend} at the timed size: relative error {res[backend]:.3g} against float32")
    rep.set("bfloat16_vs_float32_at_timed_size", res)
    log(f"bfloat16 at the timed size: {res}")
    if _tensor_cores_apply(q, v, device):  # bitwise repeatability of the tensor-core forward + backward
        q, k, v, w = inputs(B, H, T, S, D, Dv, L, torch.bfloat16, device, seed=3)
        gout = torch.randn(B, H, T, Dv, device=device, dtype=torch.bfloat16)
        fn = lambda *a, **kw: hkt.hkt_attention(*a, backend="kernels", **kw)  # noqa: E731
        with tensor_cores(True):
            runs = [out_and_grads(fn, q, k, v, w, None, True, gout) for _ in range(2)]
        same = all(torch.equal(a, b) for a, b in zip(*runs))
        rep.set("tensor_cores_bitwise_repeatable", same)
        if not same:
            rep.fail("the tensor-core kernels' forward+backward differ between two identical runs")


@contextlib.contextmanager
def setting(module, name, value):
    """module.name = value inside the block, the old value back after it."""
    was = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, was)


def tensor_cores(on):
    """hkt's bfloat16 tensor-core kernels on (or off) inside the block: they are
    opt-in (hkt._core.kernels.cuda_tensor_cores) until this check has passed."""
    return setting(_kernels, "cuda_tensor_cores", on)


def sdpa_variant(name):
    """hkt's "sdpa" backend with one variant (hkt.ops.sdpa.VARIANTS) inside the block."""
    return setting(_sdpa, "variant", name)


def backend_under(checked):
    """(hkt_attention's backend, the setting that makes it) for a checked name:
    "kernels", "kernels, tensor cores" or "sdpa, <variant>"."""
    backend, _, detail = checked.partition(", ")
    return backend, sdpa_variant(detail) if backend == "sdpa" else tensor_cores(detail == "tensor cores")


def _tensor_cores_apply(q, v, device):
    """whether a bfloat16 forward of these inputs would take the tensor-core kernel"""
    with tensor_cores(True):
        return device.type == "cuda" and _C.has_cuda and _kernels._cuda_tc(q, v, 0.0)


def time_once(fn, device):
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(fn, device, budget_s, max_reps=10):
    """Median seconds of fn: one warm-up call, then as many as fit in budget_s (1..max_reps)."""
    first = time_once(fn, device)  # warm-up (also loads, autotunes, allocates)
    t = time_once(fn, device)
    times = [t]
    reps = max(1, min(max_reps, int(budget_s / max(t, 1e-6))))
    for _ in range(reps - 1):
        times.append(time_once(fn, device))
    return {"median_s": statistics.median(times), "runs": len(times), "first_call_s": first}


class Candidate:
    """What is timed: fn() computes the output; setting() is the context (tensor
    cores, a variant, SDPA kernels allowed) that holds for the whole timed call,
    the backward included: a setting left before .backward() would time that
    backward with the default."""

    def __init__(self, fn, setting=contextlib.nullcontext):
        self.fn, self.setting = fn, setting


SDPA_PLAIN = "SDPA, plain attention (q[0], k[0], v)"


def candidates(q, k, v, w, device, causal):
    """The timed calls, most wanted first (a run short of time drops the last)."""
    c = {SDPA_PLAIN: Candidate(lambda: F.scaled_dot_product_attention(q[0], k[0], v, is_causal=causal))}

    def kernels():
        return hkt.hkt_attention(q, k, v, w, is_causal=causal, backend="kernels")

    if _tensor_cores_apply(q, v, device):
        c["hkt kernels, tensor cores"] = Candidate(kernels, lambda: tensor_cores(True))
    for name in _sdpa.VARIANTS:
        c[f"hkt sdpa, {name}"] = Candidate(lambda: hkt.hkt_attention(q, k, v, w, is_causal=causal, backend="sdpa"),
                                           lambda name=name: sdpa_variant(name))
    if _C.has_cuda or device.type == "cpu":
        c["hkt kernels"] = Candidate(kernels, lambda: tensor_cores(False))
    if device.type == "cuda":  # which SDPA kernel is fastest on plain attention, for the record
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            c[f"{SDPA_PLAIN}, {b} only"] = Candidate(c[SDPA_PLAIN].fn,
                                                     lambda b=b: sdpa_kernel([getattr(SDPBackend, b)]))
    return c


def timed_call(cand, mode, gout):
    """The function measure() times: cand's output (forward), or its output and
    .backward(gout) (forward+backward), all inside cand.setting()."""
    def call():
        with cand.setting():
            if mode == "forward":
                with torch.no_grad():
                    cand.fn()
            else:
                cand.fn().backward(gout)
    return call


def sdp_choice(q, k, v, causal):
    """The kernel torch's SDPA picks for these tensors (torch._fused_sdp_choice)."""
    try:
        from torch.nn.attention import SDPBackend
        names = {int(b.value): n for n, b in SDPBackend.__members__.items()}
        return names.get(int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal)), "?")
    except Exception as e:  # noqa: BLE001 -- a private function: its absence is reported, not fatal
        return f"unknown ({type(e).__name__})"


def run_timings(rep, device, size, deadline):
    B, H, T, S, D, Dv, L = size
    q, k, v, w = inputs(B, H, T, S, D, Dv, L, torch.bfloat16, device, seed=4)
    gout = torch.randn(B, H, T, Dv, device=device, dtype=torch.bfloat16)
    res = {"size": dict(B=B, H=H, T=T, S=S, D=D, Dv=Dv, L=L, dtype="bfloat16"), "results": {},
           "sdpa_picks_on_plain_attention": {}}
    rep.set("timing", res)
    cands = {causal: candidates(q, k, v, w, device, causal) for causal in (True, False)}
    for causal in (True, False):
        for grad in (False, True):
            x = [t.detach().requires_grad_(grad) for t in (q[0], k[0], v)]
            res["sdpa_picks_on_plain_attention"][f"causal={causal} {'training' if grad else 'inference'}"] = \
                sdp_choice(*x, causal)
    # every candidate's forward, then its forward+backward, causal before not causal:
    # the comparisons the targets name come first
    jobs = [(name, causal, mode) for name in cands[True] for causal in (True, False)
            for mode in ("forward", "forward+backward")]
    for x, (name, causal, mode) in enumerate(jobs):
        left = deadline - time.monotonic()
        key = f"{'causal' if causal else 'not causal'}, {mode}"
        if left < 5:
            res["results"].setdefault(name, {})[key] = "skipped: out of time"
            rep.set("timing", res)
            continue
        try:
            budget = min(20.0, left / (len(jobs) - x) * 0.8)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            r = measure(timed_call(cands[causal][name], mode, gout), device, budget)
            if device.type == "cuda":
                r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        except Exception as e:  # a candidate SDPA cannot run (e.g. no FlashAttention here) is reported, not fatal
            r = f"failed: {type(e).__name__}: {str(e)[:300]}"
        for x_ in [*q, *k, v, w]:
            x_.grad = None
        res["results"].setdefault(name, {})[key] = r
        rep.set("timing", res)
        log(f"{name:48s} {key:30s} " + (f"{r['median_s'] * 1e3:10.2f} ms ({r['runs']} runs)"
                                        if isinstance(r, dict) else r))
    base = res["results"].get(SDPA_PLAIN, {})
    ratios = {}
    for name, modes in res["results"].items():
        for key, r in modes.items():
            b = base.get(key)
            if isinstance(r, dict) and isinstance(b, dict):
                ratios[f"{name} / {key}"] = round(r["median_s"] / b["median_s"], 3)
    res["time_over_sdpa_plain_attention"] = ratios
    rep.set("timing", res)
    rep.set("sdpa_fastest_variant", fastest_variants(res["results"], device))


def fastest_variants(results, device):
    """hkt.ops.sdpa.variant_key -> the variant of the "sdpa" backend with the least
    time, causal and not causal together, per mode; what "auto" is to follow
    (hkt.ops.sdpa.MEASURED_FASTEST).  A mode where a variant has no time is left out."""
    out = {}
    for mode in ("forward", "forward+backward"):
        total = {}
        for name in _sdpa.VARIANTS:
            r = results.get(f"hkt sdpa, {name}", {})
            times = [r.get(f"{c}, {mode}") for c in ("causal", "not causal")]
            if all(isinstance(t, dict) for t in times):
                total[name] = sum(t["median_s"] for t in times)
        if len(total) == len(_sdpa.VARIANTS):
            out[_sdpa.variant_key(device, torch.bfloat16, mode == "forward+backward")] = min(total, key=total.get)
    return out


def failures_in_tests(s):
    """What fails the check in benchmarks/gpu_tests.py's summary s of tests/kernels/test_cuda.py."""
    if "unreadable" in s:
        return [f"no test results ({s['unreadable']})"]
    out = []
    if not s.get("passed"):
        out.append("tests/kernels/test_cuda.py: no test passed")
    if s.get("gpu_skipped"):
        out.append(f"tests/kernels/test_cuda.py: {s['gpu_skipped']} GPU tests skipped")
    if s.get("failed_tests"):
        out.append(f"tests/kernels/test_cuda.py: {len(s['failed_tests'])} failed, errored or died; the first: "
                   f"{s['first_failure']['nodeid']}")
    if s.get("not_run"):
        out.append(f"tests/kernels/test_cuda.py: {len(s['not_run'])} tests not run (out of time)")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_session", "gpu.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test of this script)")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds this script may take")
    ap.add_argument("--tests-summary", help="benchmarks/gpu_tests.py's summary of tests/kernels/test_cuda.py, copied into "
                    "the report (its failures fail the check)")
    args = ap.parse_args()
    deadline = START + args.deadline
    rep = Report(args.out)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        rep.fail("torch sees no CUDA GPU")
        return 1
    rep.set("machine", machine(device))
    log(f"machine: {json.dumps(rep.data['machine'])}")
    if device.type == "cuda" and not _C.has_cuda:
        rep.fail("hkt._C was built without CUDA (HKT_CUDA=1)")
    if rep.data["machine"].get("links_shared_cudart"):
        rep.fail("hkt._C links a shared libcudart (it should link the static runtime)")
    if args.tests_summary:
        try:
            with open(args.tests_summary) as f:
                s = json.load(f)
        except (OSError, ValueError) as e:
            s = {"unreadable": f"{type(e).__name__}: {e}"}
        rep.set("tests_test_cuda", s)
        for what in failures_in_tests(s):
            rep.fail(what)
    size = (1, 2, 256, 256, 16, 16, 3) if args.quick else (4, 16, 4096, 4096, 64, 64, 3)
    # each step on its own: an exception in one is recorded and the next still runs
    # (after a sticky CUDA error they fail too, and say so)
    for step in (lambda: check_correctness(rep, device, args.quick), lambda: check_bf16_at_size(rep, device, size),
                 lambda: run_timings(rep, device, size, deadline)):
        try:
            step()
        except Exception as e:  # noqa: BLE001
            rep.fail(f"{type(e).__name__}: {e}")
            traceback.print_exc()
    rep.write()
    log(f"wrote {args.out}: {'ok' if rep.ok else 'FAILED: ' + '; '.join(rep.data.get('failures', []))}")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
