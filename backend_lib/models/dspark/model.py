"""The DSpark / DFlash block drafter for a Llama-family target (DeepSpec ``deepspec/modeling/dspark/qwen3``, written
anew; q / k norms only for Qwen3-style drafters).

Context. The target's hidden states at ``target_layer_ids`` (each the *output* of that layer, DeepSpec's
``hidden_states[id + 1]``; -1 the embedding output), concatenated, become ``main_x = hidden_norm(fc(.))``. Each
draft layer's context K / V is ``k_proj(main_x)`` / ``v_proj(main_x)`` (no input norm: ``main_x`` is normed already)
with RoPE at the context position; the engine keeps them in the drafter's own cache.

Block. To draft after the anchor ``t_p`` (the newest token, at position ``p``, whose target hidden state does not
exist yet) the query block is ``[t_p, mask x (B - 1)]`` at positions ``p .. p + B - 1``; it attends to the context
at positions ``< p`` (DeepSpec's mask ``kv < anchor``) and to the whole block (non-causal), and slot ``i`` predicts
the token at ``p + i + 1`` (vLLM's convention: the bonus token at its own position). The block's own K / V never
enter the cache. Logits come from the target's head on ``norm(h)``; DSpark's heads (heads.py) read ``norm(h)`` too.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from backend_lib.models.dspark.config import DrafterConfig
from backend_lib.models.dspark.heads import build_heads
from backend_lib.models.layers import RMSNorm, silu_and_mul
from backend_lib.models.loading.loader import safetensors_files
from kernels.rope import rope_at, rope_cos_sin_cache, rope_inv_freq, rotate

# The drafter shares these with the target; DeepSpec's checkpoints carry frozen copies, which we do not load.
SHARED_WITH_TARGET = ("embed_tokens.", "lm_head.")


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        arch = config.arch
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        bias = arch.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, arch.num_heads * arch.head_dim, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, torch.float32) if config.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, torch.float32) if config.qk_norm else None

    def keys_values(self, x: torch.Tensor,  # [..., H] (main_x for the context, the normed block for the block)
                    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [N, 1, D/2] for the flattened rows
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [..., Hkv, D]
        lead = x.shape[:-1]
        k = self.k_proj(x).reshape(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = rotate(k, *rope)
        v = self.v_proj(x).reshape(-1, self.num_kv_heads, self.head_dim)
        return k.reshape(*lead, self.num_kv_heads, self.head_dim), v.reshape(*lead, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor,  # [S, B, H] the block, input-normed
                rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [S * B, 1, D/2] of the block positions
                ctx_k: torch.Tensor,  # [S, C, Hkv, D] context keys (roped)
                ctx_v: torch.Tensor,  # [S, C, Hkv, D]
                ctx_valid: torch.Tensor,  # [S, C] bool: context positions below the anchor
                ) -> torch.Tensor:  # [S, B, H]
        S, B, _ = x.shape
        q = self.q_proj(x).reshape(S * B, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = rotate(q, *rope).reshape(S, B, self.num_heads, self.head_dim)
        k_blk, v_blk = self.keys_values(x, rope)
        k = torch.cat([ctx_k.to(x.dtype), k_blk], dim=1)
        v = torch.cat([ctx_v.to(x.dtype), v_blk], dim=1)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        # every block slot sees the valid context and the whole block (non-causal within the block)
        mask = torch.cat([ctx_valid, ctx_valid.new_ones(S, B)], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(S, B, self.num_heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        arch = config.arch
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return self.down_proj(silu_and_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        eps = config.arch.rms_norm_eps
        self.input_layernorm = RMSNorm(config.arch.hidden_size, eps, torch.float32)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(config.arch.hidden_size, eps, torch.float32)
        self.mlp = DrafterMLP(config)

    def forward(self, x: torch.Tensor,  # [S, B, H]
                rope: tuple[torch.Tensor, torch.Tensor],
                ctx_k: torch.Tensor, ctx_v: torch.Tensor,  # [S, C, Hkv, D]
                ctx_valid: torch.Tensor) -> torch.Tensor:  # [S, C] bool -> [S, B, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx_k, ctx_v, ctx_valid)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        arch = config.arch
        self.fc = nn.Linear(len(config.target_layer_ids) * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, torch.float32)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, torch.float32)
        self.markov_head, self.confidence_head = build_heads(config)
        cos, sin = rope_cos_sin_cache(rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling), max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_at(self.rope_cos, self.rope_sin, positions.reshape(-1), dtype)  # positions [...] int64

    def project_context(self, captured: torch.Tensor) -> torch.Tensor:  # [T, n * H] -> [T, H] main_x
        return self.hidden_norm(self.fc(captured.to(self.fc.weight.dtype)))

    def context_kv(self, main_x: torch.Tensor,  # [..., H]
                   positions: torch.Tensor,  # [...] int64
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per layer k, v [..., Hkv, D]
        rope = self.rope(positions, main_x.dtype)
        return [layer.self_attn.keys_values(main_x, rope) for layer in self.layers]

    def block_hidden(self, block_embeds: torch.Tensor,  # [S, B, H] embed([anchor, mask, ...])
                     block_positions: torch.Tensor,  # [S, B] int64
                     context: list[tuple[torch.Tensor, torch.Tensor]],  # per layer k, v [S, C, Hkv, D]
                     ctx_valid: torch.Tensor,  # [S, C] bool
                     ) -> torch.Tensor:  # [S, B, H] final-normed
        x = block_embeds.to(self.fc.weight.dtype)
        rope = self.rope(block_positions, x.dtype)
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, rope, k, v, ctx_valid)
        return self.norm(x)


def init_random(drafter: DSparkDrafter, generator: torch.Generator, std: float = 0.02) -> None:
    """Random weights (tests, and the training script's start): normal projections, unit norms, zero biases."""
    for name, param in drafter.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def load_drafter(directory: str, max_model_len: int, dtype: torch.dtype = torch.float32) -> DSparkDrafter:
    """A drafter directory (config.json + safetensors) in DeepSpec's names; every drafter tensor must be there and
    nothing unknown may be (a checkpoint for another layout fails here, naming the tensors). RoPE covers a block
    anchored at the last position (``max_model_len + block_size``)."""
    config = DrafterConfig.from_directory(directory)
    drafter = DSparkDrafter(config, max_model_len + config.block_size)
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        state.update({k: v for k, v in load_file(path).items() if not k.startswith(SHARED_WITH_TARGET)})
    expected = set(drafter.state_dict())
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise ValueError(f"speculative_model {directory!r}: missing tensors {missing[:6]}, unknown tensors "
                         f"{unknown[:6]} (a DeepSpec DSpark / DFlash drafter for a Llama-family target expected)")
    drafter.load_state_dict(state)
    return drafter.to(dtype).eval()


def save_drafter(drafter: DSparkDrafter, directory: str, config: dict) -> None:
    """The directory load_drafter reads: config.json (``config``, the drafter's DeepSpec config) and
    model.safetensors."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()},
              os.path.join(directory, "model.safetensors"))
