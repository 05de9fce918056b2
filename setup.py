"""Builds hkt._C: plain C11 + OpenMP, no torch needed at build time.

The binding uses only CPython's stable ABI (Py_LIMITED_API = 3.10), so the
extension is hkt/_C.abi3.so and a wheel is tagged cp310-abi3: one wheel for
CPython 3.10 and every later 3.x (not the free-threaded builds, which have no
stable ABI).

DEBUG=1 builds -O0 -g.  HKT_NO_OPENMP=1 builds single-threaded (for compilers
without OpenMP).  CFLAGS=-DHKT_NO_CLONES builds the hot loops once, for the
compiler's default target, instead of AVX-512/AVX2/baseline clones picked at
load time (for toolchains without ifunc support).

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
define_macros, libraries, library_dirs = [("Py_LIMITED_API", hex(LIMITED_API))], [], []
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

setup(
    ext_modules=[
        Extension(
            "hkt._C",
            sources=["csrc/hkt_attention.c", "csrc/hkt_decode.c", "csrc/hkt_cpu_f32.c", "csrc/hkt_cpu_f64.c",
                     "csrc/hkt_cpu_f32_avx2.c", "csrc/hkt_cpu_f64_avx2.c", "csrc/hkt_cpu_f32_avx512.c",
                     "csrc/hkt_cpu_f64_avx512.c", "csrc/hkt_varlen.c", "csrc/hkt_downsample.c",
                     "csrc/hkt_binding.c"],
            include_dirs=["csrc"],
            depends=["csrc/hkt.h", "csrc/dlpack.h", "csrc/hkt_dropout.h", "csrc/hkt_level.h", "csrc/hkt_cpu.h", "csrc/hkt_real.h",
                     "csrc/hkt_attention_body.h", "csrc/hkt_decode_body.h", "csrc/hkt_bf16_body.h", "csrc/hkt_isa.h"]
            + ([CUDA_SOURCE] if build_ext_cuda.nvcc else []),
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
