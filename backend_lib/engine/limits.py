"""Checks of one request against the server's limits (RequestLimits, max_model_len), before any work is done.

Each refusal is a ValueError (INVALID_ARG) naming the request field, what it holds and the limit, so a client
knows what to change. They run before tokenization where they can: a huge prompt must not cost a tokenizer pass
on the way to its refusal.
"""
from __future__ import annotations

from typing import Any

from backend_lib.core.config import RequestLimits
from backend_lib.core.sampling_params import SamplingParams


def _chars(value: Any) -> int:
    """Characters of every string in a JSON-like value (keys included); other scalars count one. Iterative: a
    deeply nested value must not exhaust the stack."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        else:
            total += 1
    return total


def check_prompt(limits: RequestLimits, prompt: Any, max_model_len: int) -> None:
    """text_input characters, input_ids length (max_input_ids, or max_model_len when that is 0), messages count
    and size."""
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise ValueError(f"text_input has {len(prompt)} characters; the limit (max_prompt_chars) is "
                             f"{limits.max_prompt_chars}")
        return
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return  # the engine's tokenize names the problem
    if isinstance(prompt[0], dict):
        if len(prompt) > limits.max_messages:
            raise ValueError(f"messages has {len(prompt)} messages; the limit (max_messages) is {limits.max_messages}")
        size = _chars(prompt)
        if size > limits.max_messages_chars:
            raise ValueError(f"messages has {size} characters; the limit (max_messages_chars) is "
                             f"{limits.max_messages_chars}")
    elif limits.max_input_ids and len(prompt) > limits.max_input_ids:
        raise ValueError(f"input_ids has {len(prompt)} tokens; the limit (max_input_ids) is {limits.max_input_ids}")
    else:
        _check_room(len(prompt), max_model_len, "")


def _check_room(num_prompt_tokens: int, max_model_len: int, what: str) -> None:
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens{what}; max_model_len is {max_model_len}, which "
                         "must leave room for at least one new token")


def check_params(limits: RequestLimits, params: SamplingParams, vocab_size: int) -> None:
    """Stop strings (count, length), stop_token_ids (count), logit_bias (count, ids within the vocabulary),
    logprobs and prompt_logprobs (top-n, also within the vocabulary)."""
    if len(params.stop) > limits.max_stop_strings:
        raise ValueError(f"stop has {len(params.stop)} strings; the limit (max_stop_strings) is "
                         f"{limits.max_stop_strings}")
    longest = max(params.stop, key=len, default="")
    if len(longest) > limits.max_stop_string_chars:
        raise ValueError(f"stop has a string of {len(longest)} characters; the limit (max_stop_string_chars) is "
                         f"{limits.max_stop_string_chars}")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} ids; the limit (max_stop_token_ids) is "
                         f"{limits.max_stop_token_ids}")
    if len(params.logit_bias) > limits.max_logit_bias:
        raise ValueError(f"logit_bias has {len(params.logit_bias)} entries; the limit (max_logit_bias) is "
                         f"{limits.max_logit_bias}")
    beyond = [token for token in params.logit_bias if token >= vocab_size]
    if beyond:
        raise ValueError(f"logit_bias has token id {beyond[0]}, outside the vocabulary (size {vocab_size})")
    top_n = min(limits.max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > top_n:
            raise ValueError(f"{name} must be in [0, {top_n}] (max_logprobs {limits.max_logprobs}, vocabulary "
                             f"{vocab_size}), got {value}")


def check_context(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, what: str = "") -> None:
    """The prompt (``what`` says if a session's history is in it) must leave room for one new token, and for
    max_tokens when the client set it; an unset max_tokens is cut where max_model_len ends the request."""
    _check_room(num_prompt_tokens, max_model_len, what)
    if params.max_tokens_set and num_prompt_tokens + params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens is {params.max_tokens}, but the prompt has {num_prompt_tokens} tokens{what} "
                         f"and max_model_len is {max_model_len}: at most {max_model_len - num_prompt_tokens} new "
                         "tokens fit; lower max_tokens or shorten the prompt")
