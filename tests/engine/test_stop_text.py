"""A request that ends on a stop token keeps the token's id but not its text (vLLM's rule), on every path out.

The real SmolLM2 (bundled GGUF) answers a chat question and ends on its EOS, "<|im_end|>", a special token: with
``skip_special_tokens`` false its text used to end the output. Checked: the offline engine, the Triton model's
streamed responses (codec -> engine -> coalescer -> response tensors) and the OpenAI front's chunks (OpenAI request
-> the gRPC request it sends -> the Triton model's inputs ... the model's responses as the KServe protobufs Triton
returns -> the front's chunks); only Triton's own transport is left out.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from backend_lib.core.config import EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.frontend.openai import translate
from backend_lib.frontend.openai.schema import ChatCompletionRequest
from backend_lib.frontend.openai.triton_stream import build_infer_request, parse_response
from backend_lib.frontend.triton import codec
from backend_lib.frontend.triton.responses import DeltaCoalescer, ResponseEncoder
from tests.helpers.engines import drive, final_outputs, full_texts, new_tokens

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EOS_TEXT = "<|im_end|>"
GREEDY = dict(max_tokens=96, temperature=0.0)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """With n-gram drafts (greedy output is the same; a step may emit several tokens, which one test needs)."""
    with LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 256, "max_num_seqs": 4,
                                            "method": "ngram", "num_speculative_tokens": 4})) as llm:
        yield llm


@pytest.fixture(scope="module")
def free(smollm2):
    """The greedy answer with special tokens kept: it ends on the EOS (the premise of every test here)."""
    result = smollm2.generate([QUESTION], SamplingParams(skip_special_tokens=False, **GREEDY))[0]
    assert result.finish_reason == "stop" and result.token_ids[-1] in smollm2.tokenizer.eos_token_ids
    assert smollm2.tokenizer.decode(result.token_ids[-1:], skip_special_tokens=False) == EOS_TEXT
    return result


def test_the_eos_text_is_left_out_and_its_id_kept(smollm2, free):
    decode = smollm2.tokenizer.decode
    assert EOS_TEXT not in free.text and free.text.strip()
    assert free.text == decode(free.token_ids[:-1], skip_special_tokens=False)
    skipped = smollm2.generate([QUESTION], SamplingParams(**GREEDY))[0]  # the default: special tokens skipped
    assert (skipped.text, skipped.token_ids) == (free.text, free.token_ids)
    kept = smollm2.generate([QUESTION], SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True,
                                                       **GREEDY))[0]
    assert kept.token_ids == free.token_ids and kept.text == free.text + EOS_TEXT
    ignored = smollm2.generate([QUESTION], SamplingParams(skip_special_tokens=False, ignore_eos=True,
                                                          max_tokens=len(free.token_ids) + 2, temperature=0.0))[0]
    # Not a stop with ignore_eos: the EOS is a token like any other, and its text stays.
    assert ignored.finish_reason == "length" and ignored.token_ids[:len(free.token_ids)] == free.token_ids
    assert ignored.text.startswith(free.text + EOS_TEXT)


def test_a_stop_token_id_of_a_plain_word_leaves_its_text_out(smollm2, free):
    """stop_token_ids: the same rule for a token that is not special (vLLM's), and the stop_reason is its id."""
    decode = smollm2.tokenizer.decode
    index = next(i for i, t in enumerate(free.token_ids) if i >= 2 and decode([t]).strip().isalpha())
    stop_id = free.token_ids[index]
    first = free.token_ids.index(stop_id)
    engine = smollm2.engine
    for include in (False, True):
        engine.add_request(f"stop-id-{include}", QUESTION, SamplingParams(
            stop_token_ids=[stop_id], include_stop_str_in_output=include, **GREEDY))
        outputs = drive(engine)
        ids, text = new_tokens(outputs)[f"stop-id-{include}"], full_texts(outputs)[f"stop-id-{include}"]
        final = final_outputs(outputs)[f"stop-id-{include}"]
        assert final.finish_reason == "stop" and final.stop_reason == stop_id
        assert ids == free.token_ids[:first + 1]
        assert text == decode(ids if include else ids[:-1])
        assert text.endswith(decode([stop_id])) == include


def _triton_inputs(infer: service_pb2.ModelInferRequest) -> tuple[dict[str, np.ndarray], list[str]]:
    """A KServe request's inputs as the Triton model gets them (numpy arrays), and the outputs it names."""
    arrays = {}
    for tensor in infer.inputs:
        contents = tensor.contents
        if tensor.datatype == "BYTES":
            arrays[tensor.name] = np.array(list(contents.bytes_contents), dtype=np.object_)
        elif tensor.datatype == "BOOL":
            arrays[tensor.name] = np.array(list(contents.bool_contents), dtype=bool)
        else:
            assert tensor.datatype == "INT32", tensor.datatype
            arrays[tensor.name] = np.array(list(contents.int_contents), dtype=np.int32)
    return arrays, [output.name for output in infer.outputs]


def _kserve_response(tensors: dict[str, np.ndarray]) -> service_pb2.ModelInferResponse:
    """The model's response tensors as Triton returns them over gRPC (raw little-endian contents)."""
    result = service_pb2.ModelInferResponse()
    for name, array in tensors.items():
        result.outputs.add(name=name)
        if array.dtype == np.object_:
            raw = b"".join(len(item).to_bytes(4, "little") + bytes(item) for item in array.reshape(-1))
        else:
            raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        result.raw_output_contents.append(raw)
    return result


def _serve(llm: LLM, request_id: str, decoded: codec.DecodedRequest) -> list[dict[str, np.ndarray]]:
    """The Triton model's loop for one request: engine outputs -> coalesced deltas -> response tensors."""
    encoder, coalescer = ResponseEncoder(decoded, llm.tokenizer.decode), DeltaCoalescer(1)
    llm.engine.add_request(request_id, decoded.prompt, decoded.params, decoded.session)
    responses = []
    while llm.engine.has_unfinished_requests():
        outputs = [out for out in llm.engine.step() if out.request_id == request_id]
        while (merged := coalescer.push(outputs)) is not None:
            outputs = []
            tensors = encoder.encode(merged)
            if tensors is not None:
                responses.append(tensors)
    return responses


def test_the_triton_stream_leaves_the_eos_text_out(smollm2, free):
    inputs = {"messages": np.array([json.dumps(QUESTION).encode()], dtype=np.object_), "stream": np.array([True])}
    for name in codec.BOOL_INPUTS:
        if name.startswith("return_"):
            inputs[name] = np.array([True])
    for include in (False, True):
        decoded = codec.decode_request(inputs, parameters_json=(
            '{"max_tokens": 96, "temperature": 0, "skip_special_tokens": false, '
            f'"include_stop_str_in_output": {str(include).lower()}}}'))
        responses = _serve(smollm2, f"triton-{include}", decoded)
        text = b"".join(r["text_output"][0] for r in responses).decode()
        ids = [int(i) for r in responses for i in r["output_ids"]]
        assert ids == free.token_ids and text == free.text + (EOS_TEXT if include else "")
        assert [r["finish_reason"][0] for r in responses][-1] == b"stop"
        # The EOS comes with the final response (its id there, its text not, unless asked).
        assert responses[-1]["output_ids"].tolist()[-1] == free.token_ids[-1]
        assert responses[-1]["text_output"][0].decode().endswith(EOS_TEXT) == include


def test_the_openai_chunks_leave_the_eos_text_out(smollm2, free):
    for include in (False, True):
        chat = ChatCompletionRequest(model="deepinfer", messages=QUESTION, stream=True, skip_special_tokens=False,
                                     include_stop_str_in_output=include, max_tokens=96, temperature=0.0)
        [model_request] = translate.chat_requests(chat, None)
        inputs, requested = _triton_inputs(build_infer_request("deepinfer", "oa", model_request))
        decoded = codec.decode_request(inputs, requested_outputs=requested)
        chunks = [translate.chat_chunk("chatcmpl-x", 1, "deepinfer", 0, parse_response(_kserve_response(tensors)),
                                       False).choices[0]
                  for tensors in _serve(smollm2, f"openai-{include}", decoded)]
        assert "".join(c.delta.content or "" for c in chunks) == free.text + (EOS_TEXT if include else "")
        assert [c.finish_reason for c in chunks][-1] == "stop" and not any(c.finish_reason for c in chunks[:-1])
        assert (EOS_TEXT in (chunks[-1].delta.content or "")) == include  # the finish chunk



def test_a_stop_string_in_the_step_that_hit_max_tokens_is_the_reason(smollm2):
    """With n-gram drafts a step emits several tokens: when a stop string is in a step's text before the token that
    reached max_tokens, the text ends at the string and the string is the reason (vLLM), not "length"."""
    text = "The keeper climbed the spiral stairs every evening, lit the lamp, and wrote the ships in a book."
    prompt = [{"role": "user", "content": f"Repeat the following text exactly.\n\n{text}"}]
    engine, decode = smollm2.engine, smollm2.tokenizer.decode
    free = drive(engine, {"free": (prompt, SamplingParams(max_tokens=48, temperature=0.0))})["free"]
    ids = [t for out in free for t in out.new_token_ids]
    # A step of several tokens whose first token's text is new to the output: it is the stop string.
    emitted, chosen = 0, None
    for out in free:
        n = len(out.new_token_ids)
        piece = decode(ids[:emitted + 1])[len(decode(ids[:emitted])):]
        if n >= 2 and len(piece.strip()) >= 3 and piece not in decode(ids[:emitted]) + piece[:-1]:
            chosen = (emitted, piece, emitted + n)
            break
        emitted += n
    assert chosen is not None, [len(out.new_token_ids) for out in free]
    start, stop, end = chosen
    cut = drive(engine, {"cut": (prompt, SamplingParams(max_tokens=end, temperature=0.0, stop=[stop]))})["cut"]
    final = cut[-1]
    assert final.finished and (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert "".join(out.new_text for out in cut) == decode(ids[:start])
    assert [t for out in cut for t in out.new_token_ids] == ids[:end]  # the step's tokens, max_tokens reached
