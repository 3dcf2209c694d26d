"""stream_interval through a real tritonserver: the first token streams alone, later deltas come n tokens at a time
(the last may be shorter), and the streamed text equals the same greedy request sent non-streaming."""
from __future__ import annotations

import json

import pytest
from conftest import SERVER_PARAMETERS
from triton_helpers import StreamClient, new_server

from backend_lib.frontend.triton.server import TritonServer

pytestmark = pytest.mark.e2e

INTERVAL = 4
MAX_TOKENS = 21


@pytest.fixture(scope="module")
def chunky_triton(tmp_path_factory) -> TritonServer:
    overrides = {**SERVER_PARAMETERS, "stream_interval": str(INTERVAL)}
    with new_server(tmp_path_factory.mktemp("triton_interval"), overrides) as server:
        yield server

def test_stream_interval_groups_tokens_after_the_first(chunky_triton):
    client = StreamClient(chunky_triton.grpc_url)
    try:
        request = {"text_input": "Count from one to twenty:", "exclude_input_in_output": True,
                   "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS,
                                                      "ignore_eos": True})}
        streamed = client.generate({**request, "stream": True})
        whole = client.generate({**request, "stream": False})
    finally:
        client.close()
    assert streamed.error is None and whole.error is None
    sizes = [len(ids) for ids in streamed.ids if ids]
    assert sizes[0] == 1 and sum(sizes) == MAX_TOKENS
    assert all(size >= INTERVAL for size in sizes[1:-1]), sizes  # held until INTERVAL tokens wait
    assert len(sizes) <= 2 + MAX_TOKENS // INTERVAL, sizes
    assert streamed.text == whole.text and [t for ids in streamed.ids for t in ids] == whole.ids[0]
