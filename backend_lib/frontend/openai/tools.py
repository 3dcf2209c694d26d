"""OpenAI ``tools`` in the front: the prompt rendered with the tools, the constraint forcing a call, the answer read
back as ``tool_calls`` (whole or as stream deltas).

Where it lives and why: the model's ``messages`` input carries ``{"role", "content"}`` pairs only, and the engine
renders them without tools. A request that has ``tools``, an assistant message with ``tool_calls`` or a ``tool``
message is rendered here instead, with the model's own tokenizer and chat template (``engine/tokenizer.py``, the same
renderer the engine runs, given ``tools=``), and sent as ``input_ids``: exactly the ids the engine would build. The
tokenizer is loaded once, on the first such request, from the model Triton serves (its config's ``model`` parameter;
empty is the bundled default), and its template also names the parser of the model's own tool-call format
(``structured_output/tool_calls.py: parser_for_template``). Such a request cannot be a session turn (the engine keeps
a session's conversation as messages): the client sends the whole conversation.

``tool_choice``: ``"required"`` and a named function constrain the output with the grammar of
``structured_output/tool_choice.py`` (sent as the model's ``structured_outputs`` field): ``"required"`` writes a
JSON array of ``{"name", "arguments"}`` objects, read by the JSON call parser; a named function writes its arguments
object, which is that call's ``arguments`` as generated. ``"auto"`` (the default with tools) constrains nothing: the
template's parser reads the model's own format; DeepSeek's tool tokens are special tokens, so for its parsers the
text keeps them (``skip_special_tokens`` false unless the client set it); the EOS token's text is never in the
engine's text (``engine/detokenizer.py``: vLLM's stop-token rule).
``"none"``: plain text, the tools still shown to the template (vLLM's default).

A template that drops ``tools`` (``template_renders_tools``, probed once when the tokenizer loads; the bundled
SmolLM2's) gets the generic format instead, whatever the ``tool_choice``: the front's own description of the tools
and the envelope-or-text grammar (``tool_calls/generic.py``), read by ``GenericToolParser``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from backend_lib.core.errors import RequestError
from backend_lib.engine.tokenizer import Tokenizer
from backend_lib.frontend.openai.errors import bad_request
from backend_lib.frontend.openai.schema import ChatCompletionRequest, ChatMessage
from backend_lib.core.model_path import resolve_model_path
from backend_lib.structured_output.constraints import StructuredOutputError
from backend_lib.frontend.openai.tool_calls import generic
from backend_lib.frontend.openai.tool_calls.parsers import GenericToolParser, HermesToolParser, parser_for_template
from backend_lib.frontend.openai.tool_calls.choice import (FunctionTool, ToolCall, new_call_id, parse_tools,
                                                       tool_choice_constraint)
from backend_lib.frontend.openai.tool_calls.parser_base import StreamDelta, ToolCallDelta, ToolCallParser, \
    ToolCallStreamer

# The model's refusal of the constraint we sent (a limit, a schema xgrammar cannot compile) names its
# structured_outputs field: the client wrote that schema in its tools.
_ENGINE_FIELD = "structured_outputs"
logger = logging.getLogger("deepinfer.openai")


# A tool no request has: rendering it shows whether a template prints the tools it is given.
_PROBE_TOOL = {"type": "function", "function": {"name": "deepinfer_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_MESSAGES = [{"role": "user", "content": "probe"}]


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template shows the model its tools: the probe conversation rendered with a tool differs
    from it rendered without. A template that fails on the probe cannot render tools either."""
    try:
        plain = tokenizer.render_chat(_PROBE_MESSAGES, tools=None)
        with_tool = tokenizer.render_chat(_PROBE_MESSAGES, tools=[_PROBE_TOOL])
    except RequestError as exc:
        logger.warning("the chat template failed on the tools probe (%s); using the generic tool format", exc)
        return False
    return plain != with_tool


class ChatRenderer:
    """The served model's tokenizer and chat template, for requests the engine cannot render (tools)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # Decided once, when the tokenizer loads: a template that drops tools gets the generic format.
        self.renders_tools = template_renders_tools(tokenizer)
        self.parser: type[ToolCallParser] = (parser_for_template(tokenizer.chat_template) if self.renders_tools
                                             else GenericToolParser)
        # DeepSeek's tool-call markers are special tokens, which the default detokenization drops; Hermes' tags are
        # plain text (added, not special, tokens where a vocabulary has them).
        self.keeps_special_tokens = self.parser not in (HermesToolParser, GenericToolParser)

    @classmethod
    def load(cls, model_path: str) -> "ChatRenderer":
        """``model_path`` as the Triton model's config gives it ("" = the bundled model)."""
        return cls(Tokenizer.load(resolve_model_path(model_path)))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except RequestError as exc:
            raise bad_request(exc.message, param=exc.field or "messages") from None


@dataclass(frozen=True)
class ToolMode:
    """How one chat request's output becomes tool calls."""

    # required: a JSON array of calls; named: the named function's arguments; auto: the template's own format;
    # generic: the generic format's envelope or text (tool_calls/generic.py), whatever the tool_choice
    kind: Literal["required", "named", "auto", "generic"]
    parser: type[ToolCallParser]
    name: str | None = None  # the named function


@dataclass
class ToolRequest:
    """What a tools request adds to the model request."""

    prompt_ids: list[int]
    mode: ToolMode | None  # None: plain text (tool_choice "none")
    sampling: dict[str, Any] = field(default_factory=dict)
    field_names: dict[str, str] = field(default_factory=dict)


def needs_renderer(request: ChatCompletionRequest) -> bool:
    """Tools, or messages the engine's ``messages`` input cannot carry (tool calls and results)."""
    return bool(request.tools) or any(m.tool_calls or m.role == "tool" for m in request.messages)


def _checked_tools(tools: Any) -> list[FunctionTool]:
    try:
        return parse_tools(tools)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), param=exc.field) from None


def tool_request(tools: list[Any] | None, tool_choice: Any, parallel: bool, messages: list[dict[str, Any]],
                 renderer: ChatRenderer) -> ToolRequest:
    """The prompt ids, the constraint (as sampling fields) and how to read the answer."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        plain = messages if renderer.renders_tools else generic.plain_messages(messages, None)
        return ToolRequest(renderer.render(plain, None), None)
    functions = _checked_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    try:
        constraint = tool_choice_constraint(functions, choice, parallel=parallel)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), param=exc.field) from None
    if not renderer.renders_tools:
        return _generic_request(functions, choice, parallel, messages, renderer)
    prompt_ids = renderer.render(messages, [dict(tool) for tool in tools])
    if choice == "none":
        return ToolRequest(prompt_ids, None)
    if choice == "auto":
        if not renderer.keeps_special_tokens:
            return ToolRequest(prompt_ids, ToolMode("auto", renderer.parser))
        return ToolRequest(prompt_ids, ToolMode("auto", renderer.parser), {"skip_special_tokens": False})
    assert constraint is not None
    if choice == "required":
        return ToolRequest(prompt_ids, ToolMode("required", HermesToolParser), constraint.to_request(),
                           {_ENGINE_FIELD: "tools"})
    name = choice["function"]["name"]
    index = next(i for i, tool in enumerate(functions) if tool.name == name)
    return ToolRequest(prompt_ids, ToolMode("named", HermesToolParser, name), constraint.to_request(),
                       {_ENGINE_FIELD: f"tools[{index}].function.parameters"})


def _generic_request(functions: list[FunctionTool], choice: Any, parallel: bool, messages: list[dict[str, Any]],
                     renderer: ChatRenderer) -> ToolRequest:
    """A template without tools: the front's own description of them and the envelope-or-text grammar."""
    if choice == "none":
        return ToolRequest(renderer.render(generic.plain_messages(messages, None), None), None)
    system_text = generic.tools_system_text(functions, choice, parallel)
    prompt_ids = renderer.render(generic.plain_messages(messages, system_text), None)
    try:
        constraint = generic.generic_constraint(functions, choice, parallel)
    except StructuredOutputError as exc:
        raise bad_request(str(exc), param=exc.field) from None
    return ToolRequest(prompt_ids, ToolMode("generic", GenericToolParser), constraint.to_request(),
                       {_ENGINE_FIELD: "tools"})


def template_message(index: int, role: str, content: str | None, message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates take it: tool calls in OpenAI's form (arguments a JSON string, as DeepSeek's
    templates concatenate them), a tool result with its ``tool_call_id``; an assistant message that only calls
    tools gets "" as content, which every template can print."""
    out: dict[str, Any] = {"role": role, "content": content}
    if message.tool_calls:
        if role != "assistant":
            raise bad_request(f"messages[{index}]: only assistant messages carry tool_calls",
                              param=f"messages[{index}].tool_calls")
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if content is None:
            out["content"] = ""
    if role == "tool":
        if not message.tool_call_id:
            raise bad_request(f"messages[{index}]: a tool message needs the tool_call_id it answers",
                              param=f"messages[{index}].tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    if out["content"] is None:
        raise bad_request(f"messages[{index}].content must be a string or text parts, got null",
                          param=f"messages[{index}].content")
    return out


# -- the answer ----------------------------------------------------------------------------------


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` when the model ended its calls itself; ``length`` stays (the calls may be cut)."""
    return "tool_calls" if called and reason == "stop" else reason


def parse_answer(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; the same reading as ``ToolStream`` (its deltas concatenate to this)."""
    if mode.kind == "named":
        return None, [ToolCall(str(mode.name), text)]
    parsed = mode.parser().parse(text)
    return parsed.content, list(parsed.calls)


class _NamedStreamer:
    """A named function's output is its arguments: the first delta announces the call, the rest are fragments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls: list[ToolCallDelta] = []

    def feed(self, text: str) -> StreamDelta:
        if not self.calls:
            self.calls.append(ToolCallDelta(0, id=new_call_id(), name=self._name, arguments=text))
            return StreamDelta(tool_calls=[self.calls[0]])
        return StreamDelta(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])

    def finish(self) -> StreamDelta:
        return self.feed("") if not self.calls else StreamDelta()


class ToolStream:
    """One streamed choice's text deltas -> content and tool-call deltas."""

    def __init__(self, mode: ToolMode) -> None:
        self._mode = mode
        self._streamer: _NamedStreamer | ToolCallStreamer = (
            _NamedStreamer(str(mode.name)) if mode.kind == "named" else mode.parser().streamer())

    @property
    def called(self) -> bool:
        return bool(self._streamer.calls)

    def feed(self, text: str, final: bool) -> StreamDelta:
        """``final``: the choice's last response."""
        delta = self._streamer.feed(text)
        if final:
            tail = self._streamer.finish()
            delta.content += tail.content
            for entry in tail.tool_calls:  # a fragment of the call this delta already carries joins it
                last = delta.tool_calls[-1] if delta.tool_calls else None
                if last is not None and last.index == entry.index and entry.id is None:
                    last.arguments = (last.arguments or "") + (entry.arguments or "")
                else:
                    delta.tool_calls.append(entry)
        return delta


def calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [call.to_openai() for call in calls]


def deltas_json(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    return [delta.to_openai() for delta in deltas]
