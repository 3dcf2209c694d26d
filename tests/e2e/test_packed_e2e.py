"""``weight_format=packed`` through a real tritonserver: the bundled SmolLM2 Q4_1 served from its packed blocks
(config.pbtxt parameter), greedy output equal to the offline engine's with the same setting, over gRPC streaming
and HTTP; on the fp32 path, equal to ``weight_format=dequantize``."""
from __future__ import annotations

import json

import pytest
from tests.helpers.triton_server import StreamClient, http_generate, new_server

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM

pytestmark = pytest.mark.e2e

SETTINGS = {"max_model_len": "512", "num_blocks": "128", "block_size": "16", "max_num_seqs": "4",
            "max_num_batched_tokens": "256"}
PROMPTS = ["Write a short story about the sea.", "What is the capital of France?", "List three colours."]
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}


@pytest.mark.parametrize("path", ["auto", "fp32"])
def test_packed_server_equals_the_offline_engine(path, tmp_path):
    settings = {k: int(v) for k, v in SETTINGS.items()}
    references = {}
    for fmt in ("packed", "dequantize") if path == "fp32" else ("packed",):  # dequantize: the fp32 path's oracle
        with LLM("", weight_format=fmt, packed_gemm_path=path, **settings) as llm:
            references[fmt] = [llm.generate([p], SamplingParams(**GREEDY))[0] for p in PROMPTS]  # one at a time
    overrides = {**SETTINGS, "weight_format": "packed", "packed_gemm_path": path}
    with new_server(tmp_path, overrides) as server:
        client = StreamClient(server.grpc_url)
        try:
            results = [client.generate({"text_input": p, "sampling_parameters": json.dumps(GREEDY), "stream": True,
                                        "exclude_input_in_output": True}) for p in PROMPTS]
        finally:
            client.close()
        for result, expected in zip(results, references["packed"]):
            assert result.error is None and result.all_ids == expected.token_ids
        body = {"text_input": PROMPTS[1], **GREEDY, "exclude_input_in_output": True}
        status, (response,) = http_generate(server.http_url, body)
        assert status == 200 and response["text_output"] == references["packed"][1].text
    if path == "fp32":
        assert [r.token_ids for r in references["packed"]] == [r.token_ids for r in references["dequantize"]]
