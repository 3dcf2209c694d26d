"""perf_analyzer (tritonclient 2.41.0) drives the model over gRPC streaming at concurrency 4."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "perf_analyzer.sh"


@pytest.fixture(scope="module")
def perf_analyzer() -> str:
    install = subprocess.run(["bash", str(SCRIPT), "--install-only"], capture_output=True, text=True, timeout=600)
    if install.returncode == 3:  # the script's "could not install" code: nothing else may skip
        pytest.skip(f"perf_analyzer could not be installed: {install.stderr.strip().splitlines()[-1]}")
    assert install.returncode == 0, install.stderr
    return install.stdout.strip().splitlines()[-1]


def test_perf_analyzer_streaming_concurrency_4(perf_analyzer, triton):
    run = subprocess.run(["bash", str(SCRIPT), "-u", triton.grpc_url, "-c", "4", "-n", "8"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"Concurrency: 4, throughput: [0-9.]+ infer/sec", out), out[-3000:]
    assert int(re.search(r"Request count: (\d+)", out).group(1)) >= 8
    # Every request streamed one response per token (max_tokens 8, ignore_eos): responses = 8 x requests.
    requests = float(re.search(r"\n\s+Throughput: ([0-9.]+) infer/sec", out).group(1))
    responses = float(re.search(r"Response Throughput: ([0-9.]+) infer/sec", out).group(1))
    assert responses / requests == pytest.approx(8, rel=0.1), out[-3000:]
