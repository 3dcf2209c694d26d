"""OpenAI requests -> our Triton model's request; the model's responses -> OpenAI responses and chunks.

The model validates every sampling field itself (the engine's intake) and names the field it refuses, so fields
pass through with their engine names; here we only refuse what the model has no notion of (suffix, ...), map
response_format to the model's structured_outputs field, pick the prompt input (text_input, input_ids or messages;
a chat with tools is rendered by tools.py and goes as input_ids) and map the session headers. A call
asking for several choices (``n``, a completions batch of prompts) becomes one model request per choice, prompt
by prompt, n each: OpenAI's choice index is the request's place in that list.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from backend_lib.core.errors import RequestError
from backend_lib.core.sampling_params import SEED_LIMIT
from backend_lib.engine.intake import parse_bool
from backend_lib.frontend.openai import tools
from backend_lib.frontend.openai.errors import OpenAIError, bad_request
from backend_lib.frontend.openai.images import part_text
from backend_lib.frontend.openai.schema import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                                ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChatLogprobs,
                                                CompletionChoice, Completion, CompletionLogprobs, CompletionRequest,
                                                TokenLogprob, TopLogprob, Usage)

SESSION_ID_HEADER = "x-session-id"
SESSION_START_HEADER = "x-session-start"
SESSION_END_HEADER = "x-session-end"
# Fields passed to the model's sampling_parameters under the same name.
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                "skip_special_tokens", "logit_bias", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "guided_json_object", "priority")
_CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "guided_json_object")
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
# Choices (prompts x n) one call may ask for: each is an engine request, admitted like any other.
MAX_CHOICES = 64


@dataclass(frozen=True)
class Session:
    """Triton's sequence protocol: the gRPC sequence_id with its START / END flags."""

    sequence_id: int | str
    start: bool = False
    end: bool = False


@dataclass
class ModelRequest:
    """What one OpenAI call asks of our Triton model."""

    prompt_input: str  # text_input | input_ids | messages
    prompt: str | list[int]  # messages: their JSON text
    sampling: dict[str, Any]
    stream: bool
    logprobs: bool
    session: Session | None
    # Engine field name -> the name the client used, so an engine refusal names the client's field.
    field_names: dict[str, str] = field(default_factory=dict)
    echo: bool = False  # completions: the prompt before the completion (its logprobs too, when asked)
    prompt_index: int = 0  # which of the call's prompts (choices of one prompt count its tokens once)
    tool_mode: tools.ToolMode | None = None  # chat with tools: how the answer becomes tool_calls
    images: list[str] = field(default_factory=list)  # chat image_url parts: base64, one per placeholder in order


@dataclass
class ModelDelta:
    """One response of the Triton model (streaming: the new text; otherwise the whole text)."""

    text: str
    num_output_tokens: int
    num_input_tokens: int | None
    finish_reason: str | None
    # vLLM's layout: per token {token_id: {logprob, rank, decoded_token}}, the sampled token first.
    logprobs: list[dict[str, dict[str, Any]]] | None = None
    # The same layout over the prompt (echo with logprobs); the first token's logprob is null.
    prompt_logprobs: list[dict[str, dict[str, Any]]] | None = None


def _parse_bool_header(name: str, value: str) -> bool:
    """An absent or empty header is false; otherwise the intake's words for true and false."""
    if not value.strip():
        return False
    try:
        return parse_bool(name, value)
    except RequestError:
        raise bad_request(f"header {name} must be true or false, got {value!r}", param=name) from None


def session_from_headers(headers: Mapping[str, str]) -> Session | None:
    """X-Session-Id (a positive integer or a string) with X-Session-Start / X-Session-End (true / false)."""
    raw = headers.get(SESSION_ID_HEADER)
    start = _parse_bool_header("X-Session-Start", headers.get(SESSION_START_HEADER, ""))
    end = _parse_bool_header("X-Session-End", headers.get(SESSION_END_HEADER, ""))
    if raw is None or not raw.strip():
        if start or end:
            raise bad_request("X-Session-Start / X-Session-End need an X-Session-Id header", param="X-Session-Id")
        return None
    raw = raw.strip()
    sequence_id: int | str = raw
    if raw.isdigit():
        sequence_id = int(raw)
        if not 0 < sequence_id <= _INT64_MAX:
            raise bad_request(f"X-Session-Id must be in [1, {_INT64_MAX}] or a non-numeric string, got {raw}",
                              param="X-Session-Id")
    return Session(sequence_id, start, end)


def _sampling(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> dict[str, Any]:
    sampling = {name: getattr(request, name) for name in _PASSTHROUGH if getattr(request, name) is not None}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    return sampling


def _choices(prompts: list[ModelRequest], n: int | None) -> list[ModelRequest]:
    """n requests for each prompt, prompt by prompt; choice j of a prompt samples with seed + j (vLLM's rule), so
    a seeded call's choices differ and each is reproducible."""
    count = 1 if n is None else n
    if count < 1:
        raise bad_request(f"n must be at least 1, got {n}", param="n")
    if count * len(prompts) > MAX_CHOICES:
        raise bad_request(f"n x prompts is {count} x {len(prompts)} = {count * len(prompts)} choices; at most "
                          f"{MAX_CHOICES} a request", param="n" if len(prompts) == 1 else "prompt")
    if prompts[0].session is not None and count * len(prompts) > 1:
        raise bad_request(f"a session turn continues one conversation: n must be 1 and prompt one prompt, got "
                          f"n={count} and {len(prompts)} prompts", param="n" if count > 1 else "prompt")
    choices = []
    for index, prompt in enumerate(prompts):
        for j in range(count):
            sampling = dict(prompt.sampling)
            seed = sampling.get("seed")
            if j and isinstance(seed, int) and 0 <= seed < SEED_LIMIT:  # the model refuses a bad one by name
                sampling["seed"] = (seed + j) % SEED_LIMIT
            choices.append(replace(prompt, sampling=sampling, prompt_index=index))
    return choices


def _check_unicode(text: str, name: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which no UTF-8 text (what Triton carries) can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{name} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                          f"character {exc.start}", param="prompt") from None


def _prompts(prompt: Any) -> list[tuple[str, str | list[int]]]:
    """(the name an error gives it, the prompt) for each prompt of a completions call: a string, a list of token
    ids, or a batch (a list) of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        named = [(f"prompt[{index}]", one) for index, one in enumerate(prompt)]
    else:
        named = [("prompt", prompt)]
    for name, one in named:
        if isinstance(one, list) and not one:
            raise bad_request(f"{name} is empty: give at least one token id", param="prompt")
        if isinstance(one, str):
            _check_unicode(one, name)
        else:  # Triton's input_ids are INT32; the engine checks them against the vocabulary
            bad = next((i for i, token in enumerate(one) if not 0 <= token <= _INT32_MAX), None)
            if bad is not None:
                raise bad_request(f"{name}[{bad}] must be a token id in [0, {_INT32_MAX}], got {one[bad]}",
                                  param="prompt")
    return named


def completion_requests(request: CompletionRequest, session: Session | None) -> list[ModelRequest]:
    """One model request per choice: n for each prompt."""
    if request.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != 1:
        raise bad_request(f"best_of must be 1, got {request.best_of}", param="best_of")
    named = _prompts(request.prompt)
    if request.echo and request.stream and any(isinstance(prompt, list) for _, prompt in named):
        raise bad_request("echo of a token-id prompt needs stream: false (the prompt's text comes with the "
                          "whole answer)", param="echo")
    sampling = _sampling(request, request.max_tokens)
    if request.logprobs is not None:
        sampling["logprobs"] = request.logprobs
        if request.echo:
            sampling["prompt_logprobs"] = request.logprobs
    prompts = [ModelRequest(prompt_input="input_ids" if isinstance(prompt, list) else "text_input", prompt=prompt,
                            sampling=sampling, stream=request.stream, logprobs=request.logprobs is not None,
                            session=session, field_names={"prompt_logprobs": "logprobs"}, echo=bool(request.echo))
               for _, prompt in named]
    return _choices(prompts, request.n)


def _message_text(index: int, content: Any, images: list[str]) -> str:
    if content is None:
        raise bad_request(f"messages[{index}].content must be a string or text parts, got null",
                          param=f"messages[{index}].content")
    if isinstance(content, str):
        return content
    return "".join(part_text(index, k, part, images) for k, part in enumerate(content))


def _response_format(request: ChatCompletionRequest) -> tuple[dict[str, Any], dict[str, str]]:
    """response_format -> the model's structured_outputs field (the model's intake checks and compiles the schema)
    and the client's names of the fields its refusals name."""
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return {}, {}
    given = [name for name in _CONSTRAINT_FIELDS if getattr(request, name) is not None]
    if given:
        raise bad_request(f"response_format and {given[0]} both constrain the output; send one of them",
                          param="response_format")
    if request.tools and request.tool_choice not in (None, "none", "auto"):
        raise bad_request("response_format and a forced tool_choice both constrain the output; send one of them",
                          param="response_format")
    if response_format.type == "json_object":
        return {"structured_outputs": {"json_object": True}}, {"structured_outputs": "response_format"}
    if response_format.json_schema is None:
        raise bad_request("response_format of type json_schema needs its json_schema object",
                          param="response_format.json_schema")
    return ({"structured_outputs": {"json": response_format.json_schema.schema_}},
            {"structured_outputs": "response_format.json_schema.schema"})


def _messages(request: ChatCompletionRequest, images: list[str]) -> list[dict[str, Any]]:
    messages = []
    for index, message in enumerate(request.messages):
        # "developer" is the newer name OpenAI gives the system role; chat templates know "system".
        role = "system" if message.role == "developer" else message.role
        content = None if message.content is None and (message.tool_calls or role == "tool") else \
            _message_text(index, message.content, images)
        messages.append(tools.template_message(index, role, content, message))
    return messages


def chat_requests(request: ChatCompletionRequest, session: Session | None,
                  renderer: tools.ChatRenderer | None = None) -> list[ModelRequest]:
    """One model request per choice (n). A request with tools or tool messages is rendered here (``renderer``, the
    served model's template: tools.py) and sent as input_ids; the others go as the model's messages input."""
    if not request.messages:
        raise bad_request("messages must not be empty", param="messages")
    images: list[str] = []
    messages = _messages(request, images)
    if None not in (request.max_completion_tokens, request.max_tokens) and \
            request.max_completion_tokens != request.max_tokens:
        raise bad_request(f"max_tokens ({request.max_tokens}) and max_completion_tokens "
                          f"({request.max_completion_tokens}) differ: give one of them", param="max_completion_tokens")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    sampling = _sampling(request, max_tokens)
    if max_tokens is None:  # OpenAI's and vLLM's chat default: the rest of the context (the model's null)
        sampling["max_tokens"] = None
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    if request.logprobs:
        sampling["logprobs"] = request.top_logprobs or 0
    names = {"logprobs": "top_logprobs"}
    if request.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    constraint, constraint_names = _response_format(request)
    sampling.update(constraint)
    names.update(constraint_names)
    prompt = ModelRequest(prompt_input="messages", prompt=json.dumps(messages), sampling=sampling,
                          stream=request.stream, logprobs=bool(request.logprobs), session=session, field_names=names,
                          images=images)
    if tools.needs_renderer(request):
        if session is not None:
            raise bad_request("tools and tool messages cannot be a session turn (X-Session-Id): send the whole "
                              "conversation", param="tools" if request.tools else "messages")
        if renderer is None:
            raise OpenAIError(500, "the chat template renderer is not loaded", "server_error")
        extra = tools.tool_request(request.tools, request.tool_choice, request.parallel_tool_calls is not False,
                                   messages, renderer)
        given = [name for name in _CONSTRAINT_FIELDS if name in sampling]
        if extra.sampling.get("structured_outputs") is not None and given:
            raise bad_request(f"tool_choice {json.dumps(request.tool_choice or 'auto')} and {given[0]} both constrain the "
                              "output; send one of them", param="tool_choice")
        # The client's own fields win (its skip_special_tokens over auto's false; a second constraint was refused).
        prompt = replace(prompt, prompt_input="input_ids", prompt=extra.prompt_ids, tool_mode=extra.mode,
                         sampling={**extra.sampling, **sampling}, field_names={**names, **extra.field_names})
    elif request.tool_choice not in (None, "none"):
        raise bad_request("tool_choice needs tools", param="tool_choice")
    return _choices([prompt], request.n)


# -- responses -----------------------------------------------------------------------------------

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


def finish_reason(model_reason: str | None) -> str | None:
    if model_reason is None or model_reason == "None":
        return None
    return _FINISH_REASONS.get(model_reason, model_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _sampled_and_top(entry: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The model puts the sampled token first, then the top-n (the sampled one may be among them)."""
    values = list(entry.values())
    ranked = sorted((v for v in values[1:] if v.get("rank") is not None), key=lambda v: v["rank"])
    if values[0].get("rank") is not None and values[0] not in ranked:
        ranked = sorted(ranked + [values[0]], key=lambda v: v["rank"])
    return values[0], ranked


def _token_text(value: dict[str, Any]) -> str:
    return value.get("decoded_token") or ""


def completion_logprobs(entries: list[dict[str, dict[str, Any]]], text_offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for entry in entries:
        sampled, top = _sampled_and_top(entry)
        token = _token_text(sampled)
        out.tokens.append(token)
        out.token_logprobs.append(sampled["logprob"])  # null for a prompt's first token (echo): nothing predicts it
        out.top_logprobs.append(None if sampled["logprob"] is None else {_token_text(v): v["logprob"] for v in top})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(entries: list[dict[str, dict[str, Any]]]) -> ChatLogprobs:
    content = []
    for entry in entries:
        sampled, top = _sampled_and_top(entry)
        token = _token_text(sampled)
        content.append(TokenLogprob(
            token=token, logprob=sampled["logprob"], bytes=list(token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=_token_text(v), logprob=v["logprob"],
                                     bytes=list(_token_text(v).encode("utf-8"))) for v in top]))
    return ChatLogprobs(content=content)


@dataclass
class Totals:
    """What a whole request produced, gathered from its deltas."""

    text: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[str, dict[str, Any]]] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]]] | None = None

    def add(self, delta: ModelDelta) -> None:
        self.text.append(delta.text)
        self.completion_tokens += delta.num_output_tokens
        if delta.num_input_tokens is not None:
            self.prompt_tokens = delta.num_input_tokens
        self.finish_reason = finish_reason(delta.finish_reason) or self.finish_reason
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs


def call_usage(choices: list[Totals], requests: list[ModelRequest]) -> Usage:
    """Every choice's completion tokens; each prompt's tokens once, however many choices it has (as vLLM counts)."""
    prompt_tokens = {request.prompt_index: totals.prompt_tokens for totals, request in zip(choices, requests)}
    return usage(sum(prompt_tokens.values()), sum(totals.completion_tokens for totals in choices))


def completion_response(request_id: str, created: int, model: str, choices: list[Totals], call: Usage,
                        logprobs: bool) -> Completion:
    """An echoed prompt is in the text already (the model put it there) and its logprobs lead the choice's."""
    return Completion(id=request_id, created=created, model=model, usage=call, choices=[CompletionChoice(
        index=index, text="".join(totals.text), finish_reason=totals.finish_reason,
        logprobs=completion_logprobs((totals.prompt_logprobs or []) + (totals.logprobs or []), 0)
        if logprobs else None) for index, totals in enumerate(choices)])


def _chat_choice(index: int, totals: Totals, logprobs: bool, mode: tools.ToolMode | None) -> ChatChoice:
    text, reason = "".join(totals.text), totals.finish_reason
    message = AssistantMessage(content=text)
    if mode is not None:
        content, calls = tools.parse_answer(mode, text)
        message = AssistantMessage(content=content, tool_calls=tools.calls_json(calls) if calls else None)
        reason = tools.tool_finish_reason(reason, bool(calls))
    return ChatChoice(index=index, message=message, finish_reason=reason,
                      logprobs=chat_logprobs(totals.logprobs or []) if logprobs else None)


def chat_response(request_id: str, created: int, model: str, choices: list[Totals], call: Usage,
                  logprobs: bool, requests: list[ModelRequest]) -> ChatCompletion:
    return ChatCompletion(id=request_id, created=created, model=model, usage=call, choices=[
        _chat_choice(index, totals, logprobs, request.tool_mode)
        for index, (totals, request) in enumerate(zip(choices, requests))])


def completion_chunk(request_id: str, created: int, model: str, index: int, delta: ModelDelta, text_offset: int,
                     logprobs: bool) -> Completion:
    return Completion(id=request_id, created=created, model=model, choices=[CompletionChoice(
        index=index, text=delta.text, finish_reason=finish_reason(delta.finish_reason),
        logprobs=completion_logprobs(delta.logprobs or [], text_offset) if logprobs else None)])


def echo_chunk(request_id: str, created: int, model: str, index: int, prompt: str,
               prompt_logprobs: list[dict[str, dict[str, Any]]] | None, logprobs: bool) -> Completion:
    """A streamed echo's first chunk: the prompt's text (and its tokens' logprobs) before the completion's."""
    return Completion(id=request_id, created=created, model=model, choices=[CompletionChoice(
        index=index, text=prompt, logprobs=completion_logprobs(prompt_logprobs or [], 0) if logprobs else None)])


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: ModelDelta | None,
               logprobs: bool, tool_stream: tools.ToolStream | None = None) -> ChatCompletionChunk:
    """``delta`` None: the opening chunk that carries the assistant role. With ``tool_stream`` (a tools request)
    the text goes through its parser: content and tool-call deltas, flushed at the choice's last response."""
    if delta is None:
        choice = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
    else:
        reason = finish_reason(delta.finish_reason)
        message = ChatDelta(content=delta.text) if delta.text else ChatDelta()
        if tool_stream is not None:
            parsed = tool_stream.feed(delta.text, final=reason is not None)
            message = ChatDelta(content=parsed.content or None,
                                tool_calls=tools.deltas_json(parsed.tool_calls) or None)
            reason = tools.tool_finish_reason(reason, tool_stream.called)
        choice = ChatChunkChoice(index=index, delta=message, finish_reason=reason,
                                 logprobs=chat_logprobs(delta.logprobs or []) if logprobs else None)
    return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])
