# `make demo` and `make test` work on a fresh machine: each bootstraps .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch, from PyTorch's own CPU wheel index: the same pin from the default index is
# the CUDA build (gigabytes). Where that index cannot be reached (a machine without the internet, or
# with its own package mirror), one try of at most 5 s without retries, then the plain pin from the
# default index (README.md, "Two commands on a fresh machine", says what each case gets).
TORCH_PIN := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
MARKDOWNLINT := npx -y markdownlint-cli2@0.22.0
# Two pytest-xdist workers; tests/parallel.py keeps each file (and each directory whose tests share a
# port, the Docker engine or an end-of-run tally) on one worker. `make test-costs` stays serial: it
# measures each test alone.
XDIST := -n 2 --dist loadgroup
# mkdocs-material renders ```mermaid blocks but fetches mermaid.js from a CDN unless the page already
# loaded it; the site serves this pinned copy instead (mkdocs.yml extra_javascript), so diagrams
# render offline (CI's browser tier has no internet). Fetched with npm, not committed (2.7 MB).
MERMAID_VERSION := 11.12.0
MERMAID_JS := docs/javascripts/mermaid.min.js

.PHONY: demo test test-fast test-costs test-gpu lint docs docs-serve docs-assets browser-deps monitoring-deps clean venv dev checkov

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --timeout 5 --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH_PIN) \
	  || { echo "$(TORCH_CPU_INDEX) unreachable: $(TORCH_PIN) from the default index"; $(PIP) install -q $(TORCH_PIN); }
	$(PIP) install -q -e .
	touch $@

# The previous transformers major (4.x) goes apart from the venv's 5.x, in .work/tf4 with the hub
# client and tokenizers it needs: tests/integration/test_hf_parity.py puts it on PYTHONPATH of a
# subprocess that writes checkpoints as 4.x does (its other dependencies come from the venv).
TF4_DIR := .work/tf4
TF4_PINS := 'transformers>=4.57,<5' 'huggingface-hub>=0.34,<1' 'tokenizers>=0.22,<=0.23.0'

$(VENV)/.dev-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[dev]'
	rm -rf $(TF4_DIR) && $(PIP) install -q --no-deps --target $(TF4_DIR) $(TF4_PINS)
	touch $@

venv: $(VENV)/.installed
dev: $(VENV)/.dev-installed

# checkov (the policy scanner that tests/docker/test_policy.py runs over examples/) in a venv of its
# own: it pins packaging 23 and networkx 2.6, which would downgrade the project's venv (torch needs a
# newer networkx). Pinned, so a new checkov release cannot add findings to an unchanged tree.
CHECKOV_VENV := .work/checkov-venv
CHECKOV_PIN := checkov==3.3.30

$(CHECKOV_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install -q $(CHECKOV_PIN)
	touch $@

checkov: $(CHECKOV_VENV)/.installed

# Re-fetched when the pin changes: the version is recorded beside the file.
$(MERMAID_JS): Makefile
	mkdir -p $(@D)
	tmp=$$(mktemp -d) && cd $$tmp && npm pack -q mermaid@$(MERMAID_VERSION) >/dev/null \
	  && tar -xzf mermaid-$(MERMAID_VERSION).tgz package/dist/mermaid.min.js \
	  && cp package/dist/mermaid.min.js $(CURDIR)/$@ && rm -rf $$tmp
	echo $(MERMAID_VERSION) > $(@D)/mermaid.version

docs-assets: $(MERMAID_JS)

# The browser tier (tests/browser) drives Debian's chromium; on CI (root, fresh machine) install it.
# Elsewhere the tier skips with a reason when /usr/bin/chromium is missing.
browser-deps:
	@if [ "$$CI" = true ] && [ ! -x /usr/bin/chromium ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi

# Debian's prometheus (prometheus, promtool): tests/integration/test_monitoring.py scrapes a real
# daemon and engine with it and checks examples/monitoring/ with promtool. On CI (root, fresh
# machine) install it without starting its service: a policy-rc.d that denies every start is put
# in place for the install when the machine has none (a container image usually has one), and no
# recommended packages (node-exporter). Elsewhere the tests skip with a reason when it is missing.
monitoring-deps:
	@if [ "$$CI" = true ] && ! command -v promtool >/dev/null; then \
	  own=; if [ ! -e /usr/sbin/policy-rc.d ]; then own=1; printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
	    chmod +x /usr/sbin/policy-rc.d; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  status=$$?; if [ -n "$$own" ]; then rm -f /usr/sbin/policy-rc.d; fi; exit $$status; fi

demo: $(VENV)/.installed
	$(PY) tools/demo.py

# Two passes: everything on two workers, then the tests marked `timed` alone, on a machine no other
# test loads (their bounds are claims about an idle host: a kill answered within 1.5 s, a 50 ms wait).
test: $(VENV)/.dev-installed docs-assets browser-deps monitoring-deps checkov
	$(PY) -m pytest tests $(XDIST) -m "not timed" --durations=20
	$(PY) -m pytest tests -m timed
	$(MAKE) lint

# 5 min 56 s on a busy 2-core machine (2026-12-07; README.md says the same): leaves out docker, the browser and every test whose measured
# cost in tests/costs.json reaches tests/costs.py's SLOW_S (such tests are marked slow at collection).
test-fast: $(VENV)/.dev-installed docs-assets monitoring-deps checkov
	$(PY) -m pytest tests $(XDIST) -m "not slow and not docker and not browser"

# Measure every test's cost again (tests/costs.json decides which tests are slow); on an idle machine.
test-costs: $(VENV)/.dev-installed docs-assets
	$(PY) -m pytest tests -m "not docker and not browser" --record-costs

# On a CUDA host, as root: the gpu-marked tests and every page in GPU mode, side by side on
# GPU_WORKERS workers (tools/gpu_tier.sh; docs/gpu-ci.md says what one run costs and needs).
test-gpu: $(VENV)/.dev-installed
	PYTHON=$(PY) bash tools/gpu_tier.sh

lint:
	$(MARKDOWNLINT) "docs/**/*.md" README.md

# The site needs only pyproject's docs extra (mkdocs and its theme and extensions), in a venv of its
# own: not torch, not the test tools (tests/docs/test_make_docs.py keeps it so).
DOCS_VENV := .work/docs-venv

$(DOCS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PYTHON) tools/extra_requirements.py docs | xargs $(DOCS_VENV)/bin/python -m pip install -q
	touch $@

# The guide as HTML in site/ (open site/index.html).
docs: $(DOCS_VENV)/.installed docs-assets
	$(DOCS_VENV)/bin/mkdocs build --strict

# The guide at http://127.0.0.1:8765/, rebuilt on every save (the guide's pages use ports 80xx to 84xx).
docs-serve: $(DOCS_VENV)/.installed docs-assets
	$(DOCS_VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8765

clean:
	rm -rf $(VENV) $(DOCS_VENV) $(CHECKOV_VENV) site .pytest_cache $(MERMAID_JS) docs/javascripts/mermaid.version
