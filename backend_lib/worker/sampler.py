"""The fused sampler: one call turns a step's logits into token ids (and logprobs when asked).

The host builds ``SamplingMetadata`` once per step (one tensor per field, one host->device copy each)
and computes flags that pick the ops to run, so the device path has no syncs and no data-dependent
shapes. Order, as in vLLM v1: grammar bitmask -> logits -> logprobs (raw) ; logit_bias -> penalties -> min_tokens
block -> temperature -> min-p -> top-k / top-p -> greedy argmax or seeded Gumbel-max.

``sample_tokens`` is the one sampling core: the eager ``Sampler`` calls it, and the compiled sampler region
(worker/compiled_sampler.py) traces it, with the flags as graph constants. Structured output: the runner fills
``SamplingMetadata.bitmask`` ([B, ceil(V/32)] int32, all ones on free rows) for the constrained rows; the core applies
it first (eagerly in place on those rows only, ``kernels.grammar_mask.apply_bitmask_inplace``; in a graph to every
row, ``apply_bitmask_static``), so the greedy argmax, the filters and the logprobs (as vLLM v1's, of the masked
logits) all see it. A batch without constrained rows has no bitmask and takes the unmasked path unchanged.

Rows never interact: the filters are per row and the noise of a token depends only on (seed, output
position, vocabulary index), so a seeded request draws the same tokens whatever batch it runs in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.core.sampling_params import SamplingParams
from kernels import sampling as ops
from kernels.grammar_mask import FULL_WORD, apply_bitmask_inplace, apply_bitmask_static


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
    temperature: torch.Tensor  # [B] float32 > 0 (a greedy row's is 1: is_greedy says it is greedy)
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
    # Structured output: [B, ceil(V/32)] int32 (all ones on free rows); None when no row is constrained.
    bitmask: torch.Tensor | None = None
    masked_rows: tuple[int, ...] = ()  # host: the constrained rows (the eager path masks only these)

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
        """Every row's token is the raw logits' argmax and nothing else is asked of them (no logprobs, no grammar
        mask): the screened greedy heads may give the tokens without the logits."""
        return self.raw_greedy and self.max_num_logprobs is None and self.bitmask is None

    @property
    def masked_greedy(self) -> bool:
        """Every row's token is the argmax of its raw logits under its grammar mask, and nothing else is asked of
        them: a screened greedy head that honours the mask may give the tokens without the logits."""
        return self.raw_greedy and self.max_num_logprobs is None and self.bitmask is not None

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    def padded(self, rows: int) -> "SamplingMetadata":
        """This batch grown to ``rows`` rows for a compiled region: padding rows are greedy, unfiltered, seed 0 and
        unmasked; only the fields a graph takes (no [B, V] side inputs)."""
        b = self.batch_size
        if rows == b:
            return self
        bitmask = None
        if self.bitmask is not None:
            bitmask = torch.cat([self.bitmask, self.bitmask.new_full((rows - b, self.bitmask.shape[1]), FULL_WORD)])
        return SamplingMetadata(
            temperature=_pad_1d(self.temperature, rows, 1.0), is_greedy=_pad_1d(self.is_greedy, rows, True),
            top_k=_pad_1d(self.top_k, rows, 2**31 - 1), top_p=_pad_1d(self.top_p, rows, 1.0),
            min_p=_pad_1d(self.min_p, rows, 0.0), seeds=_pad_1d(self.seeds, rows, 0),
            positions=_pad_1d(self.positions, rows, 0), repetition_penalty=None, presence_penalty=None,
            frequency_penalty=None, prompt_mask=None, output_counts=None, blocked=None, logit_bias=None,
            num_logprobs=self.num_logprobs + [None] * (rows - b), all_greedy=self.all_greedy,
            any_top_k=self.any_top_k, any_top_p=self.any_top_p, any_min_p=self.any_min_p, any_penalty=False,
            any_min_tokens=False, max_num_logprobs=None, bitmask=bitmask, masked_rows=self.masked_rows)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str,
              bitmask: torch.Tensor | None = None,  # [>= B, ceil(V/32)] int32 host: the step's grammar masks
              masked_rows: tuple[int, ...] = ()) -> "SamplingMetadata":
        if not rows:
            raise ValueError("SamplingMetadata.build needs at least one row, got 0")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        params = [r.params for r in rows]
        greedy = [p.is_greedy for p in params]
        # Greedy rows (SamplingParams.is_greedy, the one place that decides it) skip temperature and filters: every
        # filter keeps the top token, so argmax is unchanged.
        top_k = [vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
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
        # A grammar decides where a constrained output ends: min_tokens does not block its stop tokens (once the
        # grammar is complete they are all it allows).
        blocked = _min_tokens_mask(rows, vocab_size, device, frozenset(masked_rows))
        logit_bias = _logit_bias(rows, vocab_size, device)
        return cls(
            temperature=floats(temperature),
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
            bitmask=bitmask[:len(rows)].to(device) if masked_rows else None,
            masked_rows=tuple(masked_rows),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: sampled token under the raw model distribution; None unless asked
    top_ids: torch.Tensor | None  # [B, n] int64, best first, n = max_num_logprobs; None when n is 0 or unset
    top_logprobs: torch.Tensor | None  # [B, n] float32


def apply_grammar_mask(logits: torch.Tensor,  # [B, V] float32
                       meta: SamplingMetadata) -> torch.Tensor:  # [B, V] float32
    """The constrained rows keep only the tokens their grammar allows (-inf elsewhere); without a bitmask, ``logits``
    itself. Eagerly in place on the constrained rows only (the caller's logits are the step's own); in a compiled
    region out of place on every row (free rows carry all-ones words, which change nothing)."""
    if meta.bitmask is None:
        return logits
    if torch.compiler.is_compiling():
        return apply_bitmask_static(logits, meta.bitmask)
    return apply_bitmask_inplace(logits, meta.bitmask, list(meta.masked_rows))


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias, penalties and min_tokens blocking -> [B, V] float32 (no temperature)."""
    if meta.logit_bias is not None:
        logits = logits + meta.logit_bias
    if meta.any_penalty:
        logits = ops.apply_penalties(logits, meta.prompt_mask, meta.output_counts, meta.repetition_penalty,
                                     meta.presence_penalty, meta.frequency_penalty)
    if meta.any_min_tokens:
        logits = ops.apply_blocked_tokens(logits, meta.blocked)
    return logits


def filtered_logits(processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, then top-k / top-p -> [B, V] float32 whose softmax is the sampling distribution of
    the random rows (greedy rows are left unscaled and unfiltered)."""
    scaled = ops.apply_temperature(processed, meta.temperature)
    if meta.any_min_p:
        scaled = ops.apply_min_p(scaled, meta.min_p)
    return ops.apply_top_k_top_p(scaled, meta.top_k, meta.top_p, meta.any_top_k, meta.any_top_p)


def sample_tokens(logits: torch.Tensor,  # [B, V] float32, already masked (apply_grammar_mask)
                  meta: SamplingMetadata) -> torch.Tensor:  # [B] int64
    """The sampling core: the greedy fast path (no sort, no noise) when every row takes the raw argmax, else
    processing, the greedy argmax and the seeded Gumbel-max draw of the filtered distribution. The eager Sampler
    calls it; the compiled sampler region traces it (the flags are graph constants, so an all-greedy batch has no
    filter and no noise in its graph)."""
    if meta.raw_greedy:
        return ops.row_argmax(logits)
    processed = process_logits(logits, meta)
    greedy_ids = ops.row_argmax(processed)
    if meta.all_greedy:
        return greedy_ids
    random_ids = ops.gumbel_argmax(filtered_logits(processed, meta), meta.seeds, meta.positions)
    return torch.where(meta.is_greedy, greedy_ids, random_ids)


def masked_sample(logits: torch.Tensor,  # [B, V]
                  meta: SamplingMetadata) -> torch.Tensor:  # [B] int64
    """The grammar mask, then ``sample_tokens``: what a compiled sampler region traces."""
    return sample_tokens(apply_grammar_mask(logits.to(torch.float32), meta), meta)


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32 raw model logits of the rows in ``meta`` (masked in place when ``meta`` has a
        grammar bitmask)."""
        logits = apply_grammar_mask(logits.to(torch.float32), meta)
        return self._with_logprobs(logits, sample_tokens(logits, meta), meta)

    # Spec decode's rejection sampler uses the same steps as the core.
    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return process_logits(logits, meta)

    def filtered_logits(self, processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return filtered_logits(processed, meta)

    def _with_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_ids=None, top_logprobs=None)
        sampled, top_ids, top_lp = ops.compute_logprobs(logits, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=sampled, top_ids=top_ids, top_logprobs=top_lp)


def _pad_1d(x: torch.Tensor | None, rows: int, value: float | int) -> torch.Tensor | None:
    if x is None or x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0],), value)])


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


def _min_tokens_mask(rows: list[SamplingRow], vocab_size: int, device: torch.device | str,
                     constrained: frozenset[int] = frozenset()) -> torch.Tensor | None:
    """[B, V] bool: stop ids (and eos unless ignore_eos) of rows whose token is below min_tokens (not the
    ``constrained`` rows)."""
    flat: list[int] = []
    for b, row in enumerate(rows):
        p = row.params
        if row.output_position >= p.min_tokens or b in constrained:
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
