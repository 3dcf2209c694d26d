"""The OpenAI front's response_format and tools without a server: what goes to the model (through the engine's real
intake and the bundled model's real tokenizer), and how answers become tool_calls, whole and streamed."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from backend_lib.core.config import RequestLimits
from backend_lib.core.errors import RequestError, to_wire
from backend_lib.engine.intake import parse_sampling
from backend_lib.engine.tokenizer import Tokenizer
from backend_lib.frontend.openai import tools, translate
from backend_lib.frontend.openai.errors import OpenAIError, from_model_error
from backend_lib.frontend.openai.schema import ChatCompletionRequest
from backend_lib.frontend.openai.translate import ModelDelta, Session, Totals
from backend_lib.core.model_path import default_model_path
from backend_lib.structured_output.constraints import ConstraintKind
from backend_lib.frontend.openai.tool_calls.parsers import (DeepSeekDSMLToolParser, DeepSeekV3ToolParser,
                                                      HermesToolParser)
from backend_lib.frontend.openai.tool_calls.choice import ToolCall, required_calls_schema, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
# A template that shows what reaches it: the tools, an assistant's calls, a tool result with its call id.
SHOWING_TEMPLATE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %} CALL {{ c['id'] }} {{ c['function']['name'] }}"
    "{{ c['function']['arguments'] }}{% endfor %}{% endif %}"
    "{% if m['tool_call_id'] %} FOR {{ m['tool_call_id'] }}{% endif %}\n{% endfor %}assistant:")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def renderer(tokenizer) -> tools.ChatRenderer:
    """A template that renders tools: the native path (SmolLM2's own drops them: tests/frontend, the generic one)."""
    return tools.ChatRenderer(tokenizer.with_chat_template(SHOWING_TEMPLATE))


def _chat(messages=QUESTION, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="deepinfer", messages=messages, **fields)


def _engine_params(model: translate.ModelRequest, limits: RequestLimits = RequestLimits()):
    """The sampling JSON as the model's intake parses it (what the engine would run)."""
    return parse_sampling(json.loads(json.dumps(model.sampling)), limits)


def _refusal_param(model: translate.ModelRequest) -> str | None:
    """The param of the model's refusal of this request (a server whose schemas may nest 2 deep), as the front
    maps it. (A schema xgrammar refuses is refused the same way, at compile: the e2e test.)"""
    with pytest.raises(RequestError) as raised:
        _engine_params(model, RequestLimits(max_schema_depth=2))
    return from_model_error(to_wire(raised.value), model.field_names).param


# -- response_format -----------------------------------------------------------------------------


def test_response_format_json_schema_and_json_object_become_the_models_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    [model] = translate.chat_requests(_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}), None)
    assert model.prompt_input == "messages" and model.sampling["structured_outputs"] == {"json": schema}
    constraint = _engine_params(model).structured_outputs
    assert constraint.kind is ConstraintKind.JSON and constraint.schema() == schema
    [model] = translate.chat_requests(_chat(response_format={"type": "json_object"}), None)
    assert _engine_params(model).structured_outputs.kind is ConstraintKind.JSON_OBJECT
    [model] = translate.chat_requests(_chat(response_format={"type": "text"}), None)
    assert "structured_outputs" not in model.sampling


def test_a_bad_schema_is_refused_naming_the_clients_field():
    nested = {"type": "object", "properties": {"a": {"type": "integer"}}}
    [model] = translate.chat_requests(_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": nested}}), None)
    assert _refusal_param(model) == "response_format.json_schema.schema"
    with pytest.raises(ValidationError) as raised:  # the app's 400 takes its param from pydantic's place
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert raised.value.errors()[0]["loc"] == ("response_format", "json_schema", "schema")


# -- tools: the request --------------------------------------------------------------------------


def test_required_is_the_calls_grammar_on_the_templates_ids(renderer, tokenizer):
    [model] = translate.chat_requests(_chat(tools=[WEATHER, TIME], tool_choice="required"), None, renderer)
    assert model.prompt_input == "input_ids" and model.prompt == renderer.tokenizer.apply_chat_template(
        QUESTION, tools=[WEATHER, TIME])
    assert model.tool_mode.kind == "required"
    constraint = _engine_params(model).structured_outputs
    assert constraint.schema() == required_calls_schema(parse_tools([WEATHER, TIME]))
    [auto] = translate.chat_requests(_chat(tools=[WEATHER]), None, renderer)
    assert auto.tool_mode.kind == "auto" and auto.tool_mode.parser is HermesToolParser
    assert "skip_special_tokens" not in auto.sampling and "structured_outputs" not in auto.sampling
    [none] = translate.chat_requests(_chat(tools=[WEATHER], tool_choice="none"), None, renderer)
    assert none.tool_mode is None and "structured_outputs" not in none.sampling


def test_auto_with_deepseek_tool_tokens_keeps_special_tokens(tokenizer):
    """DeepSeek's markers are special tokens: the text must keep them (the EOS token's text is never in the engine's
    text: tests/engine/test_stop_text.py)."""
    template = "{% if tools %}T{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}{# <｜tool▁calls▁begin｜> #}"
    renderer = tools.ChatRenderer(tokenizer.with_chat_template(template))
    [auto] = translate.chat_requests(_chat(tools=[WEATHER]), None, renderer)
    assert auto.tool_mode.parser is DeepSeekV3ToolParser and auto.sampling["skip_special_tokens"] is False
    [kept] = translate.chat_requests(_chat(tools=[WEATHER], skip_special_tokens=True), None, renderer)
    assert kept.sampling["skip_special_tokens"] is True
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    _check_stream_equals_whole(auto.tool_mode, text, [("get_time", "{}")])
    _check_stream_equals_whole(auto.tool_mode, "Plain.", [], "Plain.")


def test_a_named_tool_constrains_to_its_parameters(renderer):
    [model] = translate.chat_requests(_chat(tools=[TIME, WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None, renderer)
    assert (model.tool_mode.kind, model.tool_mode.name) == ("named", "get_weather")
    assert _engine_params(model).structured_outputs.schema() == WEATHER["function"]["parameters"]
    [model] = translate.chat_requests(_chat(tools=[TIME, WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None, renderer)
    assert _refusal_param(model) == "tools[1].function.parameters"
    [model] = translate.chat_requests(_chat(tools=[TIME, WEATHER], tool_choice="required"), None, renderer)
    assert _refusal_param(model) == "tools"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400_naming_the_place(renderer, fields, param):
    with pytest.raises(OpenAIError) as raised:
        translate.chat_requests(_chat(**fields), None, renderer)
    assert raised.value.status == 400 and raised.value.param == param


def test_tools_and_tool_messages_reach_the_template(tokenizer):
    renderer = tools.ChatRenderer(tokenizer.with_chat_template(SHOWING_TEMPLATE))
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    [model] = translate.chat_requests(_chat(messages, tools=[WEATHER, TIME]), None, renderer)
    assert tokenizer.decode(model.prompt) == (  # (trim_blocks, as transformers: no newline after a block tag)
        "TOOLS get_weather;get_time;user: Weather in Paris?"
        "assistant:  CALL call_1 get_weather{\"city\": \"Paris\"}tool: sunny FOR call_1assistant:")
    with pytest.raises(OpenAIError) as raised:  # a conversation with tools cannot be a session turn
        translate.chat_requests(_chat(messages), Session(5, start=True), renderer)
    assert raised.value.param == "messages"
    with pytest.raises(OpenAIError) as raised:
        translate.chat_requests(_chat(QUESTION + [{"role": "tool", "content": "x"}]), None, renderer)
    assert raised.value.param == "messages[1].tool_call_id"


# -- tools: the answer ---------------------------------------------------------------------------


def _answer(mode: tools.ToolMode, text: str, reason: str = "stop"):
    totals = Totals()
    totals.add(ModelDelta(text, 5, 9, reason))
    request = translate.ModelRequest("input_ids", [1], {}, False, False, None, tool_mode=mode)
    return translate.chat_response("chatcmpl-x", 1, "m", [totals], translate.usage(9, 5), False,
                                   [request]).choices[0]


def _streamed(mode: tools.ToolMode, text: str, size: int, reason: str = "stop"):
    """The chunks of ``text`` sent ``size`` characters a response; (content, calls as dicts, finish reasons)."""
    stream = tools.ToolStream(mode)
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    content, calls, reasons = "", {}, []
    for number, piece in enumerate(pieces):
        last = number == len(pieces) - 1
        chunk = translate.chat_chunk("chatcmpl-x", 1, "m", 0, ModelDelta(piece, 1, None, reason if last else None),
                                     False, stream).choices[0]
        content += chunk.delta.content or ""
        for entry in chunk.delta.tool_calls or []:
            call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in entry:
                assert call["id"] is None and entry["type"] == "function" and entry["id"].startswith("call_")
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry.get("function", {}).get("arguments", "")
        reasons.append(chunk.finish_reason)
    return content or None, [calls[i] for i in sorted(calls)], reasons


def _check_stream_equals_whole(mode, text, expected_calls, expected_content=None):
    whole = _answer(mode, text)
    got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert got == expected_calls and whole.message.content == expected_content
    assert all(c.id.startswith("call_") and c.type == "function" for c in whole.message.tool_calls or [])
    assert whole.finish_reason == ("tool_calls" if expected_calls else "stop")
    for size in (1, 3, 7, len(text)):
        content, calls, reasons = _streamed(mode, text, size)
        assert content == expected_content and [(c["name"], c["arguments"]) for c in calls] == expected_calls
        assert reasons[-1] == whole.finish_reason and not any(reasons[:-1])


def test_required_and_named_answers_are_tool_calls_whole_and_streamed():
    required = tools.ToolMode("required", HermesToolParser)
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time", ' \
           '"arguments": {}}]'
    _check_stream_equals_whole(required, text, [("get_weather", '{"city": "Paris", "days": 2}'),
                                                ("get_time", "{}")])
    named = tools.ToolMode("named", HermesToolParser, "get_weather")
    _check_stream_equals_whole(named, '{"city": "Oslo"}', [("get_weather", '{"city": "Oslo"}')])
    cut = _answer(named, '{"city": "Os', reason="length")  # cut by max_tokens: the call as far as it got
    assert cut.finish_reason == "length" and cut.message.tool_calls[0].function.arguments == '{"city": "Os'


# Recorded model text in each template family's own format (tool_choice "auto").
AUTO_CASES = [
    (HermesToolParser, 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call>', [("get_weather", '{"city": "Paris"}')], "Let me check."),
    (HermesToolParser, '{"name": "get_time", "parameters": {}}', [("get_time", "{}")], None),
    (HermesToolParser, "Paris is sunny today.", [], "Paris is sunny today."),
    (DeepSeekV3ToolParser, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                           '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     [("get_weather", '{"city": "Paris"}')], None),
    (DeepSeekV3ToolParser, '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
                           '<｜tool▁calls▁end｜>', [("get_time", "{}")], None),
    (DeepSeekDSMLToolParser, 'On it.<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
                             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
     [("get_weather", '{"city": "Paris", "days": 3}')], "On it."),
]


@pytest.mark.parametrize("parser, text, calls, content", AUTO_CASES,
                         ids=["hermes-tag", "llama-json", "hermes-text", "deepseek-v3", "deepseek-v31", "dsml"])
def test_auto_reads_the_models_own_format_whole_and_streamed(parser, text, calls, content):
    _check_stream_equals_whole(tools.ToolMode("auto", parser), text, calls, content)


def test_parse_answer_matches_the_tool_helpers():
    mode = tools.ToolMode("named", HermesToolParser, "f")
    assert tools.parse_answer(mode, "{}") == (None, [ToolCall("f", "{}")])
