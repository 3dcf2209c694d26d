"""``EngramConfig``: the ``engram`` object of a checkpoint's config.json (DeepSeek's Engram conditional memory).

The fields and their defaults are those of ``EngramConfig`` in DeepSeek's public reference (``deepseek-ai/Engram``,
``engram_demo_v1.py``); the backbone's own ``hidden_size`` and ``hc_mult`` give the rest. ``tokenizer_name_or_path``
is read for completeness and not used: the compressed vocabulary is built from the checkpoint's own tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class EngramConfig:
    engram_vocab_size: tuple[int, ...]  # table size per n-gram order (2 .. max_ngram_size), before the prime search
    max_ngram_size: int = 3
    n_embed_per_ngram: int = 512  # the heads of one n-gram order together
    n_head_per_ngram: int = 8
    layer_ids: tuple[int, ...] = (1, 15)  # decoder layers that carry an Engram module, in the hash's seed order
    pad_id: int = 2  # a tokenizer id; its compressed id fills the n-gram context before the first token
    seed: int = 0
    kernel_size: int = 4  # the ShortConv's taps (dilation: max_ngram_size)
    tokenizer_name_or_path: str = ""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngramConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"config.json engram: unknown field(s) {unknown} (known: {sorted(known)})")
        if "engram_vocab_size" not in values:
            raise ValueError("config.json engram: engram_vocab_size is required (one table size per n-gram order)")
        kwargs = dict(values)
        for name in ("engram_vocab_size", "layer_ids"):
            if name in kwargs:
                kwargs[name] = tuple(int(v) for v in kwargs[name])
        config = cls(**kwargs)
        config._check()
        return config

    def _check(self) -> None:
        if self.max_ngram_size < 2:
            raise ValueError(f"config.json engram: max_ngram_size must be >= 2, got {self.max_ngram_size}")
        if len(self.engram_vocab_size) != self.max_ngram_size - 1:
            raise ValueError(f"config.json engram: engram_vocab_size has {len(self.engram_vocab_size)} entries, "
                             f"max_ngram_size {self.max_ngram_size} needs {self.max_ngram_size - 1} (orders 2..n)")
        if min(self.engram_vocab_size) < 2:
            raise ValueError(f"config.json engram: engram_vocab_size entries must be >= 2, got "
                             f"{list(self.engram_vocab_size)}")
        if self.n_head_per_ngram < 1 or self.n_embed_per_ngram % self.n_head_per_ngram:
            raise ValueError(f"config.json engram: n_embed_per_ngram ({self.n_embed_per_ngram}) must be a multiple "
                             f"of n_head_per_ngram ({self.n_head_per_ngram})")
        if self.kernel_size < 1:
            raise ValueError(f"config.json engram: kernel_size must be >= 1, got {self.kernel_size}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"config.json engram: layer_ids repeats a layer: {list(self.layer_ids)}")

    def check_layers(self, num_layers: int) -> None:
        past = [i for i in self.layer_ids if not 0 <= i < num_layers]
        if past:
            raise ValueError(f"config.json engram: layer_ids {past} are not layers of this model "
                             f"(num_hidden_layers {num_layers})")

    @property
    def head_dim(self) -> int:
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def embed_width(self) -> int:
        """Width of one token's gathered rows: every head of every n-gram order."""
        return (self.max_ngram_size - 1) * self.n_embed_per_ngram

    @property
    def conv_lookback(self) -> int:
        """Past positions the ShortConv reads: (kernel_size - 1) taps, max_ngram_size apart."""
        return (self.kernel_size - 1) * self.max_ngram_size

    @property
    def history(self) -> int:
        """Previous token ids an n-gram needs."""
        return self.max_ngram_size - 1
