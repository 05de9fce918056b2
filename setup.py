"""Builds hkt._C: plain C11 + OpenMP, no torch needed at build time.

DEBUG=1 builds -O0 -g.  HKT_NO_OPENMP=1 builds single-threaded (for compilers
without OpenMP).
"""
import os

from setuptools import Extension, setup

debug = os.environ.get("DEBUG", "0") == "1"
openmp = os.environ.get("HKT_NO_OPENMP", "0") != "1"

cflags = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Wno-psabi"]
cflags += ["-O0", "-g"] if debug else ["-O3"]
ldflags = []
if openmp:
    cflags.append("-fopenmp")
    ldflags.append("-fopenmp")

setup(
    ext_modules=[
        Extension(
            "hkt._C",
            sources=["csrc/hkt_attention.c", "csrc/hkt_module.c"],
            include_dirs=["csrc"],
            depends=["csrc/hkt.h", "csrc/dlpack.h"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    ],
)
