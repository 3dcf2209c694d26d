#!/usr/bin/env bash
# Install perf_analyzer (from the tritonclient 2.41.0 wheel) into a cache dir, then run it against the
# DeepInfer model over gRPC streaming (decoupled model: --streaming --async).
#
#   scripts/perf_analyzer.sh [-u localhost:8001] [-c 4] [-n 16] [-- extra perf_analyzer args]
#   scripts/perf_analyzer.sh --install-only      # prints the binary's path
#
# perf_analyzer needs Debian's libb64-0d and a libcudart.so.12 (PyPI: nvidia-cuda-runtime-cu12) even on
# a CPU-only machine; both go next to it in the cache. Exit code 3 means "could not install".
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
CACHE="${DEEPINFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deepinfer}/perf_analyzer-2.41.0"
BIN="$CACHE/bin/perf_analyzer"

URL="localhost:8001"
CONCURRENCY=4
MAX_TOKENS=16
INSTALL_ONLY=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -u|--url) URL="$2"; shift 2 ;;
    -c|--concurrency) CONCURRENCY="$2"; shift 2 ;;
    -n|--max-tokens) MAX_TOKENS="$2"; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

fail_install() { echo "perf_analyzer install failed: $*" >&2; exit 3; }

install() {
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p "$CACHE/bin" "$CACHE/lib"

  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
      --python-version 3.11 "tritonclient==2.41.0" -d "$tmp/tc" \
    || fail_install "pip download tritonclient==2.41.0"
  "$PYTHON" -m zipfile -e "$tmp"/tc/tritonclient-2.41.0-*.whl "$tmp/tc/x" || fail_install "unpack tritonclient wheel"
  cp "$tmp/tc/x/tritonclient-2.41.0.data/data/bin/perf_analyzer" "$CACHE/bin/perf_analyzer.partial" \
    || fail_install "no perf_analyzer in the tritonclient wheel"

  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: "nvidia-cuda-runtime-cu12~=12.0" -d "$tmp/cuda" \
    || fail_install "pip download nvidia-cuda-runtime-cu12"
  "$PYTHON" -m zipfile -e "$tmp"/cuda/nvidia_cuda_runtime_cu12-*.whl "$tmp/cuda/x" || fail_install "unpack cuda runtime"
  cp "$tmp"/cuda/x/nvidia/cuda_runtime/lib/libcudart.so.12 "$CACHE/lib/" || fail_install "no libcudart.so.12 in the wheel"

  (cd "$tmp" && apt-get download libb64-0d >/dev/null 2>&1) \
    || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && (cd "$tmp" && apt-get download libb64-0d >/dev/null 2>&1); } \
    || fail_install "apt-get download libb64-0d (Debian/Ubuntu only)"
  dpkg -x "$tmp"/libb64-0d_*.deb "$tmp/b64" || fail_install "unpack libb64-0d"
  cp -L "$tmp"/b64/usr/lib/*/libb64.so.0d "$CACHE/lib/" || fail_install "no libb64.so.0d in the package"

  chmod +x "$CACHE/bin/perf_analyzer.partial"
  mv "$CACHE/bin/perf_analyzer.partial" "$BIN"
}

[ -x "$BIN" ] || install
export LD_LIBRARY_PATH="$CACHE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$BIN" --version >/dev/null 2>&1 || "$BIN" --help >/dev/null 2>&1 || fail_install "$BIN does not run (missing libraries?)"
if [ "$INSTALL_ONLY" = 1 ]; then echo "$BIN"; exit 0; fi

DATA="$(mktemp)"
trap 'rm -f "$DATA"' EXIT
cat > "$DATA" <<JSON
{"data": [{"text_input": ["Write a short poem about the sea."], "stream": [true],
           "exclude_input_in_output": [true],
           "sampling_parameters": ["{\"max_tokens\": $MAX_TOKENS, \"ignore_eos\": true, \"temperature\": 0}"]}]}
JSON

exec "$BIN" -m deepinfer -u "$URL" -i grpc --streaming --async --input-data "$DATA" \
  --concurrency-range "$CONCURRENCY" --measurement-mode count_windows --measurement-request-count 8 \
  --max-trials 10 --stability-percentage 999 ${EXTRA[@]+"${EXTRA[@]}"}
