"""Triton-free codec between the Triton tensor API and the engine.

model.py only moves numpy arrays and strings in and out of ``pb_utils``; every decision about what a
request means (prompt source, sampling fields, session controls, which outputs to return) and how an
engine output becomes response tensors lives here, so it is unit-tested without a server.

The tensor API follows Triton's vLLM backend (text_input, stream, sampling_parameters,
exclude_input_in_output, return_* flags; text_output, finish_reason, cumulative_logprob, logprobs,
num_input_tokens, num_output_tokens) so its clients and ``genai-perf --backend vllm`` work unchanged.
Ours besides: input_ids (INT32) or messages (BYTES, JSON chat) instead of text, output_ids, and prompt_logprobs
(the prompt_logprobs sampling field's answer, with the first response that carries tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import numpy as np

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import PromptLogprobs, RequestOutput, SessionControl, TokenLogprob
from backend_lib.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend_lib.engine.async_engine import AsyncEngine

# Triton's request flags (tritonserver.h): the sequence protocol on gRPC.
FLAG_SEQUENCE_START = 1
FLAG_SEQUENCE_END = 2

PROMPT_INPUTS = ("text_input", "input_ids", "messages")
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
               "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")
INPUT_NAMES = PROMPT_INPUTS + ("sampling_parameters",) + BOOL_INPUTS
SESSION_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")

# Engine settings accepted as config.pbtxt parameters: name -> (EngineConfig flat name, converter name).
_ENGINE_PARAMETERS: dict[str, tuple[str, type]] = {
    "model": ("model", str),
    "dtype": ("dtype", str),
    "device": ("device", str),
    "host_gemm": ("host_gemm", str),
    "host_attention": ("host_attention", str),
    "greedy_head_screen": ("greedy_head_screen", bool),
    "max_num_seqs": ("max_num_seqs", int),
    "max_model_len": ("max_model_len", int),
    "block_size": ("block_size", int),
    "num_blocks": ("num_blocks", int),
    "kv_cache_memory_gb": ("kv_cache_memory_gb", float),
    "kv_cache_memory_fraction": ("kv_cache_memory_fraction", float),
    "enable_prefix_caching": ("enable_prefix_caching", bool),
    "kv_cache_dtype": ("kv_cache_dtype", str),
    "max_num_batched_tokens": ("max_num_batched_tokens", int),
    "enable_chunked_prefill": ("enable_chunked_prefill", bool),
    "session_idle_timeout_s": ("session_idle_timeout_s", float),
    "spec_method": ("method", str),
    "num_speculative_tokens": ("num_speculative_tokens", int),
    "ngram_min": ("ngram_min", int),
    "ngram_max": ("ngram_max", int),
    "compile_backend": ("compile_backend", str),
    # Bucket lists stay strings ("1,2,4,8"): CompileConfig parses and validates them.
    "batch_buckets": ("batch_buckets", str),
    "width_buckets": ("width_buckets", str),
    "prefill_buckets": ("prefill_buckets", str),
    "compile_cache_dir": ("compile_cache_dir", str),
    "compile_sampler_variants": ("compile_sampler_variants", str),
    "compile_scope": ("compile_scope", str),
    "seed": ("seed", int),
    "num_threads": ("num_threads", int),
    "tensor_parallel_size": ("tensor_parallel_size", int),
    "enable_expert_parallel": ("enable_expert_parallel", bool),
    "nnodes": ("nnodes", int),
    "master_addr": ("master_addr", str),
    "master_port": ("master_port", int),
    "distributed_timeout_s": ("distributed_timeout_s", float),
    "max_waiting_requests": ("max_waiting_requests", int),
    "max_sessions": ("max_sessions", int),
    "max_prompt_chars": ("max_prompt_chars", int),
    "max_input_ids": ("max_input_ids", int),
    "max_messages": ("max_messages", int),
    "max_messages_chars": ("max_messages_chars", int),
    "max_stop_strings": ("max_stop_strings", int),
    "max_stop_string_chars": ("max_stop_string_chars", int),
    "max_stop_token_ids": ("max_stop_token_ids", int),
    "max_logit_bias": ("max_logit_bias", int),
    "max_logprobs": ("max_logprobs", int),
}
ENGINE_PARAMETER_NAMES = tuple(_ENGINE_PARAMETERS)
# Parameters of the Triton model itself, not the engine.
SERVING_PARAMETER_NAMES = ("stream_interval",)
MAX_STREAM_INTERVAL = 1024

# Sampling fields by type, for values that arrive as strings (HTTP parameters, vLLM-style clients
# that send {"temperature": "0.1"}). Everything else goes to SamplingParams unchanged.
_INT_FIELDS = frozenset({"max_tokens", "top_k", "seed", "min_tokens", "logprobs", "prompt_logprobs"})
_FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty"})
_BOOL_FIELDS = frozenset({"ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"})


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {text!r}")


def engine_config_from_parameters(parameters: Mapping[str, str]) -> EngineConfig:
    """config.pbtxt ``parameters`` (all strings) -> a validated EngineConfig.

    An empty string means "not set" (the EngineConfig default). A bad name or value raises ValueError
    naming the parameter, which Triton reports as the model's load error.
    """
    flat: dict[str, Any] = {}
    for name, text in parameters.items():
        if name in SERVING_PARAMETER_NAMES:
            continue
        if name not in _ENGINE_PARAMETERS:
            allowed = ", ".join(ENGINE_PARAMETER_NAMES + SERVING_PARAMETER_NAMES)
            raise ValueError(f"unknown model parameter {name!r} (allowed: {allowed})")
        if text == "":
            continue
        target, kind = _ENGINE_PARAMETERS[name]
        if kind is bool:
            value: Any = _parse_bool(f"model parameter {name}", text)
        elif kind is str:
            value = text
        else:
            try:
                value = kind(text.strip())
            except ValueError:
                raise ValueError(f"model parameter {name} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {text!r}") from None
        flat[target] = value
    try:
        return EngineConfig.from_flat(flat)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid model parameters: {exc}") from exc


@dataclass
class ServingOptions:
    """How the Triton model streams (config.pbtxt parameters that are not engine settings)."""

    # Tokens per streamed response after the first: 1 = one response per token; n > 1 sends every n tokens
    # (the first token and the final response always go at once), for fewer responses under load.
    stream_interval: int = 1


def serving_options_from_parameters(parameters: Mapping[str, str]) -> ServingOptions:
    text = parameters.get("stream_interval", "").strip()
    if not text:
        return ServingOptions()
    if not text.isdigit() or not 1 <= int(text) <= MAX_STREAM_INTERVAL:
        raise ValueError(f"model parameter stream_interval must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                         f"got {text!r}")
    return ServingOptions(stream_interval=int(text))


def build_engine(parameters: Mapping[str, str]) -> "AsyncEngine":
    """The one factory the Triton model uses: parameters -> running AsyncEngine."""
    from backend_lib.engine.async_engine import AsyncEngine  # deferred: torch and the model load only here

    return AsyncEngine(engine_config_from_parameters(parameters))


@dataclass
class OutputOptions:
    """Which optional outputs the client asked for (the vLLM backend's return_* inputs)."""

    finish_reason: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    # The outputs the client named in its request (empty: it named none, so it gets every output). Triton drops
    # unnamed outputs before they reach the client; not building them saves the stub and Triton a copy each.
    requested: frozenset[str] = frozenset()

    def sends(self, output: str) -> bool:
        """Whether responses carry ``output``: its return_* flag is on (text_output and output_ids have none)
        and the client named it, if it named any."""
        return getattr(self, output, True) and (not self.requested or output in self.requested)


@dataclass
class DecodedRequest:
    prompt: str | list[int] | list[dict[str, str]]
    params: SamplingParams
    stream: bool = False
    prepend_text: str = ""  # the prompt text put before a non-streamed output ("" when excluded)
    prepend_ids: list[int] = field(default_factory=list)  # an input_ids prompt to decode and put there instead
    session: SessionControl | None = None
    options: OutputOptions = field(default_factory=OutputOptions)


def _scalar(name: str, array: np.ndarray) -> Any:
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"input {name} must hold exactly one element, got shape {list(np.shape(array))}")
    return flat[0]


def _text(name: str, array: np.ndarray) -> str:
    value = _scalar(name, array)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"input {name} is not valid UTF-8: {exc}") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"input {name} must be BYTES (a string), got {np.asarray(array).dtype}")


def _bool_input(name: str, array: np.ndarray) -> bool:
    value = _scalar(name, array)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"input {name} must be BOOL, got {np.asarray(array).dtype}")


def _coerce(name: str, value: Any) -> Any:
    """Strings for typed sampling fields become numbers / booleans; anything else is left to SamplingParams."""
    if not isinstance(value, str):
        return value
    try:
        if name in _INT_FIELDS:
            return int(value.strip())
        if name in _FLOAT_FIELDS:
            return float(value.strip())
    except ValueError:
        kind = "an integer" if name in _INT_FIELDS else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}") from None
    if name in _BOOL_FIELDS:
        return _parse_bool(name, value)
    return value


def _parse_json(what: str, text: str) -> Any:
    """json.loads with every failure a ValueError naming ``what``: Python's parser recurses per nesting level, so
    a deeply nested document ("[[[[...") raises RecursionError, not JSONDecodeError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} is not valid JSON: nested too deeply") from None


def _decode_prompt(inputs: Mapping[str, np.ndarray]) -> str | list[int] | list[dict[str, str]]:
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if len(given) != 1:
        raise ValueError(f"give exactly one of the inputs {', '.join(PROMPT_INPUTS)}; got "
                         f"{', '.join(given) if given else 'none'}")
    name = given[0]
    if name == "text_input":
        text = _text(name, inputs[name])
        if not text:
            raise ValueError("text_input is empty: the prompt must have at least one character")
        return text
    if name == "input_ids":
        ids = np.asarray(inputs[name])
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be INT32, got {ids.dtype}")
        # tolist() converts in C (Python ints, exact for uint64 too): the length cap is the engine's
        # (RequestLimits.max_input_ids), and a per-element Python loop made a huge tensor cost seconds first.
        flat = ids.reshape(-1).tolist()
        if not flat:
            raise ValueError("input_ids is empty: the prompt must have at least one token")
        if min(flat) < 0:
            raise ValueError(f"input_ids must be >= 0, got {min(flat)}")
        return flat
    messages = _parse_json("messages", _text(name, inputs[name]))
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty JSON list of {\"role\": ..., \"content\": ...} objects")
    for i, message in enumerate(messages):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise ValueError(f"messages[{i}] must be an object with string fields role and content, got {message!r}")
    return messages


def _decode_session(extra: dict[str, Any], correlation_id: int | str, flags: int) -> SessionControl | None:
    sequence_id: Any = extra.get("sequence_id", correlation_id)
    start = bool(flags & FLAG_SEQUENCE_START)
    end = bool(flags & FLAG_SEQUENCE_END)
    for name in ("sequence_start", "sequence_end"):
        if name in extra:
            value = extra[name]
            value = _parse_bool(name, value) if isinstance(value, str) else value
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}")
            if name == "sequence_start":
                start = start or value
            else:
                end = end or value
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
        raise ValueError(f"sequence_id must be an integer or a string, got {sequence_id!r}")
    if sequence_id in (0, ""):
        if start or end:
            raise ValueError("sequence_start / sequence_end need a non-zero sequence_id")
        return None
    return SessionControl(session_id=str(sequence_id), start=start, end=end)


def decode_request(inputs: Mapping[str, np.ndarray], parameters_json: str = "{}",
                   correlation_id: int | str = 0, flags: int = 0,
                   requested_outputs: Iterable[str] = ()) -> DecodedRequest:
    """Input tensors + request parameters (+ gRPC sequence controls) -> what the engine needs.

    ``inputs`` holds the numpy arrays of the inputs the request carries. Sampling fields come from the
    ``sampling_parameters`` JSON and/or request parameters (the JSON wins on a clash). Raises
    ValueError with a message naming the problem; nothing is queued before this succeeds.
    """
    unknown_inputs = [name for name in inputs if name not in INPUT_NAMES]
    if unknown_inputs:
        raise ValueError(f"unknown input {unknown_inputs[0]!r} (allowed: {', '.join(INPUT_NAMES)})")
    prompt = _decode_prompt(inputs)

    request_parameters = _parse_json("request parameters", parameters_json or "{}")
    if not isinstance(request_parameters, dict):
        raise ValueError("request parameters must be a JSON object")
    extra = {k: v for k, v in request_parameters.items() if k in SESSION_PARAMETERS}
    sampling = {k: v for k, v in request_parameters.items() if k not in SESSION_PARAMETERS}
    allowed = SamplingParams.field_names()
    for name in sampling:
        if name not in allowed:
            raise ValueError(f"unknown request parameter {name!r} (allowed: {', '.join(allowed + SESSION_PARAMETERS)})")

    if "sampling_parameters" in inputs:
        text = _text("sampling_parameters", inputs["sampling_parameters"])
        from_json = _parse_json("sampling_parameters", text) if text.strip() else {}
        if not isinstance(from_json, dict):
            raise ValueError(f"sampling_parameters must be a JSON object, got {type(from_json).__name__}")
        # vLLM clients send null for "use the default"; max_tokens' null is vLLM's "as many as fit" (SamplingParams).
        sampling.update({k: v for k, v in from_json.items() if v is not None or k == "max_tokens"})
    params = SamplingParams.from_dict({name: _coerce(name, value) for name, value in sampling.items()})

    bools = {name: _bool_input(name, inputs[name]) for name in BOOL_INPUTS if name in inputs}
    stream = bools.get("stream", False)
    if "exclude_input_in_output" in bools:
        prepend = not bools["exclude_input_in_output"]
    else:
        prepend = not stream  # the vLLM backend's default: prompt + output unless streaming
    if prepend and stream:
        raise ValueError("exclude_input_in_output=false is not allowed when streaming")
    options = OutputOptions(**{name[len("return_"):]: bools.get(name, False)
                               for name in BOOL_INPUTS if name.startswith("return_")},
                            requested=frozenset(requested_outputs))
    return DecodedRequest(
        prompt=prompt,
        params=params,
        stream=stream,
        # A text prompt is repeated as given; input_ids are decoded only when the client asked by name
        # (exclude_input_in_output=false: OpenAI's echo), so the default output of an ids prompt stays the new text
        # alone, as it always was; chat messages have no text (documented choice).
        prepend_text=prompt if (prepend and isinstance(prompt, str)) else "",
        prepend_ids=list(prompt) if "exclude_input_in_output" in bools and prepend and isinstance(prompt, list)
        and prompt and isinstance(prompt[0], int) else [],
        session=_decode_session(extra, correlation_id, flags),
        options=options,
    )


def _logprob_entry(item: TokenLogprob, decode_token: Callable[[int], str] | None) -> dict[str, dict[str, Any]]:
    """{token_id: {logprob, rank, decoded_token}}: the token itself first, then its top-n."""
    ranked = {token_id: (rank, lp) for rank, (token_id, lp) in enumerate(item.top, start=1)}
    entry = {}
    own_rank = ranked.get(item.token_id, (None, item.logprob))[0]
    for token_id, (rank, lp) in [(item.token_id, (own_rank, item.logprob))] + list(ranked.items()):
        entry[str(token_id)] = {"logprob": lp, "rank": rank,
                                "decoded_token": decode_token(token_id) if decode_token else None}
    return entry


def _logprobs_json(logprobs: list[TokenLogprob] | None, decode_token: Callable[[int], str] | None) -> bytes:
    """vLLM's per-token layout: [{token_id: {logprob, rank, decoded_token}}, ...] (sampled token + top-n)."""
    if logprobs is None:
        return b"null"
    return json.dumps([_logprob_entry(item, decode_token) for item in logprobs]).encode("utf-8")


def _prompt_logprobs_json(prompt: PromptLogprobs, decode_token: Callable[[int], str] | None) -> bytes:
    """The logprobs layout over the prompt's tokens; the first has nothing that predicts it: its logprob and rank
    are null (vLLM puts a bare null there; the entry keeps the token and its text, which OpenAI's echo shows)."""
    first = {str(prompt.first_token_id): {"logprob": None, "rank": None, "decoded_token":
                                          decode_token(prompt.first_token_id) if decode_token else None}}
    entries = [first] + [_logprob_entry(item, decode_token) for item in prompt.entries]
    return json.dumps(entries).encode("utf-8")


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one: the text, ids and logprobs joined, the rest from the last.

    Under load the response thread finds several steps' deltas waiting per request; one response for all of
    them costs the stub, Triton and the client one round instead of several (the streamed text is the same)."""
    if len(outputs) == 1:
        return outputs[0]
    logprobs = [lp for o in outputs for lp in (o.new_logprobs or [])]
    return replace(outputs[-1], new_token_ids=[t for o in outputs for t in o.new_token_ids],
                   new_text="".join(o.new_text for o in outputs),
                   new_logprobs=logprobs if any(o.new_logprobs is not None for o in outputs) else None,
                   prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None))


class DeltaCoalescer:
    """Decides when one request's waiting deltas become a response: the first token at once and alone (time to
    first token is not delayed, and a stream always has it as its own response), the final output at once, the
    rest once ``interval`` new tokens are waiting. ``push`` returns one response per call: a caller that got
    one calls again (with no new outputs) for what is still held."""

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self._held: list[RequestOutput] = []
        self._sent_tokens = False

    def push(self, outputs: list[RequestOutput], flush: bool = False) -> RequestOutput | None:
        """Add the deltas that arrived; returns what to send now, coalesced, or None to hold them."""
        held = self._held + outputs
        if not held:
            return None
        if not self._sent_tokens and not flush:
            # The first token goes alone, even when later deltas already wait: it is the client's first token.
            first = next((i for i, o in enumerate(held) if o.new_token_ids), None)
            if first is not None and first + 1 < len(held):
                self._held = held[first + 1:]
                self._sent_tokens = True
                return coalesce(held[:first + 1])
        tokens = sum(len(o.new_token_ids) for o in held)
        if not (flush or held[-1].finished) and self._sent_tokens and tokens < self.interval:
            self._held = held
            return None
        self._held = []
        self._sent_tokens = self._sent_tokens or tokens > 0
        return coalesce(held)


class ResponseEncoder:
    """Turns one request's stream of RequestOutput deltas into response tensors.

    Streaming: one response per delta carrying only the new text (empty non-final deltas are skipped).
    Non-streaming: the deltas are gathered and one response with the whole text is produced at the end.
    ``encode`` returns ``None`` when nothing is to be sent for this output.
    """

    def __init__(self, request: DecodedRequest, decode_token: Callable[[int], str] | None = None,
                 decode_ids: Callable[[list[int]], str] | None = None) -> None:
        self._request = request
        self._decode_token = decode_token
        self._decode_ids = decode_ids  # an input_ids prompt's text, when the output repeats the prompt
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._prompt_logprobs: PromptLogprobs | None = None

    def encode(self, output: RequestOutput) -> dict[str, np.ndarray] | None:
        if self._request.stream:
            if not (output.finished or output.new_token_ids or output.new_text):
                return None
            return self._tensors(output, output.new_text, output.new_token_ids, output.new_logprobs,
                                 output.prompt_logprobs)
        self._text.append(output.new_text)
        self._ids.extend(output.new_token_ids)
        if output.new_logprobs is not None:
            self._logprobs = (self._logprobs or []) + list(output.new_logprobs)
        self._prompt_logprobs = self._prompt_logprobs or output.prompt_logprobs
        if not output.finished:
            return None
        prompt_ids = self._request.prepend_ids
        prompt_text = self._decode_ids(prompt_ids) if prompt_ids and self._decode_ids else self._request.prepend_text
        return self._tensors(output, prompt_text + "".join(self._text), self._ids, self._logprobs,
                             self._prompt_logprobs)

    def _tensors(self, output: RequestOutput, text: str, ids: list[int], logprobs: list[TokenLogprob] | None,
                 prompt_logprobs: PromptLogprobs | None) -> dict[str, np.ndarray]:
        options = self._request.options
        tensors = {}
        if options.sends("text_output"):
            tensors["text_output"] = np.array([text.encode("utf-8")], dtype=np.object_)
        if options.sends("output_ids"):
            tensors["output_ids"] = np.array(ids, dtype=np.int32)
        if options.sends("finish_reason"):
            # str(None) for unfinished deltas, as the vLLM backend sends.
            tensors["finish_reason"] = np.array([str(output.finish_reason).encode("utf-8")], dtype=np.object_)
        if options.sends("cumulative_logprob"):
            tensors["cumulative_logprob"] = np.array([output.cumulative_logprob], dtype=np.float32)
        if options.sends("logprobs"):
            wanted = self._request.params.logprobs is not None
            tensors["logprobs"] = np.array([_logprobs_json(logprobs if wanted else None, self._decode_token)],
                                           dtype=np.object_)
        if prompt_logprobs is not None and options.sends("prompt_logprobs"):
            tensors["prompt_logprobs"] = np.array([_prompt_logprobs_json(prompt_logprobs, self._decode_token)],
                                                  dtype=np.object_)
        if options.sends("num_input_tokens"):
            tensors["num_input_tokens"] = np.array([output.num_prompt_tokens], dtype=np.uint32)
        if options.sends("num_output_tokens"):
            tensors["num_output_tokens"] = np.array([len(ids)], dtype=np.uint32)
        return tensors
