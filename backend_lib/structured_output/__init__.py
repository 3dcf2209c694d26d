"""Structured output: a request's output constrained to a JSON schema, any JSON object, a regex, a list of choices,
an EBNF grammar or an xgrammar structural tag, and the OpenAI tool-call machinery built on it.

This package owns, and only owns:

- ``constraints``: what a request asks for (``OutputConstraint``), parsed from the request fields (vLLM's
  ``structured_outputs`` object and the older ``guided_*`` fields), checked against the server's limits
  (``StructuredOutputLimits``); the typed refusals (ValueError subclasses naming the field). No xgrammar import.
- ``grammar_compiler``: the xgrammar ``TokenizerInfo`` built from our tokenizer at the model's padded logits width,
  and compilation of constraints on a thread pool (cache, time limit, errors naming the field).
- ``matcher``: one request's grammar state (``GrammarMatcher``): its row of the step's shared bitmask, accepted
  tokens, rollback of rejected speculative tokens, draft validation, release.
- ``tool_choice``: OpenAI ``tools`` without the engine: the JSON schemas that force ``tool_choice="required"`` /
  a named function, and the calls read back from such an output;
- ``tool_parser_base`` and ``tool_calls``: parsers (complete and streaming) of a model's own tool-call text, one per
  chat template family.

Applying the bitmask to logits is ``kernels/grammar_mask.py``. The engine uses this package through
``core/grammar.py`` (a request's compile and matcher), ``worker/grammar_bitmask.py`` (the step's bitmask) and the
one sampling core (``worker/sampler.py``); the intake parses constraints with ``constraints.py`` and the OpenAI front
(``frontend/openai/tools.py``) builds tool calls with ``tool_choice`` and the parsers.
"""
