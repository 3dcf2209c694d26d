"""Where each Hugging Face checkpoint name of a Llama model goes: the destination view (fused q/k/v and gate/up
rows), this rank's shard of the tensor, the names a complete checkpoint has, and the module a packed GGUF weight
belongs to. models/llama.py's ``load_weights`` drives it."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from backend_lib.models.layers import Linear, VocabEmbedding
from backend_lib.models.parallel import Shard

if TYPE_CHECKING:
    from backend_lib.models.llama.model import LlamaForCausalLM

# Checkpoint name inside "model.layers.N." -> (module path inside the layer, shard of a fused matrix or None).
LAYER_WEIGHTS = re.compile(
    r"(?P<module>self_attn\.(?P<attn>q|k|v|o)_proj|mlp\.(?P<mlp>gate|up|down)_proj|input_layernorm"
    r"|post_attention_layernorm)\.(?P<kind>weight|bias)")
# Per-tensor KV scales of fp8-KV checkpoints (llm-compressor: self_attn.k_scale; older: k_proj.output_scale).
KV_SCALE = re.compile(r"model\.layers\.(?P<index>\d+)\.self_attn\.(?:(?P<a>k|v)_scale|(?P<b>k|v)_proj\.output_scale)")


def weight_target(model: "LlamaForCausalLM", name: str) -> tuple[str, torch.Tensor, Shard | None] | None:
    """(loaded-key, destination view, this rank's part of the checkpoint tensor or None for all of it) for a
    checkpoint name; None for names that carry nothing to load."""
    if name == "model.embed_tokens.weight":
        return name, model.embed_tokens.weight, model.vocab_rows
    if name == "model.norm.weight":
        return name, model.norm.weight, None
    if name == "lm_head.weight":
        # Tied checkpoints sometimes store the head too; it is the embedding again.
        return None if model.lm_head is None else (name, model.lm_head.weight, model.vocab_rows)
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None:
        raise ValueError(f"unexpected weight {name!r} for LlamaForCausalLM")
    index, rest = int(match.group(1)), match.group(2)
    if rest.endswith("rotary_emb.inv_freq"):
        return None  # old checkpoints store the RoPE table; it is recomputed
    parts = LAYER_WEIGHTS.fullmatch(rest)
    if parts is None or index >= len(model.layers):
        raise ValueError(f"unexpected weight {name!r} for LlamaForCausalLM with {len(model.layers)} layers")
    layer = model.layers[index]
    kind = parts.group("kind")
    attn, mlp = layer.self_attn, layer.mlp
    shard: Shard | None = None
    if parts.group("attn") in ("q", "k", "v"):
        param = getattr(attn.qkv_proj, kind)
        view = None if param is None else param[attn.shard_rows(parts.group("attn"))]
        shard = attn.checkpoint_rows[parts.group("attn")]
    elif parts.group("mlp") in ("gate", "up"):
        param = getattr(mlp.gate_up_proj, kind)
        view = None if param is None else param[mlp.shard_rows(parts.group("mlp"))]
        shard = mlp.checkpoint_rows
    elif parts.group("attn") == "o" or parts.group("mlp") == "down":
        if kind == "bias":  # row-parallel bias: whole, on the driver only
            if not model.par.is_driver:
                return None
        else:
            shard = attn.o_columns if parts.group("attn") == "o" else mlp.down_columns
        view = getattr(layer.get_submodule(parts.group("module")), kind, None)
    else:
        view = getattr(layer.get_submodule(parts.group("module")), kind, None)
    if view is None:
        raise ValueError(f"weight {name!r} is a bias but the config has no bias for that projection")
    return name, view, shard


def expected_keys(model: "LlamaForCausalLM") -> set[str]:
    """Every checkpoint name the model needs (this rank's: row-parallel biases live on the driver)."""
    keys = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if model.lm_head is None
                                                                  else {"lm_head.weight"})
    for i in range(len(model.layers)):
        for kind, with_bias in (("weight", True), ("bias", model.arch.attention_bias)):
            if with_bias:
                keys |= {f"model.layers.{i}.self_attn.{p}_proj.{kind}" for p in "qkv"}
                if kind == "weight" or model.par.is_driver:
                    keys.add(f"model.layers.{i}.self_attn.o_proj.{kind}")
        for kind, with_bias in (("weight", True), ("bias", model.arch.mlp_bias)):
            if with_bias:
                keys |= {f"model.layers.{i}.mlp.{p}_proj.{kind}" for p in ("gate", "up")}
                if kind == "weight" or model.par.is_driver:
                    keys.add(f"model.layers.{i}.mlp.down_proj.{kind}")
        keys |= {f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"}
    return keys


def quantized_target(model: "LlamaForCausalLM", name: str) -> tuple[Linear | VocabEmbedding, int]:
    """(module, first row inside its fused weight) of a checkpoint weight kept in GGUF blocks."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens, 0
    if name == "lm_head.weight" and model.lm_head is not None:
        return model.lm_head, 0
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    parts = LAYER_WEIGHTS.fullmatch(f"{match.group(2)}.weight") if match else None
    if parts is None or parts.group("module").endswith("layernorm"):
        raise ValueError(f"weight_format=packed: {name!r} is not a projection or embedding")
    layer = model.layers[int(match.group(1))]
    attn, mlp = layer.self_attn, layer.mlp
    if parts.group("attn") in ("q", "k", "v"):
        return attn.qkv_proj, attn.shard_rows(parts.group("attn")).start
    if parts.group("mlp") in ("gate", "up"):
        return mlp.gate_up_proj, mlp.shard_rows(parts.group("mlp")).start
    return layer.get_submodule(parts.group("module")), 0
