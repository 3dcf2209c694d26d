"""The Llama family's architecture as read from a Hugging Face config (transformers 5's ``rope_parameters`` or the
older ``rope_theta`` + ``rope_scaling``), checked once: what models/llama.py builds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernels.rope import RopeScaling


def _positive(name: str, value: int | float) -> None:
    if not value > 0:
        raise ValueError(f"llama config {name} must be > 0, got {value}")


def _parse_rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's ``rope_parameters`` or the older ``rope_theta`` +
    ``rope_scaling``."""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    llama3 = {key: merged[key] for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
              if key in merged}
    return theta, RopeScaling(rope_type=rope_type, factor=float(merged.get("factor", 1.0)), **llama3)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


@dataclass(frozen=True)
class LlamaArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"llama config num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"llama config head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "LlamaArchConfig":
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"llama config hidden_act must be 'silu', got {act!r}")
        if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
            # Exact only while every sequence fits in the window; refusing beats a silent mismatch later.
            raise ValueError(f"llama config sliding_window={config['sliding_window']} is not supported "
                             "(full attention only)")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        theta, scaling = _parse_rope(config)
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_token_ids(config.get("eos_token_id")),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )
