"""Images through the APIs, without servers: the Triton ``image`` input (base64 BYTES, as Triton's vLLM backend
takes it) and OpenAI chat ``image_url`` data-URL parts, translated into the Triton request the front sends, decoded
by the model's codec under a tiny vision V4.1 engine's rules, give the same tokens as the offline engine given the
image bytes; refusals name the field."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from backend_lib.core.config import EngineConfig
from backend_lib.core.errors import RequestError
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.intake import RequestRules
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.frontend.openai import translate
from backend_lib.frontend.openai.errors import OpenAIError
from backend_lib.frontend.openai.images import checkpoint_takes_images
from backend_lib.frontend.openai.schema import ChatCompletionRequest
from backend_lib.frontend.openai.triton_stream import build_infer_request
from backend_lib.frontend.triton import codec
from backend_lib.models.deepseek_v41.vision.placeholder import IMAGE_PLACEHOLDER
from backend_lib.tools.tiny import make_tiny
from tests.helpers.engines import drive, new_tokens


@pytest.fixture(scope="module")
def vision_engine(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a busy 2-core machine
    path = make_tiny("deepseek_v41", tmp_path_factory.mktemp("v41_vision_api"), seed=3, vision=True)
    engine = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "block_size": 16,
                                               "max_num_seqs": 2, "max_num_batched_tokens": 64}))
    yield path, engine
    torch.set_num_threads(threads)


def _png(seed: int, size=(50, 40)) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _backend_inputs(infer) -> dict[str, np.ndarray]:
    """The infer request's tensors as the Python backend's as_numpy() gives them."""
    inputs = {}
    for tensor in infer.inputs:
        if tensor.datatype == "BYTES":
            inputs[tensor.name] = np.array(list(tensor.contents.bytes_contents), dtype=object)
        elif tensor.datatype == "BOOL":
            inputs[tensor.name] = np.array(list(tensor.contents.bool_contents), dtype=np.bool_)
        else:
            inputs[tensor.name] = np.array(list(tensor.contents.int_contents), dtype=np.int32)
    return inputs


def _run(engine, rid, request) -> list[int]:
    engine.add_prepared(engine.prepare_request(rid, request))
    return new_tokens(drive(engine))[rid]


def test_openai_image_url_and_triton_image_equal_the_offline_engine(vision_engine):
    path, engine = vision_engine
    one, two = _png(1), _png(2, (33, 70))
    url = "data:image/png;base64," + base64.b64encode(one).decode()
    chat = ChatCompletionRequest(model="deepinfer", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": " and say"}]}])
    [model_request] = translate.chat_requests(chat, None)
    assert len(model_request.images) == 1 and IMAGE_PLACEHOLDER in json.loads(model_request.prompt)[0]["content"]
    infer = build_infer_request("deepinfer", "chat-1", model_request)
    decoded = codec.decode_request(_backend_inputs(infer), "{}", 0, 0, [o.name for o in infer.outputs], engine.rules)
    assert decoded.request.images == (one,)
    via_openai = _run(engine, "openai", decoded.request)
    messages = json.loads(model_request.prompt)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    offline = _run(engine, "offline", engine.take_in(messages, params, images=[one]))
    assert via_openai == offline and len(offline) == 6

    # Triton's image input with a text prompt and two placeholders (base64 elements in prompt order)
    text = f"first {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER}."
    inputs = {"text_input": np.array([text.encode()], dtype=object),
              "image": np.array([base64.b64encode(one), base64.b64encode(two)], dtype=object),
              "sampling_parameters": np.array([json.dumps({"max_tokens": 5, "temperature": 0}).encode()],
                                              dtype=object)}
    decoded = codec.decode_request(inputs, "{}", rules=engine.rules)
    assert _run(engine, "triton", decoded.request) == _run(
        engine, "offline2", engine.take_in(text, SamplingParams(max_tokens=5, temperature=0.0), images=[one, two]))


def test_image_refusals_name_the_field(vision_engine):
    _, engine = vision_engine
    prompt = np.array([f"x {IMAGE_PLACEHOLDER}".encode()], dtype=object)
    with pytest.raises(RequestError) as err:
        codec.decode_request({"text_input": prompt, "image": np.array([b"%%% not base64"], dtype=object)},
                             rules=engine.rules)
    assert err.value.field == "image[0]"
    with pytest.raises(RequestError, match="does not take images") as err:  # a text model's rules
        codec.decode_request({"text_input": prompt, "image": np.array([base64.b64encode(_png(3))], dtype=object)},
                             rules=RequestRules())
    assert err.value.field == "image"
    for url, words in (("http://example.com/cat.png", "not fetched"), ("data:image/gif;base64,R0lG", "GIF"),
                       ("data:text/plain,hello", "data:image")):
        chat = ChatCompletionRequest(model="deepinfer", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
        with pytest.raises(OpenAIError, match=words.lower() if words == "GIF" else words) as err:
            translate.chat_requests(chat, None)
        assert err.value.param == "messages[0].content[0].image_url.url"


def test_models_endpoint_knows_a_vision_checkpoint(vision_engine, tmp_path):
    path, _ = vision_engine
    assert checkpoint_takes_images(str(path))
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 14}}))  # a config, no tower
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": "a"}}))
    assert not checkpoint_takes_images(str(tmp_path)) and not checkpoint_takes_images(str(tmp_path / "none"))


def test_a_chat_session_renders_its_earlier_images_again(vision_engine):
    """A chat session's second turn renders the whole conversation: its first turn's image expands again, before
    the new one; equal to one request of that conversation."""
    from backend_lib.core.outputs import SessionControl
    _, engine = vision_engine
    one, two = _png(4), _png(5, (41, 29))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ask = [{"role": "user", "content": f"see {IMAGE_PLACEHOLDER}"}]
    engine.submit("c1", engine.take_in(ask, params, SessionControl("chat", start=True), images=[one]))
    drive(engine)
    answer = engine.scheduler.sessions.get("chat").messages[-1]
    more = [{"role": "user", "content": f"and {IMAGE_PLACEHOLDER}"}]
    engine.submit("c2", engine.take_in(more, params, SessionControl("chat", end=True), images=[two]))
    turn2 = new_tokens(drive(engine))["c2"]
    whole = _run(engine, "whole", engine.take_in(ask + [answer] + more, params, images=[one, two]))
    assert answer["role"] == "assistant" and turn2 == whole


def test_remote_image_urls_are_fetched_only_when_allowed():
    """--allow-remote-images: an http image part becomes the data URL of what the server sent (a local server)."""
    import asyncio
    import http.server
    import threading

    from backend_lib.frontend.openai.images import fetch_remote

    png = _png(6)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png if self.path == "/cat.png" else b"")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        chat = ChatCompletionRequest(model="deepinfer", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": base + "/cat.png"}}]}])
        asyncio.run(fetch_remote(chat.messages))
        [model_request] = translate.chat_requests(chat, None)
        assert [base64.b64decode(i) for i in model_request.images] == [png]
        missing = ChatCompletionRequest(model="deepinfer", messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": base + "/none.png"}}]}])
        with pytest.raises(OpenAIError, match="could not fetch") as err:
            asyncio.run(fetch_remote(missing.messages))
        assert err.value.param == "messages[0].content[0].image_url.url"
    finally:
        server.shutdown()
