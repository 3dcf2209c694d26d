"""The generic tool format: tool calling for chat templates that do not render ``tools`` (llama.cpp's server has
the same idea; the wording and the envelope here are ours).

The front describes the tools itself, in a system message (``tools_system_text``: the functions' names,
descriptions and argument schemas, one JSON object a line, then how to call them), merged after the client's own
system message when the conversation starts with one. The reply is constrained (``generic_constraint``, an xgrammar
structural tag) to either

- the envelope ``{"tool_calls": [{"name": <a tool's name>, "arguments": <its arguments object>}, ...]}``: one or
  more calls, at most one when ``parallel_tool_calls`` is false, only the named function's for a named
  ``tool_choice``; or
- a plain text answer, which cannot start with ``{`` or whitespace (so a text answer is never half a call), for
  ``tool_choice="auto"`` only.

Earlier turns are written in the same format (``plain_messages``): an assistant message's ``tool_calls`` become the
envelope as its content, and a run of ``tool`` messages becomes one user message
``{"tool_results": [{"tool_call_id", "name", "content"}, ...]}``, so the template sees only roles and text.
``GenericToolParser`` (``parsers.py``) reads the reply back.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from backend_lib.frontend.openai.tool_calls.choice import FunctionTool, required_calls_schema
from backend_lib.structured_output.constraints import ConstraintKind, OutputConstraint, make_constraint

ENVELOPE_KEY = "tool_calls"
RESULTS_KEY = "tool_results"
# A text answer's first character: not "{" (the envelope's) and not whitespace (which would let the model put
# off the choice between a call and text, and a bare envelope after it would read as text).
_TEXT_ANSWER = r"[^{\s][\s\S]*"
# Whitespace between the calls' JSON tokens: a small model left free pads pretty-printed JSON with newlines until
# max_tokens cuts the call (SmolLM2 did, on a second turn); one character still allows ": " and ", ".
_MAX_WHITESPACE = 1


def tools_system_text(tools: Sequence[FunctionTool], tool_choice: Any, parallel: bool) -> str:
    """The fixed wording that tells the model its tools (documented in docs/API.md: keep the two the same)."""
    lines = ["You can call these tools. Each line is one tool: its name, what it does and the JSON schema of its "
             "arguments."]
    for tool in tools:
        entry: dict[str, Any] = {"name": tool.name}
        if tool.description:
            entry["description"] = tool.description
        entry["parameters"] = dict(tool.parameters)
        lines.append(json.dumps(entry, ensure_ascii=False))
    how_many = "one or more calls" if parallel else "exactly one call"
    lines += ["", "To call tools, reply with only this JSON object, with " + how_many + ":",
              '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}',
              'Tool results come back as {"tool_results": [...]}.']
    if tool_choice == "auto":
        lines.append("To answer without calling a tool, reply in plain text.")
    elif tool_choice == "required":
        lines.append("You must call a tool.")
    else:
        lines.append(f"You must call the tool {tool_choice['function']['name']}.")
    return "\n".join(lines)


def generic_constraint(tools: Sequence[FunctionTool], tool_choice: Any, parallel: bool) -> OutputConstraint:
    """The reply's grammar: the envelope of calls, or (``auto``) a plain text answer."""
    if isinstance(tool_choice, dict):  # OpenAI's named choice: one call of that function
        name = tool_choice["function"]["name"]
        tools, parallel = [tool for tool in tools if tool.name == name], False
    calls = required_calls_schema(tools, parallel)
    envelope = {"type": "sequence", "elements": [
        {"type": "const_string", "value": '{"' + ENVELOPE_KEY + '": '},
        {"type": "json_schema", "json_schema": calls, "max_whitespace_cnt": _MAX_WHITESPACE},
        {"type": "const_string", "value": "}"}]}
    answer = envelope if tool_choice != "auto" else \
        {"type": "or", "elements": [envelope, {"type": "regex", "pattern": _TEXT_ANSWER}]}
    return make_constraint(ConstraintKind.STRUCTURAL_TAG, {"type": "structural_tag", "format": answer},
                           field_name="tools")


def _arguments_value(arguments: str) -> Any:
    """A call's arguments as the envelope holds them: the object its JSON text is, or the text itself if it is not
    JSON (a client may send back what a model wrote)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def envelope_text(tool_calls: Sequence[dict[str, Any]]) -> str:
    """OpenAI ``tool_calls`` (``{"id", "function": {"name", "arguments"}}``) as the envelope the model writes."""
    calls = [{"name": call["function"]["name"], "arguments": _arguments_value(call["function"]["arguments"])}
             for call in tool_calls]
    return json.dumps({ENVELOPE_KEY: calls}, ensure_ascii=False)


def plain_messages(messages: list[dict[str, Any]], system_text: str | None) -> list[dict[str, Any]]:
    """Template messages (``tools.template_message``'s) with tool calls and results written in the generic format,
    and ``system_text`` (the tools) added to the first system message, or as one before the conversation."""
    names = {call["id"]: call["function"]["name"]
             for message in messages for call in message.get("tool_calls") or ()}
    out: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []  # the current run of tool messages

    def flush_results() -> None:
        if results:
            out.append({"role": "user", "content": json.dumps({RESULTS_KEY: list(results)}, ensure_ascii=False)})
            results.clear()

    for message in messages:
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            results.append({"tool_call_id": call_id, "name": message.get("name") or names.get(call_id),
                            "content": message["content"]})
            continue
        flush_results()
        plain = {"role": message["role"], "content": message["content"]}
        if message.get("tool_calls"):
            calls = envelope_text(message["tool_calls"])
            plain["content"] = f"{message['content']}\n{calls}" if message["content"] else calls
        out.append(plain)
    flush_results()
    if system_text is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system_text}"}
        else:
            out.insert(0, {"role": "system", "content": system_text})
    return out
