"""Images through the engine on a tiny vision V4.1 (``make-tiny --arch deepseek_v41 --vision``): greedy ids equal
the oracles' (tests/helpers/deepseek_v41_vision_reference.py for the spans, the V4.1 text oracle fed their input
embeddings, with bias_vl on image tokens) for one and two images, with prefill chunks of 7 tokens that cut inside
the spans, batched with a text-only request and a text prompt with the placeholder string; bad images refused
naming the field, nothing left behind."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from backend_lib.core.config import EngineConfig
from backend_lib.core.errors import RequestError
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.models.deepseek_v41.model import DeepseekV41ForCausalLM
from backend_lib.models.deepseek_v41.vision.span import IMAGE_PLACEHOLDER
from backend_lib.tools.tiny import make_tiny
from tests.helpers import deepseek_v41_vision_reference as vref
from tests.helpers.deepseek_v41_cases import tokens
from tests.helpers.deepseek_v41_reference import ReferenceV41
from tests.helpers.engines import drive, new_tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

NEW = 8


def _image(width: int, height: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny("deepseek_v41", tmp_path_factory.mktemp("v41_vision_engine"), seed=7, vision=True)
    with pytest.MonkeyPatch.context() as mp:  # exact fp32 comparisons: the QAT roundings off (as the text tests)
        mp.setattr(DeepseekV41ForCausalLM, "qat_activations", False)
        engine = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "block_size": 16,
                                                   "max_num_seqs": 4, "max_num_batched_tokens": 7}))
    return path, engine, ReferenceV41(path, qat=False)


def _oracle(ref: ReferenceV41, vision: dict, ids: list[int], images: list[bytes], new: int = NEW) -> list[int]:
    """The placeholders expanded by the oracle's preprocessing, the spans' embeddings by its tower."""
    out, embeds, k = [], {}, 0
    for t in ids:
        if t != ref.image_token_id:
            out.append(t)
            continue
        patches, n_h, n_w, _, _ = vref.load_image(Image.open(io.BytesIO(images[k])), vision)
        span = vref.image_span(ref.w, vision, patches, n_h, n_w)
        embeds.update({len(out) + j: row for j, row in enumerate(span)})
        out += [ref.image_token_id] * span.shape[0]
        k += 1
    return ref.greedy(out, new, embeds)


def test_images_give_the_oracle_greedy_ids_chunked_and_batched(setup):
    path, engine, ref = setup
    vision = engine.model.image_encoder.args.__dict__
    img = ref.image_token_id
    a, b = _image(120, 90, 1), _image(61, 47, 2)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    requests = {"one": (tokens(5, 1) + [img] + tokens(9, 2), [a]),
                "two": (tokens(3, 3) + [img] + tokens(4, 4) + [img] + tokens(2, 5), [b, a]),
                "text": (tokens(20, 6), None)}
    for rid, (prompt, images) in requests.items():
        engine.add_request(rid, prompt, params, images=images)
    text = "a picture " + IMAGE_PLACEHOLDER + " of noise"
    engine.add_request("placeholder", text, params, images=[b])
    got = new_tokens(drive(engine))
    for rid, (prompt, images) in requests.items():
        assert got[rid] == _oracle(ref, vision, prompt, images or []), rid
    tok = engine.tokenizer
    ids = tok.encode("a picture ") + [img] + tok.encode(" of noise", add_special_tokens=False)
    assert got["placeholder"] == _oracle(ref, vision, ids, [b])
    assert not engine.has_unfinished_requests()


def test_bad_images_are_refused_and_nothing_is_left(setup):
    _, engine, ref = setup
    params = SamplingParams(max_tokens=2)
    prompt = tokens(4, 7) + [ref.image_token_id]
    cases = [([b"GIF89a not really"], "image[0]"), ([_image(30, 30, 3)[:60]], "image[0]"),
             ([_image(30, 30, 3), _image(30, 30, 4)], "image"), (None, "image")]
    for images, field in cases:
        with pytest.raises(RequestError) as err:
            engine.add_request("bad", prompt, params, images=images)
        assert err.value.field == field, images
    with pytest.raises(RequestError, match="max_images_per_request") as err:
        engine.add_request("bad", prompt * 9, params, images=[_image(30, 30, 5)] * 9)
    assert err.value.limit == "max_images_per_request"
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats.kv_blocks_used == 0 and stats.num_waiting == 0


@pytest.mark.slow
def test_preemption_recomputes_the_spans_from_their_embeddings(setup):
    """Too few blocks for both requests: one is preempted (its KV dropped) and recomputed from the embeddings its
    request keeps, without re-encoding; the oracle's ids all the same."""
    path, engine, ref = setup
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeepseekV41ForCausalLM, "qat_activations", False)
        small = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "block_size": 16,
                                                  "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_blocks": 4}))
    vision = small.model.image_encoder.args.__dict__
    img = ref.image_token_id
    a, b = _image(120, 90, 5), _image(90, 120, 6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {"p": (tokens(6, 8) + [img] + tokens(3, 9), [a]), "q": (tokens(4, 10) + [img], [b])}
    calls = []
    encode = small.model.image_encoder.encode
    small.model.image_encoder.encode = lambda image: calls.append(1) or encode(image)
    for rid, (prompt, images) in requests.items():
        small.add_request(rid, prompt, params, images=images)
    got = new_tokens(drive(small))
    assert small.stats().num_preemptions > 0 and len(calls) == 2
    for rid, (prompt, images) in requests.items():
        assert got[rid] == _oracle(ref, vision, prompt, images, 12), rid


@pytest.mark.slow
def test_engram_treats_image_tokens_as_dead(tmp_path):
    """Engram on layers 0 and 3 with an image: the image positions' gates zero and the n-grams reaching back into
    the span padded, as the oracle does; ids after the span still hash the text before it only through padding."""
    path = make_tiny("deepseek_v41", tmp_path, seed=10, vision=True, engram_layers=[0, 3])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeepseekV41ForCausalLM, "qat_activations", False)
        engine = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "block_size": 16,
                                                   "max_num_seqs": 2, "max_num_batched_tokens": 9}))
    ref = ReferenceV41(path, qat=False)
    prompt, images = tokens(6, 11) + [ref.image_token_id] + tokens(5, 12), [_image(64, 80, 7)]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    engine.add_request("e", prompt, params, images=images)
    got = new_tokens(drive(engine))["e"]
    assert got == _oracle(ref, engine.model.image_encoder.args.__dict__, prompt, images)


@pytest.mark.slow
def test_two_ranks_keep_the_oracle_greedy_ids_with_an_image(setup):
    """TP=2, QAT on: the driver encodes, the step message carries the span's embeddings to the other rank."""
    from backend_lib.engine.offline import LLM
    path, _, _ = setup
    ref = ReferenceV41(path, qat=True)
    prompt, images = tokens(5, 13) + [ref.image_token_id] + tokens(4, 14), [_image(100, 70, 8)]
    with LLM(str(path), num_blocks=32, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        llm.engine.add_request("tp", prompt, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
                               images=images)
        got = new_tokens(drive(llm.engine))["tp"]
        vision = llm.engine.model.image_encoder.args.__dict__
    assert got == _oracle(ref, vision, prompt, images)


def test_a_two_turn_session_keeps_its_first_image(setup):
    """Turn 1 with an image, its KV evicted, turn 2 with another: the history is recomputed with turn 1's span from
    the embeddings the session kept; both turns give the oracle's ids."""
    from backend_lib.core.outputs import SessionControl
    _, engine, ref = setup
    vision = engine.model.image_encoder.args.__dict__
    img = ref.image_token_id
    a, b = _image(70, 50, 9), _image(50, 70, 10)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    first, second = tokens(4, 15) + [img] + tokens(3, 16), tokens(2, 17) + [img]
    engine.add_request("t1", first, params, session=SessionControl("s", start=True), images=[a])
    turn1 = new_tokens(drive(engine))["t1"]
    assert engine.scheduler.sessions.evict_kv()  # the next turn recomputes the whole history
    engine.add_request("t2", second, params, session=SessionControl("s", end=True), images=[b])
    turn2 = new_tokens(drive(engine))["t2"]
    assert turn1 == _oracle(ref, vision, first, [a])
    assert turn2 == _oracle(ref, vision, first + turn1 + second, [a, b])
