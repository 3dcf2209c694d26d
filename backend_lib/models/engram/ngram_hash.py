"""Engram's n-gram hash: token ids -> rows of each Engram layer's table, exact int64 arithmetic on the host.

The math is DeepSeek's reference (``deepseek-ai/Engram``, ``engram_demo_v1.py``):
- a compressed vocabulary maps token ids many-to-one (each id's decoded text NFKC'd, NFD'd, accents stripped,
  lower-cased, whitespace runs collapsed to one space, stripped unless it is only that space; an id whose text
  decodes to U+FFFD keeps its token string), numbered in order of first appearance;
- per Engram layer, ``max_ngram_size`` odd multipliers drawn from ``numpy.random.default_rng(seed + 10007 * layer)``
  below ``int64 max // compressed vocab`` so that no product overflows;
- for n = 2 .. max_ngram_size, the n-gram's mix is ``XOR_k c[t - k] * m[k]`` over k < n (the context before the
  first token is the compressed ``pad_id``), and head j of that order takes ``mix % p_j``: primes searched upward
  from each order's table size, distinct across all heads of all layers (in ``layer_ids`` order);
- the heads' tables are one table with per-head row offsets.

Everything here is torch int64 on the host: products stay below 2**63 by construction, XOR and ``%`` of
non-negative int64 are exact, so the result equals the reference's numpy arithmetic bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sympy import isprime  # torch's own dependency
from tokenizers import Regex, Tokenizer, normalizers

from backend_lib.models.engram.config import EngramConfig

_LAYER_SEED_PRIME = 10007
_REPLACEMENT = "\ufffd"


def _normalizer():  # the reference's ``tokenizers`` normalizer sequence, step for step
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])


def compressed_vocabulary(tokenizer_file: str | Path) -> np.ndarray:  # [vocab] int64: token id -> compressed id
    """The compressed id of every id of a ``tokenizer.json`` (added tokens included, as ``len(tokenizer)``)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    normalizer = _normalizer()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    lookup = np.empty(size, dtype=np.int64)
    numbering: dict[str, int] = {}
    for token_id, text in enumerate(texts):
        if _REPLACEMENT in text:
            key = tokenizer.id_to_token(token_id)
        else:
            normalized = normalizer.normalize_str(text)
            key = normalized if normalized else text
        lookup[token_id] = numbering.setdefault(key, len(numbering))
    return lookup


def _next_prime(after: int, taken: set[int]) -> int:
    candidate = after + 1
    while not isprime(candidate) or candidate in taken:
        candidate += 1
    return candidate


def head_table_sizes(config: EngramConfig) -> dict[int, list[list[int]]]:
    """layer id -> per n-gram order, its heads' table sizes (primes unique across every layer and head)."""
    taken: set[int] = set()
    sizes: dict[int, list[list[int]]] = {}
    for layer_id in config.layer_ids:
        orders = []
        for base in config.engram_vocab_size:
            heads, start = [], base - 1
            for _ in range(config.n_head_per_ngram):
                start = _next_prime(start, taken)
                taken.add(start)
                heads.append(start)
            orders.append(heads)
        sizes[layer_id] = orders
    return sizes


def layer_multipliers(config: EngramConfig, layer_id: int, compressed_size: int) -> np.ndarray:  # [max_n] int64
    half_bound = max(1, int(np.iinfo(np.int64).max // compressed_size) // 2)
    rng = np.random.default_rng(int(config.seed + _LAYER_SEED_PRIME * int(layer_id)))
    return rng.integers(low=0, high=half_bound, size=(config.max_ngram_size,), dtype=np.int64) * 2 + 1


@dataclass(frozen=True)
class EngramVocabulary:
    """What every Engram layer of a model shares: the compressed ids and the context's padding id."""

    lookup: torch.Tensor  # [vocab] int64
    pad_id: int  # compressed
    size: int  # number of compressed ids

    @classmethod
    def build(cls, lookup: np.ndarray, config: EngramConfig) -> "EngramVocabulary":
        if not 0 <= config.pad_id < len(lookup):
            raise ValueError(f"config.json engram: pad_id {config.pad_id} is not a token id of the tokenizer "
                             f"({len(lookup)} ids)")
        return cls(torch.from_numpy(np.ascontiguousarray(lookup, dtype=np.int64)), int(lookup[config.pad_id]),
                   int(lookup.max()) + 1)


class NgramHasher:
    """One Engram layer's hash: per token, the row of every head in the layer's flat table."""

    def __init__(self, config: EngramConfig, vocab: EngramVocabulary, layer_id: int,
                 table_sizes: list[list[int]]) -> None:
        self.vocab = vocab
        self.multipliers = torch.from_numpy(layer_multipliers(config, layer_id, vocab.size))  # [max_n]
        flat = [p for order in table_sizes for p in order]
        self.primes = torch.tensor(table_sizes, dtype=torch.int64)  # [max_n - 1, heads]
        self.offsets = torch.tensor([0] + flat[:-1], dtype=torch.int64).cumsum(0)  # [heads total]
        self.num_rows = sum(flat)

    def __call__(self, context: torch.Tensor,  # [T, max_n] int64 token ids, oldest first; -1 before the start
                 ) -> torch.Tensor:  # [T, heads total] int64 rows of the flat table
        lookup = self.vocab.lookup.to(context.device)
        compressed = torch.where(context < 0, torch.full_like(context, self.vocab.pad_id),
                                 lookup[context.clamp(min=0)])
        # column k of the reference's shifts is the token k positions back: reverse so that k = 0 is the current one
        products = compressed.flip(1) * self.multipliers.to(context.device)
        mix, rows = products[:, 0], []
        for order in range(self.primes.shape[0]):  # n = order + 2
            mix = torch.bitwise_xor(mix, products[:, order + 1])
            rows.append(torch.remainder(mix[:, None], self.primes[order].to(context.device)))
        return torch.cat(rows, dim=1) + self.offsets.to(context.device)
