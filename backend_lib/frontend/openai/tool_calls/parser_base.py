"""What every tool-call parser (``tool_calls``) shares: the parse results, the complete and streaming parser bases
(one partial parse of the text so far, ``_snapshot``, which only ever extends what it returned before, so streamed
fragments concatenate to the complete parse), and the hold-back of a marker's possible prefix at the end of a
delta."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend_lib.frontend.openai.tool_calls.choice import ToolCall, new_call_id

# ---------------------------------------------------------------------------------------------- parse results


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str | None  # the text outside the calls, None when there is none (whitespace only)
    calls: tuple[ToolCall, ...]

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


@dataclass
class ToolCallDelta:
    """One entry of a chunk's ``delta.tool_calls`` (OpenAI's layout): the first for a call carries its id and
    name, later ones argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            entry["id"] = self.id
            entry["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        if function:
            entry["function"] = function
        return entry


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class _PartialCall:
    name: str | None  # None until the whole name has arrived
    arguments: str  # the arguments text so far (only ever extended)
    done: bool = False


@dataclass
class _Snapshot:
    content: str  # the content so far (only ever extended)
    calls: list[_PartialCall]


def _held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker (it may become one)."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


# ---------------------------------------------------------------------------------------------- parser base


class ToolCallParser:
    """Reads one chat template family's tool calls; subclasses give ``_snapshot``."""

    name = ""

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        self._make_id = make_id

    def _snapshot(self, text: str, final: bool) -> _Snapshot:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedToolCalls:
        snapshot = self._snapshot(text, final=True)
        calls = tuple(ToolCall(call.name, call.arguments, self._make_id())
                      for call in snapshot.calls if call.name is not None)
        content = snapshot.content if snapshot.content.strip() else None
        return ParsedToolCalls(content, calls)

    def streamer(self) -> "ToolCallStreamer":
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Text deltas -> ``StreamDelta``s for one output."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._calls_sent: list[int] = []  # per call announced: argument characters sent
        self.calls: list[ToolCallDelta] = []  # the first delta of each call announced (id, name)

    def feed(self, delta: str) -> StreamDelta:
        self._text += delta
        return self._emit(self._parser._snapshot(self._text, final=False))

    def finish(self) -> StreamDelta:
        return self._emit(self._parser._snapshot(self._text, final=True))

    def _emit(self, snapshot: _Snapshot) -> StreamDelta:
        out = StreamDelta(content=snapshot.content[self._content_sent:])
        self._content_sent = len(snapshot.content)
        for index, call in enumerate(snapshot.calls):
            if index == len(self._calls_sent):
                if call.name is None:
                    break  # calls are announced in order, each once its name is whole
                first = ToolCallDelta(index, id=self._parser._make_id(), name=call.name, arguments="")
                self.calls.append(first)
                self._calls_sent.append(0)
                out.tool_calls.append(first)
            fragment = call.arguments[self._calls_sent[index]:]
            if fragment:
                self._calls_sent[index] = len(call.arguments)
                if out.tool_calls and out.tool_calls[-1].index == index:
                    out.tool_calls[-1].arguments = (out.tool_calls[-1].arguments or "") + fragment
                else:
                    out.tool_calls.append(ToolCallDelta(index, arguments=fragment))
        return out
