"""Engine outputs -> Triton response tensors: ``DeltaCoalescer`` (when a request's waiting deltas become a
response) and ``ResponseEncoder`` (a request's ``RequestOutput`` deltas -> the output tensors it asked for, vLLM's
logprobs layout). Triton-free, like the rest of the codec: model.py only moves the arrays."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from backend_lib.core.outputs import PromptLogprobs, RequestOutput, TokenLogprob

if TYPE_CHECKING:
    from backend_lib.frontend.triton.codec import DecodedRequest


def _logprob_entry(item: TokenLogprob, decode_token: Callable[[int], str] | None) -> dict[str, dict[str, Any]]:
    """{token_id: {logprob, rank, decoded_token}}: the token itself first, then its top-n."""
    ranked = {token_id: (rank, lp) for rank, (token_id, lp) in enumerate(item.top, start=1)}
    entry = {}
    own_rank = ranked.get(item.token_id, (None, item.logprob))[0]
    for token_id, (rank, lp) in [(item.token_id, (own_rank, item.logprob))] + list(ranked.items()):
        entry[str(token_id)] = {"logprob": lp, "rank": rank,
                                "decoded_token": decode_token(token_id) if decode_token else None}
    return entry


def _logprobs_json(logprobs: list[TokenLogprob] | None, decode_token: Callable[[int], str] | None) -> bytes:
    """vLLM's per-token layout: [{token_id: {logprob, rank, decoded_token}}, ...] (sampled token + top-n)."""
    if logprobs is None:
        return b"null"
    return json.dumps([_logprob_entry(item, decode_token) for item in logprobs]).encode("utf-8")


def _prompt_logprobs_json(prompt: PromptLogprobs, decode_token: Callable[[int], str] | None) -> bytes:
    """The logprobs layout over the prompt's tokens; the first has nothing that predicts it: its logprob and rank
    are null (vLLM puts a bare null there; the entry keeps the token and its text, which OpenAI's echo shows)."""
    first = {str(prompt.first_token_id): {"logprob": None, "rank": None, "decoded_token":
                                          decode_token(prompt.first_token_id) if decode_token else None}}
    entries = [first] + [_logprob_entry(item, decode_token) for item in prompt.entries]
    return json.dumps(entries).encode("utf-8")


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one: the text, ids and logprobs joined, the rest from the last.

    Under load the response thread finds several steps' deltas waiting per request; one response for all of
    them costs the stub, Triton and the client one round instead of several (the streamed text is the same)."""
    if len(outputs) == 1:
        return outputs[0]
    logprobs = [lp for o in outputs for lp in (o.new_logprobs or [])]
    return replace(outputs[-1], new_token_ids=[t for o in outputs for t in o.new_token_ids],
                   new_text="".join(o.new_text for o in outputs),
                   new_logprobs=logprobs if any(o.new_logprobs is not None for o in outputs) else None,
                   prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None))


class DeltaCoalescer:
    """Decides when one request's waiting deltas become a response: the first token at once and alone (time to
    first token is not delayed, and a stream always has it as its own response), the final output at once, the
    rest once ``interval`` new tokens are waiting. ``push`` returns one response per call: a caller that got
    one calls again (with no new outputs) for what is still held."""

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self._held: list[RequestOutput] = []
        self._sent_tokens = False

    def push(self, outputs: list[RequestOutput], flush: bool = False) -> RequestOutput | None:
        """Add the deltas that arrived; returns what to send now, coalesced, or None to hold them."""
        held = self._held + outputs
        if not held:
            return None
        if not self._sent_tokens and not flush:
            # The first token goes alone, even when later deltas already wait: it is the client's first token.
            first = next((i for i, o in enumerate(held) if o.new_token_ids), None)
            if first is not None and first + 1 < len(held):
                self._held = held[first + 1:]
                self._sent_tokens = True
                return coalesce(held[:first + 1])
        tokens = sum(len(o.new_token_ids) for o in held)
        if not (flush or held[-1].finished) and self._sent_tokens and tokens < self.interval:
            self._held = held
            return None
        self._held = []
        self._sent_tokens = self._sent_tokens or tokens > 0
        return coalesce(held)


class ResponseEncoder:
    """Turns one request's stream of RequestOutput deltas into response tensors.

    Streaming: one response per delta carrying only the new text (empty non-final deltas are skipped).
    Non-streaming: the deltas are gathered and one response with the whole text is produced at the end.
    ``encode`` returns ``None`` when nothing is to be sent for this output.
    """

    def __init__(self, request: DecodedRequest, decode_token: Callable[[int], str] | None = None,
                 decode_ids: Callable[[list[int]], str] | None = None) -> None:
        self._request = request
        self._decode_token = decode_token
        self._decode_ids = decode_ids  # an input_ids prompt's text, when the output repeats the prompt
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._prompt_logprobs: PromptLogprobs | None = None

    def encode(self, output: RequestOutput) -> dict[str, np.ndarray] | None:
        if self._request.stream:
            if not (output.finished or output.new_token_ids or output.new_text):
                return None
            return self._tensors(output, output.new_text, output.new_token_ids, output.new_logprobs,
                                 output.prompt_logprobs)
        self._text.append(output.new_text)
        self._ids.extend(output.new_token_ids)
        if output.new_logprobs is not None:
            self._logprobs = (self._logprobs or []) + list(output.new_logprobs)
        self._prompt_logprobs = self._prompt_logprobs or output.prompt_logprobs
        if not output.finished:
            return None
        prompt_ids = self._request.prepend_ids
        prompt_text = self._decode_ids(prompt_ids) if prompt_ids and self._decode_ids else self._request.prepend_text
        return self._tensors(output, prompt_text + "".join(self._text), self._ids, self._logprobs,
                             self._prompt_logprobs)

    def _tensors(self, output: RequestOutput, text: str, ids: list[int], logprobs: list[TokenLogprob] | None,
                 prompt_logprobs: PromptLogprobs | None) -> dict[str, np.ndarray]:
        options = self._request.options
        tensors = {}
        if options.sends("text_output"):
            tensors["text_output"] = np.array([text.encode("utf-8")], dtype=np.object_)
        if options.sends("output_ids"):
            tensors["output_ids"] = np.array(ids, dtype=np.int32)
        if options.sends("finish_reason"):
            # str(None) for unfinished deltas, as the vLLM backend sends.
            tensors["finish_reason"] = np.array([str(output.finish_reason).encode("utf-8")], dtype=np.object_)
        if options.sends("cumulative_logprob"):
            tensors["cumulative_logprob"] = np.array([output.cumulative_logprob], dtype=np.float32)
        if options.sends("logprobs"):
            wanted = self._request.params.logprobs is not None
            tensors["logprobs"] = np.array([_logprobs_json(logprobs if wanted else None, self._decode_token)],
                                           dtype=np.object_)
        if prompt_logprobs is not None and options.sends("prompt_logprobs"):
            tensors["prompt_logprobs"] = np.array([_prompt_logprobs_json(prompt_logprobs, self._decode_token)],
                                                  dtype=np.object_)
        if options.sends("num_input_tokens"):
            tensors["num_input_tokens"] = np.array([output.num_prompt_tokens], dtype=np.uint32)
        if options.sends("num_output_tokens"):
            tensors["num_output_tokens"] = np.array([len(ids)], dtype=np.uint32)
        return tensors
