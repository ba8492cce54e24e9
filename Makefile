# `make demo` and `make test` work on a fresh machine: each bootstraps .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
MARKDOWNLINT := npx -y markdownlint-cli2@0.22.0

.PHONY: demo test test-fast test-gpu lint docs clean venv dev

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed
dev: $(VENV)/.dev-installed

demo: $(VENV)/.installed
	$(PY) tools/demo.py

test: $(VENV)/.dev-installed
	$(PY) -m pytest tests
	$(MAKE) lint

test-fast: $(VENV)/.dev-installed
	$(PY) -m pytest tests -m "not slow and not docker"

# On any CUDA host: the gpu-marked tests and the guide's GPU-only blocks.
test-gpu: $(VENV)/.dev-installed
	WCACHE_RUN_GPU_BLOCKS=1 $(PY) -m pytest tests -m gpu

lint:
	$(MARKDOWNLINT) "docs/**/*.md" README.md

docs: $(VENV)/.dev-installed
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache
