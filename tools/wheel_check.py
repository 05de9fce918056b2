"""make wheel-check: the manylinux abi3 wheel works on a CPython other than the one that built it.

    python tools/wheel_check.py dist/hkt-*-cp310-abi3-manylinux*.whl [--python PYTHON]

Checks the wheel first: tagged abi3 and manylinux (auditwheel's repair, which
``make wheel`` runs), and no OpenMP runtime inside it (``--exclude
libgomp.so.1``: torch's own serves hkt._C).  Then finds a second CPython >= 3.10
(``--python``, else $WHEEL_CHECK_PYTHON, else python3.13 / 3.12 / 3.10 / 3.14
that run, else pyenv's versions, else Debian's python3.X from apt-get), makes a
clean venv with it in a temporary folder, installs NumPy (from PyPI) and the
wheel (``--no-deps``: no torch there), and runs this file again inside that
venv (``--inner``), which loads the installed ``hkt/_C.abi3.so`` by itself
(``hkt/__init__.py`` imports torch), checks its forward, backward and dropout
mask on NumPy arrays against a float64 NumPy reference written here, and that
the process maps one OpenMP runtime, from outside the installed package.

:func:`openmp_runtimes` is also what tests/packaging/test_openmp_runtime.py reads the
process with (torch and hkt, both import orders).
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

CANDIDATES = ["python3.13", "python3.12", "python3.10", "python3.14"]

# GNU's, Intel's and LLVM's OpenMP runtimes, by file name (libgomp.so.1,
# libgomp-a34b3233.so.1 as auditwheel renames a vendored one, libiomp5.so, libomp.so)
_OPENMP_RUNTIME = re.compile(r"lib(gomp|iomp5|omp)\b[^/]*\.so[^/]*$")


def openmp_runtimes(maps="/proc/self/maps"):
    """The files of the OpenMP runtimes mapped into this process (a set of paths)."""
    found = set()
    with open(maps) as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and _OPENMP_RUNTIME.match(os.path.basename(parts[5].strip())):
                found.add(parts[5].strip())
    return found


# --------------------------------------------------------------------------- outer: find, install, run

def _version(python):
    try:
        out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2]); "
                              "print(sys.implementation.name)"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or lines[1] != "cpython":
        return None
    major, minor = map(int, lines[0].split("."))
    return (major, minor)


def _pyenv_pythons():
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    return sorted(glob.glob(os.path.join(root, "versions", "3.1[0-9]*", "bin", "python3")), reverse=True)


def _apt_python(exclude):
    """Debian's python3.X besides the build's, when apt offers one (needs root)."""
    if shutil.which("apt-get") is None:
        return None
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
    for minor in (13, 12, 10, 14):
        if (3, minor) == exclude:
            continue
        pkg = f"python3.{minor}"
        policy = subprocess.run(["apt-cache", "policy", pkg], capture_output=True, text=True, timeout=60).stdout
        if "Candidate:" in policy and "Candidate: (none)" not in policy:
            subprocess.run(["apt-get", "install", "-y", "-qq", pkg, f"{pkg}-venv"], check=True, timeout=900)
            return shutil.which(pkg)
    return None


def find_python(explicit):
    here = sys.version_info[:2]
    if explicit:
        v = _version(explicit)
        if v is None or v < (3, 10):
            sys.exit(f"wheel-check: {explicit} is not a runnable CPython >= 3.10")
        return explicit, v
    for cand in [c for c in CANDIDATES if shutil.which(c)] + _pyenv_pythons():
        v = _version(cand)
        if v is not None and v >= (3, 10) and v != here:
            return cand, v
    cand = _apt_python(here)
    if cand:
        return cand, _version(cand)
    sys.exit(f"wheel-check: no CPython >= 3.10 other than {here[0]}.{here[1]} found "
             "(set WHEEL_CHECK_PYTHON, or install one)")


def check_wheel_file(wheel):
    """What the wheel's name and contents promise: abi3, manylinux, and no
    OpenMP runtime of its own (hkt._C takes the process's)."""
    name = os.path.basename(wheel)
    if "-abi3-" not in name:
        sys.exit(f"wheel-check: {name} is not an abi3 wheel")
    if "-abi3-manylinux" not in name:
        sys.exit(f"wheel-check: {name} is not a manylinux wheel (auditwheel repair it: make wheel)")
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
    vendored = [f for f in files if _OPENMP_RUNTIME.match(os.path.basename(f))]
    if vendored:
        sys.exit(f"wheel-check: {name} vendors an OpenMP runtime ({vendored}): a second one beside torch's; "
                 "repair with --exclude libgomp.so.1")
    if "hkt/_C.abi3.so" not in files:
        sys.exit(f"wheel-check: {name} has no hkt/_C.abi3.so")


def outer(wheel, python):
    check_wheel_file(wheel)
    python, v = find_python(python or os.environ.get("WHEEL_CHECK_PYTHON"))
    print(f"wheel-check: {os.path.basename(wheel)} on CPython {v[0]}.{v[1]} ({python}); "
          f"built with {sys.version_info[0]}.{sys.version_info[1]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hkt-wheel-check-") as tmp:
        venv = os.path.join(tmp, "venv")
        subprocess.run([python, "-m", "venv", venv], check=True, timeout=300)
        vpy = os.path.join(venv, "bin", "python")
        pip = [vpy, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run(pip + ["numpy"], check=True, timeout=900)
        subprocess.run(pip + ["--no-deps", os.path.abspath(wheel)], check=True, timeout=300)
        # run from the temporary folder: the source tree's hkt/ must not be found instead
        res = subprocess.run([vpy, os.path.abspath(__file__), "--inner"], cwd=tmp, timeout=600)
        if res.returncode:
            sys.exit(res.returncode)


# --------------------------------------------------------------------------- inner: inside the clean venv

def _load_installed_extension():
    import importlib.machinery
    import importlib.util
    import sysconfig
    folder = os.path.join(sysconfig.get_paths()["platlib"], "hkt")
    found = sorted(glob.glob(os.path.join(folder, "_C*.so")))
    if [os.path.basename(f) for f in found] != ["_C.abi3.so"]:
        sys.exit(f"wheel-check: expected only hkt/_C.abi3.so in {folder}, found {found}")
    loader = importlib.machinery.ExtensionFileLoader("hkt._C", found[0])
    spec = importlib.util.spec_from_file_location("hkt._C", found[0], loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _reference(np, q, k, v, w, mask, scale, dout):
    """float64 NumPy: out, and the gradients of sum(out * dout)."""
    L = len(q)
    B, H, T, _ = q[0].shape
    S = k[0].shape[2]

    def up(g, l):  # (B, H, ceil(T/2^l), ceil(S/2^l)) -> (B, H, T, S)
        return np.repeat(np.repeat(g, 2**l, axis=2)[:, :, :T], 2**l, axis=3)[:, :, :, :S]

    def down(g, l):  # the adjoint of up: sum over each 2^l x 2^l block
        f = 2**l
        t, s = -(-T // f), -(-S // f)
        pad = np.zeros((B, H, t * f, s * f))
        pad[:, :, :T, :S] = g
        return pad.reshape(B, H, t, f, s, f).sum(axis=(3, 5))

    wl = [w[:, l].reshape(1, H, 1, 1) for l in range(L)]
    grams = [q[l] @ np.swapaxes(k[l], -1, -2) for l in range(L)]
    score = sum(scale * wl[l] * up(grams[l], l) for l in range(L))
    score = np.where(mask, score, -np.inf)
    P = np.exp(score - score.max(axis=-1, keepdims=True))
    P /= P.sum(axis=-1, keepdims=True)
    out = P @ v
    dv = np.swapaxes(P, -1, -2) @ dout
    dP = dout @ np.swapaxes(v, -1, -2)
    dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
    dq, dk, dw = [], [], np.zeros_like(w)
    for l in range(L):
        g = down(dS, l)
        dq.append(scale * wl[l] * (g @ k[l]))
        dk.append(scale * wl[l] * (np.swapaxes(g, -1, -2) @ q[l]))
        dw[:, l] = scale * (g * grams[l]).sum(axis=(0, 2, 3))
    return out, dq, dk, dv, dw


def inner():
    import numpy as np
    C = _load_installed_extension()
    rng = np.random.default_rng(0)
    B, H, T, S, D, Dv, L = 2, 3, 37, 29, 8, 5, 3
    scale = 0.3
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 2e-4)):
        q = [rng.standard_normal((B, H, -(-T // 2**l), D)).astype(dtype) for l in range(L)]
        k = [rng.standard_normal((B, H, -(-S // 2**l), D)).astype(dtype) for l in range(L)]
        v = rng.standard_normal((B, H, S, Dv)).astype(dtype)
        w = rng.random((H, L)).astype(dtype)
        mask = rng.random((B, 1, T, S)) > 0.3
        mask[..., 0] = True  # every row sees a key
        dout = rng.standard_normal((B, H, T, Dv)).astype(dtype)

        out = np.empty((B, H, T, Dv), dtype)
        lse = np.empty((B, H, T), dtype)
        C.forward(q, k, v, w, out, lse, attn_mask=mask, scale=scale)
        dq = [np.empty_like(x) for x in q]
        dk = [np.empty_like(x) for x in k]
        dv, dw = np.empty_like(v), np.empty_like(w)
        C.backward(dout, q, k, v, w, out, lse, dq, dk, dv, dw, attn_mask=mask, scale=scale)

        f64 = [x.astype(np.float64) for x in (*q, *k, v, w, dout)]
        ref = _reference(np, f64[:L], f64[L:2 * L], f64[2 * L], f64[2 * L + 1], mask, scale, f64[-1])
        got = (out, dq, dk, dv, dw)
        worst = 0.0
        for name, a, b in zip(("out", "dq", "dk", "dv", "dw"), got, ref):
            for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                err = float(np.max(np.abs(x.astype(np.float64) - y)) / max(1.0, float(np.max(np.abs(y)))))
                worst = max(worst, err)
                if not err <= tol:
                    sys.exit(f"wheel-check: {name} ({np.dtype(dtype).name}) differs from NumPy by {err:.3g}")
        print(f"  {np.dtype(dtype).name}: forward and backward match NumPy (max rel. error {worst:.2g})")

    keep = np.empty((1, 2, 64, 64), dtype=np.bool_)
    C.dropout_mask(keep, 1234, 0.25)
    frac = 1.0 - keep.mean()
    if not 0.2 < frac < 0.3:
        sys.exit(f"wheel-check: dropout_mask dropped {frac:.3f}, expected about 0.25")
    print(f"  dropout_mask: {frac:.3f} dropped at p = 0.25")
    runtimes = openmp_runtimes()
    package = os.path.dirname(os.path.dirname(os.path.abspath(C.__file__)))  # site-packages
    if len(runtimes) != 1 or any(r.startswith(package + os.sep) for r in runtimes):
        sys.exit(f"wheel-check: expected one OpenMP runtime from outside the installed package, found "
                 f"{sorted(runtimes)}")
    print(f"  OpenMP runtime: {next(iter(runtimes))} (the only one mapped)")
    print(f"wheel-check: ok on CPython {sys.version.split()[0]} ({C.__name__} from {os.path.basename(C.__file__)}, "
          f"no torch: {'torch' not in sys.modules})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", nargs="?")
    ap.add_argument("--python", help="the CPython to check with")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner()
    elif not args.wheel:
        ap.error("give the wheel to check")
    else:
        outer(args.wheel, args.python)


if __name__ == "__main__":
    main()
