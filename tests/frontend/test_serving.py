"""The Triton-free codec: config parameters -> EngineConfig, request tensors -> engine inputs, outputs -> tensors."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from backend_lib.core.config import RequestLimits
from backend_lib.core.errors import ErrorKind, RequestError
from backend_lib.core.outputs import PromptLogprobs, RequestOutput, SessionControl, TokenLogprob
from backend_lib.core.sampling_params import UNTIL_CONTEXT_ENDS
from backend_lib.structured_output.constraints import ConstraintKind, OutputConstraint
from backend_lib.frontend.triton import codec, parameters, responses
from backend_lib.engine.intake import RequestRules


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _bool(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def _out(text: str, ids: list[int], finished: bool = False, reason: str | None = None, n_out: int = 0,
         logprobs: list[TokenLogprob] | None = None, cum: float = 0.0) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=ids, new_text=text, finished=finished,
                         finish_reason=reason, num_prompt_tokens=7, num_output_tokens=n_out,
                         cumulative_logprob=cum, new_logprobs=logprobs)


# ---- engine configuration from config.pbtxt parameters -------------------------------------------

def test_engine_config_typed_conversion_and_defaults():
    config = parameters.engine_config_from_parameters({
        "model": "", "dtype": "float32", "max_num_seqs": "8", "max_model_len": "256", "block_size": "16",
        "num_blocks": "64", "max_num_batched_tokens": "128", "session_idle_timeout_s": "2.5",
        "spec_method": "ngram", "num_speculative_tokens": "3", "enable_prefix_caching": "false"})
    assert config.scheduler.max_num_seqs == 8
    assert config.model.max_model_len == 256 and config.model.model == ""
    assert config.cache.num_blocks == 64 and config.cache.enable_prefix_caching is False
    assert config.session_idle_timeout_s == 2.5
    assert config.spec.method == "ngram" and config.spec.num_speculative_tokens == 3
    # "" means "use the default", also for numbers
    assert parameters.engine_config_from_parameters({"num_blocks": ""}).cache.num_blocks == 0


def test_engine_config_spec_ngram_and_compile_parameters():
    config = parameters.engine_config_from_parameters({
        "spec_method": "ngram", "num_speculative_tokens": "2", "ngram_min": "2", "ngram_max": "5",
        "compile_backend": "aot_eager", "batch_buckets": "1,2,4", "width_buckets": "8, 16",
        "prefill_buckets": ""})
    assert (config.spec.ngram_min, config.spec.ngram_max) == (2, 5)
    assert config.compile.compile_backend == "aot_eager"
    assert config.compile.batch_buckets == (1, 2, 4) and config.compile.width_buckets == (8, 16)
    assert config.compile.prefill_buckets == ()
    defaults = parameters.engine_config_from_parameters({"ngram_min": "", "ngram_max": "", "compile_backend": ""})
    assert (defaults.spec.ngram_min, defaults.spec.ngram_max) == (1, 4)
    assert defaults.compile.compile_backend == "none"


def test_shipped_config_pbtxt_parameters_are_valid():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "model_repository/deepinfer/config.pbtxt").read_text()
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', text))
    # Every accepted parameter is listed (render_config can only set lines that exist), with a valid default.
    assert set(params) == set(parameters.ENGINE_PARAMETER_NAMES + parameters.SERVING_PARAMETER_NAMES)
    config = parameters.engine_config_from_parameters(params)
    assert parameters.serving_options_from_parameters(params).stream_interval == 1
    assert config.spec.ngram_min == 1 and config.spec.ngram_max == 4 and config.compile.compile_backend == "none"
    assert "decoupled: true" in text and "max_batch_size: 0" in text


@pytest.mark.parametrize("params, needle", [
    ({"max_num_seqs": "eight"}, "max_num_seqs must be an integer"),
    ({"max_num_seqs": "0"}, "max_num_seqs must be in [1, 1024]"),
    ({"session_idle_timeout_s": "soon"}, "session_idle_timeout_s must be a number"),
    ({"dtype": "int4"}, "dtype must be one of"),
    ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching must be true or false"),
    ({"max_tokens": "3"}, "unknown model parameter 'max_tokens'"),
    ({"ngram_min": "two"}, "ngram_min must be an integer"),
    ({"ngram_min": "5", "ngram_max": "3"}, "1 <= ngram_min <= ngram_max, got [5, 3]"),
    ({"ngram_min": "0"}, "1 <= ngram_min <= ngram_max"),
    ({"compile_backend": "tensorrt"}, "compile_backend must be one of"),
    ({"batch_buckets": "4,2"}, "batch_buckets must be strictly increasing"),
    ({"width_buckets": "8,x"}, "width_buckets must be a list of ints"),
])
def test_engine_config_bad_values_name_the_parameter(params, needle):
    with pytest.raises(ValueError) as info:
        parameters.engine_config_from_parameters(params)
    assert needle in str(info.value)


@pytest.mark.parametrize("text", ["0", "-2", "four", "1.5", "2000"])
def test_bad_stream_interval_names_the_parameter(text):
    with pytest.raises(ValueError, match=r"stream_interval must be an integer in \[1, 1024\]"):
        parameters.serving_options_from_parameters({"stream_interval": text})


# ---- request decoding ----------------------------------------------------------------------------

def test_text_request_defaults_follow_the_vllm_backend():
    req = codec.decode_request({"text_input": _bytes("Hello")})
    assert req.prompt == "Hello" and req.stream is False
    assert req.prepend_text == "Hello"  # non-streaming, exclude_input_in_output absent -> prompt prepended
    assert req.params.max_tokens == 16 and req.session is None
    assert req.options == codec.OutputOptions()

    streamed = codec.decode_request({"text_input": _bytes("Hello"), "stream": _bool(True)})
    assert streamed.stream and streamed.prepend_text == ""
    excluded = codec.decode_request({"text_input": _bytes("Hello"), "exclude_input_in_output": _bool(True)})
    assert excluded.prepend_text == ""
    with pytest.raises(ValueError, match="exclude_input_in_output=false is not allowed when streaming"):
        codec.decode_request({"text_input": _bytes("x"), "stream": _bool(True),
                              "exclude_input_in_output": _bool(False)})


def test_sampling_from_json_and_request_parameters_json_wins():
    req = codec.decode_request(
        {"text_input": _bytes("x"), "sampling_parameters": _bytes('{"max_tokens": 5, "temperature": "0"}')},
        parameters_json=json.dumps({"max_tokens": 9, "top_k": "4", "ignore_eos": "true", "stop": "\n"}))
    assert req.params.max_tokens == 5  # the JSON input wins
    assert req.params.temperature == 0.0 and req.params.top_k == 4 and req.params.ignore_eos is True
    assert req.params.stop == ["\n"]
    # vLLM clients send null for "default"; max_tokens' null is vLLM's "as many as max_model_len leaves"
    nulls = codec.decode_request({"text_input": _bytes("x"),
                                  "sampling_parameters": _bytes('{"seed": null, "max_tokens": null}')}).params
    assert nulls.seed is None and nulls.max_tokens == UNTIL_CONTEXT_ENDS and not nulls.max_tokens_set


@pytest.mark.parametrize("inputs, params, needle, field", [
    ({"sampling_parameters": _bytes("{max_tokens: 3")}, "{}", "sampling_parameters is not valid JSON",
     "sampling_parameters"),
    ({"sampling_parameters": _bytes("[1]")}, "{}", "sampling_parameters must be a JSON object", "sampling_parameters"),
    ({"sampling_parameters": _bytes('{"max_tokenz": 3}')}, "{}", "unknown sampling field 'max_tokenz'", "max_tokenz"),
    ({"sampling_parameters": _bytes('{"max_tokens": -1}')}, "{}", "max_tokens must be >= 1", "max_tokens"),
    ({"sampling_parameters": _bytes('{"top_p": 2}')}, "{}", "top_p must be in (0, 1]", "top_p"),
    ({"sampling_parameters": _bytes('{"max_tokens": "lots"}')}, "{}", "max_tokens must be an integer", "max_tokens"),
    # One whitelist for both places a field can come from (request parameters and the JSON input).
    ({}, '{"colour": "blue"}', "unknown sampling field 'colour'", "colour"),
    ({}, '{"temperature": -1}', "temperature must be >= 0", "temperature"),
    ({}, '{"logit_bias": {"5": 1000}}', "logit_bias[5] must be in [-100, 100]", "logit_bias"),
    ({}, '{"guided_regex": ""}', "guided_regex must be a non-empty string", "guided_regex"),
    ({}, '{"structured_outputs": {"regex": "a", "choice": ["b"]}}', "both constrain the output",
     "structured_outputs"),
    ({}, '{"guided_json_object": "maybe"}', "guided_json_object must be true or false", "guided_json_object"),
])
def test_bad_sampling_input_names_the_problem(inputs, params, needle, field):
    with pytest.raises(RequestError) as info:
        codec.decode_request({"text_input": _bytes("hi"), **inputs}, parameters_json=params)
    assert needle in str(info.value)
    assert info.value.field == field and info.value.kind is ErrorKind.INVALID


def test_structured_output_fields_become_the_constraint_under_the_servers_limits():
    """structured_outputs and the older guided_* fields (JSON input or parameters) -> SamplingParams.structured_outputs;
    a limit refusal names the field and the setting (config.pbtxt's max_schema_chars)."""
    text = {"text_input": _bytes("hi")}
    regex = codec.decode_request({**text, "sampling_parameters": _bytes('{"guided_regex": "[ab]+"}')})
    assert regex.params.structured_outputs == OutputConstraint(ConstraintKind.REGEX, "[ab]+")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = json.dumps({"structured_outputs": {"json": schema}})
    assert codec.decode_request(text, body).params.structured_outputs.schema() == schema
    obj = codec.decode_request(text, '{"guided_json_object": "true"}').params.structured_outputs
    assert obj.kind is ConstraintKind.JSON_OBJECT and obj.field == "guided_json_object"
    assert codec.decode_request(text, '{"guided_json_object": false}').params.structured_outputs is None
    with pytest.raises(RequestError) as info:
        codec.decode_request(text, '{"guided_choice": ["a", "b", "c"]}', rules=RequestRules(RequestLimits(max_choices=2)))
    assert info.value.field == "guided_choice" and info.value.limit == "max_choices"
    assert "max_choices" in str(info.value)
    with pytest.raises(RequestError, match="guided_json_object and guided_regex both constrain"):
        codec.decode_request(text, '{"guided_json_object": true, "guided_regex": "a"}')


def test_prompt_sources():
    ids = codec.decode_request({"input_ids": np.array([1, 2, 3], dtype=np.int32)})
    assert ids.prompt == [1, 2, 3] and ids.prepend_text == ""  # ids have no text to repeat
    chat = [{"role": "user", "content": "Hi"}]
    msg = codec.decode_request({"messages": _bytes(json.dumps(chat))})
    assert msg.prompt == chat and msg.prepend_text == ""


@pytest.mark.parametrize("inputs, needle", [
    ({}, "give exactly one of the inputs text_input, input_ids, messages; got none"),
    ({"text_input": _bytes("a"), "input_ids": np.array([1], dtype=np.int32)}, "got text_input, input_ids"),
    ({"text_input": _bytes("")}, "text_input is empty"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "text_input is not valid UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input must hold exactly one element"),
    ({"input_ids": np.array([], dtype=np.int32)}, "input_ids is empty"),
    ({"input_ids": np.array([5, -2], dtype=np.int32)}, "input_ids must be >= 0, got -2"),
    ({"input_ids": np.array([1.5], dtype=np.float32)}, "input_ids must be INT32"),
    ({"messages": _bytes("not json")}, "messages is not valid JSON"),
    ({"messages": _bytes("[]")}, "messages must be a non-empty JSON list"),
    ({"messages": _bytes('[{"role": "user"}]')}, "messages[0] must be an object with string fields role and content"),
    ({"text_input": _bytes("a"), "stream": np.array([1], dtype=np.int32)}, "input stream must be BOOL"),
    ({"text_input": _bytes("a"), "image": _bytes("eA==")}, "this model does not take images"),  # a text model
])
def test_bad_prompts_name_the_problem(inputs, needle):
    with pytest.raises(RequestError) as info:
        codec.decode_request(inputs)
    assert needle in str(info.value)
    assert info.value.field in ("text_input", "input_ids", "messages", "stream", "image")


def test_sessions_from_grpc_flags_and_http_parameters():
    text = {"text_input": _bytes("turn")}
    assert codec.decode_request(text, correlation_id=0, flags=0).session is None
    first = codec.decode_request(text, correlation_id=42, flags=codec.FLAG_SEQUENCE_START)
    assert first.session == SessionControl("42", start=True, end=False)
    middle = codec.decode_request(text, correlation_id="chat-1", flags=0)
    assert middle.session == SessionControl("chat-1", start=False, end=False)
    last = codec.decode_request(text, correlation_id=42, flags=codec.FLAG_SEQUENCE_END)
    assert last.session == SessionControl("42", start=False, end=True)
    http = codec.decode_request(text, parameters_json=json.dumps(
        {"sequence_id": 7, "sequence_start": True, "sequence_end": "false", "max_tokens": 3}))
    assert http.session == SessionControl("7", start=True, end=False) and http.params.max_tokens == 3
    with pytest.raises(ValueError, match="need a non-zero sequence_id"):
        codec.decode_request(text, parameters_json='{"sequence_start": true}')
    with pytest.raises(ValueError, match="sequence_id must be an integer or a string"):
        codec.decode_request(text, parameters_json='{"sequence_id": 1.5}')


def test_return_flags():
    req = codec.decode_request({"text_input": _bytes("x"), "return_finish_reason": _bool(True),
                                "return_num_output_tokens": _bool(True), "return_logprobs": _bool(False)})
    assert req.options == codec.OutputOptions(finish_reason=True, num_output_tokens=True)


# ---- response encoding ---------------------------------------------------------------------------

def _all_flags(stream: bool, **extra) -> codec.DecodedRequest:
    inputs = {"text_input": _bytes("Q: "), "stream": _bool(stream)}
    for name in codec.BOOL_INPUTS:
        if name.startswith("return_"):
            inputs[name] = _bool(True)
    return codec.decode_request(inputs, parameters_json=json.dumps(extra))


def test_streaming_sends_deltas_and_skips_empty_ones():
    encoder = responses.ResponseEncoder(_all_flags(stream=True))
    first = encoder.encode(_out("Par", [10], n_out=1, cum=-0.5))
    assert first["text_output"].tolist() == [b"Par"] and first["output_ids"].tolist() == [10]
    assert first["finish_reason"].tolist() == [b"None"]
    assert first["num_output_tokens"].tolist() == [1] and first["num_input_tokens"].tolist() == [7]
    assert first["cumulative_logprob"].dtype == np.float32
    assert first["logprobs"].tolist() == [b"null"]  # the request did not ask for logprobs
    assert encoder.encode(_out("", [], n_out=1)) is None
    last = encoder.encode(_out("is.", [11, 12], finished=True, reason="stop", n_out=3, cum=-1.0))
    assert last["text_output"].tolist() == [b"is."] and last["finish_reason"].tolist() == [b"stop"]
    assert last["num_output_tokens"].tolist() == [2]  # a delta count, like the vLLM backend
    assert last["cumulative_logprob"].tolist() == [-1.0]


def test_non_streaming_gathers_everything_and_prepends_the_prompt():
    encoder = responses.ResponseEncoder(_all_flags(stream=False, logprobs=1), decode_token=lambda t: f"<{t}>")
    lp1 = TokenLogprob(10, -0.1, top=[(10, -0.1)])
    lp2 = TokenLogprob(11, -2.0, top=[(12, -0.5)])
    assert encoder.encode(_out("Par", [10], n_out=1, logprobs=[lp1])) is None
    final = encoder.encode(_out("is", [11], finished=True, reason="length", n_out=2, logprobs=[lp2]))
    assert final["text_output"].tolist() == ["Q: Paris".encode()]
    assert final["output_ids"].tolist() == [10, 11] and final["num_output_tokens"].tolist() == [2]
    assert final["finish_reason"].tolist() == [b"length"]
    logprobs = json.loads(final["logprobs"][0])
    assert logprobs[0] == {"10": {"logprob": -0.1, "rank": 1, "decoded_token": "<10>"}}
    assert logprobs[1]["11"] == {"logprob": -2.0, "rank": None, "decoded_token": "<11>"}
    assert logprobs[1]["12"]["rank"] == 1


def test_prompt_logprobs_go_with_the_first_tokens_and_an_ids_prompt_is_decoded_before_the_output():
    prompt = PromptLogprobs(5, [TokenLogprob(6, -1.5, top=[(7, -0.2)]), TokenLogprob(8, -0.3)])
    inputs = {"input_ids": np.array([5, 6, 8], dtype=np.int32), "exclude_input_in_output": _bool(False)}
    request = codec.decode_request(inputs, parameters_json=json.dumps({"prompt_logprobs": 1}))
    encoder = responses.ResponseEncoder(request, decode_token=lambda t: f"<{t}>",
                                    decode_ids=lambda ids: "".join(f"<{t}>" for t in ids))
    assert encoder.encode(replace(_out("a", [9], n_out=1), prompt_logprobs=prompt)) is None
    final = encoder.encode(_out("b", [10], finished=True, reason="length", n_out=2))
    assert final["text_output"].tolist() == [b"<5><6><8>ab"]
    entries = json.loads(final["prompt_logprobs"][0])
    assert entries[0] == {"5": {"logprob": None, "rank": None, "decoded_token": "<5>"}}
    assert entries[1] == {"6": {"logprob": -1.5, "rank": None, "decoded_token": "<6>"},
                          "7": {"logprob": -0.2, "rank": 1, "decoded_token": "<7>"}}
    assert list(entries[2]) == ["8"]
    # Not asked by name, an ids prompt's non-streamed text is the new text alone, as before.
    assert codec.decode_request({"input_ids": np.array([5, 6], dtype=np.int32)}).prepend_ids == []
    # Streamed (coalesced deltas included), the entries ride with the first tokens and only there.
    streaming = responses.ResponseEncoder(_all_flags(stream=True, prompt_logprobs=1))
    merged = responses.coalesce([replace(_out("a", [9], n_out=1), prompt_logprobs=prompt), _out("b", [10], n_out=2)])
    assert "prompt_logprobs" in streaming.encode(merged)
    assert "prompt_logprobs" not in streaming.encode(_out("c", [11], n_out=3))


def test_coalesced_deltas_stream_as_one_response():
    lp = [TokenLogprob(10, -0.1), TokenLogprob(11, -0.2), TokenLogprob(12, -0.3)]
    parts = [_out("Pa", [10], n_out=1, logprobs=lp[:1]), _out("", [11], n_out=2, logprobs=lp[1:2]),
             _out("ris", [12], finished=True, reason="stop", n_out=3, logprobs=lp[2:], cum=-0.6)]
    merged = responses.coalesce(parts)
    assert merged.new_text == "Paris" and merged.new_token_ids == [10, 11, 12] and merged.new_logprobs == lp
    assert merged.finished and merged.finish_reason == "stop" and merged.cumulative_logprob == -0.6
    assert responses.coalesce(parts[:1]) is parts[0]
    assert responses.coalesce([_out("a", [1]), _out("b", [2])]).new_logprobs is None
    tensors = responses.ResponseEncoder(_all_flags(stream=True)).encode(merged)
    assert tensors["text_output"].tolist() == [b"Paris"] and tensors["num_output_tokens"].tolist() == [3]


def test_stream_interval_holds_deltas_but_never_the_first_token_or_the_end():
    coalescer = responses.DeltaCoalescer(interval=3)
    assert coalescer.push([]) is None
    assert coalescer.push([_out("", [])]).new_text == ""  # no token yet: nothing held back
    assert coalescer.push([_out("A", [1])]).new_token_ids == [1]  # the first token goes at once
    assert coalescer.push([_out("b", [2])]) is None
    assert coalescer.push([_out("c", [3])]) is None
    sent = coalescer.push([_out("d", [4])])
    assert sent.new_text == "bcd" and sent.new_token_ids == [2, 3, 4]
    assert coalescer.push([_out("e", [5])]) is None
    assert coalescer.push([_out("e", [5])], flush=True).new_token_ids == [5, 5]
    assert coalescer.push([_out("f", [6])]) is None
    final = coalescer.push([_out(".", [7], finished=True, reason="stop")])
    assert final.finished and final.new_text == "f." and final.new_token_ids == [6, 7]
    every_token = responses.DeltaCoalescer()
    assert [every_token.push([_out(t, [i])]).new_text for i, t in enumerate("xyz")] == ["x", "y", "z"]
    late = responses.DeltaCoalescer(interval=1)  # the response thread found the whole request waiting
    assert late.push([_out("A", [1]), _out("b", [2]), _out(".", [3], finished=True)]).new_text == "A"
    rest = late.push([])
    assert rest.finished and rest.new_text == "b." and late.push([]) is None


def test_minimal_response_has_only_text_and_ids():
    encoder = responses.ResponseEncoder(codec.decode_request({"text_input": _bytes("a"),
                                                          "exclude_input_in_output": _bool(True)}))
    final = encoder.encode(_out("b", [3], finished=True, reason="stop", n_out=1))
    assert set(final) == {"text_output", "output_ids"} and final["text_output"].tolist() == [b"b"]


def test_named_outputs_are_the_only_ones_built():
    """A client that names its outputs gets only those (Triton would drop the rest anyway); a named output whose
    return_* flag is off is still not built."""
    inputs = {"text_input": _bytes("a"), "stream": _bool(True), "return_num_output_tokens": _bool(True),
              "return_finish_reason": _bool(True)}
    request = codec.decode_request(inputs, requested_outputs=["text_output", "num_output_tokens", "logprobs"])
    tensors = responses.ResponseEncoder(request).encode(_out("b", [3], n_out=1))
    assert set(tensors) == {"text_output", "num_output_tokens"}
    every = responses.ResponseEncoder(codec.decode_request(inputs)).encode(_out("b", [3], n_out=1))
    assert set(every) == {"text_output", "output_ids", "num_output_tokens", "finish_reason"}


# ---- `deepinfer serve` plumbing (no server started here; tests/e2e starts real ones) ----------------

def test_render_config_sets_parameters_and_rejects_unknown_names():
    from backend_lib.frontend.triton import install as triton_install

    template = (triton_install.MODEL_SOURCE / "config.pbtxt").read_text()
    rendered = triton_install.render_config(template, {"max_num_seqs": "4", "model": "/m/x.gguf"})
    assert 'parameters { key: "max_num_seqs" value: { string_value: "4" } }' in rendered
    assert 'parameters { key: "model" value: { string_value: "/m/x.gguf" } }' in rendered
    assert 'parameters { key: "block_size" value: { string_value: "16" } }' in rendered  # untouched
    with pytest.raises(ValueError, match="unknown model parameter 'max_batch'"):
        triton_install.render_config(template, {"max_batch": "4"})
    with pytest.raises(ValueError, match="must not contain quotes"):
        triton_install.render_config(template, {"model": 'a"b'})


def test_server_env_points_the_stub_at_this_environment(tmp_path):
    import sysconfig

    from backend_lib.frontend.triton import install as triton_install

    install = triton_install.TritonInstall(root=tmp_path, libs=tmp_path / "libs")
    env = triton_install.server_env(install, base={"LD_LIBRARY_PATH": "/opt/x"})
    ld = env["LD_LIBRARY_PATH"].split(":")
    assert ld[0] == str(tmp_path / "libs") and ld[-1] == "/opt/x"
    assert sysconfig.get_config_var("LIBDIR") in ld  # the stub links this interpreter's libpython
    site_dirs = env["DEEPINFER_SITE_DIRS"].split(":")
    assert str(triton_install.PROJECT_ROOT) in site_dirs and sysconfig.get_paths()["purelib"] in site_dirs


def test_prepared_tritonserver_has_binary_backend_and_stub(tmp_path):
    from backend_lib.frontend.triton import install as triton_install

    install = triton_install.prepare_tritonserver(tmp_path)
    assert install.binary.is_file()
    assert (install.backends / "python" / "libtriton_python.so").is_file()
    assert (install.backends / "python" / "triton_python_backend_stub").is_file()
    assert triton_install.prepare_tritonserver(tmp_path) == install  # cached: the second call copies nothing


def test_an_installed_triton_or_a_users_repository_missing_a_part_is_refused_naming_it(tmp_path):
    from backend_lib.frontend.triton import install as triton_install

    root = tmp_path / "triton"
    with pytest.raises(ValueError, match="no bin/tritonserver there"):
        triton_install.installed_tritonserver(root)
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tritonserver").write_bytes(b"")
    with pytest.raises(ValueError, match="no backends/python/triton_python_backend_stub there"):
        triton_install.installed_tritonserver(root)
    (root / "backends" / "python").mkdir(parents=True)
    (root / "backends" / "python" / "triton_python_backend_stub").write_bytes(b"")
    assert triton_install.installed_tritonserver(root).libs is None  # its libraries are the loader's business
    (root / "lib").mkdir()
    assert triton_install.installed_tritonserver(root).libs == root / "lib"  # NVIDIA's layout: on LD_LIBRARY_PATH
    with pytest.raises(ValueError, match="no deepinfer/config.pbtxt there"):
        triton_install.checked_model_repository(tmp_path / "models")
    repository = triton_install.write_model_repository(tmp_path / "models", {})
    assert triton_install.checked_model_repository(repository) == repository.resolve()


def test_serve_refuses_engine_settings_beside_a_repository_served_as_is(tmp_path):
    from backend_lib.frontend.triton import server

    with pytest.raises(SystemExit, match="--model-repository is served as is"):
        server.main(["--model-repository", str(tmp_path), "--param", "max_num_seqs=2"])
    with pytest.raises(SystemExit, match="no deepinfer/config.pbtxt there"):
        server.main(["--model-repository", str(tmp_path)])
    with pytest.raises(SystemExit, match="no bin/tritonserver there"):
        server.main(["--tritonserver", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown model parameter 'bogus'"):  # was a traceback from start()
        server.main(["--param", "bogus=1"])


def test_free_ports_lie_below_the_ephemeral_range():
    """Outgoing connections take their local ports from the ephemeral range, so a server port chosen there can
    be gone by the time the server binds it."""
    from pathlib import Path

    from backend_lib.core.processes import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= port < low for port in ports) and len(ports) > 1
