"""kv_cache_dtype=fp8_e4m3 through a real tritonserver: SmolLM2 answers the README's question ("Paris"), /metrics
names the KV dtype, and tiny DeepSeek-V3 / V4 stream the tokens of the offline fp8 engine."""
from __future__ import annotations

import json

import pytest
from tests.helpers.triton_server import StreamClient, http_generate, metric, metrics, new_server

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny

pytestmark = pytest.mark.e2e

SETTINGS = {"max_model_len": "256", "num_blocks": "64", "max_num_seqs": "4", "kv_cache_dtype": "fp8_e4m3"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_with_fp8_kv_answers_paris_and_metrics_name_the_dtype(tmp_path):
    with new_server(tmp_path, SETTINGS) as server:
        status, [answer] = http_generate(server.http_url, {
            "messages": json.dumps(QUESTION), "temperature": 0, "max_tokens": 32, "exclude_input_in_output": True})
        assert status == 200, answer
        assert "Paris" in answer["text_output"]
        assert metric(metrics(server.metrics_url), "deepinfer_kv_cache_dtype_info", kv_cache_dtype="fp8_e4m3") == 1


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_tiny_deepseek_with_fp8_kv_streams_the_offline_tokens(tmp_path, arch):
    path = make_tiny(arch, tmp_path / arch)
    prompt = [5, 17, 42, 99, 150, 7, 211, 64]
    with LLM(str(path), **{k: (v if k == "kv_cache_dtype" else int(v)) for k, v in SETTINGS.items()}) as llm:
        expected = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    with new_server(tmp_path / "server", {**SETTINGS, "model": str(path)}, exit_timeout_s=5) as server:
        client = StreamClient(server.grpc_url)
        try:
            result = client.generate({"input_ids": prompt, "stream": True, "exclude_input_in_output": True,
                                      "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 24,
                                                                         "ignore_eos": True})})
        finally:
            client.close()
    assert result.error is None and result.all_ids == expected.token_ids
