#!/usr/bin/env bash
# AIPerf on the OpenAI front, side by side with the gRPC path (benchmarks/serving.py's client), one server, one run:
# concurrency 1 / 8 / 32 on the shared workload; writes benchmarks/results/openai.md and openai.png.
# AIPerf lives in its own venv (its dependencies must not move the project's pins).
# Usage: bash benchmarks/aiperf.sh [--concurrency 1,8,32]    (AIPERF_VENV=/tmp/aiperf-venv by default)
set -euo pipefail
cd "$(dirname "$0")/.."
AIPERF_VERSION=0.13.0
AIPERF_VENV=${AIPERF_VENV:-/tmp/aiperf-venv}
PYTHON=${PYTHON:-python3}

if ! "$AIPERF_VENV/bin/aiperf" --version 2>/dev/null | grep -q "$AIPERF_VERSION"; then
  "$PYTHON" -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/python" -m pip install -q --upgrade pip
  "$AIPERF_VENV/bin/python" -m pip install -q "aiperf==$AIPERF_VERSION"
fi
PYTHONPATH="$PWD" .venv/bin/python benchmarks/openai_aiperf.py --aiperf "$AIPERF_VENV/bin/aiperf" "$@"
