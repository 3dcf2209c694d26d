"""A DSpark / DFlash drafter directory's config.json (DeepSpec's layout, ``deepspec/modeling/dspark/*/config.py``):
the target's architecture copied, then the drafter's own fields. Checked once, each bad field refused by name."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from backend_lib.models.llama.config import LlamaArchConfig

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# Qwen3-style drafters normalize q and k per head (DeepSpec's qwen3 modeling); Llama's attention has no such norm.
QK_NORM_MODEL_TYPES = ("qwen3",)
DRAFTER_MODEL_TYPES = ("llama", "qwen3")


def _refuse(setting: str, problem: str) -> ValueError:
    return ValueError(f"drafter config {setting}: {problem}")


@dataclass(frozen=True)
class DrafterConfig:
    arch: LlamaArchConfig  # the drafter's layers (num_layers = its draft layers; vocab / hidden = the target's)
    block_size: int  # query slots per draft: [anchor, mask x (block_size - 1)], each drafting one token
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # -1 = the embedding output; i = the output of target layer i
    num_target_layers: int
    markov_rank: int  # 0: no Markov head (DFlash)
    markov_head_type: str  # vanilla | gated | rnn (ignored when markov_rank is 0)
    enable_confidence_head: bool
    confidence_head_with_markov: bool  # the confidence head also reads the Markov embedding of the previous token
    qk_norm: bool

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise _refuse("block_size", f"must be >= 1, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.arch.vocab_size:
            raise _refuse("mask_token_id", f"must be a token id below vocab_size {self.arch.vocab_size}, "
                                           f"got {self.mask_token_id}")
        ids = self.target_layer_ids
        if not ids or list(ids) != sorted(set(ids)):
            raise _refuse("target_layer_ids", f"must be a non-empty strictly increasing list, got {list(ids)}")
        # DeepSpec's evaluator refuses the last layer too: its captured "output" would be transformers' final-normed
        # hidden state, not a residual stream.
        if ids[0] < -1 or ids[-1] > self.num_target_layers - 2:
            raise _refuse("target_layer_ids", f"must lie in [-1, {self.num_target_layers - 2}] for a target of "
                                              f"{self.num_target_layers} layers, got {list(ids)}")
        if self.markov_rank < 0:
            raise _refuse("markov_rank", f"must be >= 0, got {self.markov_rank}")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise _refuse("markov_head_type", f"must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}")
        if self.confidence_head_with_markov and not self.markov_rank:
            raise _refuse("confidence_head_with_markov", "needs a Markov head (markov_rank > 0)")

    @property
    def has_heads(self) -> bool:
        """DSpark (a Markov or a confidence head) rather than DFlash (the bare block backbone)."""
        return self.markov_rank > 0 or self.enable_confidence_head

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "DrafterConfig":
        model_type = config.get("model_type", "llama")
        if model_type not in DRAFTER_MODEL_TYPES:
            raise _refuse("model_type", f"must be one of {DRAFTER_MODEL_TYPES}, got {model_type!r}")
        for name in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers"):
            if name not in config:
                raise _refuse(name, "missing (DeepSpec's drafter configs carry it)")
        enable_confidence = bool(config.get("enable_confidence_head", False))
        return cls(arch=LlamaArchConfig.from_hf_config(config), block_size=int(config["block_size"]),
                   mask_token_id=int(config["mask_token_id"]),
                   target_layer_ids=tuple(int(i) for i in config["target_layer_ids"]),
                   num_target_layers=int(config["num_target_layers"]),
                   markov_rank=int(config.get("markov_rank", 0)),
                   markov_head_type=str(config.get("markov_head_type", "vanilla")).lower(),
                   enable_confidence_head=enable_confidence,
                   confidence_head_with_markov=enable_confidence and bool(config.get("confidence_head_with_markov",
                                                                                     False)),
                   qk_norm=model_type in QK_NORM_MODEL_TYPES)

    @classmethod
    def from_directory(cls, directory: str) -> "DrafterConfig":
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"speculative_model {directory!r}: no config.json (a DeepSpec drafter directory holds "
                             f"config.json and safetensors weights)")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def check_target(self, target: LlamaArchConfig) -> None:
        """The drafter shares the target's embedding and head, and reads its layers: they must fit."""
        if (self.arch.vocab_size, self.arch.hidden_size) != (target.vocab_size, target.hidden_size):
            raise ValueError(f"speculative_model: the drafter's vocab_size / hidden_size "
                             f"({self.arch.vocab_size}, {self.arch.hidden_size}) differ from the target's "
                             f"({target.vocab_size}, {target.hidden_size})")
        if self.num_target_layers != target.num_layers:
            raise ValueError(f"speculative_model: the drafter was built for a target of {self.num_target_layers} "
                             f"layers (num_target_layers), the target has {target.num_layers}")


def deepspec_config(target: LlamaArchConfig, *, num_draft_layers: int, block_size: int, mask_token_id: int,
                    target_layer_ids: tuple[int, ...], markov_rank: int = 0, markov_head_type: str = "vanilla",
                    confidence_head: bool = False, confidence_head_with_markov: bool = False) -> dict[str, Any]:
    """A drafter's config.json as DeepSpec's ``build_draft_config`` writes it: the target's config (here from its
    architecture) with the drafter's layer count and fields."""
    config: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaDSparkModel"], "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
        "num_hidden_layers": num_draft_layers, "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta, "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": target.attention_bias, "mlp_bias": target.mlp_bias, "hidden_act": "silu",
        "tie_word_embeddings": False, "num_target_layers": target.num_layers, "block_size": block_size,
        "mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids), "markov_rank": markov_rank,
        "enable_confidence_head": confidence_head}
    if target.rope_scaling is not None:
        scaling = target.rope_scaling
        config["rope_scaling"] = {"rope_type": scaling.rope_type, "factor": scaling.factor,
                                  "low_freq_factor": scaling.low_freq_factor,
                                  "high_freq_factor": scaling.high_freq_factor,
                                  "original_max_position_embeddings": scaling.original_max_position_embeddings}
    if markov_rank:
        config["markov_head_type"] = markov_head_type
    if confidence_head:
        config["confidence_head_with_markov"] = confidence_head_with_markov
    DrafterConfig.from_dict(config)  # refuses what the loader would refuse
    return config
