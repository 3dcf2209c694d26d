"""Constraints -> xgrammar compiled grammars, off the caller's thread.

Owns:

- ``build_tokenizer_info``: xgrammar's ``TokenizerInfo`` from our tokenizer's vocabulary as its model spells it
  (byte-level ``Ġa``, SentencePiece ``▁a`` / ``<0x0A>``; xgrammar decodes them), its end-of-sequence ids as the
  grammar's stop tokens, and ``vocab_size`` = the model's padded logits width: ids past the tokenizer are special
  to xgrammar, so their bits are 0 in every mask and a padded logit column can never be sampled.
- ``GrammarCompiler``: ``submit(constraint)`` returns a ``concurrent.futures.Future`` at once; the compile runs on
  a small thread pool (xgrammar releases the GIL while it compiles, so the step loop keeps running). The future
  resolves to an ``xgrammar.CompiledGrammar`` or to a ``StructuredOutputError`` naming the constraint's field:
  ``GrammarCompileError`` (bad regex or EBNF, invalid schema), ``UnsupportedSchemaError`` (a schema feature
  xgrammar would not enforce), ``GrammarCompileTimeout`` (not ready ``compile_timeout_s`` after submission; the
  compile itself cannot be interrupted and finishes in the background, its result cached). Identical constraints
  share one compile (in flight) and one result (an LRU of compiled grammars, beside xgrammar's own cache).
- ``check_schema_features``: the fail-closed list of JSON schema features xgrammar 0.2.9 accepts but does not
  enforce (measured: a violating instance is accepted), refused instead of silently producing invalid output.
"""
from __future__ import annotations

import heapq
import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from backend_lib.structured_output.constraints import (
    DEFAULT_LIMITS,
    ConstraintKind,
    GrammarCompileError,
    GrammarCompileTimeout,
    OutputConstraint,
    StructuredOutputError,
    StructuredOutputLimits,
    UnsupportedSchemaError,
)
from kernels.grammar_mask import bitmask_width

# ---------------------------------------------------------------------------------------------- tokenizer info


def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters GPT-2's byte-to-unicode table spells bytes with."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [256 + n for n in range(256 - len(kept))]
    return frozenset(chr(c) for c in kept + shifted)


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def encoded_vocabulary(tokenizer: Any) -> list[str]:
    """Every id's token as the tokenizer model spells it ("" for ids it lacks). ``tokenizer``: our
    ``backend_lib.engine.tokenizer.Tokenizer``, a ``tokenizers.Tokenizer``, a token -> id mapping, or the list
    itself."""
    if isinstance(tokenizer, Sequence) and not isinstance(tokenizer, str):
        return [str(token) for token in tokenizer]
    if isinstance(tokenizer, Mapping):
        vocab = tokenizer
    else:
        vocab = tokenizer.get_vocab(with_added_tokens=True)  # ours and tokenizers.Tokenizer alike
    size = max(vocab.values(), default=-1) + 1
    tokens = [""] * size
    for token, index in vocab.items():
        tokens[index] = token
    return tokens


def detect_vocab_type(tokens: Sequence[str]) -> xgr.VocabType:
    """From the vocabulary itself: SentencePiece byte fallback has the 256 ``<0xNN>`` pieces; byte-level BPE spells
    (almost) every token with GPT-2's byte alphabet and has most of it as single-character tokens; else raw."""
    present = set(tokens)
    if sum(f"<0x{byte:02X}>" in present for byte in range(256)) >= 128:
        return xgr.VocabType.BYTE_FALLBACK
    if sum(char in present for char in _BYTE_LEVEL_ALPHABET) >= 128:
        spelled = sum(all(char in _BYTE_LEVEL_ALPHABET for char in token) for token in tokens if token)
        if spelled >= 0.99 * sum(1 for token in tokens if token):  # added tokens (<|im_end|>) may stray
            return xgr.VocabType.BYTE_LEVEL
    return xgr.VocabType.RAW


def build_tokenizer_info(tokenizer: Any, vocab_size: int, *,
                         stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer`` for a model whose logits have ``vocab_size`` columns (>= the tokenizer's
    size when the head is padded). Stop tokens: ``stop_token_ids``, else the tokenizer's ``eos_token_ids``."""
    tokens = encoded_vocabulary(tokenizer)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    vocab_type = detect_vocab_type(tokens)
    add_prefix_space = False
    encode = getattr(tokenizer, "encode", None)
    if vocab_type is not xgr.VocabType.RAW and callable(encode):
        # As xgrammar's own detection: does encoding "a" start with the model's space marker?
        try:
            ids = encode("a", add_special_tokens=False)
        except TypeError:
            ids = encode("a")
        ids = getattr(ids, "ids", ids)
        first = tokens[ids[0]] if ids and 0 <= ids[0] < len(tokens) else ""
        add_prefix_space = first.startswith("▁" if vocab_type is xgr.VocabType.BYTE_FALLBACK else "Ġ")
    if stop_token_ids is None:
        stop_token_ids = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    stops = [int(i) for i in stop_token_ids if 0 <= int(i) < vocab_size] or None  # None: xgrammar detects them
    return xgr.TokenizerInfo(tokens[:vocab_size], vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=add_prefix_space)


# ---------------------------------------------------------------------------------------------- schema features

# Measured on xgrammar 0.2.9: the schema compiles, and an instance violating the keyword is accepted (re-checked by
# tests/structured_output/test_structured_output.py::test_refused_features_are_still_ignored_by_xgrammar).
_IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
                     "uniqueItems", "contains", "minContains", "maxContains")
# Keywords beside "$ref" that change nothing (annotations, definitions); any other sibling is ignored by xgrammar.
_REF_SIBLINGS_OK = frozenset(("$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description",
                              "default", "examples", "deprecated", "readOnly", "writeOnly"))
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
                  "propertyNames", "contains", "not", "if", "then", "else")


def check_schema_features(schema: Mapping[str, Any], field_name: str) -> None:
    """Refuse (``UnsupportedSchemaError`` naming ``field_name`` and the schema path) a feature xgrammar would accept
    but not enforce: ``not``, ``if`` / ``then`` / ``else``, dependencies, ``uniqueItems``, ``contains``, ``allOf``
    of several schemas, constraints beside a ``$ref``, a ``$ref`` outside the document, ``pattern`` or ``format``
    with ``minLength`` / ``maxLength``. ``oneOf`` is enforced as ``anyOf`` (exclusivity is not checked) and
    ``format`` values xgrammar does not know are annotations, as JSON Schema's default."""
    pending: list[tuple[Any, str]] = [(schema, "")]
    while pending:
        node, path = pending.pop()
        if not isinstance(node, Mapping):
            continue
        where = path or "/"

        def refuse(what: str) -> None:
            raise UnsupportedSchemaError(field_name, f"uses {what} at {where}, which the grammar engine accepts "
                                         "but cannot enforce; remove it or express it another way")

        for keyword in _IGNORED_KEYWORDS:
            if keyword in node:
                refuse(f"{keyword!r}")
        all_of = node.get("allOf")
        if isinstance(all_of, list) and len(all_of) > 1:
            refuse("'allOf' of several schemas")
        ref = node.get("$ref")
        if ref is not None:
            if not (isinstance(ref, str) and ref.startswith("#")):
                refuse(f"a '$ref' outside the document ({str(ref)[:64]!r})")
            extra = sorted(key for key in node if key not in _REF_SIBLINGS_OK)
            if extra:
                refuse(f"{extra[0]!r} beside '$ref'")
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            refuse("'pattern' or 'format' together with 'minLength' / 'maxLength'")
        for key in _SCHEMA_MAPS:
            children = node.get(key)
            if isinstance(children, Mapping):
                pending.extend((child, f"{path}/{key}/{name}") for name, child in children.items())
        for key in _SCHEMA_LISTS:
            children = node.get(key)
            if isinstance(children, list):
                pending.extend((child, f"{path}/{key}/{index}") for index, child in enumerate(children))
        for key in _SCHEMA_VALUES:
            child = node.get(key)
            if isinstance(child, Mapping):
                pending.append((child, f"{path}/{key}"))


def _embedded_schemas(tag: Any) -> list[Mapping[str, Any]]:
    """The JSON schemas inside a structural tag (its ``{"type": "json_schema", "json_schema": ...}`` formats, at any
    depth), which xgrammar would compile without ``check_schema_features``' refusals."""
    found, pending = [], [tag]
    while pending:
        node = pending.pop()
        if isinstance(node, Mapping):
            if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), Mapping):
                found.append(node["json_schema"])
            else:
                pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return found


# ---------------------------------------------------------------------------------------------- compiling


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly ``choices``."""
    def literal(text: str) -> str:
        out = []
        for char in text:
            code = ord(char)
            if char in '"\\':
                out.append("\\" + char)
            elif 32 <= code < 127:
                out.append(char)
            elif code < 0x10000:
                out.append(f"\\u{code:04x}")
            else:
                out.append(f"\\U{code:08x}")
        return '"' + "".join(out) + '"'
    return "root ::= " + " | ".join(literal(choice) for choice in choices)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its log prefix ("[18:32:07] /project/cpp/regex_converter.cc:94: ")."""
    text = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(exc).strip()))
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."


class _Deadlines:
    """One daemon thread that fails futures still pending at their deadline."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Future, Callable[[], BaseException]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, deadline: float, future: Future, make_error: Callable[[], BaseException]) -> None:
        with self._cv:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-deadlines", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (deadline, next(self._order), future, make_error))
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._heap.clear()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stopped:
                        return
                    while self._heap and self._heap[0][2].done():
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cv.wait()
                        continue
                    delay = self._heap[0][0] - time.monotonic()
                    if delay <= 0:
                        break
                    self._cv.wait(delay)
                now = time.monotonic()
                expired = []
                while self._heap and self._heap[0][0] <= now:
                    expired.append(heapq.heappop(self._heap))
            for _, _, future, make_error in expired:  # outside the lock: callbacks run here
                _fail(future, make_error())


def _resolve(future: Future, value: Any) -> None:
    try:
        future.set_result(value)
    except InvalidStateError:  # already timed out or cancelled
        pass


def _fail(future: Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass


class _Job:
    """One compile in flight and the futures (with their field names) waiting for it."""

    __slots__ = ("constraint", "waiters")

    def __init__(self, constraint: OutputConstraint) -> None:
        self.constraint = constraint
        self.waiters: list[tuple[Future, str]] = []


class GrammarCompiler:
    """Compiles ``OutputConstraint``s for one tokenizer and vocabulary width on a thread pool (see the module
    docstring). Thread-safe; ``shutdown`` when the engine stops."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, limits: StructuredOutputLimits = DEFAULT_LIMITS,
                 max_workers: int = 2, compile_threads: int = 1, cache_limit_bytes: int = 256 << 20,
                 cached_grammars: int = 256, max_whitespace: int | None = None) -> None:
        if max_workers < 1 or compile_threads < 1 or cached_grammars < 0:
            raise ValueError("max_workers and compile_threads must be >= 1 and cached_grammars >= 0, got "
                             f"{max_workers}, {compile_threads}, {cached_grammars}")
        self.tokenizer_info = tokenizer_info
        self.limits = limits
        # Between JSON tokens: any whitespace, at most this many characters in a row (None: no bound); a bound
        # stops a model from padding with whitespace until max_tokens.
        self.max_whitespace = max_whitespace
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=compile_threads, cache_enabled=True,
                                             cache_limit_bytes=cache_limit_bytes)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._deadlines = _Deadlines()
        self._lock = threading.Lock()
        self._inflight: dict[tuple, _Job] = {}
        self._compiled: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._cached_grammars = cached_grammars
        self._closed = False

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                       **kwargs: Any) -> "GrammarCompiler":
        return cls(build_tokenizer_info(tokenizer, vocab_size, stop_token_ids=stop_token_ids), **kwargs)

    @property
    def vocab_size(self) -> int:
        """The logits width every mask covers."""
        return self.tokenizer_info.vocab_size

    @property
    def bitmask_width(self) -> int:
        return bitmask_width(self.vocab_size)

    # ------------------------------------------------------------------ submitting

    def submit(self, constraint: OutputConstraint) -> Future:
        """A future of the constraint's ``xgrammar.CompiledGrammar`` (or its ``StructuredOutputError``); resolved
        already when the grammar is cached. Cancelling the future abandons the wait (the compile goes on when others
        wait for it too)."""
        result: Future = Future()
        key, name = constraint.key, constraint.field
        start = None
        with self._lock:
            if self._closed:
                raise RuntimeError("GrammarCompiler is shut down")
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
            else:
                job = self._inflight.get(key)
                if job is None:
                    job = self._inflight[key] = _Job(constraint)
                    start = job
                job.waiters.append((result, name))
        if compiled is not None:
            result.set_result(compiled)
            return result
        limit = self.limits.compile_timeout_s
        self._deadlines.add(time.monotonic() + limit, result, lambda: GrammarCompileTimeout(
            name, f"did not compile within {limit:g} s; the limit (compile_timeout_s) is {limit:g}", limit))
        if start is not None:
            try:
                self._pool.submit(self._run, start)
            except RuntimeError:  # shut down meanwhile
                with self._lock:
                    self._inflight.pop(key, None)
                for future, _ in start.waiters:
                    future.cancel()
        return result

    def compile(self, constraint: OutputConstraint) -> xgr.CompiledGrammar:
        """Blocking: the compiled grammar or its ``StructuredOutputError``."""
        return self.submit(constraint).result()

    def shutdown(self, wait: bool = False) -> None:
        """Stop taking constraints; queued compiles are dropped, their futures cancelled."""
        with self._lock:
            self._closed = True
            jobs = list(self._inflight.values())
        self._deadlines.stop()
        self._pool.shutdown(wait=wait, cancel_futures=True)
        for job in jobs:
            for future, _ in job.waiters:
                future.cancel()

    def __enter__(self) -> "GrammarCompiler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the pool's side

    def _run(self, job: _Job) -> None:
        key = job.constraint.key
        with self._lock:
            if all(future.done() for future, _ in job.waiters):  # every waiter timed out or left while queued
                del self._inflight[key]
                return
        compiled: xgr.CompiledGrammar | None = None
        error: BaseException | None = None
        try:
            compiled = self._compile(job.constraint)
        except StructuredOutputError as exc:
            error = exc
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's refusals (and pydantic's, for tags)
            error = GrammarCompileError(job.constraint.field, f"could not be compiled: {_clean(exc)}")
        except BaseException as exc:  # noqa: BLE001 - an internal failure still ends the waiters, as itself
            error = exc
        with self._lock:
            del self._inflight[key]
            waiters = list(job.waiters)
            if compiled is not None and self._cached_grammars:
                self._compiled[key] = compiled
                while len(self._compiled) > self._cached_grammars:
                    self._compiled.popitem(last=False)
        for future, name in waiters:
            if compiled is not None:
                _resolve(future, compiled)
            elif isinstance(error, StructuredOutputError) and name != error.field:
                _fail(future, error.with_field(name))
            else:
                _fail(future, error)

    def _compile(self, constraint: OutputConstraint) -> xgr.CompiledGrammar:
        kind, spec = constraint.kind, constraint.spec
        whitespace = {"any_whitespace": constraint.any_whitespace}
        if constraint.any_whitespace and self.max_whitespace is not None:
            whitespace["max_whitespace_cnt"] = self.max_whitespace
        if kind is ConstraintKind.JSON:
            check_schema_features(json.loads(spec), constraint.field)
            return self._compiler.compile_json_schema(spec, strict_mode=True, **whitespace)
        if kind is ConstraintKind.JSON_OBJECT:  # any object: properties not listed are allowed
            return self._compiler.compile_json_schema('{"type":"object"}', strict_mode=False, **whitespace)
        if kind is ConstraintKind.REGEX:
            return self._compiler.compile_regex(spec)
        if kind is ConstraintKind.CHOICE:
            return self._compiler.compile_grammar(choice_grammar(spec))
        if kind is ConstraintKind.GRAMMAR:
            return self._compiler.compile_grammar(spec)
        for schema in _embedded_schemas(json.loads(spec)):
            check_schema_features(schema, constraint.field)
        return self._compiler.compile_structural_tag(spec)
