"""``DeepseekV4Args``: a DeepSeek-V4 config.json (transformers 5.24's names, the release's legacy ones, the fp8 /
fp4 ``quantization_config`` and an Engram ``engram`` object) read and checked once."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from backend_lib.models.deepseek_v4.attention import CSA, HCA, LAYER_TYPES, SLIDING, compress_rope_scaling
from backend_lib.models.deepseek_v4.layers import HASH_MOE, SCORING_FUNCS, TOPK_MOE
from backend_lib.models.engram.config import EngramConfig
from kernels.quant import DEFAULT_BLOCK

_LEGACY_RATE_TYPES = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class DeepseekV4Args:
    """The DeepseekV4Config fields that change the math (defaults: transformers' DeepseekV4Config)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    rope_head_dim: int = 64  # head_dim * partial_rotary_factor
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict | None = None  # the YaRN parameters of the "compress" rotary, None for default
    layer_types: tuple[str, ...] = ()
    compress_rates: tuple[tuple[str, int], ...] = ((CSA, 4), (HCA, 128))
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: tuple[str, ...] = ()
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    fp8_block_size: tuple[int, int] = DEFAULT_BLOCK
    expert_dtype: str | None = None  # quantized checkpoints: "fp8" or "fp4" routed experts; None when unquantized
    engram: EngramConfig | None = None  # config.json's ``engram`` object (DeepSeek's Engram conditional memory)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "DeepseekV4Args":
        names = {f.name for f in fields(cls)} - {"layer_types", "mlp_layer_types", "compress_rates",
                                                  "rope_head_dim", "compress_rope_scaling", "engram"}
        kw: dict[str, Any] = {k: v for k, v in config.items() if k in names and v is not None}
        n = int(config.get("num_hidden_layers", cls.num_hidden_layers))
        quant = config.get("quantization_config")
        if quant:
            if quant.get("quant_method") != "fp8":
                raise ValueError(f"quantization_config.quant_method must be 'fp8', got {quant.get('quant_method')!r}")
            kw["fp8_block_size"] = tuple(quant.get("weight_block_size") or DEFAULT_BLOCK)
            kw["expert_dtype"] = quant.get("expert_dtype", config.get("expert_dtype")) or "fp8"
        rates = dict(cls.compress_rates)
        rates.update(config.get("compress_rates") or {})
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if config.get(legacy) is not None:
                rates[kind] = int(config[legacy])
        kw["compress_rates"] = tuple(sorted(rates.items()))
        layer_types = config.get("layer_types")
        if layer_types is None and config.get("compress_ratios") is not None:
            layer_types = [_LEGACY_RATE_TYPES[r] for r in config["compress_ratios"]]
        if layer_types is None:  # transformers' default schedule: two HCA layers, then CSA / HCA interleaved
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        kw["layer_types"] = tuple(layer_types[:n])
        mlp_types = config.get("mlp_layer_types")
        if mlp_types is None:
            num_hash = int(config.get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n, num_hash) + [TOPK_MOE] * max(0, n - num_hash)
        kw["mlp_layer_types"] = tuple(mlp_types[:n])
        head_dim = int(config.get("head_dim", cls.head_dim))
        factor = config.get("partial_rotary_factor")
        if factor is None:
            legacy = config.get("qk_rope_head_dim")
            factor = legacy / head_dim if legacy is not None else 64 / 512
        kw["rope_head_dim"] = int(head_dim * factor)
        kw["num_nextn_predict_layers"] = int(config.get("num_nextn_predict_layers") or 0)
        kw["compress_rope_scaling"] = compress_rope_scaling(config)
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias must be false for DeepSeek-V4")
        if config.get("engram") is not None:
            kw["engram"] = EngramConfig.from_dict(config["engram"])
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types must list num_hidden_layers={n} entries from {LAYER_TYPES}, "
                             f"got {list(self.layer_types)}")
        if len(self.mlp_layer_types) != n or any(t not in (HASH_MOE, TOPK_MOE) for t in self.mlp_layer_types):
            raise ValueError(f"mlp_layer_types must list num_hidden_layers={n} entries from "
                             f"{(HASH_MOE, TOPK_MOE)}, got {list(self.mlp_layer_types)}")
        if self.num_key_value_heads != 1:
            raise ValueError(f"num_key_value_heads must be 1 (shared-KV MQA), got {self.num_key_value_heads}")
        if self.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts must be 1 for DeepSeek-V4, got {self.n_shared_experts}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(f"head_dim * partial_rotary_factor must be even and in (0, min(head_dim, "
                             f"index_head_dim)], got {self.rope_head_dim}")
        for kind, rate in self.compress_rates:
            if kind in self.layer_types and rate < 1:
                raise ValueError(f"compress_rates[{kind!r}] must be >= 1, got {rate}")
        if self.expert_dtype not in (None, "fp8", "fp4"):
            raise ValueError(f"quantization_config.expert_dtype must be 'fp8' or 'fp4', got {self.expert_dtype!r}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.engram is not None:
            self.engram.check_layers(self.num_hidden_layers)

    def rate(self, layer_type: str) -> int:
        return dict(self.compress_rates).get(layer_type, 0) if layer_type != SLIDING else 0

    def count(self, layer_type: str) -> int:
        return sum(1 for t in self.layer_types if t == layer_type)
