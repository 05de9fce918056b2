"""Builds hkt._C in place (hkt/_C.abi3.so) with the setuptools that is there, also
one older than pyproject.toml asks for: the GPU machine has no package registry,
and its setuptools may be Ubuntu 24.04's 68.

    python tools/build_inplace.py [-j N]        # HKT_CUDA=1, HKT_CUDA_ARCHS=... as for setup.py

pyproject.toml writes the licence the PEP 639 way (``license = "MIT"`` with
``license-files``), which setuptools reads from 77 on; an older one rejects the
whole [project] table, so even ``setup.py build_ext`` fails.  Where setuptools is
older, the build runs in a temporary copy of what it reads (setup.py, csrc/, hkt/,
README.md, LICENSE) with a pyproject.toml whose licence is the older table form,
and the extension built there is copied into hkt/.  The metadata of that copy
matters to nobody: only the binary leaves it.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEP639_SETUPTOOLS = (77,)


def setuptools_version():
    """setuptools' version as a tuple of ints (its leading numeric parts), without
    importing it (an import patches distutils in this process)."""
    out = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('setuptools'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return tuple(int(p) for p in re.findall(r"\d+", out.split("+")[0])[:3])


def older_pyproject(text):
    """pyproject.toml's text with the PEP 639 licence (a string ``license`` and
    ``license-files``) in the table form setuptools before 77 reads, and its
    build-system requirement relaxed to match.  Raises ValueError when the text
    has no string licence to rewrite (the pyproject.toml changed: look again)."""
    lic = re.search(r'^license\s*=\s*"([^"]*)"\s*$', text, flags=re.M)
    if lic is None:
        raise ValueError("pyproject.toml: no `license = \"...\"` line to rewrite for an older setuptools")
    text = text[:lic.start()] + f'license = {{text = "{lic.group(1)}"}}' + text[lic.end():]
    text = re.sub(r"^license-files\s*=.*\n", "", text, flags=re.M)
    return re.sub(r'"setuptools>=[0-9.]+"', '"setuptools"', text)


def build(args, cwd):
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace", *args]
    print(f"[build_inplace] {' '.join(cmd)}  (in {cwd})", flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-j", "--parallel", type=int, help="compile the C files N at a time (build_ext --parallel)")
    ap.add_argument("--force", action="store_true", help="rebuild everything")
    ap.add_argument("--copy", action="store_true", help="build in a patched copy even with setuptools >= 77")
    args = ap.parse_args()
    extra = ([f"--parallel={args.parallel}"] if args.parallel else []) + (["--force"] if args.force else [])
    v = setuptools_version()
    print(f"[build_inplace] setuptools {'.'.join(map(str, v))}", flush=True)
    if v >= PEP639_SETUPTOOLS and not args.copy:
        build(extra, ROOT)
        return 0
    with tempfile.TemporaryDirectory(prefix="hkt-build-") as d:
        for name in ("setup.py", "README.md", "LICENSE", "MANIFEST.in"):
            if os.path.exists(os.path.join(ROOT, name)):
                shutil.copy2(os.path.join(ROOT, name), d)
        for folder in ("csrc", "hkt"):
            shutil.copytree(os.path.join(ROOT, folder), os.path.join(d, folder),
                            ignore=shutil.ignore_patterns("__pycache__", "_C*.so", "_C*.pyd"))
        with open(os.path.join(ROOT, "pyproject.toml")) as f:
            text = f.read()
        with open(os.path.join(d, "pyproject.toml"), "w") as f:
            f.write(older_pyproject(text))
        build(extra, d)
        built = glob.glob(os.path.join(d, "hkt", "_C*.so")) + glob.glob(os.path.join(d, "hkt", "_C*.pyd"))
        if len(built) != 1:
            raise SystemExit(f"error: expected one hkt/_C binary in the build copy, found {built}")
        for old in glob.glob(os.path.join(ROOT, "hkt", "_C*.so")) + glob.glob(os.path.join(ROOT, "hkt", "_C*.pyd")):
            os.remove(old)  # another ABI's binary would shadow the new one (setup.py's build_ext says why)
        shutil.copy2(built[0], os.path.join(ROOT, "hkt"))
        print(f"[build_inplace] copied {os.path.basename(built[0])} into {os.path.join(ROOT, 'hkt')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
