# Everything a fresh Debian machine needs, then the project in .venv.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
APT_PKGS := fuse3 libfuse3-dev pkg-config gcc
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install lint test test-fast test-agents agents stress demo bench bench-deps bench-quick clean deps

# and the package's .pyc (up to date: ~30 ms): with PYTHONDONTWRITEBYTECODE set, an
# editable install has none, and every daemon and CLI start compiled the package again
# (a mount's daemon answered after ~300 ms instead of ~170)
install: $(STAMP)
	@$(PY) -m compileall -q overlayckpt

deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

$(STAMP): pyproject.toml setup.py $(wildcard overlayckpt/fuse/csrc/*.c overlayckpt/fuse/csrc/*.h) overlayckpt/bin/hook.c
	$(MAKE) deps
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# compat: the .pth is a plain path, no import finder (it cost every CLI start ~10-20 ms)
	$(PY) -m pip install -q -e '.[test,lint]' --config-settings editable_mode=compat
	touch $(STAMP)

# ruff (lint and import order) and mypy, both configured in pyproject.toml
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

# the in-process tier only (no FUSE, no root): seconds, for while changing code
test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider tests/core

# The real agent CLIs for tests/test_agents_*.py, pinned, from npm into .agents/ (node and
# npm from Debian), Aider from PyPI into a venv of its own (.agents/aider-venv: it pins
# many packages). The tests install them this way themselves when they are missing.
AGENTS := .agents
CLAUDE_CODE := @anthropic-ai/claude-code@2.1.197
CODEX := @openai/codex@0.171.0
GEMINI_CLI := @google/gemini-cli@0.61.0
QWEN_CODE := @qwen-code/qwen-code@0.15.10
OPENCODE := opencode-ai@1.18.33
AIDER := aider-chat==0.86.2
NPM_AGENTS := $(CLAUDE_CODE) $(CODEX) $(GEMINI_CLI) $(QWEN_CODE) $(OPENCODE)
AGENT_STAMP := $(AGENTS)/.installed-$(shell echo '$(NPM_AGENTS) $(AIDER)' | cksum | cut -d' ' -f1)

agents: $(AGENT_STAMP)

$(AGENT_STAMP):
	@command -v npm >/dev/null || { echo "installing Debian packages: nodejs npm"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq nodejs npm; }
	mkdir -p $(AGENTS)
	npm install --prefix $(AGENTS) --no-audit --no-fund --loglevel=error $(NPM_AGENTS)
	$(AGENTS)/node_modules/.bin/claude --version
	HOME=$(CURDIR)/$(AGENTS) $(AGENTS)/node_modules/.bin/codex --version
	HOME=$(CURDIR)/$(AGENTS) $(AGENTS)/node_modules/.bin/gemini --version
	HOME=$(CURDIR)/$(AGENTS) $(AGENTS)/node_modules/.bin/qwen --version
	HOME=$(CURDIR)/$(AGENTS) $(AGENTS)/node_modules/.bin/opencode --version
	python3 -m venv $(AGENTS)/aider-venv
	$(AGENTS)/aider-venv/bin/pip install -q --disable-pip-version-check $(AIDER)
	HOME=$(CURDIR)/$(AGENTS) $(AGENTS)/aider-venv/bin/aider --version
	touch $(AGENT_STAMP)

test-agents: install agents
	$(PY) -m pytest -q -p no:cacheprovider tests/test_agents_*.py

stress: install
	$(PY) -m pytest -q -p no:cacheprovider -m stress tests

demo: install
	$(PY) -m overlayckpt.demo

# the C overlay every bench compares against (a contender is skipped, with a note, if missing)
bench-deps: install
	@command -v fuse-overlayfs >/dev/null || { echo "installing Debian package: fuse-overlayfs"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq fuse-overlayfs; }
	$(PY) -m pip install -q -e '.[bench]' --config-settings editable_mode=compat

bench: bench-deps
	$(PY) -m bench.projects
	$(PY) -m bench.run --sizes 1000,10000,100000

bench-quick: bench-deps
	$(PY) -m bench.projects
	$(PY) -m bench.run --sizes 1000,10000 --quick

clean:
	-for m in $$(awk '$$3 ~ /^fuse/ {print $$2}' /proc/mounts); do fusermount3 -uz $$m; done
	rm -rf $(VENV) build *.egg-info .pytest_cache bench/work $(AGENTS)
