"""What a GPU machine has, read before anything is built (benchmarks/gpu_session.sh's
first step): a build that cannot work, or a torch that sees no GPU, shows here in
seconds instead of after the build's minutes.

    python benchmarks/gpu_probe.py --out probe.json

Writes the JSON after every section, so a section that hangs (until the session's
timeout) loses only itself.  Imports torch but not hkt (not built yet).  Exit
status 0 when torch sees a CUDA GPU, 3 when it sees none (a dry run), 1 when the
probe found something that stops the build (no Python.h, no OpenMP, no nvcc or
libcudart_static.a on a GPU machine).

Sections: the machine (nvidia-smi, CPUs, disk), the Python packages (torch with
its CUDA and cuDNN, Triton, setuptools, pytest, pytest-timeout, numpy), the
build's needs (Python.h, omp.h, nvcc, libcudart_static.a as setup.py looks for
them), and which kernel torch's scaled_dot_product_attention picks, per shape of
benchmarks/gpu_check.py's timings.
"""
import argparse
import ast
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/gpu_check.py's timed size: B, H, T, D, L
TIMED = (4, 16, 4096, 64, 3)


def run(cmd, timeout=30):
    """stdout of cmd (stderr appended when it fails), or why it did not run."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return f"not run: {type(e).__name__}: {e}"
    out = r.stdout.strip()
    return out if r.returncode == 0 else f"exit status {r.returncode}: {out} {r.stderr.strip()}"[:2000]


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def setup_py_functions(*names):
    """setup.py's own functions (find_cuda, cuda_lib_dir), taken out of its source:
    importing setup.py would run setup().  So the probe looks where the build will."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
            or (isinstance(n, ast.FunctionDef) and n.name in names)]
    scope = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "setup.py", "exec"), scope)
    return [scope[n] for n in names]


def machine():
    du = shutil.disk_usage(ROOT)
    return {"python": sys.executable, "python_version": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "disk_free_gib": round(du.free / 2**30, 1),
            "nvidia_smi": run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap,"
                               "clocks.max.sm,clocks.max.mem", "--format=csv"])
            if shutil.which("nvidia-smi") else "no nvidia-smi on PATH"}


def packages():
    info = {d: version(d) for d in ("torch", "triton", "setuptools", "wheel", "pytest", "pytest-timeout", "numpy")}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 -- a broken torch is what the probe is for
        info["torch_import"] = f"{type(e).__name__}: {e}"
        return info
    info.update(torch_cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version()
                if torch.backends.cudnn.is_available() else None, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}{p.minor}", sms=p.multi_processor_count,
                    gpu_memory_gib=round(p.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    return info


def build_needs():
    info = {}
    inc = sysconfig.get_paths().get("include") or ""
    info["python_h"] = os.path.join(inc, "Python.h") if os.path.exists(os.path.join(inc, "Python.h")) else None
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "omp.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        out = run([cc, "-fopenmp", src, "-o", os.path.join(d, "omp")], timeout=60)
        info["omp_h"] = "ok" if not out.startswith(("exit status", "not run")) else out
    info["cc"] = cc
    try:
        find_cuda, cuda_lib_dir = setup_py_functions("find_cuda", "cuda_lib_dir")
        found = find_cuda()
    except Exception as e:  # noqa: BLE001
        found, info["find_cuda_error"] = None, f"{type(e).__name__}: {e}"
    info["nvcc_on_path"] = shutil.which("nvcc")
    if found:
        nvcc, home = found
        info.update(nvcc=nvcc, cuda_home=home, libcudart_static=os.path.join(cuda_lib_dir(home), "libcudart_static.a"),
                    nvcc_version=run([nvcc, "--version"]).splitlines()[-1:])
    else:
        info.update(nvcc=None, libcudart_static=None)
    return info


def sdpa_choices():
    """Which kernel SDPA picks (torch._fused_sdp_choice) for bfloat16 at the timed
    size: plain attention, and the "sdpa" backend's shapes (Q~, K~ of L*D against
    v of D: "concat"; v padded to L*D: "pad_v"), causal or not, inference and
    training (tensors that require grad)."""
    import torch
    from torch.nn.attention import SDPBackend
    names = {int(b.value): n for n, b in SDPBackend.__members__.items()}
    B, H, T, D, L = TIMED
    dev = torch.device("cuda")
    shapes = {"plain attention (D, D, D)": (D, D), "sdpa backend, concat (L*D, L*D, D)": (L * D, D),
              "sdpa backend, pad_v (L*D, L*D, L*D)": (L * D, L * D)}
    res = {}
    for name, (dqk, dv) in shapes.items():
        for grad in (False, True):
            q = torch.empty(B, H, T, dqk, device=dev, dtype=torch.bfloat16, requires_grad=grad)
            v = torch.empty(B, H, T, dv, device=dev, dtype=torch.bfloat16, requires_grad=grad)
            for causal in (False, True):
                key = f"{name}, {'training' if grad else 'inference'}, {'causal' if causal else 'not causal'}"
                try:
                    c = torch._fused_sdp_choice(q, q, v, None, 0.0, causal, scale=D ** -0.5)
                    res[key] = names.get(int(c), str(c))
                except Exception as e:  # noqa: BLE001
                    res[key] = f"{type(e).__name__}: {e}"[:300]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    start = time.monotonic()
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def write():
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    for name, fn in (("machine", machine), ("packages", packages), ("build", build_needs)):
        try:
            report[name] = fn()
        except Exception as e:  # noqa: BLE001 -- each section on its own
            report[name] = {"error": f"{type(e).__name__}: {e}"}
        write()
    gpu = report["packages"].get("cuda_available") is True
    if gpu:
        try:
            report["sdpa_choice"] = sdpa_choices()
        except Exception as e:  # noqa: BLE001
            report["sdpa_choice"] = {"error": f"{type(e).__name__}: {e}"}
    b = report["build"]
    stops = [what for what, bad in (("no Python.h", not b.get("python_h")),
                                    ("no OpenMP (omp.h, -fopenmp)", b.get("omp_h") != "ok"),
                                    ("no nvcc with a libcudart_static.a", gpu and not b.get("libcudart_static")))
             if bad]
    report["gpu"] = gpu
    report["hkt_cuda_archs"] = report["packages"].get("capability") if gpu else None
    report["build_blockers"] = stops
    write()
    print(json.dumps({k: report[k] for k in ("gpu", "hkt_cuda_archs", "build_blockers")}))
    print(f"packages: {json.dumps(report['packages'])}")
    return 1 if stops else (0 if gpu else 3)


if __name__ == "__main__":
    sys.exit(main())
