"""A tiny vision DeepSeek-V4.1 served through a real tritonserver and its OpenAI front: the Triton ``image`` input
(base64 BYTES) and the official openai client with a data-URL ``image_url`` part give the offline engine's tokens;
/v1/models says the model takes images."""
from __future__ import annotations

import base64
import io
import json

import openai
import pytest
import torch
from PIL import Image

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.models.deepseek_v41.vision.placeholder import IMAGE_PLACEHOLDER
from backend_lib.tools.tiny import make_tiny
from tests.helpers.triton_server import StreamClient, new_server

pytestmark = pytest.mark.e2e

# one torch thread, in the server and offline: tiny ops, and a second OpenMP thread only spins on a busy machine
SETTINGS = {"max_model_len": "256", "num_blocks": "32", "block_size": "16", "max_num_seqs": "2",
            "max_num_batched_tokens": "64", "num_threads": "1"}
PROMPT = f"Describe {IMAGE_PLACEHOLDER} briefly."


def _png(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (45, 60, 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    return make_tiny("deepseek_v41", tmp_path_factory.mktemp("tiny_v41_vision"), seed=5, vision=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory, vision_dir):
    with new_server(tmp_path_factory.mktemp("triton_vision"), {**SETTINGS, "model": str(vision_dir)},
                    openai=True, exit_timeout_s=5) as server:
        yield server


@pytest.fixture()
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the offline engine set one for this process


def test_triton_image_and_openai_image_url_give_the_offline_tokens(served, vision_dir, threads):
    image = _png(1)
    llm = LLM(str(vision_dir), **{k: int(v) for k, v in SETTINGS.items()})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    messages = [{"role": "user", "content": f"What is in {IMAGE_PLACEHOLDER}?"}]
    expected = {}
    for rid, prompt in (("text", PROMPT), ("chat", messages)):
        engine.add_request(rid, prompt, params, images=[image])
    while engine.has_unfinished_requests():
        for out in engine.step():
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)

    grpc = StreamClient(served.grpc_url)
    try:
        result = grpc.generate({"text_input": PROMPT, "image": [base64.b64encode(image)], "stream": True,
                                "exclude_input_in_output": True, "sampling_parameters": json.dumps(
                                    {"max_tokens": 8, "temperature": 0, "ignore_eos": True})},
                               dtypes={"image": "BYTES"})
    finally:
        grpc.close()
    assert result.error is None, result.error
    assert result.all_ids == expected["text"]

    client = openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120)
    assert client.models.retrieve("deepinfer").model_extra["input_modalities"] == ["text", "image"]
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    answer = client.chat.completions.create(
        model="deepinfer", max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                               {"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "?"}]}])
    assert answer.usage.completion_tokens == 8
    assert answer.choices[0].message.content == llm.tokenizer.decode(expected["chat"])
    llm.close()
