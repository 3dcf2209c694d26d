"""One real tritonserver per test module, on free ports, small KV cache and context (fast load); always stopped."""
from __future__ import annotations

import pytest
from tests.helpers.triton_server import new_server

from backend_lib.frontend.triton.server import TritonServer

# Small enough to load fast, large enough for 16 concurrent streams of the tests' requests.
SERVER_PARAMETERS = {
    "max_model_len": "512",
    "num_blocks": "256",
    "block_size": "16",
    "max_num_seqs": "16",
    "max_num_batched_tokens": "256",
    "session_idle_timeout_s": "600",
}


@pytest.fixture(scope="module")
def triton(tmp_path_factory) -> TritonServer:
    with new_server(tmp_path_factory.mktemp("triton"), dict(SERVER_PARAMETERS)) as server:
        yield server
