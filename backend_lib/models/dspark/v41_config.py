"""DeepSeek-V4.1's DSpark drafter fields (``text_config.dspark_*``, ``num_nextn_predict_layers``; design note
``DEEPSEEK_V41.md`` sections 1.1 and 3), read from the checkpoint's config.json and checked against the target."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from backend_lib.models.deepseek_v41.config import DeepseekV41TextArgs

_FIELDS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
           "dspark_n_routed_experts", "dspark_num_experts_per_tok")


def _refuse(field: str, problem: str) -> ValueError:
    return ValueError(f"speculative_model text_config.{field}: {problem}")


@dataclass(frozen=True)
class V41DSparkArgs:
    num_layers: int  # num_nextn_predict_layers: the mtp.{j} blocks
    block_size: int  # query slots [anchor, noise x (block_size - 1)]
    noise_token_id: int
    target_layer_ids: tuple[int, ...]  # the target layers whose input streams feed main_proj
    markov_rank: int  # 0: no Markov head in the checkpoint
    num_experts: int
    experts_per_token: int

    @classmethod
    def from_text_config(cls, text: dict[str, Any]) -> "V41DSparkArgs":
        missing = [f for f in ("num_nextn_predict_layers",) + _FIELDS if text.get(f) is None]
        if missing:
            raise _refuse(missing[0], "missing (a DeepSeek-V4.1 checkpoint with its DSpark drafter carries it)")
        return cls(int(text["num_nextn_predict_layers"]), int(text["dspark_block_size"]),
                   int(text["dspark_noise_token_id"]), tuple(int(i) for i in text["dspark_target_layer_ids"]),
                   int(text["dspark_markov_rank"]), int(text["dspark_n_routed_experts"]),
                   int(text["dspark_num_experts_per_tok"]))

    @classmethod
    def from_directory(cls, directory: str) -> "V41DSparkArgs":
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"speculative_model {directory!r}: no config.json (for DeepSeek-V4.1, the checkpoint "
                             f"directory whose mtp.* tensors hold the drafter)")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        return cls.from_text_config(config.get("text_config", config))

    def check_target(self, target: DeepseekV41TextArgs) -> None:
        if self.num_layers < 1:
            raise _refuse("num_nextn_predict_layers", f"must be >= 1 for a DSpark drafter, got {self.num_layers}")
        if self.block_size < 1:
            raise _refuse("dspark_block_size", f"must be >= 1, got {self.block_size}")
        if not 0 <= self.noise_token_id < target.vocab_size:
            raise _refuse("dspark_noise_token_id", f"must be below vocab_size {target.vocab_size}, got "
                                                   f"{self.noise_token_id}")
        ids, n = self.target_layer_ids, target.num_hidden_layers
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= n:
            raise _refuse("dspark_target_layer_ids", f"must be strictly increasing layers in [0, {n}), got "
                                                     f"{list(ids)}")
        if self.markov_rank < 0:
            raise _refuse("dspark_markov_rank", f"must be >= 0, got {self.markov_rank}")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise _refuse("dspark_num_experts_per_tok", f"must be in [1, dspark_n_routed_experts="
                                                        f"{self.num_experts}], got {self.experts_per_token}")
