"""OpenAI ``tools`` without the engine, part one: forcing calls with a grammar.

(a) Forcing calls with a grammar (``tool_choice_constraint``): ``tool_choice="required"`` constrains the output to a
JSON array of one or more ``{"name": <a tool's name>, "arguments": <that function's parameters>}`` objects
(``required_calls_schema``); a named function constrains it to that function's arguments object
(``named_call_schema``). ``calls_from_constrained_output`` turns such an output into calls. ``"none"`` and
``"auto"`` constrain nothing: with ``auto`` the model writes calls in its own format, which a parser reads.

The parsers of a model's own tool-call text are ``tool_calls``.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend_lib.structured_output.constraints import (
    DEFAULT_LIMITS,
    ConstraintKind,
    InvalidConstraintError,
    OutputConstraint,
    StructuredOutputLimits,
    make_constraint,
)

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's names (a-z, A-Z, 0-9, _ and -), plus . and :


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------------- tools and choice


@dataclass(frozen=True)
class FunctionTool:
    """One ``{"type": "function", "function": {...}}`` entry of a request's ``tools``."""

    name: str
    parameters: Mapping[str, Any]  # the arguments' JSON schema
    description: str | None = None


def parse_tools(tools: Any, field_name: str = "tools") -> list[FunctionTool]:
    """Checked function tools; each refusal names its place (``tools[1].function.name``)."""
    if not isinstance(tools, list) or not tools:
        raise InvalidConstraintError(field_name, "must be a non-empty list of {\"type\": \"function\", "
                                     "\"function\": {...}} objects")
    parsed: list[FunctionTool] = []
    for index, tool in enumerate(tools):
        where = f"{field_name}[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidConstraintError(where, "must be an object with \"type\": \"function\"")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidConstraintError(f"{where}.function", "must be an object with a \"name\"")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise InvalidConstraintError(f"{where}.function.name", "must be 1 to 64 letters, digits, '_', '-', "
                                         f"'.' or ':', got {name!r}"[:200])
        if any(other.name == name for other in parsed):
            raise InvalidConstraintError(f"{where}.function.name", f"repeats the tool name {name!r}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise InvalidConstraintError(f"{where}.function.parameters", "must be a JSON schema object, got "
                                         f"{type(parameters).__name__}")
        description = function.get("description")
        parsed.append(FunctionTool(name, dict(parameters), description if isinstance(description, str) else None))
    return parsed


def required_calls_schema(tools: Sequence[FunctionTool], parallel: bool = True) -> dict[str, Any]:
    """One or more calls (exactly one unless ``parallel``): ``[{"name": <tool name>, "arguments": <its
    parameters>}, ...]``."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [{
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": dict(tool.parameters)},
            "required": ["name", "arguments"],
        } for tool in tools]},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_call_schema(tool: FunctionTool) -> dict[str, Any]:
    """A named function's call: the output is its arguments object."""
    return dict(tool.parameters)


def tool_choice_constraint(tools: Sequence[FunctionTool], tool_choice: Any = "auto", *,
                           field_name: str = "tool_choice", parallel: bool = True,
                           limits: StructuredOutputLimits = DEFAULT_LIMITS) -> OutputConstraint | None:
    """The constraint forcing ``tool_choice``: None for ``"none"`` / ``"auto"``; the array of calls for
    ``"required"``; the named function's arguments for ``{"type": "function", "function": {"name": ...}}``."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return make_constraint(ConstraintKind.JSON, required_calls_schema(tools, parallel), field_name=field_name,
                               limits=limits)
    if isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        for tool in tools:
            if tool.name == name:
                return make_constraint(ConstraintKind.JSON, named_call_schema(tool), field_name=field_name,
                                       limits=limits)
        raise InvalidConstraintError(f"{field_name}.function.name", f"names {name!r}, which is not in tools")
    raise InvalidConstraintError(field_name, "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                 f"\"function\": {{\"name\": ...}}}}, got {str(tool_choice)[:64]!r}")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments
    id: str = field(default_factory=new_call_id, compare=False)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def calls_from_constrained_output(text: str, tool_choice: Any) -> list[ToolCall]:
    """The calls of an output generated under ``tool_choice_constraint``: ``"required"`` -> each array element,
    a named function -> one call with the whole output as its arguments."""
    if tool_choice == "required":
        calls = json.loads(text)
        return [ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in calls]
    return [ToolCall(tool_choice["function"]["name"], text.strip())]
