# Two commands do all set-up on a fresh machine:
#   make demo   builds everything and runs the demo on built-in random data
#   make test   builds everything and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# exactly this torch: a CPU build pip finds locally; an unpinned torch would pull a CUDA build
TORCH  ?= torch==2.13.0

.PHONY: install test demo bench clean wheel wheel-check

$(BIN)/.installed: pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h csrc/*.cu)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BIN)/.installed

test: install
	HKT_TEST_CUDA_EMULATION=1 $(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/python -m hkt.demo

bench: install
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_module.py

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

clean:
	rm -rf build dist *.egg-info hkt/*.so
