"""Draft verification: one batched op over the target logits of every draft position of every request.

Layout. Request ``b`` proposes ``n_b`` drafts ``d_1 .. d_n`` (``n_b`` may differ per request, 0 included). The target
model ran on ``[t, d_1, .., d_n]``, giving ``n_b + 1`` logit rows: row ``j`` is the target distribution of the token at
output position ``o_b + j``; rows of a request are contiguous, requests in order (``sum(n_b + 1)`` rows in all).

Vocabulary of the output (vLLM v1's):
  * accepted token  - a draft the verifier keeps (row ``j`` accepts ``d_{j+1}``); acceptance stops at the first
    draft that is not accepted.
  * recovered token - emitted at the first rejected position instead of the draft, drawn from
    ``normalize(max(p - q, 0))``; for greedy rows it is the target argmax.
  * bonus token     - emitted after all ``n_b`` drafts were accepted, drawn from the last row's ``p`` (argmax for
    greedy rows): a step always emits ``accepted + 1`` tokens.
The output is ``[B, max_n + 1]`` int64: the accepted drafts, then the recovered or bonus token, then ``-1`` padding.

Rules. Greedy rows accept a draft while it equals the argmax of the processed logits. Sampled rows use the standard
rule (Leviathan et al. / Chen et al.): accept with probability ``min(1, p(d) / q(d))``, else emit a draw from
``normalize(max(p - q, 0))``; this leaves every emitted token distributed exactly as ``p``. Deterministic drafts
(n-gram, argmax MTP: ``q`` one-hot, ``draft_probs=None``) use the same rule through one coupled draw: ``x`` is the
seeded Gumbel-max sample from ``p`` at the row's (seed, output position) - the very token the plain sampler would draw
there - and the draft is accepted iff ``x == d``. Then ``P(accept) = p(d) = min(1, p(d)/q(d))`` and a rejected
position emits ``x``, distributed as ``p`` without ``d``, renormalized = ``normalize(max(p - q, 0))``. So with
deterministic drafts a seeded request emits the same tokens with or without speculation, whatever its batch.
With general ``q``, the acceptance uniform comes from the same counter hash keyed by ``seed ^ _ACCEPT_KEY`` and the
recovered draw is Gumbel-max over ``log(max(p - q, 0))`` at (seed, position): batch-invariant as well.

``p`` is the sampler's distribution: the grammar bitmask of structured-output rows (``apply_grammar_mask``; the
runner gives each verified position the mask of the grammar state after the drafts before it, and the scheduler cut
the drafts at the first token the grammar refuses), ``Sampler.process_logits`` (logit_bias, penalties, min_tokens) then
``filtered_logits`` (temperature, min-p, top-k / top-p), so spec decoding samples exactly what the plain sampler
samples. No host sync here; the caller reads the output once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.worker.sampler import Sampler, SamplingMetadata, apply_grammar_mask
from kernels import sampling as ops

_ACCEPT_KEY = 0x2545F491  # int32-safe key that separates the acceptance uniforms from the Gumbel noise


@dataclass
class DraftLayout:
    """Host-built indexing of the verification rows (one host->device copy per tensor)."""

    num_draft_tokens: list[int]  # host: n_b per request
    draft_token_ids: torch.Tensor  # [N] int64: row j of request b holds d_{j+1}; bonus rows hold 0
    is_draft_row: torch.Tensor  # [N] bool: False on each request's last (bonus) row
    row_index: torch.Tensor  # [B, max_n + 1] int64: row of (b, j), clamped to the request's last row
    slot_valid: torch.Tensor  # [B, max_n + 1] bool: j <= n_b

    @property
    def max_num_drafts(self) -> int:
        return max(self.num_draft_tokens, default=0)

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device | str) -> "DraftLayout":
        """``drafts[b]`` are request b's draft ids (possibly empty)."""
        if not drafts:
            raise ValueError("DraftLayout.build needs at least one request, got 0")
        counts = [len(d) for d in drafts]
        width = max(counts) + 1
        ids: list[int] = []
        is_draft: list[bool] = []
        index: list[list[int]] = []
        valid: list[list[bool]] = []
        for d in drafts:
            start = len(ids)
            ids += list(d) + [0]
            is_draft += [True] * len(d) + [False]
            index.append([start + min(j, len(d)) for j in range(width)])
            valid.append([j <= len(d) for j in range(width)])
        return cls(
            num_draft_tokens=counts,
            draft_token_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            is_draft_row=torch.tensor(is_draft, dtype=torch.bool, device=device),
            row_index=torch.tensor(index, dtype=torch.int64, device=device).view(len(drafts), width),
            slot_valid=torch.tensor(valid, dtype=torch.bool, device=device).view(len(drafts), width),
        )


@dataclass
class RejectionOutput:
    token_ids: torch.Tensor  # [B, max_n + 1] int64: accepted drafts, then recovered / bonus, then -1
    row_token_ids: torch.Tensor  # [N] int64: the token each row emits if reached (for logprobs)


def rejection_sample(target_logits: torch.Tensor,  # [N, V] raw target logits, one row per draft position + bonus
                     layout: DraftLayout,
                     meta: SamplingMetadata,  # N rows: row (b, j) has output position o_b + j
                     draft_probs: torch.Tensor | None = None,  # [N, V] q per draft row; None = one-hot drafts
                     sampler: Sampler | None = None) -> RejectionOutput:
    sampler = sampler or Sampler()
    logits = apply_grammar_mask(target_logits.to(torch.float32), meta)
    drafts = layout.draft_token_ids
    if meta.raw_greedy:
        return greedy_verify(ops.row_argmax(logits), layout)
    processed = sampler.process_logits(logits, meta)
    greedy = ops.row_argmax(processed)
    if meta.all_greedy:
        return greedy_verify(greedy, layout)
    if draft_probs is None:
        sampled = ops.gumbel_argmax(sampler.filtered_logits(processed, meta), meta.seeds, meta.positions)
        row_tokens = torch.where(meta.is_greedy, greedy, sampled)
        accept = (row_tokens == drafts) & layout.is_draft_row
    else:
        row_tokens, accept = _standard_rule(sampler.filtered_logits(processed, meta), greedy, draft_probs,
                                            layout, meta)
    return RejectionOutput(token_ids=_assemble(row_tokens, accept, layout), row_token_ids=row_tokens)


def greedy_verify(row_tokens: torch.Tensor,  # [N] int64: each row's greedy token (raw logits' argmax)
                  layout: DraftLayout) -> RejectionOutput:
    """The greedy rule from tokens already picked (the runner's screened head gives them without logits): a draft
    stands while it equals its row's token."""
    accept = (row_tokens == layout.draft_token_ids) & layout.is_draft_row
    return RejectionOutput(token_ids=_assemble(row_tokens, accept, layout), row_token_ids=row_tokens)


def _standard_rule(filtered: torch.Tensor,  # [N, V] temperature-scaled, filtered logits
                   greedy: torch.Tensor,  # [N] int64
                   draft_probs: torch.Tensor,  # [N, V]
                   layout: DraftLayout, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    drafts = layout.draft_token_ids
    p = torch.softmax(filtered, dim=-1)
    q = draft_probs.to(torch.float32) * layout.is_draft_row[:, None]  # bonus rows: q = 0, residual = p
    p_d = p.gather(1, drafts[:, None]).squeeze(1)
    q_d = q.gather(1, drafts[:, None]).squeeze(1)
    u = ops.seeded_uniform(meta.seeds ^ _ACCEPT_KEY, meta.positions, 1)[:, 0]
    accept = (u * q_d < p_d) & layout.is_draft_row  # u < p/q without dividing by q
    residual = torch.clamp(p - q, min=0.0)
    # p == q leaves no residual mass; rejection cannot happen then, but keep the draw well defined.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    recovered = ops.gumbel_argmax(torch.log(residual), meta.seeds, meta.positions)
    sampled = torch.where(accept, drafts, recovered)
    greedy_accept = (greedy == drafts) & layout.is_draft_row
    row_tokens = torch.where(meta.is_greedy, greedy, sampled)
    return row_tokens, torch.where(meta.is_greedy, greedy_accept, accept)


def _assemble(row_tokens: torch.Tensor, accept: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
    """[N] per-row tokens and accept flags -> [B, max_n + 1]: rows up to the first rejection, then -1."""
    accepted = accept[layout.row_index] & layout.slot_valid  # [B, W]
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1, keepdim=True)  # [B, 1]
    slots = torch.arange(layout.row_index.shape[1], device=row_tokens.device)[None, :]
    return torch.where(slots <= num_accepted, row_tokens[layout.row_index], torch.full_like(layout.row_index, -1))


def num_accepted(token_ids: torch.Tensor) -> torch.Tensor:
    """[B, W] rejection output -> [B] accepted drafts per request (emitted tokens minus one)."""
    return (token_ids >= 0).sum(dim=1) - 1


def rejection_sample_reference(p: list[torch.Tensor], q: list[torch.Tensor | None], drafts: list[int],
                               uniforms: list[float], generator: torch.Generator) -> list[int]:
    """The textbook rule for one request, row by row: p[j] / q[j] are [V] probabilities (q None = one-hot at the
    draft), p has one more row than drafts (the bonus row)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        qd = 1.0 if q[j] is None else float(q[j][d])
        if uniforms[j] * qd < float(p[j][d]):
            out.append(d)
            continue
        q_row = torch.zeros_like(p[j]) if q[j] is None else q[j]
        if q[j] is None:
            q_row[d] = 1.0
        residual = torch.clamp(p[j] - q_row, min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out
