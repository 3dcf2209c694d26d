"""Sampling ops: penalties, temperature, top-k / top-p / min-p, seeded Gumbel-max draws, logprobs.

Everything here is compile-friendly: no ``.item()`` / ``.tolist()`` / ``nonzero`` / host syncs and no
data-dependent shapes. Which optional op runs is decided by host flags (plain Python bools) that the
caller computes, so a compiled region sees them as constants.

Seeded noise is a counter-based hash of (seed, output position, vocabulary index): the draw of a token
never depends on the batch it runs in, which makes seeded sampling reproducible and batch-invariant.
The hash keeps every value in [0, 2**32) inside int64 tensors and uses only constants below 2**31, so
no product overflows int64 and Neuron (which rejects int64 constants outside int32) accepts it.

Each op has a plain ``*_reference`` implementation (row loops, Python ints) that the tests compare to.
"""
from __future__ import annotations

import torch

from kernels.cpu_kernels import load_cpu_kernels

# Odd multipliers below 2**31 (int32-safe): a 32-bit value times one stays below 2**63 in int64.
_MIX_MUL_1 = 0x7FEB352D  # lowbias32's first multiplier
_MIX_MUL_2 = 0x27D4EB2D  # Wang / xxhash-style odd multiplier
_WEYL = 0x61C88647  # 2**32 / golden ratio, as the int32-range negation of 0x9E3779B9
_WEYL_2 = 0x165667B1  # xxhash PRIME32_5: spreads vocabulary indices
_UNIFORM_BITS = 23  # (2k + 1) / 2**24 with k < 2**23 is exact in float32 and strictly inside (0, 1)


# ----------------------------------------------------------------------------------------------
# Seeded noise
# ----------------------------------------------------------------------------------------------

def _low32(x: torch.Tensor) -> torch.Tensor:
    """x mod 2**32 for int64 x, without a 0xFFFFFFFF constant (floor shift works for negatives too)."""
    return x - ((x >> 32) << 32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finalizer on int64 values in [0, 2**32).

    Inputs are non-negative, so ``>>`` already acts as a logical shift; products stay below 2**63.
    """
    x = x ^ (x >> 16)
    x = _low32(x * _MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _low32(x * _MIX_MUL_2)
    return x ^ (x >> 16)


def seeded_hash(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32-bit hash of (seed, position, vocab index) -> [B, V] int64 in [0, 2**32).

    seeds: [B] int64, positions: [B] int64 (index in the output of the token being sampled).
    """
    seed_key = _mix32(_low32(seeds.to(torch.int64)))  # [B]
    row_key = _mix32(_low32(_low32(positions.to(torch.int64)) * _WEYL + seed_key))  # [B]
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    h = _mix32(_low32(vocab[None, :] * _WEYL_2 + row_key[:, None]))  # [B, V]
    # A second round keyed by the seed alone decorrelates neighbouring (position, index) pairs.
    return _mix32(h ^ seed_key[:, None])


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms strictly inside (0, 1), a pure function of (seed, position, vocab index).

    seeds: [B] int64, positions: [B] int64.
    """
    h = seeded_hash(seeds, positions, vocab_size)
    odd = (h >> (32 - _UNIFORM_BITS)) * 2 + 1  # [B, V] int64 < 2**24: exact in float32
    return odd.to(torch.float32) * (1.0 / float(1 << (_UNIFORM_BITS + 1)))


def gumbel_noise(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise from uniforms in (0, 1). uniform: [B, V] float32."""
    return -torch.log(-torch.log(uniform))


def gumbel_argmax(scaled_logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from softmax(scaled_logits) with seeded Gumbel-max -> [B] int64.

    scaled_logits: [B, V] float32 (already divided by temperature; -inf = filtered out),
    seeds: [B] int64, positions: [B] int64.
    """
    noise = gumbel_noise(seeded_uniform(seeds, positions, scaled_logits.shape[-1]))
    return row_argmax(scaled_logits + noise)


def row_argmax(x: torch.Tensor) -> torch.Tensor:  # x [B, V] -> [B] int64
    """``argmax(x, -1)``, ties to the first index as argmax does (a NaN counts as the maximum). Eager host float32
    logits go to the C++ kernel (kernels/csrc/row_argmax.cpp, rows over the threads) when the host kernels are
    built; elsewhere, and in compiled regions, torch's ``max(dim)``, 2.5x faster than its ``argmax`` on [32, 49152]
    logits (0.4 against 1.0 ms)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and not torch.compiler.is_compiling()
            and load_cpu_kernels()):
        return torch.ops.deepinfer.row_argmax(x)
    return x.max(dim=-1).indices


# ----------------------------------------------------------------------------------------------
# Penalties (applied to raw logits, before temperature)
# ----------------------------------------------------------------------------------------------

def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF / vLLM repetition penalty on tokens seen in prompt or output.

    logits: [B, V] float32, seen: [B, V] bool, penalty: [B] float32 (1 = off).
    """
    p = penalty[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(logits: torch.Tensor, output_counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI presence / frequency penalties on output tokens only.

    logits: [B, V] float32, output_counts: [B, V] float32, presence: [B], frequency: [B] float32.
    """
    present = (output_counts > 0).to(logits.dtype)
    return logits - frequency[:, None] * output_counts - presence[:, None] * present


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Repetition (prompt + output), then presence / frequency (output), as vLLM v1 orders them.

    logits: [B, V] float32, prompt_mask: [B, V] bool, output_counts: [B, V] float32,
    repetition / presence / frequency: [B] float32.
    """
    seen = prompt_mask | (output_counts > 0)
    logits = apply_repetition_penalty(logits, seen, repetition)
    return apply_presence_frequency(logits, output_counts, presence, frequency)


def apply_blocked_tokens(logits: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """-inf where blocked (eos / stop ids of rows still below min_tokens).

    logits: [B, V] float32, blocked: [B, V] bool.
    """
    return logits.masked_fill(blocked, float("-inf"))


# ----------------------------------------------------------------------------------------------
# Temperature and filters
# ----------------------------------------------------------------------------------------------

def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (the caller gives greedy rows 1: SamplingMetadata decides greediness).

    logits: [B, V] float32, temperature: [B] float32 > 0.
    """
    return logits / temperature[:, None]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability.

    Done in log space (logit - max >= log(min_p)), so no softmax is needed; min_p = 0 keeps all.
    logits: [B, V] float32 (temperature-scaled), min_p: [B] float32.
    """
    top = logits.max(dim=-1, keepdim=True).values
    keep = (logits - top) >= torch.log(min_p)[:, None]
    return logits.masked_fill(~keep, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    """Top-k then top-p (over the top-k survivors) with one descending sort per batch.

    Ties with the k-th value are kept (a value threshold, like vLLM). Top-p keeps a token while the
    probability mass ranked strictly above it is below p, so the top token always survives.
    logits: [B, V] float32 (temperature-scaled), top_k: [B] int64 (V = off), top_p: [B] float32 (1 = off).
    """
    if not (use_top_k or use_top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_vals, sorted_idx = logits.sort(dim=-1, descending=True)  # [B, V]
    keep_sorted = torch.ones_like(sorted_vals, dtype=torch.bool)
    if use_top_k:
        kth = sorted_vals.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])  # [B, 1]
        keep_sorted = sorted_vals >= kth
    if use_top_p:
        masked = sorted_vals.masked_fill(~keep_sorted, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs
        # Rows with p = 1 must keep everything even where the float cumsum rounds past 1.
        within = (mass_above < top_p[:, None]) | (top_p >= 1.0)[:, None]
        keep_sorted = keep_sorted & within
    keep = torch.zeros_like(keep_sorted).scatter(1, sorted_idx, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


# ----------------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------------

def compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     num_top: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprobs of the raw model distribution (before penalties / temperature, as vLLM's default).

    raw_logits: [B, V] float32, token_ids: [B] int64. Returns the sampled tokens' logprobs [B] float32
    and, when num_top > 0, the top-n ids [B, n] int64 and logprobs [B, n] float32, best first.
    """
    logprobs = torch.log_softmax(raw_logits.to(torch.float32), dim=-1)
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if num_top <= 0:
        return sampled, None, None
    top_lp, top_ids = torch.topk(logprobs, num_top, dim=-1, largest=True, sorted=True)
    return sampled, top_ids, top_lp


# ----------------------------------------------------------------------------------------------
# Plain references (row loops, Python ints): the tests compare the ops above against these
# ----------------------------------------------------------------------------------------------

_MASK32 = (1 << 32) - 1


def _mix32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * _MIX_MUL_1) & _MASK32
    x ^= x >> 15
    x = (x * _MIX_MUL_2) & _MASK32
    return x ^ (x >> 16)


def seeded_hash_reference(seed: int, position: int, index: int) -> int:
    seed_key = _mix32_reference(seed & _MASK32)
    row_key = _mix32_reference(((position & _MASK32) * _WEYL + seed_key) & _MASK32)
    h = _mix32_reference((index * _WEYL_2 + row_key) & _MASK32)
    return _mix32_reference(h ^ seed_key)


def seeded_uniform_reference(seed: int, position: int, index: int) -> float:
    k = seeded_hash_reference(seed, position, index) >> (32 - _UNIFORM_BITS)
    return (2 * k + 1) / float(1 << (_UNIFORM_BITS + 1))


def penalties_reference(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                        repetition: list[float], presence: list[float], frequency: list[float]) -> torch.Tensor:
    """logits: [B, V] float32; per-row token id lists and penalty values."""
    out = logits.clone()
    for b in range(out.shape[0]):
        for tok in set(prompt_ids[b]) | set(output_ids[b]):
            v = out[b, tok]
            out[b, tok] = v / repetition[b] if v > 0 else v * repetition[b]
        for tok in set(output_ids[b]):
            out[b, tok] -= frequency[b] * output_ids[b].count(tok) + presence[b]
    return out


def filter_reference(scaled_logits: torch.Tensor, top_k: list[int], top_p: list[float],
                     min_p: list[float]) -> torch.Tensor:
    """min-p, then top-k, then top-p over the survivors, row by row. scaled_logits: [B, V] float32.

    top_k: -1 = off.
    """
    out = scaled_logits.clone().double()
    for b in range(out.shape[0]):
        row = out[b]
        if min_p[b] > 0:
            probs = torch.softmax(row, dim=-1)
            row[probs < min_p[b] * probs.max()] = float("-inf")
        if top_k[b] != -1 and top_k[b] < row.numel():
            kth = torch.sort(row, descending=True).values[top_k[b] - 1]
            row[row < kth] = float("-inf")
        if top_p[b] < 1.0:
            probs = torch.softmax(row, dim=-1)
            order = torch.argsort(row, descending=True).tolist()
            mass = 0.0
            for tok in order:
                if mass >= top_p[b]:
                    row[tok] = float("-inf")
                mass += float(probs[tok])
    return out.float()

