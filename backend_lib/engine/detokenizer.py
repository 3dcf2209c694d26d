"""Streaming text: an incremental detokenizer that never emits half a character, and a stop-string matcher.

Both are per-request, host-side and torch-free; the engine feeds them each step's new tokens / text.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend_lib.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens of the prompt decoded as context for the first output token: enough for a SentencePiece decoder to
# see the word boundary and for a byte-level decoder to start on a whole character.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    Decoding token by token breaks characters that span tokens (byte-level BPE, byte fallback) and drops the
    word-boundary space SentencePiece decoders strip from the first token. So each step decodes a short window
    ``ids[prefix_offset:]`` and emits only what it adds past ``ids[prefix_offset:read_offset]``; while the window
    ends in U+FFFD (an incomplete character) the text is held back and the window grows until it completes.

    A request that ends on a stop token (EOS, one of ``stop_token_ids``, the token a grammar ends on) keeps the
    token's id but not its text, unless ``include_stop_str_in_output``: vLLM's rule (v1
    ``IncrementalDetokenizer.update(..., stop_terminated)``), which matters with ``skip_special_tokens`` false
    (the text would end in "<|im_end|>") and for stop ids of plain tokens.
    """

    def __init__(self, tokenizer: "Tokenizer", prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids)
        self._read_offset = len(self._ids)  # ids before this have been emitted
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)  # start of the decode window
        self.output_text = ""

    def add(self, token_ids: list[int], stop_terminated: bool = False) -> str:
        """Append new tokens; return the text they complete (possibly ""). ``stop_terminated``: the last of
        ``token_ids`` is the stop token that ends the request, whose text is left out (see the class)."""
        if stop_terminated and token_ids and not self._include_stop:
            token_ids = token_ids[:-1]
        self._ids.extend(token_ids)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or the last character is still incomplete
        delta = window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At finish: whatever is still held back (an incomplete character decodes to U+FFFD here)."""
        prefix_text, window_text = self._decode_window()
        delta = window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        prefix_len = self._read_offset - self._prefix_offset
        return (decode(window[:prefix_len], skip_special_tokens=self._skip_special_tokens),
                decode(window, skip_special_tokens=self._skip_special_tokens))


class StopStringMatcher:
    """Cuts streamed text at the first stop string, even when the stop spans several deltas.

    Text that could still be the start of a stop string (the longest tail that is a proper prefix of some stop)
    is held back until the next delta decides it. The first match is the stop that completes earliest in the
    text (ties: the one starting earliest), which is what feeding one character at a time would find, so the
    result does not depend on how the text was chunked. After a match, nothing more is emitted.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        for index, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty str, got stops[{index}]={stop!r}")
        self._stops = list(dict.fromkeys(stops))
        self._include = include_stop_str_in_output
        self._prefixes = {stop[:n] for stop in self._stops for n in range(1, len(stop))}
        self._max_hold = max((len(stop) - 1 for stop in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string if one matched in this call)."""
        if self.matched is not None:
            return "", None
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            return text[:start] + (stop if self._include else ""), stop
        hold = self._hold_length(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], None

    def flush(self) -> str:
        """At finish without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _hold_length(self, text: str) -> int:
        for length in range(min(len(text), self._max_hold), 0, -1):
            if text[len(text) - length:] in self._prefixes:
                return length
        return 0
