"""The generic tool format (frontend/openai/tool_calls/generic.py) without a server: which templates get it, the
prompt it renders through the bundled model's real template, its grammar (compiled by xgrammar over the real
vocabulary: what it accepts and refuses), and the reply read back as text or tool calls, whole and streamed."""
from __future__ import annotations

import json

import pytest

from backend_lib.core.config import RequestLimits
from backend_lib.core.model_path import default_model_path
from backend_lib.engine.intake import parse_sampling
from backend_lib.engine.tokenizer import Tokenizer
from backend_lib.frontend.openai import tools, translate
from backend_lib.frontend.openai.errors import OpenAIError
from backend_lib.frontend.openai.schema import ChatCompletionRequest
from backend_lib.frontend.openai.tool_calls.parsers import GenericToolParser
from backend_lib.structured_output.constraints import UnsupportedSchemaError
from backend_lib.structured_output.grammar_compiler import GrammarCompiler
from backend_lib.structured_output.matcher import GrammarMatcher

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
ONE_CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
TWO_CALLS = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
            '{"name": "get_time", "arguments": {}}]}'
TEXT = "It is sunny in Paris."
GENERIC = tools.ToolMode("generic", GenericToolParser)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def renderer(tokenizer) -> tools.ChatRenderer:
    return tools.ChatRenderer(tokenizer)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    with GrammarCompiler.from_tokenizer(tokenizer, tokenizer.vocab_size) as compiler:
        yield compiler


def _model_request(renderer, messages=QUESTION, **fields) -> translate.ModelRequest:
    [model] = translate.chat_requests(ChatCompletionRequest(model="deepinfer", messages=messages, **fields), None,
                                      renderer)
    return model


def _accepts(compiler, tokenizer, model: translate.ModelRequest, text: str) -> bool:
    """Whether the request's grammar (as the engine's intake parses it) takes ``text`` as a whole reply."""
    constraint = parse_sampling(json.loads(json.dumps(model.sampling)), RequestLimits()).structured_outputs
    matcher = GrammarMatcher(compiler.compile(constraint))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_tokens(ids) == len(ids) and matcher.is_completed()


def test_the_probe_tells_templates_that_drop_tools(tokenizer, renderer):
    assert not renderer.renders_tools and renderer.parser is GenericToolParser  # SmolLM2's template drops them
    showing = tools.ChatRenderer(tokenizer.with_chat_template(
        "{% if tools %}{{ tools | length }} tools {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    assert showing.renders_tools and showing.parser is not GenericToolParser


def test_the_tools_are_described_after_the_clients_system_message(renderer, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}] + QUESTION
    model = _model_request(renderer, messages, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert model.tool_mode == GENERIC and model.prompt_input == "input_ids"
    assert tokenizer.decode(model.prompt, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.\n\n"
        "You can call these tools. Each line is one tool: its name, what it does and the JSON schema of its "
        "arguments.\n"
        '{"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
        '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}\n\n'
        "To call tools, reply with only this JSON object, with exactly one call:\n"
        '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}\n'
        'Tool results come back as {"tool_results": [...]}.\n'
        "To answer without calling a tool, reply in plain text.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    required = tokenizer.decode(_model_request(renderer, tools=[WEATHER], tool_choice="required").prompt)
    assert required.startswith("system\nYou can call these tools.") and "You must call a tool." in required
    none = _model_request(renderer, tools=[WEATHER], tool_choice="none")
    assert none.tool_mode is None and "structured_outputs" not in none.sampling
    assert "get_weather" not in tokenizer.decode(none.prompt)


def test_earlier_calls_and_results_are_written_in_the_generic_format(renderer, tokenizer):
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    text = tokenizer.decode(_model_request(renderer, messages, tools=[WEATHER, TIME]).prompt,
                            skip_special_tokens=False)
    assert text.endswith(
        "<|im_start|>assistant\n" + TWO_CALLS + "<|im_end|>\n<|im_start|>user\n"
        '{"tool_results": [{"tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}, '
        '{"tool_call_id": "call_2", "name": "get_time", "content": "noon"}]}<|im_end|>\n<|im_start|>assistant\n')


def test_the_grammar_takes_calls_or_text_as_tool_choice_and_parallel_say(renderer, compiler, tokenizer):
    auto = _model_request(renderer, tools=[WEATHER, TIME])
    assert [_accepts(compiler, tokenizer, auto, text) for text in (ONE_CALL, TWO_CALLS, TEXT)] == [True] * 3
    # Text cannot start as a call does (or with whitespace): half an envelope is never read as text.
    assert not _accepts(compiler, tokenizer, auto, '{"answer": 1}') and not _accepts(compiler, tokenizer, auto, " x")
    assert not _accepts(compiler, tokenizer, auto, '{"tool_calls": [{"name": "get_weather", "arguments": {}}]}')
    assert not _accepts(compiler, tokenizer, auto, ONE_CALL.replace('{"name"', '{\n    "name"'))  # no padding
    single = _model_request(renderer, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert _accepts(compiler, tokenizer, single, ONE_CALL) and not _accepts(compiler, tokenizer, single, TWO_CALLS)
    required = _model_request(renderer, tools=[WEATHER, TIME], tool_choice="required")
    assert _accepts(compiler, tokenizer, required, TWO_CALLS) and not _accepts(compiler, tokenizer, required, TEXT)
    named = _model_request(renderer, tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                         "function": {"name": "get_time"}})
    assert _accepts(compiler, tokenizer, named, '{"tool_calls": [{"name": "get_time", "arguments": {}}]}')
    assert not _accepts(compiler, tokenizer, named, ONE_CALL)


def test_a_schema_the_grammar_cannot_enforce_is_refused_naming_tools(renderer, compiler):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "not": {}}}}
    model = _model_request(renderer, tools=[WEATHER, bad])
    constraint = parse_sampling(json.loads(json.dumps(model.sampling)), RequestLimits()).structured_outputs
    with pytest.raises(UnsupportedSchemaError, match="'not' at /items/anyOf/1/properties/arguments"):
        compiler.compile(constraint)
    assert model.field_names["structured_outputs"] == "tools"  # the client's name of the refused field


def _streamed(text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    stream = tools.ToolStream(GENERIC)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    content, calls = "", {}
    for number, piece in enumerate(pieces):
        delta = stream.feed(piece, final=number == len(pieces) - 1)
        content += delta.content
        for entry in delta.tool_calls:
            call = calls.setdefault(entry.index, [entry.name, ""])
            call[1] += entry.arguments or ""
    return content, [tuple(calls[index]) for index in sorted(calls)]


@pytest.mark.parametrize("text, content, calls", [
    (TEXT, TEXT, []),
    (ONE_CALL, None, [("get_weather", '{"city": "Paris"}')]),
    (TWO_CALLS, None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"ci', None, [("get_weather", '{"ci')]),  # cut: length
], ids=["text", "one-call", "two-calls", "cut"])
def test_the_reply_reads_back_whole_and_streamed(text, content, calls):
    whole_content, whole_calls = tools.parse_answer(GENERIC, text)
    assert whole_content == content and [(call.name, call.arguments) for call in whole_calls] == calls
    for size in (1, 4, len(text)):
        assert _streamed(text, size) == (content or "", calls)


def test_the_generic_format_needs_the_client_constraint_free(renderer):
    with pytest.raises(OpenAIError) as raised:
        _model_request(renderer, tools=[WEATHER], guided_regex="a+")
    assert raised.value.status == 400 and raised.value.param == "tool_choice"
