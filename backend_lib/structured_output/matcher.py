"""One request's grammar state around xgrammar's ``GrammarMatcher``.

A step shares one bitmask ``[rows, ceil(V/32)] int32`` (``allocate_bitmask``; V = the model's padded logits width):
each constrained row's matcher fills its row (``fill_bitmask``), free rows stay all ones (``fill_bitmask_rows``
does both). After sampling, the matcher accepts the row's token; a token it refuses is an engine bug (the mask
forbade it). Speculative decoding: ``validate_draft`` says how many leading draft tokens the grammar accepts (the
draft is cut there before verification), ``fill_draft_bitmasks`` gives the verified positions their masks, the
matcher advances by the accepted tokens only, and ``rollback`` undoes at most ``max_rollback_tokens`` of them (the
number of speculative tokens). ``release`` drops the xgrammar state when the request finishes, is preempted or is
cancelled; a released matcher refuses every call.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from kernels.grammar_mask import FULL_WORD, bitmask_width


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A step's shared bitmask, every token allowed: [rows, ceil(vocab_size / 32)] int32 on the host."""
    return torch.full((rows, bitmask_width(vocab_size)), FULL_WORD, dtype=torch.int32)


class GrammarMatcher:
    """Grammar state of one request (not thread-safe: the step loop owns it)."""

    def __init__(self, compiled: xgr.CompiledGrammar, *, max_rollback_tokens: int = 0,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        """``stop_token_ids``: the tokens that end the output once the grammar is complete (default: the
        tokenizer info's)."""
        if max_rollback_tokens < 0:
            raise ValueError(f"max_rollback_tokens must be >= 0, got {max_rollback_tokens}")
        override = [int(i) for i in stop_token_ids] if stop_token_ids else None
        self._matcher: xgr.GrammarMatcher | None = xgr.GrammarMatcher(compiled, override_stop_tokens=override)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self.bitmask_width = bitmask_width(self.vocab_size)
        self.max_rollback_tokens = max_rollback_tokens
        self.stop_token_ids: tuple[int, ...] = tuple(self._matcher.stop_token_ids)
        self.num_accepted = 0  # tokens accepted and not rolled back
        self._rollbackable = 0  # of those, how many rollback may still undo

    # ------------------------------------------------------------------ state

    def _live(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            raise RuntimeError("this GrammarMatcher was released")
        return self._matcher

    @property
    def released(self) -> bool:
        return self._matcher is None

    def is_terminated(self) -> bool:
        """A stop token was accepted after the grammar completed: the output is finished."""
        return self._live().is_terminated()

    def is_completed(self) -> bool:
        """The tokens so far form a complete string of the grammar (a stop token may now end the output)."""
        return self._live().is_completed()

    def release(self) -> None:
        """Free the xgrammar state; idempotent."""
        self._matcher = None

    # ------------------------------------------------------------------ masks

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of the shared host bitmask := the tokens allowed next. Words past this grammar's vocabulary
        (a wider mask) are cleared; a terminated matcher allows only its stop tokens."""
        matcher = self._live()
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
            raise ValueError(f"bitmask must be a 2-D int32 host tensor, got {bitmask.dtype} {tuple(bitmask.shape)} "
                             f"on {bitmask.device}")
        width = bitmask.shape[1]
        if width < self.bitmask_width:
            raise ValueError(f"bitmask has {width} words per row; this grammar's vocabulary ({self.vocab_size}) needs "
                             f"{self.bitmask_width}")
        if matcher.is_terminated():
            bitmask[row].zero_()
            for token in self.stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
            return
        if width == self.bitmask_width:
            matcher.fill_next_token_bitmask(bitmask, row)
            return
        matcher.fill_next_token_bitmask(bitmask[row:row + 1, :self.bitmask_width], 0)
        bitmask[row, self.bitmask_width:] = 0

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, first_row: int, draft: Sequence[int]) -> None:
        """Rows ``first_row .. first_row + len(draft)``: the masks of a verification's positions (before each draft
        token, and for the bonus token after the last). ``draft`` must already be cut to what the grammar accepts
        (``validate_draft``). The matcher's state is unchanged."""
        matcher = self._live()
        self.fill_bitmask(bitmask, first_row)
        accepted = 0
        try:
            for offset, token in enumerate(draft, start=1):
                if not matcher.accept_token(int(token)):
                    raise ValueError(f"draft token {token} at {offset - 1} is not accepted by the grammar; cut the "
                                     "draft with validate_draft first")
                accepted += 1
                self.fill_bitmask(bitmask, first_row + offset)
        finally:
            if accepted:
                matcher.rollback(accepted)

    # ------------------------------------------------------------------ tokens

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled (or verified) token; False leaves the state unchanged."""
        if not self._live().accept_token(int(token_id)):
            return False
        self.num_accepted += 1
        self._rollbackable = min(self._rollbackable + 1, self.max_rollback_tokens)
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance token by token; stops at the first refused one. Returns how many were accepted."""
        count = 0
        for token in token_ids:
            if not self.accept_token(token):
                break
            count += 1
        return count

    def validate_draft(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar accepts from the current state (a stop token may be
        the last of them); the state is unchanged."""
        matcher = self._live()
        count = 0
        for token in draft:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            count += 1
        if count:
            matcher.rollback(count)
        return count

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens): at most
        ``max_rollback_tokens`` since the last rollback window began."""
        matcher = self._live()
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:
            return
        if num_tokens > self._rollbackable:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._rollbackable} may be (max_rollback_tokens "
                             f"{self.max_rollback_tokens}, {self.num_accepted} accepted)")
        matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens
        self._rollbackable -= num_tokens


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word as a Python int in int32 range (bit 31 is the sign bit)."""
    return (1 << index) - (1 << 32 if index == 31 else 0)


def fill_bitmask_rows(bitmask: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> list[int]:
    """Row i := ``matchers[i]``'s next-token mask, or all ones where ``matchers[i]`` is None (a free row).
    Returns the constrained rows (the rows the sampler must mask)."""
    constrained = []
    for row, matcher in enumerate(matchers):
        if matcher is None:
            bitmask[row].fill_(FULL_WORD)
        else:
            matcher.fill_bitmask(bitmask, row)
            constrained.append(row)
    return constrained
