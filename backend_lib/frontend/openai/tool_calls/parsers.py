"""OpenAI ``tools`` without the engine, part two: parsers of a model's own tool-call text (forcing calls with a
grammar is ``tool_choice``).

(b) Parsers of a model's own tool-call text, one per chat template family (``PARSERS``):

- ``DeepSeekV3ToolParser`` (DeepSeek-V3 / R1 and V3.1, one token vocabulary, two layouts)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
      ```json
      {"arg": 1}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
      (V3, R1: calls joined by "\\n"), and V3.1:
      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

- ``DeepSeekDSMLToolParser`` (DeepSeek-V3.2 ``function_calls``, DeepSeek-V4 ``tool_calls``)::

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="NAME">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  (``string="true"``: the raw text is a string; ``"false"``: it is JSON). The arguments are rebuilt as JSON:
  ``{"city": "Paris", "days": 3}``.
- ``HermesToolParser`` (Hermes / Qwen / Llama-family templates, SmolLM2's): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` (a JSON list of such objects inside one tag too, as SmolLM2 writes them), or the whole output
  a bare JSON object / list of them (Llama 3's ``{"name": ..., "parameters": {...}}``).

The special tokens must reach the parser as text: the front detokenizes a tools request with
``skip_special_tokens=False``.

Each parser has ``parse(text) -> ParsedToolCalls`` (content outside the calls, the calls with their JSON arguments
as the model wrote them) and ``streamer()``: ``feed(delta) -> StreamDelta`` turns text deltas into content deltas
and OpenAI tool-call deltas (index, id and name first, then argument fragments), ``finish()`` flushes what was
held back at the end. Both run the same partial parse (``_snapshot``) of the text so far, which only ever extends
what it returned before, so the streamed fragments always concatenate to the complete parse.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from backend_lib.frontend.openai.tool_calls.parser_base import (
    ToolCallParser,
    _held_back,
    _PartialCall,
    _Snapshot,
)

# ---------------------------------------------------------------------------------------------- DeepSeek V3 / V3.1

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
_FENCE_END = "\n```"


class DeepSeekV3ToolParser(ToolCallParser):
    """DeepSeek-V3 / R1 (``function<｜tool▁sep｜>NAME`` + a json fence) and V3.1
    (``NAME<｜tool▁sep｜>ARGS``)."""

    name = "deepseek_v3"

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        starts = [i for i in (text.find(CALLS_BEGIN), text.find(CALL_BEGIN)) if i >= 0]
        if not starts:
            hold = 0 if final else _held_back(text, (CALLS_BEGIN, CALL_BEGIN))
            return _Snapshot(text[:len(text) - hold], [])
        begin = min(starts)
        content, calls = text[:begin], []
        position = begin + len(CALLS_BEGIN) if text.startswith(CALLS_BEGIN, begin) else begin
        while True:
            start = text.find(CALL_BEGIN, position)
            end_all = text.find(CALLS_END, position)
            if start < 0 or (0 <= end_all < start):
                if end_all >= 0:  # text after the calls block is content again
                    content += text[end_all + len(CALLS_END):]
                break
            body_start = start + len(CALL_BEGIN)
            end = text.find(CALL_END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            call = self._call(body, closed=end >= 0)
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            position = end + len(CALL_END)
        return _Snapshot(content, calls)

    @staticmethod
    def _call(body: str, closed: bool) -> _PartialCall | None:
        sep = body.find(TOOL_SEP)
        if sep < 0:
            return None
        head, rest = body[:sep].strip(), body[sep + len(TOOL_SEP):]
        if head in ("function", "") and not rest.lstrip().startswith(("{", "[")):
            # V3: NAME "\n```json\n" ARGS "\n```"
            newline = rest.find("\n")
            if newline < 0:
                return _PartialCall(rest.strip() or None, "", done=closed) if closed else None
            name = rest[:newline].strip() or None
            args = rest[newline + 1:]
            if args.startswith("```"):  # the opening fence line: "```json"
                fence_line_end = args.find("\n")
                if fence_line_end < 0:
                    return _PartialCall(name, "", done=closed)
                args = args[fence_line_end + 1:]
            elif "```".startswith(args) and not closed:  # maybe the opening fence, not whole yet
                return _PartialCall(name, "")
            fence = args.find(_FENCE_END)
            if fence >= 0:
                return _PartialCall(name, args[:fence], done=True)
            return _PartialCall(name, args[:len(args) - _held_back(args, (_FENCE_END,))], done=closed)
        # V3.1: NAME <sep> ARGS
        if closed:
            return _PartialCall(head or None, rest, done=True)
        return _PartialCall(head or None, rest[:len(rest) - _held_back(rest, (CALL_END,))])


# ---------------------------------------------------------------------------------------------- DeepSeek DSML

_DSML_BLOCKS = ("function_calls", "tool_calls")  # V3.2, V4
_DSML_BEGIN = re.compile(r"<｜DSML｜(function_calls|tool_calls)>")
_DSML_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]*)"\s*>')
_DSML_INVOKE_END = "</｜DSML｜invoke>"
_DSML_PARAMETER = re.compile(
    r'<｜DSML｜parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>', re.DOTALL)


def _dsml_value(raw: str, is_string: bool) -> str:
    if is_string:
        return json.dumps(raw, ensure_ascii=False)
    value = raw.strip()
    try:
        json.loads(value)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)  # not JSON after all: keep it, as a string
    return value


class DeepSeekDSMLToolParser(ToolCallParser):
    """DeepSeek-V3.2 / V4 DSML invokes; the arguments JSON is rebuilt from the parameters, one parameter at a
    time (each appears whole in the stream)."""

    name = "deepseek_dsml"

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        match = _DSML_BEGIN.search(text)
        if match is None:
            markers = tuple(f"<｜DSML｜{block}>" for block in _DSML_BLOCKS)
            hold = 0 if final else _held_back(text, markers)
            return _Snapshot(text[:len(text) - hold], [])
        content, calls = text[:match.start()], []
        close = f"</｜DSML｜{match.group(1)}>"
        block_end = text.find(close, match.end())
        block = text[match.end():] if block_end < 0 else text[match.end():block_end]
        position = 0
        while True:
            invoke = _DSML_INVOKE.search(block, position)
            if invoke is None:
                break
            end = block.find(_DSML_INVOKE_END, invoke.end())
            body = block[invoke.end():] if end < 0 else block[invoke.end():end]
            pieces = [f"{json.dumps(name, ensure_ascii=False)}: {_dsml_value(raw, flag == 'true')}"
                      for name, flag, raw in _DSML_PARAMETER.findall(body)]
            arguments = ("{" + ", ".join(pieces)) if pieces else ""
            closed = end >= 0 or final
            if closed:
                arguments = arguments + "}" if pieces else "{}"
            calls.append(_PartialCall(invoke.group(1), arguments, done=closed))
            if end < 0:
                break
            position = end + len(_DSML_INVOKE_END)
        if block_end >= 0:
            content += text[block_end + len(close):]
        return _Snapshot(content, calls)


# ---------------------------------------------------------------------------------------------- Hermes / JSON

_TAG_OPEN = "<tool_call>"
_TAG_CLOSE = "</tool_call>"
_NAME_KEYS = ("name",)
_ARGUMENT_KEYS = ("arguments", "parameters")
_CALL_KEYS = (*_NAME_KEYS, *_ARGUMENT_KEYS)


@dataclass
class _Scan:
    calls: list[_PartialCall]
    is_call: bool | None  # None: cannot tell yet (no key seen)
    end: int | None  # where the JSON value(s) ended, None while one is open


def _scan_json_calls(text: str, final: bool) -> _Scan:
    """Call objects in ``text``: JSON objects ``{"name": ..., "arguments": ...}`` ("parameters" too), or lists of
    them, whitespace apart. The first key of the first object decides whether this is a call at all. Partial text
    gives the calls so far: a name once whole, argument objects / arrays as far as they go (the raw text), an
    argument string (JSON inside a string) once whole; ``final`` drops a last object that never got a name."""
    calls: list[_PartialCall] = []
    is_call: bool | None = None
    stack: list[str] = []  # open containers
    call_depth = 0  # len(stack) directly inside a call object: 1 (a top-level object) or 2 (inside a list)
    in_string = escape = False
    phase = ""  # inside a call object: "key", "colon", "value", "after"
    key: str | None = None
    key_start = value_start = -1
    call: _PartialCall | None = None
    j, n = 0, len(text)
    last_end = 0  # just past the last top-level value that closed

    def finish(raw: str) -> None:
        nonlocal value_start, phase
        _finish_value(call, key, raw)
        value_start, phase = -1, "after"

    while j < n:
        char = text[j]
        depth = len(stack)
        if in_string:
            if escape:
                escape = False
            elif char == "\\":
                escape = True
            elif char == '"':
                in_string = False
                if depth == call_depth and phase == "key":
                    key, phase = json.loads(text[key_start:j + 1]), "colon"
                    if is_call is None:
                        is_call = key in _CALL_KEYS
                        if not is_call:
                            return _Scan([], False, None)
                elif depth == call_depth and phase == "value":
                    finish(text[value_start:j + 1])
            j += 1
            continue
        if depth == call_depth and phase == "value" and value_start >= 0 and (char.isspace() or char in ",}"):
            finish(text[value_start:j].strip())  # a number, true, false or null ended
        if char.isspace():
            j += 1
            continue
        if depth == 0:  # between top-level values
            if char in ",;":
                j += 1
                continue
            if char not in "{[":
                return _Scan(calls, bool(is_call), last_end)
            stack.append(char)
            if char == "{":
                call_depth, call, phase, key = 1, _PartialCall(None, ""), "key", None
                calls.append(call)
            else:
                call_depth = 2
        elif depth == call_depth:  # directly inside a call object
            if phase == "key" and char == '"':
                in_string, key_start = True, j
            elif phase == "colon" and char == ":":
                phase = "value"
            elif phase == "value" and value_start < 0:
                value_start = j
                if char == '"':
                    in_string = True
                elif char in "{[":
                    stack.append(char)
            elif phase == "after" and char == ",":
                phase, key = "key", None
            elif phase in ("key", "after") and char == "}":
                stack.pop()
                call.done, phase = True, ""
                if call.name is None:  # an object without a name is no call
                    calls.pop()
                if not stack:
                    call_depth, last_end = 0, j + 1
            elif phase != "value":  # not JSON of a call: stop here
                return _Scan(calls, bool(is_call), None)
        elif depth == call_depth - 1:  # inside the top-level list, between call objects
            if char == "{":
                stack.append(char)
                call, phase, key = _PartialCall(None, ""), "key", None
                calls.append(call)
            elif char == "]":
                stack.pop()
                call_depth, last_end = 0, j + 1
            elif char != ",":
                return _Scan(calls, bool(is_call), None)
        else:  # inside a value's containers
            if char == '"':
                in_string = True
            elif char in "{[":
                stack.append(char)
            elif char in "}]":
                stack.pop()
                if len(stack) == call_depth and phase == "value":
                    finish(text[value_start:j + 1])
        j += 1
    if stack:  # the text ended inside a value
        if phase == "value" and value_start >= 0 and key in _ARGUMENT_KEYS and text[value_start] in "{[":
            call.arguments = text[value_start:]
        if final and calls and calls[-1].name is None:
            calls.pop()
        return _Scan(calls, is_call if (is_call is not None or not final) else False, None)
    # Between values at the end: what follows the last one is known only at the end (another value may come).
    return _Scan(calls, is_call if (is_call is not None or not final) else False, last_end if final else None)


def _finish_value(call: _PartialCall | None, key: str | None, raw: str) -> None:
    if call is None or key is None:
        return
    try:
        value = json.loads(raw)
    except ValueError:
        value = None  # not JSON: a name is dropped, arguments stay as written
    if key in _NAME_KEYS:
        if isinstance(value, str) and call.name is None:
            call.name = value
    elif key in _ARGUMENT_KEYS:
        call.arguments = value if isinstance(value, str) else raw  # JSON in a string: the string is the JSON


class HermesToolParser(ToolCallParser):
    """``<tool_call>`` JSON calls, or an output that is itself a JSON call (or list of calls)."""

    name = "hermes"

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        stripped = text.lstrip()
        if not stripped and not final:  # leading whitespace: before a bare JSON call it is not content
            return _Snapshot("", [])
        if stripped.startswith(("{", "[")):  # a bare JSON call, unless it turns out to be something else
            scan = _scan_json_calls(text, final)
            if scan.is_call is None and not final:
                return _Snapshot("", scan.calls if scan.calls and scan.calls[0].name else [])
            if scan.is_call:
                tail = "" if scan.end is None else text[scan.end:]
                return _Snapshot(self._tagged(tail, final).content, scan.calls)
        return self._tagged(text, final)

    def _tagged(self, text: str, final: bool) -> _Snapshot:
        content, calls, position = "", [], 0
        while True:
            start = text.find(_TAG_OPEN, position)
            if start < 0:
                tail = text[position:]
                hold = 0 if final else _held_back(tail, (_TAG_OPEN,))
                content += tail[:len(tail) - hold]
                return _Snapshot(content, calls)
            content += text[position:start]
            body_start = start + len(_TAG_OPEN)
            end = text.find(_TAG_CLOSE, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            calls.extend(call for call in _scan_json_calls(body, final or end >= 0).calls if call.name is not None)
            if end < 0:
                return _Snapshot(content, calls)
            position = end + len(_TAG_CLOSE)


# ---------------------------------------------------------------------------------------------- generic

_ENVELOPE_HEAD = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*')


class GenericToolParser(ToolCallParser):
    """The generic format (``generic.py``): ``{"tool_calls": [<call>, ...]}`` or a plain text answer. The grammar
    decides at the first character: ``{`` opens the envelope, anything else is text."""

    name = "generic"

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        stripped = text.lstrip()
        if not stripped.startswith("{"):
            return _Snapshot(text if stripped or final else "", [])
        head = _ENVELOPE_HEAD.match(text)
        if head is None:  # the envelope's opening not whole yet (or, unconstrained, some other JSON: text)
            return _Snapshot(text if final else "", [])
        return _Snapshot("", _scan_json_calls(text[head.end():], final).calls)


PARSERS: Mapping[str, type[ToolCallParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
    "deepseek_dsml": DeepSeekDSMLToolParser,
    "deepseek_v32": DeepSeekDSMLToolParser,
    "deepseek_v4": DeepSeekDSMLToolParser,
    "hermes": HermesToolParser,
    "llama": HermesToolParser,
    "smollm2": HermesToolParser,
    "generic": GenericToolParser,
}


def parser_for_template(chat_template: str | None) -> type[ToolCallParser]:
    """The parser of the tool-call format a chat template writes: DSML, DeepSeek's tool tokens, else JSON."""
    template = chat_template or ""
    if "｜DSML｜" in template:
        return DeepSeekDSMLToolParser
    if "tool▁calls▁begin" in template:
        return DeepSeekV3ToolParser
    return HermesToolParser
