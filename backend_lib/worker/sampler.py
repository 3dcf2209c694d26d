"""The fused sampler: one call turns a step's logits into token ids (and logprobs when asked).

The host builds ``SamplingMetadata`` once per step (one tensor per field, one host->device copy each)
and computes flags that pick the ops to run, so the device path has no syncs and no data-dependent
shapes. Order, as in vLLM v1: raw logits -> logprobs (raw) ; logit_bias -> penalties -> min_tokens block ->
temperature -> min-p -> top-k / top-p -> greedy argmax or seeded Gumbel-max.

Rows never interact: the filters are per row and the noise of a token depends only on (seed, output
position, vocabulary index), so a seeded request draws the same tokens whatever batch it runs in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.core.sampling_params import SamplingParams
from kernels import sampling as ops


@dataclass
class SamplingRow:
    """One request that samples a token this step (the model runner makes one per sampling chunk)."""

    params: SamplingParams
    seed: int
    output_position: int  # index in the request's output of the token being sampled
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    is_greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor | None  # [B] int64, vocab_size = off; None when no row uses top-k
    top_p: torch.Tensor | None  # [B] float32, 1 = off; None when no row uses top-p
    min_p: torch.Tensor | None  # [B] float32, 0 = off; None when no row uses min-p
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    repetition_penalty: torch.Tensor | None  # [B] float32; the four penalty fields are None unless any_penalty
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt (repetition penalty rows only)
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far
    blocked: torch.Tensor | None  # [B, V] bool: eos / stop ids of rows still below min_tokens
    logit_bias: torch.Tensor | None  # [B, V] float32: each row's logit_bias (zeros elsewhere); None when no row has one
    num_logprobs: list[int | None]  # host: per-row top-n request (None = no logprobs)
    # Host flags: constants for a compiled region.
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    any_min_tokens: bool
    max_num_logprobs: int | None  # None when no row asked for logprobs

    @property
    def any_filter(self) -> bool:
        return self.any_top_k or self.any_top_p or self.any_min_p

    @property
    def processes_logits(self) -> bool:
        """Some row's logits change before sampling (logit_bias, penalties, min_tokens): process_logits runs."""
        return self.logit_bias is not None or self.any_penalty or self.any_min_tokens

    @property
    def raw_greedy(self) -> bool:
        """Every row's token is the raw logits' argmax."""
        return self.all_greedy and not self.processes_logits

    @property
    def plain_greedy(self) -> bool:
        """Every row's token is the raw logits' argmax and nothing else is asked of them (no logprobs)."""
        return self.raw_greedy and self.max_num_logprobs is None

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> "SamplingMetadata":
        if not rows:
            raise ValueError("SamplingMetadata.build needs at least one row, got 0")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        # Greedy rows skip filters: every filter keeps the top token, so argmax is unchanged.
        top_k = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        any_top_k = any(k < vocab_size for k in top_k)
        any_top_p = any(p < 1.0 for p in top_p)
        any_min_p = any(p > 0.0 for p in min_p)
        any_penalty = any(_has_penalty(p) for p in params)
        logprob_counts = [p.logprobs for p in params]
        requested = [n for n in logprob_counts if n is not None]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        prompt_mask = output_counts = None
        if any_penalty:
            prompt_mask, output_counts = _penalty_tensors(rows, vocab_size, device)
        blocked = _min_tokens_mask(rows, vocab_size, device)
        logit_bias = _logit_bias(rows, vocab_size, device)
        return cls(
            temperature=floats([p.temperature for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=longs(top_k) if any_top_k else None,
            top_p=floats(top_p) if any_top_p else None,
            min_p=floats(min_p) if any_min_p else None,
            seeds=longs([_check_seed(r.seed) for r in rows]),
            positions=longs([_check_position(r.output_position) for r in rows]),
            repetition_penalty=floats([p.repetition_penalty for p in params]) if any_penalty else None,
            presence_penalty=floats([p.presence_penalty for p in params]) if any_penalty else None,
            frequency_penalty=floats([p.frequency_penalty for p in params]) if any_penalty else None,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            blocked=blocked,
            logit_bias=logit_bias,
            num_logprobs=logprob_counts,
            all_greedy=all(greedy),
            any_top_k=any_top_k,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
            any_penalty=any_penalty,
            any_min_tokens=blocked is not None,
            max_num_logprobs=max(requested) if requested else None,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: sampled token under the raw model distribution; None unless asked
    top_ids: torch.Tensor | None  # [B, n] int64, best first, n = max_num_logprobs; None when n is 0 or unset
    top_logprobs: torch.Tensor | None  # [B, n] float32


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32 raw model logits of the rows in ``meta``."""
        logits = logits.to(torch.float32)
        if meta.raw_greedy:
            token_ids = ops.row_argmax(logits)  # greedy fast path: no sort, no noise
        else:
            token_ids = self._sample(logits, meta)
        return self._with_logprobs(logits, token_ids, meta)

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logit_bias, penalties and min_tokens blocking on raw logits -> [B, V] float32 (no temperature)."""
        if meta.logit_bias is not None:
            logits = logits + meta.logit_bias
        if meta.any_penalty:
            logits = ops.apply_penalties(logits, meta.prompt_mask, meta.output_counts, meta.repetition_penalty,
                                         meta.presence_penalty, meta.frequency_penalty)
        if meta.any_min_tokens:
            logits = ops.apply_blocked_tokens(logits, meta.blocked)
        return logits

    def filtered_logits(self, processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, then min-p, then top-k / top-p -> [B, V] float32 whose softmax is the sampling
        distribution of the random rows (greedy rows are left unscaled and unfiltered)."""
        scaled = ops.apply_temperature(processed, meta.temperature)
        if meta.any_min_p:
            scaled = ops.apply_min_p(scaled, meta.min_p)
        return ops.apply_top_k_top_p(scaled, meta.top_k, meta.top_p, meta.any_top_k, meta.any_top_p)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        processed = self.process_logits(logits, meta)
        greedy_ids = ops.row_argmax(processed)
        if meta.all_greedy:
            return greedy_ids
        random_ids = ops.gumbel_argmax(self.filtered_logits(processed, meta), meta.seeds, meta.positions)
        return torch.where(meta.is_greedy, greedy_ids, random_ids)

    def _with_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_ids=None, top_logprobs=None)
        sampled, top_ids, top_lp = ops.compute_logprobs(logits, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=sampled, top_ids=top_ids, top_logprobs=top_lp)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _check_seed(seed: int) -> int:
    if not 0 <= seed < 2**31:
        raise ValueError(f"SamplingRow.seed must be in [0, {2**31 - 1}], got {seed}")
    return seed


def _check_position(position: int) -> int:
    if position < 0:
        raise ValueError(f"SamplingRow.output_position must be >= 0, got {position}")
    return position


def _check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    for tok in ids:
        if not 0 <= tok < vocab_size:
            raise ValueError(f"{what} must be in [0, {vocab_size - 1}] (the vocabulary), got {tok}")


def _penalty_tensors(rows: list[SamplingRow], vocab_size: int,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-built prompt mask [B, V] bool and output counts [B, V] float32, for penalized rows only."""
    prompt_flat: list[int] = []
    output_flat: list[int] = []
    for b, row in enumerate(rows):
        if not _has_penalty(row.params):
            continue  # neutral penalties leave logits unchanged: no need to count
        base = b * vocab_size
        if row.params.repetition_penalty != 1.0:
            _check_ids(row.prompt_token_ids, vocab_size, "prompt token id")
            prompt_flat.extend(base + t for t in row.prompt_token_ids)
        _check_ids(row.output_token_ids, vocab_size, "output token id")
        output_flat.extend(base + t for t in row.output_token_ids)
    batch = len(rows)
    prompt_mask = torch.zeros(batch * vocab_size, dtype=torch.bool)
    prompt_mask[torch.tensor(prompt_flat, dtype=torch.int64)] = True
    counts = torch.zeros(batch * vocab_size, dtype=torch.float32)
    counts.index_add_(0, torch.tensor(output_flat, dtype=torch.int64), torch.ones(len(output_flat)))
    return (prompt_mask.view(batch, vocab_size).to(device), counts.view(batch, vocab_size).to(device))


def _min_tokens_mask(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """[B, V] bool: stop ids (and eos unless ignore_eos) of rows whose token is below min_tokens."""
    flat: list[int] = []
    for b, row in enumerate(rows):
        p = row.params
        if row.output_position >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
        _check_ids(sorted(stops), vocab_size, "stop / eos token id")
        flat.extend(b * vocab_size + t for t in stops)
    if not flat:
        return None
    mask = torch.zeros(len(rows) * vocab_size, dtype=torch.bool)
    mask[torch.tensor(flat, dtype=torch.int64)] = True
    return mask.view(len(rows), vocab_size).to(device)


def _logit_bias(rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """[B, V] float32: each row's logit_bias at its ids, zeros elsewhere; None when no row has one."""
    flat: list[int] = []
    values: list[float] = []
    for b, row in enumerate(rows):
        bias = row.params.logit_bias
        if not bias:
            continue
        _check_ids(list(bias), vocab_size, "logit_bias token id")
        flat.extend(b * vocab_size + t for t in bias)
        values.extend(bias.values())
    if not flat:
        return None
    dense = torch.zeros(len(rows) * vocab_size, dtype=torch.float32)
    dense[torch.tensor(flat, dtype=torch.int64)] = torch.tensor(values, dtype=torch.float32)
    return dense.view(len(rows), vocab_size).to(device)
