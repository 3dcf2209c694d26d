"""Drafter directories for a Llama-family target: a random DSpark / DFlash drafter in DeepSpec's layout (tests,
and the start of benchmarks/train_drafter.py), sized from the target's own architecture."""
from __future__ import annotations

import json
import os

import torch

from backend_lib.models.dspark.config import deepspec_config
from backend_lib.models.dspark.model import DSparkDrafter, DrafterConfig, init_random, save_drafter
from backend_lib.models.llama.config import LlamaArchConfig
from backend_lib.models.loading.gguf_loader import open_gguf


def target_arch(path: str) -> LlamaArchConfig:
    """The target's architecture from its GGUF metadata or its config.json, without loading weights."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return LlamaArchConfig.from_hf_config(json.load(f))
    return LlamaArchConfig.from_hf_config(open_gguf(path).config)


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers spread from the second to the third-last (DeepSpec's configs take such a spread,
    e.g. [1, 9, 17, 25, 33] of Qwen3-4B's 36)."""
    last = num_target_layers - 3
    if count == 1:
        return (last // 2,)
    return tuple(sorted({1 + round(i * (last - 1) / (count - 1)) for i in range(count)}))


def build_drafter(arch: LlamaArchConfig, *, seed: int = 0, num_draft_layers: int = 1, block_size: int = 4,
                  markov_rank: int = 32, markov_head_type: str = "vanilla", confidence_head: bool = True,
                  num_target_layer_ids: int = 3, std: float = 0.02) -> tuple[DSparkDrafter, dict]:
    """A random drafter and its config.json; the mask token is the vocabulary's last id (DeepSpec adds a mask
    token; our targets have none, so one rarely used id stands in: the drafter learns what it means)."""
    config = deepspec_config(arch, num_draft_layers=num_draft_layers, block_size=block_size,
                             mask_token_id=arch.vocab_size - 1,
                             target_layer_ids=spread_layer_ids(arch.num_layers, num_target_layer_ids),
                             markov_rank=markov_rank, markov_head_type=markov_head_type,
                             confidence_head=confidence_head, confidence_head_with_markov=bool(markov_rank))
    drafter = DSparkDrafter(DrafterConfig.from_dict(config), arch.max_position_embeddings)
    init_random(drafter, torch.Generator().manual_seed(seed), std)
    return drafter, config


def write_random_drafter(target_path: str, directory: str, **options) -> str:
    drafter, config = build_drafter(target_arch(target_path), **options)
    save_drafter(drafter, directory, config)
    return directory
