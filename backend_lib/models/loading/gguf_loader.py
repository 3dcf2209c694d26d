"""GGUF checkpoints (llama.cpp): metadata -> a Hugging Face-style config dict, tensors -> HF names, dequantized.

llama.cpp's converter permutes the rows of attn_q / attn_k so that each head's rotary pairs are interleaved
(GPT-J style); the HF rotate-half layout needs them undone here.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from backend_lib.models.loading.gguf_file import GGUFFile
from backend_lib.models.loading.quantized_blocks import PACKABLE_GGUF_TYPES, GGUFBlocks
from backend_lib.models.registry import architecture_for_gguf

Q = GGMLQuantizationType
# Types read through gguf's numpy reference dequantizers. SmolLM2 uses Q4_1, Q8_0 and F32.
SUPPORTED_GGUF_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
})

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def dequantize_tensor(name: str, data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    """float32 array in GGUF row order ([rows, cols] = [out, in] for matrices)."""
    if tensor_type not in SUPPORTED_GGUF_TYPES:
        raise ValueError(f"GGUF tensor {name!r} has unsupported type {tensor_type.name}; supported: "
                         f"{sorted(t.name for t in SUPPORTED_GGUF_TYPES)}")
    return np.asarray(dequantize(data, tensor_type), dtype=np.float32)


def hf_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> Hugging Face Llama name."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{match.group(3)}"
    match = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama equivalent (rope_freqs and other extras are not "
                     "supported)")


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:  # [num_heads * D, ...] -> same
    """Undo llama.cpp's per-head interleave: row (h, i, j) of the file, read as [h, D/2, 2], is HF row (h, j, i)."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


@dataclass
class GGUFCheckpoint:
    architecture: str  # Hugging Face class name, for the registry
    config: dict[str, Any]  # Hugging Face config.json keys
    num_tensors: int
    reader: GGUFFile

    def tensors(self, keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        """(HF name, float32 tensor), dequantized one at a time; with ``keep_blocks`` (weight_format=packed) a 2-D
        tensor in a format the packed GEMMs read comes as ``GGUFBlocks``: the file's bytes (rows reordered only)."""
        num_heads = self.config["num_attention_heads"]
        num_kv_heads = self.config["num_key_value_heads"]
        for t in self.reader.tensors:
            name = hf_name(t.name)
            weight: torch.Tensor | GGUFBlocks
            if keep_blocks and t.tensor_type in PACKABLE_GGUF_TYPES and len(t.shape) == 2:
                # rows of a memory-mapped read-only file: one copy, so the module owns writable bytes
                rows = torch.from_numpy(np.array(t.data, dtype=np.uint8))
                weight = GGUFBlocks(t.name, PACKABLE_GGUF_TYPES[t.tensor_type], rows, int(t.shape[0]))
            else:
                weight = torch.from_numpy(dequantize_tensor(t.name, t.data, t.tensor_type).copy())
            heads = num_heads if ".self_attn.q_proj." in name else num_kv_heads if ".self_attn.k_proj." in name else 0
            if heads and isinstance(weight, GGUFBlocks):  # whole rows move: the blocks stay the file's
                weight = GGUFBlocks(weight.name, weight.qtype, unpermute_rows(weight.rows, heads).contiguous(),
                                    weight.in_features)
            elif heads:
                weight = unpermute_rows(weight, heads)
            yield name, weight


def open_gguf(path: str) -> GGUFCheckpoint:
    reader = GGUFFile(path)
    gguf_arch = reader.get("general.architecture")
    if gguf_arch is None:
        raise ValueError(f"{path}: GGUF file has no general.architecture")
    architecture = architecture_for_gguf(gguf_arch)
    tensor_names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        hf_name(t.name)  # fail before any dequantization on a tensor we cannot place
        if t.tensor_type not in SUPPORTED_GGUF_TYPES:
            raise ValueError(f"GGUF tensor {t.name!r} has unsupported type {t.tensor_type.name}; supported: "
                             f"{sorted(q.name for q in SUPPORTED_GGUF_TYPES)}")

    def key(name: str, default: Any = None) -> Any:
        return reader.get(f"{gguf_arch}.{name}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    if hidden is None or heads is None or key("block_count") is None or key("feed_forward_length") is None:
        raise ValueError(f"{path}: GGUF metadata lacks {gguf_arch}.embedding_length / block_count / "
                         "feed_forward_length / attention.head_count")
    tokens = reader.get("tokenizer.ggml.tokens")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = len(tokens) if tokens is not None else key("vocab_size", int(embed.shape[-1]))
    config: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", key("rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": reader.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"{path}: GGUF rope scaling type {scaling_type!r} is not supported (none, linear)")
    return GGUFCheckpoint(architecture, config, len(reader.tensors), reader)
