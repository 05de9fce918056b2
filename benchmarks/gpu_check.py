"""The Python half of benchmarks/gpu_check.sh (run that): correctness of hkt's CUDA
paths against the float64 reference, then timings against SDPA FlashAttention,
written to benchmarks/results/gpu.json after every step (a run cut short by its
time limit still leaves what it measured).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu.json [--deadline SECONDS]
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu.json   # smoke test of the script

Correctness (float64, on the device, against hkt.reference on the same device):
the "kernels" and "sdpa" backends, out and every gradient (q[l], k[l], v, w and a
float mask's), no mask / bool mask / float mask, causal or not; bitwise
repeatability of the kernels' forward+backward; bfloat16 at the timed size
(kernels, tensor-core kernels, sdpa) against a float32 result; and
tests/test_cuda.py's GPU tests, the tensor-core kernels' among them.  Any failure makes the exit status 1.

Timing (bfloat16, causal, B=4 H=16 T=S=4096 D=Dv=64 L=3 unless --quick):
forward and forward+backward of hkt_attention(backend="kernels"), the same with
the bfloat16 tensor-core kernels switched on, of
backend="sdpa", of the sdpa construction with v zero-padded to L*D (so that
FlashAttention can take it: it wants equal head dims), and of plain SDPA with
FlashAttention on one level (q[0], k[0], v) as the yardstick.  Medians of CUDA-
event timings; each candidate gets a share of the time left.
"""
import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import hkt  # noqa: E402
from hkt import _C, _kernels, _sdpa, functional  # noqa: E402
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
            "cuda_tensor_cores_default": _kernels.cuda_tensor_cores}
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


def junit_summary(path):
    """Counts from pytest's junit XML; gpu_skipped = tests skipped for want of a GPU."""
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "gpu_skipped": 0}
    failed = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            if "needs a CUDA GPU" in (case.find("skipped").get("message") or ""):
                counts["gpu_skipped"] += 1
        else:
            counts["passed"] += 1
    counts["not_passed"] = failed[:50]
    return counts


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
            for backend in ("kernels", "sdpa"):
                if backend == "kernels" and device.type == "cuda" and not _C.has_cuda:
                    continue
                fn = lambda *a, **kw: hkt.hkt_attention(*a, backend=backend, **kw)  # noqa: E731
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
        for backend in ("kernels", "kernels, tensor cores", "sdpa"):
            if backend.startswith("kernels") and device.type == "cuda" and not _C.has_cuda:
                continue
            if backend == "kernels, tensor cores" and not _tensor_cores_apply(q, v, device):
                continue
            with tensor_cores(backend == "kernels, tensor cores"):
                got = hkt.hkt_attention(q, k, v, w, is_causal=True, backend=backend.split(",")[0])
            res[backend] = rel_err(got, want)
            if not res[backend] < 5e-2:
                rep.fail(f"bfloat16 {backend} at the timed size: relative error {res[backend]:.3g} against float32")
    rep.set("bfloat16_vs_float32_at_timed_size", res)
    log(f"bfloat16 at the timed size: {res}")


class tensor_cores:
    """hkt's bfloat16 tensor-core kernels on (or off) inside the block: they are
    opt-in (hkt._kernels.cuda_tensor_cores) until this check has passed."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.was, _kernels.cuda_tensor_cores = _kernels.cuda_tensor_cores, self.on

    def __exit__(self, *exc):
        _kernels.cuda_tensor_cores = self.was


def _tensor_cores_apply(q, v, device):
    """whether a bfloat16 forward of these inputs would take the tensor-core kernel"""
    with tensor_cores(True):
        return device.type == "cuda" and _C.has_cuda and _kernels._cuda_tc(q, v, 0.0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def candidates(q, k, v, w, device):
    L, D = len(q), q[0].shape[-1]
    scale = 1.0 / math.sqrt(D)
    c = {}
    if _C.has_cuda or device.type == "cpu":
        c["hkt kernels"] = lambda: hkt.hkt_attention(q, k, v, w, is_causal=True, backend="kernels")
    if _tensor_cores_apply(q, v, device):
        def tc():
            with tensor_cores(True):
                return hkt.hkt_attention(q, k, v, w, is_causal=True, backend="kernels")
        c["hkt kernels, tensor cores"] = tc
    c["hkt sdpa"] = lambda: hkt.hkt_attention(q, k, v, w, is_causal=True, backend="sdpa")

    def padded():
        qt, kt = _sdpa.concat_levels(q, k, w)
        vp = F.pad(v, (0, L * D - v.shape[-1]))
        return F.scaled_dot_product_attention(qt, kt, vp, is_causal=True, scale=scale)[..., :v.shape[-1]]

    c["hkt sdpa, v padded to L*D"] = padded
    c["SDPA L=1 (q[0], k[0], v)"] = lambda: F.scaled_dot_product_attention(q[0], k[0], v, is_causal=True)
    return c


def flash_only(device):
    """A context that lets SDPA use FlashAttention only (on CUDA), or nothing."""
    if device.type != "cuda":
        import contextlib
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def run_timings(rep, device, size, deadline):
    B, H, T, S, D, Dv, L = size
    q, k, v, w = inputs(B, H, T, S, D, Dv, L, torch.bfloat16, device, seed=4)
    gout = torch.randn(B, H, T, Dv, device=device, dtype=torch.bfloat16)
    cands = candidates(q, k, v, w, device)
    res = {"size": dict(B=B, H=H, T=T, S=S, D=D, Dv=Dv, L=L, dtype="bfloat16", causal=True), "results": {}}
    rep.set("timing", res)
    jobs = [(name, mode) for name in cands for mode in ("forward", "forward+backward")]
    for x, (name, mode) in enumerate(jobs):
        left = deadline - time.monotonic()
        if left < 5:
            res["results"].setdefault(name, {})[mode] = "skipped: out of time"
            rep.set("timing", res)
            continue
        fn = cands[name]
        flash = name.startswith("SDPA L=1") or "padded" in name

        def call(fn=fn, mode=mode, flash=flash):
            ctx = flash_only(device) if flash else __import__("contextlib").nullcontext()
            with ctx:
                if mode == "forward":
                    with torch.no_grad():
                        fn()
                else:
                    fn().backward(gout)

        try:
            budget = min(20.0, left / (len(jobs) - x) * 0.8)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            r = measure(call, device, budget)
            if device.type == "cuda":
                r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        except Exception as e:  # a candidate SDPA cannot run (e.g. no FlashAttention here) is reported, not fatal
            r = f"failed: {type(e).__name__}: {str(e)[:300]}"
        for x_ in [*q, *k, v, w]:
            x_.grad = None
        res["results"].setdefault(name, {})[mode] = r
        rep.set("timing", res)
        log(f"{name:32s} {mode:17s} " + (f"{r['median_s'] * 1e3:10.2f} ms ({r['runs']} runs)"
                                          if isinstance(r, dict) else r))
    base = res["results"].get("SDPA L=1 (q[0], k[0], v)", {})
    ratios = {}
    for name, modes in res["results"].items():
        for mode, r in modes.items():
            b = base.get(mode)
            if isinstance(r, dict) and isinstance(b, dict):
                ratios[f"{name} / {mode}"] = round(r["median_s"] / b["median_s"], 3)
    res["time_over_flash_L1"] = ratios
    kern = res["results"].get("hkt kernels", {}).get("forward+backward")
    sd = res["results"].get("hkt sdpa", {}).get("forward+backward")
    if isinstance(kern, dict) and isinstance(sd, dict):
        res["kernels_faster_than_sdpa_backend"] = kern["median_s"] < sd["median_s"]
    rep.set("timing", res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test of this script)")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds this script may take")
    ap.add_argument("--junit", help="pytest junit XML of tests/test_cuda.py, summarised into the report")
    ap.add_argument("--tests-rc", type=int, help="pytest's exit status")
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
    if args.junit:
        try:
            s = junit_summary(args.junit)
        except (OSError, ET.ParseError) as e:
            s = {"error": f"{type(e).__name__}: {e}"}
            rep.fail(f"no test results ({s['error']})")
        s["rc"] = args.tests_rc
        rep.set("tests_test_cuda", s)
        if "error" not in s:
            if s["passed"] == 0:
                rep.fail("tests/test_cuda.py: no test passed")
            if s["gpu_skipped"]:
                rep.fail(f"tests/test_cuda.py: {s['gpu_skipped']} GPU tests skipped")
            if s["failed"] or s["errors"]:
                rep.fail(f"tests/test_cuda.py: {s['failed']} failed, {s['errors']} errors")
    try:
        check_correctness(rep, device, args.quick)
        size = (1, 2, 256, 256, 16, 16, 3) if args.quick else (4, 16, 4096, 4096, 64, 64, 3)
        check_bf16_at_size(rep, device, size)
        run_timings(rep, device, size, deadline)
    except Exception as e:
        rep.fail(f"{type(e).__name__}: {e}")
        raise
    finally:
        rep.write()
    log(f"wrote {args.out}: {'ok' if rep.ok else 'FAILED: ' + '; '.join(rep.data.get('failures', []))}")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
