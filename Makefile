# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BUILD_INPUTS := pyproject.toml constraints.txt $(wildcard setup.py native/*.c native/*.cc native/*.cpp native/*.h native/*/*.h)

.PHONY: venv demo lint test test-unit docs docs-serve bench clean

$(STAMP): $(BUILD_INPUTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@# The interop tests read our shards with MosaicML Streaming. It declares transformers<5 and
	@# numpy<2.2, which the [hf] stack cannot share, yet imports neither pin's versions: install it
	@# without its declared requirements, plus the modules it imports. Users of [hf] never get it.
	$(PY) -m pip install -q -c constraints.txt --no-deps 'mosaicml-streaming==0.13.0'
	$(PY) -m pip install -q -c constraints.txt brotli python-snappy zstd catalogue tqdm
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Lint and type checks (configured in pyproject.toml); `make test` runs them too, so CI fails on a new finding.
LINT_PATHS := sparkgpu tests benchmarks examples
lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy sparkgpu

# Integration tests mostly wait on servers and subprocesses: workers overlap them; tests sharing a
# session server run on one worker (tests/conftest.py). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 3
# The suite starts about a thousand Python processes (agents, ranks): each would compile the
# package's modules from source again where byte code is not written (PYTHONDONTWRITEBYTECODE).
# The type check (one core for most of a minute) runs beside the tests, while their workers start
# servers; it prints when the tests end, and either failing fails the target.
test: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m compileall -q sparkgpu tests benchmarks examples
	@types=$$(mktemp); $(PY) -m mypy sparkgpu > $$types 2>&1 & mypy=$$!; \
	echo "$(PY) -m mypy sparkgpu (beside the tests)"; \
	$(PY) -m pytest -q -ra --durations=30 -n $(TEST_WORKERS); tests=$$?; \
	wait $$mypy; typed=$$?; cat $$types; rm -f $$types; \
	test $$tests -eq 0 && test $$typed -eq 0

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# The documentation site (docs/, mkdocs.yml) into site/; broken links or references fail it.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

bench: $(STAMP)
	$(PY) benchmarks/bench_launch.py

clean:
	rm -rf build site *.egg-info sparkgpu/_native*.so
