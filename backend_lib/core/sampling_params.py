"""SamplingParams: vLLM's per-request sampling knobs, validated at construction.

Every bad value raises ``RequestError`` (core/errors.py, a ValueError) with the field and a message naming the
allowed range and the value, because these messages go back to clients verbatim and must say what to fix.
Vocabulary-dependent checks (stop_token_ids < vocab size) belong to the engine, which knows the model.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from backend_lib.core.errors import RequestError
from backend_lib.structured_output.constraints import OutputConstraint

DEFAULT_MAX_TOKENS = 16  # vLLM's default
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
SEED_LIMIT = 2**31
# max_tokens None: as many as max_model_len leaves (the scheduler ends the request there, as "length").
UNTIL_CONTEXT_ENDS = 2**31 - 1


class MaxTokens(enum.Enum):
    """max_tokens left out (not null, which asks for the rest of the context): DEFAULT_MAX_TOKENS."""

    OMITTED = "omitted"


def _is_int(value: Any) -> bool:
    # bool is a subclass of int: JSON true must not silently become 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _field(name: str) -> str:
    """The request field a value belongs to: ``logit_bias[7]`` is in ``logit_bias``."""
    return name.split("[", 1)[0]


def _as_float(name: str, value: Any) -> float:
    """Accept JSON ints where floats are expected (1 -> 1.0), never bools or strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(_field(name), f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        result = float(value)
    except OverflowError:  # a JSON integer past float's range
        raise RequestError(_field(name), f"{name} must be a finite number, got an integer of "
                           f"{value.bit_length()} bits") from None
    if not math.isfinite(result):
        raise RequestError(_field(name), f"{name} must be a finite number, got {value!r}")
    return result


def _as_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise RequestError(_field(name), f"{name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(_field(name), f"{name} must be a boolean (true/false), got {type(value).__name__} {value!r}")
    return value


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise RequestError(name, message)


@dataclass
class SamplingParams:
    # vLLM's meanings: left out, DEFAULT_MAX_TOKENS; None (JSON null), as many as fit; both cut short where
    # max_model_len ends the request. A number the client set must fit: the engine refuses prompt + max_tokens >
    # max_model_len (``max_tokens_set`` tells them apart). After construction max_tokens is always an int.
    max_tokens: int | None | MaxTokens = MaxTokens.OMITTED
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return (the engine caps it); None = no logprobs
    # vLLM's prompt_logprobs: each prompt token's logprob (after the first) with this many top alternatives; the
    # whole prompt is computed (no prefix-cache hits). None = none.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # per-request opt-out of speculative decoding
    # token id -> added to its raw logit before penalties and sampling (OpenAI's and vLLM's logit_bias; JSON's keys
    # are strings of the ids); logprobs stay those of the raw logits.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # What the output must match (a JSON schema, regex, choices, grammar), parsed by the intake from the request's
    # structured_outputs / guided_* fields (backend_lib/engine/intake.py); None = unconstrained.
    structured_outputs: OutputConstraint | None = None

    def __post_init__(self) -> None:
        # Not a dataclass field: from_dict must not accept it, and equal requests stay equal.
        self.max_tokens_omitted = self.max_tokens is MaxTokens.OMITTED
        self.max_tokens_set = not self.max_tokens_omitted and self.max_tokens is not None
        if not self.max_tokens_set:
            self.max_tokens = DEFAULT_MAX_TOKENS if self.max_tokens_omitted else UNTIL_CONTEXT_ENDS
        self.max_tokens = _as_int("max_tokens", self.max_tokens)
        _require(self.max_tokens >= 1, "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")

        self.temperature = _as_float("temperature", self.temperature)
        _require(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature:g}")

        self.top_p = _as_float("top_p", self.top_p)
        _require(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p:g}")

        self.top_k = _as_int("top_k", self.top_k)
        _require(self.top_k == -1 or self.top_k >= 1, "top_k",
                 f"top_k must be -1 (off) or >= 1, got {self.top_k}")

        self.min_p = _as_float("min_p", self.min_p)
        _require(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p:g}")

        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        _require(self.repetition_penalty > 0, "repetition_penalty",
                 f"repetition_penalty must be > 0, got {self.repetition_penalty:g}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            _require(-2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value:g}")
            setattr(self, name, value)

        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            _require(0 <= self.seed < SEED_LIMIT, "seed",
                     f"seed must be in [0, {SEED_LIMIT - 1}] (or null), got {self.seed}")

        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            _as_bool(name, getattr(self, name))

        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

        self.logit_bias = self._check_logit_bias(self.logit_bias)
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, OutputConstraint),
                 "structured_outputs", "structured_outputs must be a parsed OutputConstraint (the intake parses the "
                 f"request's fields), got {type(self.structured_outputs).__name__}")

        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
            # The upper bound is a server setting (RequestLimits.max_logprobs): the engine checks it.
            _require(self.logprobs >= 0, "logprobs", f"logprobs must be >= 0 (or null), got {self.logprobs}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs)
            _require(self.prompt_logprobs >= 0, "prompt_logprobs",
                     f"prompt_logprobs must be >= 0 (or null), got {self.prompt_logprobs}")

    @staticmethod
    def _check_logit_bias(bias: Any) -> dict[int, float]:
        """Ids as ints (JSON object keys are strings), values finite in [-100, 100]; the vocabulary and the
        entry count are the engine's checks (limits.check_params)."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise RequestError("logit_bias", f"logit_bias must be an object of token id -> bias, got "
                               f"{type(bias).__name__}")
        checked = {}
        for key, value in bias.items():
            text = key.strip() if isinstance(key, str) else None
            if not (_is_int(key) or (text and text.isascii() and text.isdigit() and len(text) <= 18)):
                raise RequestError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got "
                                   f"{str(key)[:40]!r}")
            token = int(key)
            _require(token >= 0, "logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            bias_value = _as_float(f"logit_bias[{token}]", value)
            _require(-LOGIT_BIAS_LIMIT <= bias_value <= LOGIT_BIAS_LIMIT, "logit_bias",
                     f"logit_bias[{token}] must be in "
                     f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias_value:g}")
            checked[token] = bias_value
        return checked

    @staticmethod
    def _check_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise RequestError("stop", f"stop must be a string or a list of strings, got {type(stop).__name__} "
                               f"{stop!r}")
        for item in stop:
            if not isinstance(item, str) or not item:
                raise RequestError("stop", f"stop must contain only non-empty strings, got {item!r}")
        return list(stop)

    @staticmethod
    def _check_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise RequestError("stop_token_ids", f"stop_token_ids must be a list of integers >= 0, got "
                               f"{type(ids).__name__} {ids!r}")
        for item in ids:
            if not _is_int(item) or item < 0:
                raise RequestError("stop_token_ids", f"stop_token_ids must contain only integers >= 0, got {item!r}")
        return [int(i) for i in ids]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: dict[str, Any], also_allowed: tuple[str, ...] = ()) -> "SamplingParams":
        """The fields by name; an unknown name is refused, listing ours and ``also_allowed`` (the request's other
        fields, which the caller has taken out: the one place a request's field names are checked)."""
        if not isinstance(values, dict):
            raise RequestError(None, f"sampling parameters must be an object, got {type(values).__name__}")
        allowed = cls.field_names()
        for name in values:
            if name not in allowed:
                raise RequestError(str(name), f"unknown sampling field {name!r} (allowed: "
                                   f"{', '.join(allowed + also_allowed)})")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as from_dict takes them; a max_tokens left out stays out, a null stays null."""
        values = {name: (list(v) if isinstance(v, list) else v)
                  for name, v in ((f, getattr(self, f)) for f in self.field_names())}
        if self.max_tokens_omitted:
            del values["max_tokens"]
        elif not self.max_tokens_set:
            values["max_tokens"] = None
        return values

    def to_json(self) -> str:
        """The fields as JSON; a constraint as the structured_outputs request field that parses back to it."""
        values = self.to_dict()
        if self.structured_outputs is not None:
            values.update(self.structured_outputs.to_request())
        return json.dumps(values)

    def clone(self, **overrides: Any) -> "SamplingParams":
        """A validated copy with ``overrides`` applied; lists are copied so the clone owns them."""
        values = self.to_dict()
        values.update(overrides)  # an unknown name is a TypeError: overrides come from code, not from a request
        return SamplingParams(**values)
