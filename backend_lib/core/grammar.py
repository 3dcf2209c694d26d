"""A constrained request's grammar as the scheduler sees it: the compile in flight, then one matcher while the request
runs. No torch, no xgrammar: the engine hands in the compile's future and the function that builds a matcher
(``backend_lib.structured_output.matcher.GrammarMatcher``), so the scheduler only calls the few methods below.

Life: ``LLMEngine`` submits the constraint when it prepares the request (``GrammarCompiler.submit``, a thread pool);
the request waits in ``RequestStatus.WAITING_FOR_GRAMMAR`` until the future is done, and other requests run
meanwhile. At admission the scheduler fails a request whose compile failed or timed out (``error``: the refusal
names the request field) or builds its matcher (``start``: a request back from preemption re-accepts its output
ids). The matcher is released on finish, abort and preemption (``release``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from backend_lib.structured_output.constraints import OutputConstraint, StructuredOutputError


class Matcher(Protocol):
    """What the scheduler and the runner use of ``GrammarMatcher``."""

    def accept_token(self, token_id: int) -> bool: ...

    def accept_tokens(self, token_ids: Sequence[int]) -> int: ...

    def validate_draft(self, draft: Sequence[int]) -> int: ...

    def is_terminated(self) -> bool: ...

    def release(self) -> None: ...


@dataclass
class RequestGrammar:
    constraint: OutputConstraint
    future: Future  # -> the compiled grammar, or a StructuredOutputError naming the field
    new_matcher: Callable[[Any], Matcher]  # compiled grammar -> a fresh matcher
    matcher: Matcher | None = None  # while the request runs

    @property
    def ready(self) -> bool:
        return self.future.done()

    def failure(self) -> tuple[str, bool] | None:
        """Once ready: None when the grammar compiled, else (message, refused): ``refused`` when the request's
        constraint was at fault (a StructuredOutputError: INVALID_ARG), False for an internal failure."""
        if self.future.cancelled():
            return f"{self.constraint.field} was not compiled: the compile was cancelled", False
        error = self.future.exception()
        if error is None:
            return None
        if isinstance(error, StructuredOutputError):
            return str(error), True
        return f"{self.constraint.field} could not be compiled: internal error: {type(error).__name__}: {error}", False

    def start(self, output_token_ids: Sequence[int]) -> None:
        """Build the matcher (the grammar is ready and compiled) and advance it by the tokens already generated (a
        request back from preemption)."""
        matcher = self.new_matcher(self.future.result())
        accepted = matcher.accept_tokens(output_token_ids)
        if accepted != len(output_token_ids):
            matcher.release()
            raise RuntimeError(f"the grammar refuses output token {output_token_ids[accepted]} at {accepted}, which "
                               "it had accepted before preemption")
        self.matcher = matcher

    def advance(self, token: int) -> str | None:
        """The running matcher takes an emitted token: None, "terminated" (the grammar ended the output: "stop")
        or "refused" (the mask forbade the token: an engine bug)."""
        if self.matcher is None:
            return None
        if not self.matcher.accept_token(token):
            return "refused"
        return "terminated" if self.matcher.is_terminated() else None

    def cut(self, drafts: list[int]) -> list[int]:
        """``drafts`` up to the first token the grammar refuses: verification never sees one."""
        if self.matcher is None or not drafts:
            return drafts
        return drafts[:self.matcher.validate_draft(drafts)]

    def release(self) -> None:
        """Drop the matcher (finish, abort, preemption) and abandon a compile still in flight; idempotent."""
        if self.matcher is not None:
            self.matcher.release()
            self.matcher = None
        if not self.future.done():
            self.future.cancel()
