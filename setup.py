"""Builds hkt._C: plain C11 + OpenMP, no torch needed at build time.

The binding uses only CPython's stable ABI (Py_LIMITED_API = 3.10), so the
extension is hkt/_C.abi3.so and a wheel is tagged cp310-abi3: one wheel for
CPython 3.10 and every later 3.x (not the free-threaded builds, which have no
stable ABI).

DEBUG=1 builds -O0 -g.  HKT_NO_OPENMP=1 builds single-threaded (for compilers
without OpenMP).  CFLAGS=-DHKT_NO_ISA_BUILDS builds the kernels once, for the
compiler's default target, instead of the AVX-512, AVX2 and portable builds
picked at import (GCC on x86-64 only makes those; other compilers, clang
included, build the portable one).  A build with other options than the last
one in this tree (these variables, CC, CFLAGS, LDFLAGS) recompiles everything:
setuptools alone compares file dates only.

HKT_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer
(-fsanitize=address,undefined, frame pointers kept, any UB report fatal).  Such
an extension only loads into a process that has libasan first: `make sanitize`
builds one outside the source tree and runs the tests with it under LD_PRELOAD.

HKT_CUDA=1 also builds the CUDA kernels (csrc/hkt_attention_cuda.cu) when nvcc
is found (on PATH, or $CUDA_HOME/bin/nvcc); without nvcc it warns and builds
the CPU-only extension.  HKT_CUDA_ARCHS="80 90" picks the GPU architectures
(SASS for each, plus PTX of the last for newer GPUs).  The extension links the
CUDA runtime statically (libcudart_static.a, with -ldl -lrt -lpthread), so it
needs only the NVIDIA driver (libcuda.so.1) where it is imported, not the
toolkit nor a libcudart of one version, and it cannot clash with the libcudart
torch loads: `ldd hkt/_C.abi3.so` lists no libcudart.
"""
import importlib.util
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

debug = os.environ.get("DEBUG", "0") == "1"
openmp = os.environ.get("HKT_NO_OPENMP", "0") != "1"

# -fno-trapping-math: FP operations raise no traps we rely on, so GCC may compute
# both sides of a select and vectorise branchy loops (the softmax's exp) without
# AVX-512's masks -- with AVX2 it kept that loop scalar; it changes no computed
# value (no reassociation, unlike -ffast-math)
cflags = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Wno-psabi", "-fno-trapping-math"]
cflags += ["-O0", "-g"] if debug else ["-O3"]
ldflags = []
if openmp:
    cflags.append("-fopenmp")
    ldflags.append("-fopenmp")
if os.environ.get("HKT_SANITIZE", "0") == "1":
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    cflags += sanitize + ["-g"]
    ldflags += sanitize

CUDA_SOURCE = "csrc/hkt_attention_cuda.cu"
# the CPU kernels (no Python.h), and the binding, the only C that includes it
KERNEL_SOURCES = ["csrc/hkt_attention.c", "csrc/hkt_decode.c", "csrc/hkt_cpu_f32.c", "csrc/hkt_cpu_f64.c",
                  "csrc/hkt_cpu_f32_avx2.c", "csrc/hkt_cpu_f64_avx2.c", "csrc/hkt_cpu_f32_avx512.c",
                  "csrc/hkt_cpu_f64_avx512.c", "csrc/hkt_varlen.c", "csrc/hkt_downsample.c", "csrc/hkt_window.c"]
BINDING_SOURCES = [f"csrc/binding/{name}.c" for name in
                   ("capsules", "checks", "arguments", "attention", "varlen", "decode", "downsample", "window",
                    "module")]
# every header a source includes: setuptools rebuilds by file dates, these included
HEADERS = sorted(os.path.join(d, f) for d in ("csrc", "csrc/binding") for f in os.listdir(d) if f.endswith(".h"))


def find_cuda():
    """(nvcc, cuda_home) or None.  nvcc may be a wrapper script outside the toolkit
    (e.g. /usr/local/bin/nvcc), so the toolkit is looked for in $CUDA_HOME /
    $CUDA_PATH, next to nvcc, then /usr/local/cuda."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = None
    for home in homes:
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            nvcc = os.path.join(home, "bin", "nvcc")
            break
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        return None
    homes += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in homes:
        if home and cuda_lib_dir(home):
            return nvcc, home
    return None


def cuda_lib_dir(home):
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        d = os.path.join(home, sub)
        if os.path.exists(os.path.join(d, "libcudart_static.a")):
            return d
    return None


def gencode_flags():
    archs = os.environ.get("HKT_CUDA_ARCHS", "80 90").replace(";", " ").replace(",", " ").split()
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


class build_ext_cuda(build_ext):
    """Compiles the .cu with nvcc into an object the C linker adds to hkt._C
    (when nvcc is set), and removes hkt/_C binaries of other ABIs next to the
    one it built, in build/ and in place: a _C.cpython-311-*.so left from an
    older build would go into the wheel beside _C.abi3.so, and would shadow it
    in hkt/ (Python tries the version-tagged name first)."""

    nvcc = None

    def run(self):
        # setuptools rebuilds by file dates only, so a build with other options
        # over the objects of the last one (build/ stays in the tree) would link
        # those: HKT_NO_OPENMP=1 once, a plain build after kept one thread
        stamp = os.path.join(self.build_temp, "hkt-build-options")
        try:
            with open(stamp) as f:
                if f.read() != BUILD_OPTIONS:
                    self.force = True
        except OSError:
            self.force = True
        super().run()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(BUILD_OPTIONS)

    def build_extensions(self):
        if openmp:
            self._check_openmp()
        super().build_extensions()

    def _check_openmp(self):
        """A compiler without OpenMP fails on omp.h deep in the first file: say
        so first, with the way out."""
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "omp_probe.c")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint hkt_probe(void) { return omp_get_max_threads(); }\n")
            try:
                self.compiler.compile([src], output_dir=d, extra_postargs=["-fopenmp"])
            except Exception as e:  # CompileError; its message is the compiler's
                raise SystemExit(f"error: the C compiler ({' '.join(self.compiler.compiler)}) cannot build with "
                                 f"OpenMP (-fopenmp, omp.h): install its OpenMP runtime (libgomp for GCC, libomp "
                                 f"for clang), or build single-threaded with HKT_NO_OPENMP=1\n{e}") from None

    def _remove_other_abis(self, ext):
        # next to the binary just built (build/lib..., or hkt/ in place): a wheel
        # would pack both, and an import would pick the version-tagged one
        folder, built = os.path.split(self.get_ext_fullpath(ext.name))
        stem = ext.name.rsplit(".", 1)[-1] + "."
        for name in os.listdir(folder or "."):
            if name != built and name.startswith(stem) and name.endswith((".so", ".pyd")):
                os.remove(os.path.join(folder, name))

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        for ext in self.extensions:
            self._remove_other_abis(ext)

    def build_extension(self, ext):
        if self.nvcc:
            os.makedirs(self.build_temp, exist_ok=True)
            obj = os.path.join(self.build_temp, "hkt_attention_cuda.o")
            cmd = [self.nvcc, "-std=c++17", "-cudart", "static", "-Xcompiler", "-fPIC", "-Icsrc", "-DHKT_WITH_CUDA",
                   *(["-O0", "-g", "-lineinfo"] if debug else ["-O3"]), *gencode_flags(),
                   "-c", CUDA_SOURCE, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            ext.extra_objects = [*ext.extra_objects, obj]
        super().build_extension(ext)
        self._remove_other_abis(ext)


# the one place that says which stable ABI the binding is written against
LIMITED_API = 0x030A0000  # CPython 3.10; wheel tag cp310-abi3


def source_hash(folder="csrc"):
    """The digest of the C sources, built into the extension (hkt._C.source_hash):
    hkt/__init__.py computes it of the csrc/ beside the package, where there is
    one, and warns when they differ.  hkt/_sources.py's function, loaded by its
    path (hkt itself cannot be imported before its extension is built)."""
    spec = importlib.util.spec_from_file_location("_hkt_sources", os.path.join("hkt", "_sources.py"))
    sources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sources)
    digest = sources.source_digest(folder)
    if digest is None:
        raise SystemExit(f"error: cannot read the C sources in {folder}/")
    return digest


# libm: exp, log, sqrt (a Python process has it loaded, but the extension says so itself)
define_macros, libraries, library_dirs = [("Py_LIMITED_API", hex(LIMITED_API)),
                                          ("HKT_SOURCE_HASH", f'"{source_hash()}"')], ["m"], []
cmdclass = {"build_ext": build_ext_cuda}
if os.environ.get("HKT_CUDA", "0") == "1":
    found = find_cuda()
    if found is None:
        print("warning: HKT_CUDA=1 but nvcc (and a CUDA toolkit with libcudart_static.a) was not found; "
              "building hkt._C for the CPU only", file=sys.stderr)
    else:
        nvcc, home = found
        build_ext_cuda.nvcc = nvcc
        define_macros.append(("HKT_WITH_CUDA", None))
        # the static CUDA runtime (it loads libcuda.so.1, the driver, at run time)
        # and what it needs; nvcc's host code needs the C++ runtime, which the C
        # linker does not add
        libraries += ["cudart_static", "dl", "rt", "pthread", "stdc++"]
        library_dirs.append(cuda_lib_dir(home))

# what a build depends on besides the sources (build_ext_cuda.run compares it
# with the last build's)
BUILD_OPTIONS = repr(sorted({
    "cflags": cflags, "ldflags": ldflags, "nvcc": build_ext_cuda.nvcc, "macros": define_macros,
    "archs": os.environ.get("HKT_CUDA_ARCHS", "") if build_ext_cuda.nvcc else "",
    **{k: os.environ.get(k, "") for k in ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED")},
}.items()))

setup(
    ext_modules=[
        Extension(
            "hkt._C",
            sources=KERNEL_SOURCES + BINDING_SOURCES,
            include_dirs=["csrc"],
            depends=HEADERS + [CUDA_SOURCE],
            define_macros=define_macros,
            libraries=libraries,
            library_dirs=library_dirs,
            extra_compile_args=cflags,
            extra_link_args=ldflags,
            py_limited_api=True,
        )
    ],
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": f"cp{LIMITED_API >> 24}{(LIMITED_API >> 16) & 0xFF}"}},
)
