# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BUILD_INPUTS := pyproject.toml constraints.txt $(wildcard setup.py native/*.c native/*.cc native/*.cpp native/*.h)

.PHONY: venv demo test test-unit bench clean

$(STAMP): $(BUILD_INPUTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

bench: $(STAMP)
	$(PY) benchmarks/bench_launch.py

clean:
	rm -rf build *.egg-info sparkgpu/_native*.so
