"""A bad engine setting in config.pbtxt fails the model load with a message naming it (no server stays up)."""
from __future__ import annotations

import pytest
from tests.helpers.triton_server import new_server

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("overrides, message", [
    ({"max_num_seqs": "lots"}, "model parameter max_num_seqs must be an integer, got 'lots'"),
    ({"stream_interval": "0"}, "model parameter stream_interval must be an integer in [1, 1024], got '0'"),
    ({"num_blocks": "0", "kv_cache_memory_gb": "100000"}, "GiB needed (kv_cache_memory_gb=100000.0), but only"),
])
def test_bad_parameter_fails_the_load_naming_it(tmp_path, overrides, message):
    server = new_server(tmp_path, overrides)
    try:
        with pytest.raises(RuntimeError) as info:
            server.start(timeout_s=120)
        assert "exited with code" in str(info.value)
        assert message in server.log_path.read_text()
    finally:
        server.stop()
    assert server.process is None
