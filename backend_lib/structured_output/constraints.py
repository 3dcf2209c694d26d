"""What a request asks its output to match (``OutputConstraint``), parsed from the request's fields, and the typed
refusals of this package.

Request forms (one parser, ``parse_constraint``):

- vLLM's ``structured_outputs`` object: exactly one of ``{"json": schema}`` (a JSON schema object or its JSON
  text), ``{"regex": "..."}``, ``{"choice": ["a", "b"]}``, ``{"grammar": "<EBNF>"}`` (xgrammar's EBNF / GBNF,
  root rule ``root``), ``{"json_object": true}`` (any JSON object), ``{"structural_tag": ...}`` (xgrammar's
  structural tag: ``{"type": "structural_tag", "format": {...}}``, or vLLM's older
  ``{"structures": [...], "triggers": [...]}``, converted); plus vLLM's options ``disable_any_whitespace``
  (compact JSON), ``disable_additional_properties`` and ``disable_fallback`` (accepted; xgrammar is the only backend
  and its JSON schemas already refuse unlisted properties) and ``whitespace_pattern`` (refused unless null);
- the older plain fields Triton vLLM-backend clients still send: ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``.

A request carries at most one constraint. Every refusal is a ``StructuredOutputError`` (a ValueError, so
INVALID_ARG) whose message starts with the request field it is about (``structured_outputs.json``,
``guided_regex``, ...) and, for a limit, says what the request holds and the limit by its setting name, as
``backend_lib/engine/intake.py`` words them. Limits are checked before anything is parsed: a huge schema must not
cost a JSON parse on the way to its refusal.

No xgrammar here: the codec and the OpenAI front import this module without the grammar engine.
"""
from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

STRUCTURED_OUTPUTS = "structured_outputs"


class ConstraintKind(str, enum.Enum):
    JSON = "json"  # spec: the JSON schema as compact JSON text (the client's key order kept)
    JSON_OBJECT = "json_object"  # spec: "" (any JSON object)
    REGEX = "regex"  # spec: the regex; the whole output must match it
    CHOICE = "choice"  # spec: the choices, a tuple of distinct strings in the client's order
    GRAMMAR = "grammar"  # spec: EBNF text with a ``root`` rule
    STRUCTURAL_TAG = "structural_tag"  # spec: xgrammar's structural tag as compact JSON text


# The older plain fields and the kind each asks for.
LEGACY_FIELDS: Mapping[str, ConstraintKind] = {
    "guided_json": ConstraintKind.JSON,
    "guided_regex": ConstraintKind.REGEX,
    "guided_choice": ConstraintKind.CHOICE,
    "guided_grammar": ConstraintKind.GRAMMAR,
}
# Every request field parse_constraint reads: the codec takes these out of the sampling fields before
# SamplingParams sees them.
CONSTRAINT_FIELDS: tuple[str, ...] = (STRUCTURED_OUTPUTS, *LEGACY_FIELDS)
_BOOL_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
_OPTIONS = (*_BOOL_OPTIONS, "whitespace_pattern")
_KINDS_BY_KEY = {kind.value: kind for kind in ConstraintKind}


# ---------------------------------------------------------------------------------------------- errors


def _rebuild(cls: type, state: dict[str, Any], args: tuple) -> "StructuredOutputError":
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = args
    return error


class StructuredOutputError(ValueError):
    """A structured-output refusal (INVALID_ARG). ``field`` is the request field it names; the message is
    ``f"{field} {detail}"``."""

    def __init__(self, field_name: str, detail: str) -> None:
        super().__init__(f"{field_name} {detail}")
        self.field = field_name
        self.detail = detail

    def with_field(self, field_name: str) -> "StructuredOutputError":
        """The same refusal about another field (two requests can share one compile under different names)."""
        state = dict(self.__dict__, field=field_name)
        return _rebuild(type(self), state, (f"{field_name} {self.detail}",))

    def __reduce__(self):  # copy / pickle keep the subclass and its attributes (the default calls cls(message))
        return _rebuild, (type(self), dict(self.__dict__), self.args)


class InvalidConstraintError(StructuredOutputError):
    """The request's constraint fields are malformed: a wrong type, two constraints, an empty choice list."""


class ConstraintLimitError(StructuredOutputError):
    """Over one of ``StructuredOutputLimits``: ``limit_name`` is the setting, ``limit`` its value."""

    def __init__(self, field_name: str, detail: str, limit_name: str, limit: float) -> None:
        super().__init__(field_name, detail)
        self.limit_name = limit_name
        self.limit = limit


class GrammarCompileError(StructuredOutputError):
    """The grammar engine refused the constraint: a bad regex or EBNF, an invalid JSON schema."""


class UnsupportedSchemaError(GrammarCompileError):
    """A JSON schema uses a feature the grammar engine cannot enforce (it would be silently ignored)."""


class GrammarCompileTimeout(GrammarCompileError):
    """The constraint did not compile within ``compile_timeout_s`` (``limit``) of its submission."""

    def __init__(self, field_name: str, detail: str, limit: float) -> None:
        super().__init__(field_name, detail)
        self.limit_name = "compile_timeout_s"
        self.limit = limit


# ---------------------------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class StructuredOutputLimits:
    """Server settings bounding what one constraint may cost (``config.pbtxt`` parameters once wired)."""

    # Characters of a schema / regex / grammar / structural tag (a dict counted as its compact JSON), or of all
    # choices together. Compile time grows with it.
    max_schema_chars: int = 65_536
    # JSON nesting of a schema or structural tag document: xgrammar's converter recurses (500 nested arrays took
    # 9.5 s to compile, 5000 over two minutes), and so would a deep-copying client library.
    max_schema_depth: int = 64
    max_choices: int = 1024  # strings in a choice list
    # Seconds from submission (queueing behind other compiles included) until the grammar must be ready; past it
    # the request is refused. A request never waits longer than this for its grammar.
    compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compile_timeout_s":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and value > 0
                if not ok:
                    raise ValueError(f"{f.name} must be a number > 0, got {value!r}")
            elif not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")


DEFAULT_LIMITS = StructuredOutputLimits()


# ---------------------------------------------------------------------------------------------- the constraint


@dataclass(frozen=True)
class OutputConstraint:
    """One request's output constraint, normalized: equal constraints compare (and hash) equal whatever field
    or form they came from, so they share a compiled grammar."""

    kind: ConstraintKind
    spec: str | tuple[str, ...]
    # The request field it came from, named by every refusal about it; not part of equality.
    field: str = field(default=STRUCTURED_OUTPUTS, compare=False)
    # JSON kinds: any whitespace between tokens (True) or compact JSON (vLLM's disable_any_whitespace).
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise TypeError(f"kind must be a ConstraintKind, got {self.kind!r}")
        if self.kind is ConstraintKind.CHOICE:
            if not (isinstance(self.spec, tuple) and self.spec and all(isinstance(s, str) for s in self.spec)):
                raise TypeError(f"a choice constraint's spec must be a non-empty tuple of strings, got {self.spec!r}")
        elif not isinstance(self.spec, str):
            raise TypeError(f"a {self.kind.value} constraint's spec must be a string, got {type(self.spec).__name__}")

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the compile cache's key)."""
        return (self.kind.value, self.spec, self.any_whitespace)

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a ``json`` constraint."""
        if self.kind is not ConstraintKind.JSON:
            raise ValueError(f"a {self.kind.value} constraint has no JSON schema")
        return json.loads(self.spec)

    def to_request(self) -> dict[str, Any]:
        """The ``structured_outputs`` request field that parses back to this constraint (the OpenAI front sends
        it to the model this way)."""
        if self.kind is ConstraintKind.JSON:
            value: Any = json.loads(self.spec)
        elif self.kind is ConstraintKind.STRUCTURAL_TAG:
            value = json.loads(self.spec)
        elif self.kind is ConstraintKind.JSON_OBJECT:
            value = True
        elif self.kind is ConstraintKind.CHOICE:
            value = list(self.spec)
        else:
            value = self.spec
        body: dict[str, Any] = {self.kind.value: value}
        if not self.any_whitespace:
            body["disable_any_whitespace"] = True
        return {STRUCTURED_OUTPUTS: body}


# ---------------------------------------------------------------------------------------------- parsing


def parse_constraint(request: Mapping[str, Any],
                     limits: StructuredOutputLimits = DEFAULT_LIMITS) -> OutputConstraint | None:
    """The request's constraint from its fields (``CONSTRAINT_FIELDS``; others are ignored), or None when it has
    none. A null field counts as absent, as the codec treats vLLM clients' nulls."""
    found: list[tuple[str, ConstraintKind, Any]] = []
    any_whitespace = True
    body = request.get(STRUCTURED_OUTPUTS)
    if body is not None:
        if not isinstance(body, Mapping):
            raise InvalidConstraintError(STRUCTURED_OUTPUTS, "must be an object such as {\"json\": <schema>} or "
                                         f"{{\"regex\": \"...\"}}, got {type(body).__name__}")
        for key, value in body.items():
            name = f"{STRUCTURED_OUTPUTS}.{key}"
            if key == ConstraintKind.JSON_OBJECT.value:
                if value is not None and not isinstance(value, bool):
                    raise InvalidConstraintError(name, f"must be true or false, got {type(value).__name__} "
                                                 f"{_preview(value)}")
                if value:
                    found.append((name, ConstraintKind.JSON_OBJECT, value))
            elif key in _KINDS_BY_KEY:
                if value is not None:
                    found.append((name, _KINDS_BY_KEY[key], value))
            elif key in _BOOL_OPTIONS:
                if value is not None and not isinstance(value, bool):
                    raise InvalidConstraintError(name, f"must be true or false, got {type(value).__name__} "
                                                 f"{_preview(value)}")
                if key == "disable_any_whitespace" and value:
                    any_whitespace = False
            elif key == "whitespace_pattern":
                if value is not None:
                    raise InvalidConstraintError(name, "is not supported (the grammar engine has no whitespace "
                                                 "pattern); use disable_any_whitespace for compact JSON")
            else:
                allowed = ", ".join((*_KINDS_BY_KEY, *_OPTIONS))
                raise InvalidConstraintError(STRUCTURED_OUTPUTS, f"has an unknown key {str(key)[:64]!r} "
                                             f"(allowed: {allowed})")
        if not found:
            raise InvalidConstraintError(STRUCTURED_OUTPUTS, "names no constraint; give exactly one of "
                                         + ", ".join(_KINDS_BY_KEY))
    for name, kind in LEGACY_FIELDS.items():
        value = request.get(name)
        if value is not None:
            found.append((name, kind, value))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidConstraintError(found[1][0], f"and {found[0][0]} both constrain the output; send exactly one "
                                     "constraint")
    name, kind, value = found[0]
    return make_constraint(kind, value, field_name=name, limits=limits, any_whitespace=any_whitespace)


def make_constraint(kind: ConstraintKind | str, value: Any, *, field_name: str,
                    limits: StructuredOutputLimits = DEFAULT_LIMITS, any_whitespace: bool = True) -> OutputConstraint:
    """A constraint of ``kind`` from a request value (checked and normalized); refusals name ``field_name``. The
    OpenAI front builds ``response_format`` / ``tools`` constraints through this too."""
    kind = ConstraintKind(kind)
    if kind is ConstraintKind.JSON:
        spec: str | tuple[str, ...] = _json_document(field_name, value, limits, "a JSON schema")
    elif kind is ConstraintKind.JSON_OBJECT:
        if value is not True:
            raise InvalidConstraintError(field_name, f"must be true, got {_preview(value)}")
        spec = ""
    elif kind is ConstraintKind.CHOICE:
        spec = _choices(field_name, value, limits)
    elif kind is ConstraintKind.STRUCTURAL_TAG:
        spec = _structural_tag(field_name, value, limits)
    else:  # regex, grammar: text
        if not isinstance(value, str):
            raise InvalidConstraintError(field_name, f"must be a string, got {type(value).__name__} {_preview(value)}")
        _check_chars(field_name, len(value), limits)
        if not value:
            raise InvalidConstraintError(field_name, "must be a non-empty string")
        spec = value
    return OutputConstraint(kind, spec, field_name, any_whitespace)


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _check_chars(field_name: str, size: int, limits: StructuredOutputLimits, what: str = "characters") -> None:
    if size > limits.max_schema_chars:
        raise ConstraintLimitError(field_name, f"has {size} {what}; the limit (max_schema_chars) is "
                                   f"{limits.max_schema_chars}", "max_schema_chars", limits.max_schema_chars)


def _check_depth(field_name: str, document: Any, limits: StructuredOutputLimits) -> None:
    """JSON nesting of a parsed document, iteratively (a deep document must not exhaust the stack here)."""
    pending = [(document, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limits.max_schema_depth:
            raise _depth_error(field_name, limits)
        pending.extend((child, depth + 1) for child in children)


def _depth_error(field_name: str, limits: StructuredOutputLimits) -> ConstraintLimitError:
    return ConstraintLimitError(field_name, f"is nested more than {limits.max_schema_depth} levels deep; the limit "
                                f"(max_schema_depth) is {limits.max_schema_depth}", "max_schema_depth",
                                limits.max_schema_depth)


def _loads(field_name: str, text: str, limits: StructuredOutputLimits) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidConstraintError(field_name, f"is not valid JSON: {exc}") from None
    except RecursionError:  # Python's parser recurses per level: far past any depth limit
        raise _depth_error(field_name, limits) from None


def _json_document(field_name: str, value: Any, limits: StructuredOutputLimits, what: str) -> str:
    """A JSON object given as a dict or as its JSON text -> compact JSON text (key order kept), size and depth
    checked."""
    if isinstance(value, str):
        _check_chars(field_name, len(value), limits)
        value = _loads(field_name, value, limits)
    if not isinstance(value, dict):
        raise InvalidConstraintError(field_name, f"must be {what} (an object, or its JSON text), got "
                                     f"{type(value).__name__} {_preview(value)}")
    _check_depth(field_name, value, limits)
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:  # a NaN, or a value JSON has no form for (a client-side dict)
        raise InvalidConstraintError(field_name, f"is not valid JSON: {exc}") from None
    _check_chars(field_name, len(text), limits)
    return text


def _choices(field_name: str, value: Any, limits: StructuredOutputLimits) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise InvalidConstraintError(field_name, f"must be a list of strings, got {type(value).__name__} "
                                     f"{_preview(value)}")
    if not value:
        raise InvalidConstraintError(field_name, "must be a non-empty list of strings")
    if len(value) > limits.max_choices:
        raise ConstraintLimitError(field_name, f"has {len(value)} choices; the limit (max_choices) is "
                                   f"{limits.max_choices}", "max_choices", limits.max_choices)
    for item in value:
        if not isinstance(item, str):
            raise InvalidConstraintError(field_name, f"must contain only strings, got {type(item).__name__} "
                                         f"{_preview(item)}")
    _check_chars(field_name, sum(len(item) for item in value), limits, "characters in its choices")
    return tuple(dict.fromkeys(value))  # distinct, the client's order


def _structural_tag(field_name: str, value: Any, limits: StructuredOutputLimits) -> str:
    text = _json_document(field_name, value, limits, "a structural tag")
    document = json.loads(text)
    if "format" in document:
        return text
    structures, triggers = document.get("structures"), document.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise InvalidConstraintError(field_name, "must be a structural tag: {\"type\": \"structural_tag\", "
                                     "\"format\": {...}} or {\"structures\": [...], \"triggers\": [...]}")
    tags = []
    for index, item in enumerate(structures):
        if not (isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
                and isinstance(item.get("schema"), dict)):
            raise InvalidConstraintError(f"{field_name}.structures[{index}]", "must be an object with string "
                                         "\"begin\" and \"end\" and an object \"schema\"")
        tags.append({"type": "tag", "begin": item["begin"], "end": item["end"],
                     "content": {"type": "json_schema", "json_schema": item["schema"]}})
    converted = {"type": "structural_tag",
                 "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    return json.dumps(converted, ensure_ascii=False, separators=(",", ":"))
