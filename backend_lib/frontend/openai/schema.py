"""Pydantic models of the OpenAI API subset we serve: requests, responses, stream chunks, errors.

Requests ignore fields we do not know (clients and SDKs send many optional ones, e.g. ``user``, ``store``);
fields we know but cannot honour (``suffix``, ``best_of`` > 1, ...) are refused in
translate.py with a 400 naming them, never silently dropped.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share; None = the engine's default."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Not in OpenAI's schema; vLLM's extensions, which the engine has.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # vLLM's structured output: any JSON here; the engine's intake parses and checks them (naming the field).
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_json_object: Any = None
    # vLLM's scheduling priority (lower runs earlier; engine setting scheduling_policy "priority")
    priority: int | None = None


class CompletionRequest(_SamplingFields):
    # A string, one token-id list, or a batch (a list) of either: a choice for each (n each).
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ImageUrl(_Request):
    url: str  # data:image/png;base64,... (remote URLs are refused: frontend/openai/images.py)
    detail: str | None = None  # accepted, not used: the model's preprocessing decides the resolution


class ContentPart(_Request):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(_Request):
    """A call of an earlier assistant message (its tool_calls), sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None  # role "tool": the call this result answers


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    # The JSON schema (an object, which the engine's intake checks and compiles). "schema" would shadow BaseModel's.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the grammar enforces the schema either way


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by structured_output/tool_choice.py: parse_tools (naming the place)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call (OpenAI's default: true)
    response_format: ResponseFormat | None = None


# -- responses -----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # OpenAI's layout: {"index", then "id", "type", "function": {"name", "arguments": ""}} for a new call, then
    # {"index", "function": {"arguments": <fragment>}} (tool_parser_base.ToolCallDelta.to_openai).
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deepinfer"
    input_modalities: list[str] = ["text"]  # "image" too when the served checkpoint has a vision tower


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
