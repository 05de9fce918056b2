# Two commands do all set-up on a fresh machine:
#   make demo   builds everything and runs the demo on built-in random data
#   make test   builds everything and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# exactly this torch: a CPU build pip finds locally; an unpinned torch would pull a CUDA build
TORCH  ?= torch==2.13.0

.PHONY: install test demo bench clean

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

clean:
	rm -rf build *.egg-info hkt/*.so
