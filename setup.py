"""Builds hkt._C: plain C11 + OpenMP, no torch needed at build time.

The binding uses only CPython's stable ABI (Py_LIMITED_API = 3.10), so the
extension is hkt/_C.abi3.so and a wheel is tagged cp310-abi3: one wheel for
CPython 3.10 and every later 3.x (not the free-threaded builds, which have no
stable ABI).

DEBUG=1 builds -O0 -g.  OpenMP: the first form the compiler builds and links
with is used -- -fopenmp (GCC's libgomp, clang's libomp), then Apple clang's
-Xpreprocessor -fopenmp -lomp with libomp's include and lib folders under
$OpenMP_ROOT or Homebrew's prefixes; with none, the build goes on
single-threaded and says so once, with how to get threads
(hkt._C.default_threads() is 1 in such a build).  HKT_NO_OPENMP=1 builds
single-threaded without looking.  A single-threaded build keeps the kernels'
`omp simd` loops (-fopenmp-simd, no runtime needed), so it sums in the same
order as the threaded one.  CFLAGS=-DHKT_NO_ISA_BUILDS builds the kernels once,
for the compiler's default target, instead of the AVX-512, AVX2 and portable
builds picked at import (GCC and clang make those on x86-64; other targets,
AArch64 included, build the portable one).  A build with other options than the
last one in this tree (these variables, CC, CFLAGS, LDFLAGS, the OpenMP form
found) recompiles everything: setuptools alone compares file dates only.

HKT_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer
(-fsanitize=address,undefined, frame pointers kept, any UB report fatal).  Such
an extension only loads into a process that has libasan first: `make sanitize`
builds one outside the source tree and runs the tests with it under LD_PRELOAD.

HKT_CUDA=1 also builds the CUDA kernels (csrc/cuda/hkt_attention_cuda.cu) when nvcc
is found (on PATH, or $CUDA_HOME/bin/nvcc); without nvcc it warns and builds
the CPU-only extension.  HKT_CUDA_ARCHS="80 90" picks the GPU architectures
(SASS for each, plus PTX of the last for newer GPUs).  The extension links the
CUDA runtime statically (libcudart_static.a, with -ldl -lrt -lpthread), so it
needs only the NVIDIA driver (libcuda.so.1) where it is imported, not the
toolkit nor a libcudart of one version, and it cannot clash with the libcudart
torch loads: `ldd hkt/_C.abi3.so` lists no libcudart.
"""
import importlib.util
import json
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
# -ffp-contract=fast: a product may fuse into a later addition, across
# statements: GCC's default for gnu11 already; clang contracts only within one
# expression unless asked, and asked its dense float32 kernels give GCC's bits
# (docs/install.md)
cflags = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Wno-psabi", "-fno-trapping-math",
          "-ffp-contract=fast"]
cflags += ["-O0", "-g"] if debug else ["-O3"]
ldflags = []
if os.environ.get("HKT_SANITIZE", "0") == "1":
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    cflags += sanitize + ["-g"]
    ldflags += sanitize

CUDA_SOURCE = "csrc/cuda/hkt_attention_cuda.cu"
# the CPU kernels (no Python.h), and the binding, the only C that includes it
# (csrc/cpu/: the type-free parts, the dispatch, and each real type's kernels
# built per instruction set)
KERNEL_SOURCES = [f"csrc/cpu/{name}.c" for name in
                  ("hkt_dispatch", "hkt_attention", "hkt_decode", "hkt_varlen", "hkt_downsample", "hkt_window",
                   *(f"hkt_{family}_{t}{isa}" for family in ("cpu", "window") for t in ("f32", "f64")
                     for isa in ("", "_avx2", "_avx512")))]
BINDING_SOURCES = [f"csrc/binding/{name}.c" for name in
                   ("capsules", "checks", "arguments", "attention", "varlen", "decode", "downsample", "window",
                    "module")]
# every header a source includes: setuptools rebuilds by file dates, these included
HEADERS = sorted(os.path.join(d, f) for d in ("csrc", "csrc/cpu", "csrc/cuda", "csrc/binding") for f in os.listdir(d)
                 if f.endswith(".h"))


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


NO_OPENMP = {"cflags": [], "ldflags": [], "include_dirs": [], "library_dirs": [], "libraries": []}
NO_OPENMP_MESSAGE = """\
the C compiler ({cc}) builds nothing with OpenMP here, so hkt._C is
built single-threaded (hkt._C.default_threads() is 1).  For threads, install an
OpenMP runtime and build again: on macOS, Homebrew's libomp (brew install libomp,
or set OpenMP_ROOT to its folder); on Debian/Ubuntu with clang, libomp-dev (GCC's
libgomp comes with gcc).  HKT_NO_OPENMP=1 builds single-threaded without this."""
# a parallel region and the runtime's API: omp.h, the flag and the library
OMP_PROBE = """#include <omp.h>
int hkt_probe(void) {
    int n = 0;
#pragma omp parallel reduction(+ : n)
    n += omp_get_num_threads();
    return n;
}
"""
SIMD_PROBE = """int hkt_probe(const int *x) {
    int n = 0;
#pragma omp simd reduction(+ : n)
    for (int i = 0; i < 8; i++) n += x[i];
    return n;
}
"""


def openmp_forms():
    """The ways to build with OpenMP, tried in order: the compiler's own flag
    (GCC, LLVM's clang), then Apple clang's, which has no -fopenmp driver flag
    and ships no runtime: the preprocessor's flag, and libomp from $OpenMP_ROOT
    or Homebrew (Apple silicon's prefix, then Intel's)."""
    yield dict(NO_OPENMP, cflags=["-fopenmp"], ldflags=["-fopenmp"])
    roots = [os.environ.get("OpenMP_ROOT"), "/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"]
    for root in [r for r in roots if r and os.path.isdir(r)]:
        yield {"cflags": ["-Xpreprocessor", "-fopenmp"], "ldflags": [],
               "include_dirs": [os.path.join(root, "include")], "library_dirs": [os.path.join(root, "lib")],
               "libraries": ["omp"]}


class build_ext_cuda(build_ext):
    """Compiles the .cu with nvcc into an object the C linker adds to hkt._C
    (when nvcc is set), and removes hkt/_C binaries of other ABIs next to the
    one it built, in build/ and in place: a _C.cpython-311-*.so left from an
    older build would go into the wheel beside _C.abi3.so, and would shadow it
    in hkt/ (Python tries the version-tagged name first)."""

    nvcc = None

    def build_extensions(self):
        # the OpenMP form is found here, where the compiler is known
        omp = self._find_openmp()
        # clang reports each `omp simd` loop it leaves scalar (the reductions
        # whose order it keeps): dozens of lines of no use to a user
        quiet = ["-Wno-pass-failed"] if self._is_clang() else []
        for ext in self.extensions:
            ext.extra_compile_args = [*ext.extra_compile_args, *omp["cflags"], *quiet]
            ext.extra_link_args = [*ext.extra_link_args, *omp["ldflags"]]
            ext.include_dirs = [*ext.include_dirs, *omp["include_dirs"]]
            ext.library_dirs = [*ext.library_dirs, *omp["library_dirs"]]
            ext.libraries = [*ext.libraries, *omp["libraries"]]
        # setuptools rebuilds by file dates only, so a build with other options
        # over the objects of the last one (build/ stays in the tree) would link
        # those: a single-threaded build once, a threaded one after kept one thread
        options = BUILD_OPTIONS + repr(sorted(omp.items())) + repr(quiet)
        stamp = os.path.join(self.build_temp, "hkt-build-options")
        try:
            with open(stamp) as f:
                if f.read() != options:
                    self.force = True
        except OSError:
            self.force = True
        super().build_extensions()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(options)

    def _is_clang(self):
        try:
            out = subprocess.run([self.compiler.compiler[0], "--version"], capture_output=True, text=True).stdout
        except OSError:
            return False
        return "clang" in out

    def _find_openmp(self):
        """The first of openmp_forms() the compiler builds and links with; else
        single-threaded (said once, unless HKT_NO_OPENMP=1 asked for it), with
        the simd loops kept where the compiler can."""
        if openmp:
            for flags in openmp_forms():
                if self._probe(OMP_PROBE, flags, link=True):
                    return flags
            text = NO_OPENMP_MESSAGE.format(cc=self.compiler.compiler[0])
            print("warning: " + text, file=sys.stderr)
            message = " ".join(text.split())
        # the extension repeats the message at import: pip hides a build's
        # output unless -v (a JSON string of ASCII text is a C string literal)
        missing = [f"-DHKT_OPENMP_MISSING={json.dumps(message)}"] if openmp else []
        simd = dict(NO_OPENMP, cflags=["-fopenmp-simd", *missing])
        return simd if self._probe(SIMD_PROBE, simd, link=False) else dict(NO_OPENMP, cflags=missing)

    def _probe(self, code, flags, link):
        """Whether the compiler builds code with flags (and links it into a
        shared object: a compile alone passes where omp.h is there but the
        runtime library is not).  The compiler's own message says why not."""
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "probe.c")
            with open(src, "w") as f:
                f.write(code)
            try:
                objs = self.compiler.compile([src], output_dir=d, include_dirs=flags["include_dirs"],
                                             extra_postargs=flags["cflags"])
                if link:
                    self.compiler.link_shared_object(objs, os.path.join(d, "probe.so"),
                                                     libraries=flags["libraries"],
                                                     library_dirs=flags["library_dirs"],
                                                     extra_postargs=flags["ldflags"])
            except Exception:  # CompileError, LinkError
                return False
        return True

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
    one, and warns when they differ.  hkt/_core/sources.py's function, loaded by its
    path (hkt itself cannot be imported before its extension is built)."""
    spec = importlib.util.spec_from_file_location("_hkt_sources", os.path.join("hkt", "_core", "sources.py"))
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
