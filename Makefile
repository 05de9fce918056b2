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

.PHONY: install test demo bench bench-avx2 clean fuzz sanitize wheel wheel-check

$(BIN)/.installed: pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h csrc/*.cu csrc/binding/*.c csrc/binding/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,experiments,transformers]"
	touch $@

install: $(BIN)/.installed

test: install
	HKT_TEST_CUDA_EMULATION=1 $(BIN)/python -m pytest -q tests

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
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

wheel: $(BIN)/python
	$(BIN)/python -m pip install -q build
	rm -f dist/hkt-*.whl
	$(BIN)/python -m build --wheel --outdir dist .

# Installs that wheel into a clean venv of another CPython (WHEEL_CHECK_PYTHON, or the
# first of python3.13/3.12/3.10/3.14, pyenv's, apt's) with NumPy only, and checks hkt._C there.
# abi3audit first: the extension's symbols are all in the 3.10 stable ABI.
wheel-check: wheel
	$(BIN)/python -m pip install -q abi3audit
	$(BIN)/abi3audit --strict --assume-minimum-abi3 3.10 dist/hkt-*-abi3-*.whl
	$(BIN)/python tools/wheel_check.py dist/hkt-*-abi3-*.whl $(if $(WHEEL_CHECK_PYTHON),--python $(WHEEL_CHECK_PYTHON))

# The differential fuzz (tests/test_fuzz.py) at full size: FUZZ_EXAMPLES examples
# against the reference in each of float64, float32 and bfloat16 (make test runs 150);
# FUZZ_SEED=n draws another fixed set; HKT_CPU_KERNELS=avx2|default fuzzes those builds.
FUZZ_EXAMPLES ?= 20000
fuzz: install
	HKT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(if $(FUZZ_SEED),HKT_FUZZ_SEED=$(FUZZ_SEED)) \
	    $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/test_fuzz.py -k "test_fuzz_"

# The test suite and the fuzz against an ASan+UBSan build of hkt._C.  The build and
# a copy of the package and tests live in build/sanitize/ (the in-place build is
# untouched); the tests run there, so they import the sanitized extension, and
# every child interpreter they start inherits the preloaded sanitizer runtimes.
# Skipped there: the notebook (a Jupyter kernel under ASan), the torchrun test,
# the training run and the emulated-CUDA grid: plain torch work, slow under ASan;
# and the check of the committed results files (JSON only, no extension; not copied).
SAN_DIR      = build/sanitize
SAN_EXAMPLES ?= 1000
SAN_SKIP     = --ignore=tests/test_notebook.py --ignore=tests/test_experiments.py \
               --ignore=tests/test_distributed.py --ignore=tests/test_cuda.py --ignore=tests/test_results.py \
               --ignore=tests/test_exp_lanes.py --ignore=tests/test_bench_report.py
SAN_ENV      = LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
               ASAN_OPTIONS=detect_leaks=0,allocator_may_return_null=1,detect_odr_violation=0 \
               UBSAN_OPTIONS=halt_on_error=1,print_stacktrace=1
sanitize: install
	rm -rf $(SAN_DIR)/root
	mkdir -p $(SAN_DIR)/root
	HKT_SANITIZE=1 $(BIN)/python setup.py -q build_ext --build-lib $(SAN_DIR)/lib --build-temp $(SAN_DIR)/tmp
	cp -r hkt research tests examples docs README.md pyproject.toml $(SAN_DIR)/root/
	rm -rf $(SAN_DIR)/root/hkt/_C*.so $$(find $(SAN_DIR)/root -name __pycache__)
	cp $(SAN_DIR)/lib/hkt/_C*.so $(SAN_DIR)/root/hkt/
	cd $(SAN_DIR)/root && $(SAN_ENV) $(abspath $(BIN))/python -c \
	    "import hkt._C as C; assert C.__file__.startswith('$(abspath $(SAN_DIR))'), C.__file__; print('sanitized:', C.__file__)"
	cd $(SAN_DIR)/root && $(SAN_ENV) HKT_FUZZ_EXAMPLES=$(SAN_EXAMPLES) HKT_HOSTILE_TIMEOUT=120 \
	    $(abspath $(BIN))/python -m pytest -q -p no:cacheprovider tests $(SAN_SKIP)

clean:
	rm -rf build dist *.egg-info hkt/*.so
