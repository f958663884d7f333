# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BUILD_INPUTS := pyproject.toml constraints.txt $(wildcard setup.py native/*.c native/*.cc native/*.cpp native/*.h native/*/*.h)

.PHONY: venv demo lint test test-unit docs docs-serve bench clean

# Byte code is written by the first process that imports a module: neither uv nor this checkout
# compiles any ahead, and the suite starts about a thousand Python processes (agents, ranks), each
# of which would compile what it imports again where PYTHONDONTWRITEBYTECODE is set.
export PYTHONDONTWRITEBYTECODE :=

# The interop tests read our shards with MosaicML Streaming. It declares transformers<5 and
# numpy<2.2, which the [hf] stack cannot share, yet imports neither pin's versions: it is installed
# without its declared requirements, plus the modules it imports. Users of [hf] never get it.
#
# uv installs what pip would from the same constraints (the same versions), in a fraction of the
# time: its cache keeps wheels unpacked, and it compiles no byte code up front (above). INSTALLER=pip
# installs with pip instead, e.g. where pip's own configuration names a private index.
INSTALLER ?= uv
$(STAMP): $(BUILD_INPUTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$(INSTALLER)" = uv ] && $(PY) -m pip install -q -c constraints.txt uv; then \
		install="$(VENV)/bin/uv pip install --python $(PY) -q"; \
	else \
		$(PY) -m pip install -q --upgrade pip && install="$(PY) -m pip install -q"; \
	fi; set -x; \
	$$install -c constraints.txt -e '.[dev]' && \
	$$install -c constraints.txt --no-deps 'mosaicml-streaming==0.13.0' && \
	$$install -c constraints.txt brotli python-snappy zstd catalogue tqdm
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Lint and type checks (configured in pyproject.toml); `make test` runs them too, so CI fails on a new finding.
LINT_PATHS := sparkgpu tests benchmarks examples
# The type check's cache lives with pip's and uv's, not in the checkout: in a fresh clone mypy
# rechecks only the files whose contents differ from the cache's (it compares their hashes).
MYPY := $(PY) -m mypy --cache-dir $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/sparkgpu/mypy
lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(MYPY) sparkgpu

# Integration tests mostly wait on servers and subprocesses: workers overlap them; tests sharing a
# session server run on one worker (tests/conftest.py). TEST_WORKERS=0 runs them in this process.
# On 2 cores, 4 workers kept the CPU 94% busy (19:08 for the tests) where 3 kept it 91% (20:17).
TEST_WORKERS ?= 4
# The type check (one core for most of a minute where its cache is cold) runs beside the tests,
# while their workers start servers; it prints when the tests end, and either failing fails the target.
test: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	@types=$$(mktemp); $(MYPY) sparkgpu > $$types 2>&1 & mypy=$$!; \
	echo "$(MYPY) sparkgpu (beside the tests)"; \
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
