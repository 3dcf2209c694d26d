"""OpenAI tools without the engine: the grammars that force tool_choice "required" / a named function (random
sampling under their mask gives calls whose arguments validate against the function's schema), and the parsers of
a model's own tool-call text, complete and streamed (every chunking gives the complete parse)."""
from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest

from backend_lib.structured_output.constraints import ConstraintKind, InvalidConstraintError
from backend_lib.structured_output.grammar_compiler import GrammarCompiler
from backend_lib.frontend.openai.tool_calls.parsers import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    PARSERS,
    TOOL_SEP,
    DeepSeekDSMLToolParser,
    DeepSeekV3ToolParser,
    HermesToolParser,
    parser_for_template,
)
from backend_lib.frontend.openai.tool_calls.choice import (
    calls_from_constrained_output,
    parse_tools,
    required_calls_schema,
    tool_choice_constraint,
)
from backend_lib.frontend.openai.tool_calls.parser_base import ToolCallDelta
from tests.helpers.grammar_sampling import PADDED_VOCAB, sample, tokenizer  # noqa: F401 - the tokenizer fixture

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function",
     "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "properties": {}}}


# ---------------------------------------------------------------------------------------------- tools and choice


def test_parse_tools():
    tools = parse_tools(TOOLS)
    assert [tool.name for tool in tools] == ["get_weather", "add", "now"]
    assert tools[0].description == "Weather in a city" and tools[2].parameters == {"type": "object",
                                                                                   "properties": {}}


@pytest.mark.parametrize("tools, field_name, words", [
    ([], "tools", "non-empty list"),
    ({"type": "function"}, "tools", "non-empty list"),
    ([{"type": "retrieval"}], "tools[0]", "\"type\": \"function\""),
    ([{"type": "function"}], "tools[0].function", "must be an object"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name", "1 to 64 letters"),
    ([TOOLS[1], TOOLS[1]], "tools[1].function.name", "repeats the tool name 'add'"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters",
     "must be a JSON schema object"),
])
def test_tool_refusals_name_their_place(tools, field_name, words):
    with pytest.raises(InvalidConstraintError) as caught:
        parse_tools(tools)
    assert caught.value.field == field_name and words in str(caught.value)


def test_tool_choice_constraints():
    tools = parse_tools(TOOLS)
    assert tool_choice_constraint(tools, "none") is None and tool_choice_constraint(tools, "auto") is None
    required = tool_choice_constraint(tools, "required")
    assert required.kind is ConstraintKind.JSON and required.field == "tool_choice"
    assert required.schema() == required_calls_schema(tools)
    named = tool_choice_constraint(tools, {"type": "function", "function": {"name": "add"}})
    assert named.schema() == ADD
    with pytest.raises(InvalidConstraintError) as caught:
        tool_choice_constraint(tools, {"type": "function", "function": {"name": "sub"}})
    assert caught.value.field == "tool_choice.function.name" and "'sub', which is not in tools" in str(caught.value)
    with pytest.raises(InvalidConstraintError, match="^tool_choice must be"):
        tool_choice_constraint(tools, "always")


@pytest.fixture(scope="module")
def compiler(tokenizer):  # noqa: F811
    with GrammarCompiler.from_tokenizer(tokenizer, PADDED_VOCAB, max_whitespace=2) as compiler:
        yield compiler


@pytest.mark.parametrize("seed", range(6))
def test_required_calls_sampled_under_the_grammar_validate(compiler, tokenizer, seed):  # noqa: F811
    tools = parse_tools(TOOLS)
    text = tokenizer.decode(sample(compiler, tool_choice_constraint(tools, "required"), seed), False)
    calls = calls_from_constrained_output(text, "required")
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert call.id.startswith("call_") and call.to_openai()["type"] == "function"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_named_call_sampled_under_the_grammar_validates(compiler, tokenizer, seed, name):  # noqa: F811
    choice = {"type": "function", "function": {"name": name}}
    constraint = tool_choice_constraint(parse_tools(TOOLS), choice)
    [call] = calls_from_constrained_output(tokenizer.decode(sample(compiler, constraint, seed), False), choice)
    assert call.name == name
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[name])


# ---------------------------------------------------------------------------------------------- parsers

# Model text in each format, as the model writes it (its special tokens as text), with the parse expected:
# (content, [(name, arguments), ...]).
V3 = (
    "Let me look that up."
    f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_weather\n```json\n{{\"city\": \"Paris\", \"unit\": \"celsius\"}}\n"
    f"```{CALL_END}\n{CALL_BEGIN}function{TOOL_SEP}add\n```json\n{{\"a\": 2, \"b\": 0.5}}\n```{CALL_END}{CALLS_END}")
V31 = (f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{TOOL_SEP}{{\"city\": \"東京\", \"unit\": \"celsius\", \"days\": 3}}"
       f"{CALL_END}{CALL_BEGIN}now{TOOL_SEP}{{}}{CALL_END}{CALLS_END}")
DSML_V4 = (
    "I'll check both cities.\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">杭州</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"add\">\n"
    "<｜DSML｜parameter name=\"a\" string=\"false\">1</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"b\" string=\"false\">{\"x\": [1, 2]}</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>")
DSML_V32 = DSML_V4.replace("tool_calls>", "function_calls>")
SMOLLM2_LIST = ('<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},\n'
                '{"name": "add", "arguments": {"a": 1, "b": 2}}\n]</tool_call>')
HERMES = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon}{\\"", "unit": "fahrenheit"}}\n'
          '</tool_call>\n<tool_call>\n{"arguments": {"a": 3, "b": -1.5e3}, "name": "add"}\n</tool_call>')
LLAMA_JSON = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
ARGUMENT_STRING = '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
# Recorded: SmolLM2-135M-Instruct, greedy, asked about the weather with tools in its system prompt (it answers in
# prose: the small model does not call tools).
RECORDED_SMOLLM2 = [
    'The weather in Paris is described as "Paris is a city of light" by the French.<|im_end|>',
    "The weather in Tokyo today is mostly sunny with a high of 42°F (7°C) and a low of 22°F (11°C).<|im_end|>",
]

CASES = [
    (DeepSeekV3ToolParser, V3, "Let me look that up.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 2, "b": 0.5}')]),
    (DeepSeekV3ToolParser, V31, None,
     [("get_weather", '{"city": "東京", "unit": "celsius", "days": 3}'), ("now", "{}")]),
    (DeepSeekV3ToolParser, "No tools needed: 2 < 3 and <｜tool is not a token.", "No tools needed: 2 < 3 and <｜tool "
     "is not a token.", []),
    (DeepSeekDSMLToolParser, DSML_V4, "I'll check both cities.\n\n",
     [("get_weather", '{"city": "杭州", "unit": "celsius", "days": 2}'), ("add", '{"a": 1, "b": {"x": [1, 2]}}'),
      ("now", "{}")]),
    (DeepSeekDSMLToolParser, DSML_V32, "I'll check both cities.\n\n",
     [("get_weather", '{"city": "杭州", "unit": "celsius", "days": 2}'), ("add", '{"a": 1, "b": {"x": [1, 2]}}'),
      ("now", "{}")]),
    (HermesToolParser, SMOLLM2_LIST, None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')]),
    (HermesToolParser, HERMES, "Checking.\n\n",
     [("get_weather", '{"city": "Lyon}{\\"", "unit": "fahrenheit"}'), ("add", '{"a": 3, "b": -1.5e3}')]),
    (HermesToolParser, LLAMA_JSON, None, [("add", '{"a": 1, "b": 2}')]),
    (HermesToolParser, "  " + LLAMA_JSON + "\nDone.", "\nDone.", [("add", '{"a": 1, "b": 2}')]),
    (HermesToolParser, ARGUMENT_STRING, None, [("now", "{}")]),
    (HermesToolParser, '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    (HermesToolParser, "[1, 2, 3]", "[1, 2, 3]", []),
    (HermesToolParser, "a <tool_calls> tag is not <tool_call", "a <tool_calls> tag is not <tool_call", []),
    *[(HermesToolParser, text, text, []) for text in RECORDED_SMOLLM2],
]


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


@pytest.mark.parametrize("parser_class, text, content, calls", CASES)
def test_parse_complete(parser_class, text, content, calls):
    parsed = parser_class(make_id=_ids()).parse(text)
    assert parsed.content == content
    assert [(call.name, call.arguments) for call in parsed.calls] == calls
    assert parsed.tools_called == bool(calls)
    for call in parsed.calls:
        json.loads(call.arguments)
    assert [call.id for call in parsed.calls] == [f"call_{i}" for i in range(len(calls))]


def _chunkings(text: str):
    yield "whole", [text]
    yield "characters", list(text)
    for seed in range(12):
        rng, chunks, position = random.Random(seed), [], 0
        while position < len(text):
            size = rng.randint(1, 9)
            chunks.append(text[position:position + size])
            position += size
        yield f"random{seed}", chunks


@pytest.mark.parametrize("parser_class, text, content, calls", CASES)
def test_streamed_deltas_equal_the_complete_parse(parser_class, text, content, calls):
    for label, chunks in _chunkings(text):
        streamer = parser_class(make_id=_ids()).streamer()
        streamed_content, names, arguments, ids = "", {}, {}, {}
        deltas: list[ToolCallDelta] = []
        for delta in [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]:
            streamed_content += delta.content
            deltas += delta.tool_calls
        for delta in deltas:
            if delta.index not in names:  # the first delta of a call: id, type and name, in index order
                assert delta.id is not None and delta.name is not None and delta.index == len(names), label
                entry = delta.to_openai()
                assert entry["type"] == "function" and entry["function"]["name"] == delta.name
                names[delta.index], ids[delta.index], arguments[delta.index] = delta.name, delta.id, ""
            else:
                assert delta.id is None and delta.name is None and delta.arguments, label
                assert set(delta.to_openai()) == {"index", "function"}
            arguments[delta.index] += delta.arguments or ""
        assert [(names[i], arguments[i]) for i in sorted(names)] == calls, label
        assert (streamed_content if streamed_content.strip() else None) == content, label
        assert [ids[i] for i in sorted(ids)] == [f"call_{i}" for i in range(len(calls))]


def test_plain_text_streams_as_it_comes():
    """Text without a call marker is held back only while its end could begin one."""
    streamer = HermesToolParser().streamer()
    assert streamer.feed("Hello <").content == "Hello "
    assert streamer.feed("tool").content == ""
    assert streamer.feed("s> world").content == "<tools> world"
    assert streamer.finish().content == ""
    streamer = DeepSeekV3ToolParser().streamer()
    assert streamer.feed("Sure").content == "Sure"
    assert streamer.feed("<｜tool▁").content == ""
    assert streamer.finish().content == "<｜tool▁"


def test_openai_delta_layout():
    assert ToolCallDelta(0, id="call_1", name="add", arguments="").to_openai() == {
        "index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}
    assert ToolCallDelta(1, arguments='{"a"').to_openai() == {"index": 1, "function": {"arguments": '{"a"'}}


def test_parser_for_template(tokenizer):  # noqa: F811
    assert parser_for_template(tokenizer.chat_template) is HermesToolParser  # SmolLM2's template
    assert parser_for_template("{{'<｜tool▁calls▁begin｜>'}}") is DeepSeekV3ToolParser
    assert parser_for_template("{{'<｜DSML｜tool_calls>'}}") is DeepSeekDSMLToolParser
    assert parser_for_template(None) is HermesToolParser
    assert PARSERS["deepseek_v4"] is DeepSeekDSMLToolParser and PARSERS["smollm2"] is HermesToolParser


_PIECES = ['<tool_call>', '</tool_call>', '{', '}', '[', ']', '"name"', ':', '"add"', ',', '"arguments"', ' ', '\n',
           'x', '"', '\\', '1', CALLS_BEGIN, CALL_BEGIN, TOOL_SEP, CALL_END, CALLS_END, 'function', '```json\n',
           '\n```', '<｜DSML｜tool_calls>', '<｜DSML｜invoke name="f">',
           '<｜DSML｜parameter name="a" string="false">', '</｜DSML｜parameter>', '</｜DSML｜invoke>',
           '</｜DSML｜tool_calls>', '<', '<｜']


def test_streaming_never_takes_back_what_it_sent():
    """Fuzz: truncated recorded texts and random splices of markers and JSON, random chunking: the stream always
    ends equal to the complete parse (nothing sent is ever contradicted) and nothing raises."""
    for trial in range(1500):
        rng = random.Random(trial)
        parser_class = rng.choice([HermesToolParser, DeepSeekV3ToolParser, DeepSeekDSMLToolParser])
        if rng.random() < 0.5:
            base = rng.choice([case[1] for case in CASES if case[0] is parser_class])
            text = base[:rng.randint(0, len(base))]
        else:
            text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 25)))
        parsed = parser_class(make_id=_ids()).parse(text)
        streamer, content, names, arguments, position = parser_class(make_id=_ids()).streamer(), "", {}, {}, 0
        deltas = []
        while position < len(text):
            size = rng.randint(1, 5)
            deltas.append(streamer.feed(text[position:position + size]))
            position += size
        deltas.append(streamer.finish())
        for delta in deltas:
            content += delta.content
            for call in delta.tool_calls:
                if call.name is not None:
                    names[call.index] = call.name
                arguments[call.index] = arguments.get(call.index, "") + (call.arguments or "")
        assert [(names[i], arguments[i]) for i in sorted(names)] == [(c.name, c.arguments) for c in parsed.calls], text
        assert (content if content.strip() else None) == parsed.content, text
