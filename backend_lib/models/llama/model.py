"""Llama-family decoder (Llama 1-3, Mistral without sliding window, SmolLM) over the paged KV cache.

Same arithmetic as transformers' LlamaForCausalLM in the same order, with q/k/v and gate/up fused into one matmul
each; checkpoint names are Hugging Face's (the GGUF loader renames llama.cpp tensors to them).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backend_lib.models.context_parallel import context_attention
from backend_lib.models.interfaces import ModelCapabilities, ServedModel
from backend_lib.models.layers import (HostGemmPlan, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding, copy_into,
                                       linear, silu_and_mul)
from backend_lib.models.llama.config import LlamaArchConfig
from backend_lib.models.llama.weights import KV_SCALE, expected_keys, quantized_target, weight_target
from backend_lib.models.parallel import ParallelContext, Shard, read_shard, vocab_parallel_lookup
from backend_lib.models.loading.quantized_blocks import GGUFBlocks, install_gguf_parts
from kernels import fused_layer_ops as fused
from kernels.attention import paged_attention, write_kv
from kernels.attention_metadata import AttentionMetadata
from kernels.context_attention import cpp_held_decode, paged_kv_reader
from kernels.gemv import TILE, GemvPolicy, block_weight, blocked_linear_argmax, blocked_linear_float
from kernels.head_screen import HeadScreen
from kernels.int8_head_screen import Int8HeadScreen
from kernels.masked_head_screen import ScreenedHead, masked_greedy_tokens
from kernels.kv_fp8 import KVQuant
from kernels.onednn_gemm import PackedWeight
from kernels.packed_gemm import packed_linear_buffers
from kernels.rope import rope_at, rotate

if TYPE_CHECKING:
    from backend_lib.models.loading.options import LoadOptions


class LlamaAttention(nn.Module):
    """Heads split across tensor-parallel ranks by whole KV-head groups (a query head stays with its KV head).
    The split may be uneven (SmolLM2's 3 KV heads on 2 ranks: 2 + 1), so any rank count up to the KV heads works;
    ``o_proj`` is row-parallel and one all-reduce joins the ranks."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        group = arch.num_heads // arch.num_kv_heads
        kv_start, self.num_kv_heads = par.balanced(arch.num_kv_heads, "num_key_value_heads")
        self.num_heads, self.head_dim = self.num_kv_heads * group, arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim ** -0.5
        # Which rows of the checkpoint's q/k/v_proj (and columns of o_proj) this rank keeps.
        self.checkpoint_rows = {"q": Shard(0, kv_start * group * arch.head_dim, self.q_size),
                                "k": Shard(0, kv_start * arch.head_dim, self.kv_size),
                                "v": Shard(0, kv_start * arch.head_dim, self.kv_size)}
        self.o_columns = Shard(1, kv_start * group * arch.head_dim, self.q_size)
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.attention_bias, dtype)
        # The bias is added once, on the driver, before the all-reduce.
        self.o_proj = Linear(self.q_size, arch.hidden_size, arch.attention_bias and par.is_driver, dtype)
        self.cpu_decode_kernel = False  # the C++ decode attention (kernels/cpu_kernels.py), set by the engine
        self.host_fused = False  # RoPE + KV write as one C++ op in eager host steps (kernels/fused_layer_ops.py)
        self.kv_quant: KVQuant | None = None  # fp8 KV cache (use_fp8_kv): the caches hold e4m3 codes
        self.checkpoint_kv_scales: dict[str, float] = {}  # "k" / "v" -> the checkpoint's per-tensor scale

    def shard_rows(self, shard: str) -> slice:
        """Rows of the fused qkv_proj that hold this rank's part of the checkpoint's q_proj, k_proj or v_proj."""
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size), "v": (self.q_size + self.kv_size,
                                                                                   self.kv_size)}
        start, size = offsets[shard]
        return slice(start, start + size)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D/2] of the step's positions (rope_at)
        hidden: torch.Tensor,  # [T, hidden]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D] (this layer)
        v_cache: torch.Tensor,  # [num_slots, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        quant = self.kv_quant
        share = meta.context
        if share is not None:  # context parallelism: every row's q, k, v (the step's rows may be split)
            qkv = self.par.context.gather_rows(qkv, share.row_counts)
        if self.host_fused and share is None and not torch.compiler.is_compiling():
            if quant is None:
                q = fused.rope_qkv_to_cache(qkv, *rope, k_cache, v_cache, meta.slot_mapping, self.num_heads,
                                            self.num_kv_heads)
            else:
                q = fused.rope_qkv_to_cache_fp8(qkv, *rope, k_cache, v_cache, meta.slot_mapping, self.num_heads,
                                                self.num_kv_heads, quant)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            rows = qkv.shape[0]
            q = rotate(q.reshape(rows, self.num_heads, self.head_dim), *rope)
            k = rotate(k.reshape(rows, self.num_kv_heads, self.head_dim), *rope)
            v = v.reshape(rows, self.num_kv_heads, self.head_dim)
            if quant is None:
                write_kv(k_cache, k, meta.slot_mapping)
                write_kv(v_cache, v, meta.slot_mapping)
            else:
                write_kv(k_cache, k, meta.slot_mapping, quant.k_scale, quant.fp8_max)
                write_kv(v_cache, v, meta.slot_mapping, quant.v_scale, quant.fp8_max)
        if share is not None:
            read = paged_kv_reader(k_cache, v_cache, meta.block_size, q.dtype, quant)
            held_decode = cpp_held_decode(k_cache, v_cache, meta.block_size, quant) if self.cpu_decode_kernel else None
            out = context_attention(q, read, meta, self.scale, self.par.context, held_decode).to(q.dtype)
        else:
            out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.cpu_decode_kernel, quant)
        return self.par.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    """gate/up column-parallel, down row-parallel: each rank runs 1/N of the intermediate units."""

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        start, self.intermediate_size = par.even(arch.intermediate_size, "intermediate_size")
        self.checkpoint_rows = Shard(0, start, self.intermediate_size)
        self.down_columns = Shard(1, start, self.intermediate_size)
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate_size, arch.mlp_bias, dtype)
        self.down_proj = Linear(self.intermediate_size, arch.hidden_size, arch.mlp_bias and par.is_driver, dtype)

    def shard_rows(self, shard: str) -> slice:
        start = 0 if shard == "gate" else self.intermediate_size
        return slice(start, start + self.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        return self.par.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))

    def forward_add(self, x: torch.Tensor,  # [T, hidden]
                    residual: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """``residual + forward(x)`` in eager host steps, on the C++ ops: SiLU fused into the gate / up projection,
        and the down projection adding the residual as it stores its output unless the output still has to be
        all-reduced (then the add comes after it)."""
        act = self.gate_up_proj.forward_silu_mul(x)
        if self.par.world_size > 1:
            return residual + self.par.all_reduce(self.down_proj(act))
        return self.down_proj.forward_add(act, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(arch, dtype, par)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(arch, dtype, par)
        self.host_fused = False  # norms, SiLU gate and residual adds on the C++ ops in eager host steps

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D/2] (rope_at)
        hidden: torch.Tensor,  # [T, hidden]
        k_cache: torch.Tensor,  # [num_slots, Hkv, D]
        v_cache: torch.Tensor,  # [num_slots, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        if self.host_fused and not torch.compiler.is_compiling():
            first, second = self.input_layernorm, self.post_attention_layernorm
            attn = self.self_attn(rope, fused.rms_norm(hidden, first.weight, first.eps), k_cache, v_cache, meta)
            normed, hidden = fused.add_rms_norm(attn, hidden, second.weight, second.eps)
            return self.mlp.forward_add(normed, hidden)
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), k_cache, v_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(ServedModel):
    capabilities = ModelCapabilities(fp8_kv=True, context_parallel=True, host_packing=True, cpu_attention=True,
                                     greedy_head_screen=True, rope_extension=True, captures_hidden=True)

    def __init__(self, arch: LlamaArchConfig, dtype: torch.dtype = torch.float32,
                 options: "LoadOptions | None" = None) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.options = options
        self.par = par = options.par if options is not None else ParallelContext()
        # Vocabulary-parallel embedding and head: each rank keeps 1/N of the rows.
        vocab_start, vocab_local = par.even(arch.vocab_size, "vocab_size")
        self.vocab_rows = Shard(0, vocab_start, vocab_local)
        self.embed_tokens = VocabEmbedding(vocab_local, arch.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, dtype, par) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, vocab_local, False, dtype)
        self.packed_head: PackedWeight | None = None
        self.register_buffer("blocked_head", None, persistent=False)  # kernels.gemv layout of the head
        self.head_screen: HeadScreen | None = None
        self.register_buffer("screen_blocked_head", None, persistent=False)  # HeadScreen.approx_head
        self.int8_screen: Int8HeadScreen | None = None  # greedy steps of a few rows, fp32 or bf16
        self.greedy_argmax = False  # greedy steps no screen covers: the blocked head's fused argmax
        self.register_buffer("screen_int8_blocked_head", None, persistent=False)  # Int8HeadScreen.build's
        self.gemv_policy = GemvPolicy()
        self.host_fused = False  # eager host steps on the C++ ops (use_cpu_attention)
        self.kv_fp8 = False  # use_fp8_kv: e4m3 K/V (the one-op decode loop then takes each layer's scales)
        self._decode_weight_lists: tuple | None = None  # _host_decode_weights' lists, collected once
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)
        # Set by a block drafter (worker/spec_decode/dspark.py): forward then keeps the outputs of these layers (-1:
        # the embedding output), concatenated, in ``captured_hidden`` [T, len(ids) * hidden].
        self.capture_layer_ids: tuple[int, ...] = ()
        self.captured_hidden: torch.Tensor | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], dtype: torch.dtype,
                       options: "LoadOptions | None" = None) -> "LlamaForCausalLM":
        return cls(LlamaArchConfig.from_hf_config(config), dtype, options)

    def cover_positions(self, max_model_len: int) -> bool:
        """Extend the RoPE table to ``max_model_len`` positions when that is past the checkpoint's
        ``max_position_embeddings`` (RoPE computes any position; quality past the trained length is the model's).
        True when it extended."""
        if max_model_len <= self.rotary.cos.shape[0]:
            return False
        arch = self.arch
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, max_model_len).to(
            self.rotary.cos.device)
        return True

    def kv_cache_shapes(self, num_slots: int) -> list[tuple[int, ...]]:
        shape = (self.arch.num_layers, num_slots, self.layers[0].self_attn.num_kv_heads, self.arch.head_dim)
        return [shape, shape]  # K, V

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # [K, V], each [L, num_slots, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        k_caches, v_caches = kv_caches
        hidden = vocab_parallel_lookup(input_ids, self.embed_tokens.lookup, self.vocab_rows.size,
                                       self.vocab_rows.start, self.par)
        rope = rope_at(self.rotary.cos, self.rotary.sin, positions, hidden.dtype)
        if self.capture_layer_ids:
            return self._forward_capturing(rope, hidden, k_caches, v_caches, meta)
        share = meta.context
        if share is not None:  # context parallelism: this rank's rows through the layers, every row at the end
            hidden = hidden[share.rows]
            for i, layer in enumerate(self.layers):
                hidden = layer(rope, hidden, k_caches[i], v_caches[i], meta)
            return self.par.context.gather_rows(self.norm(hidden), share.row_counts)
        if not self.host_fused or torch.compiler.is_compiling():
            for i, layer in enumerate(self.layers):
                hidden = layer(rope, hidden, k_caches[i], v_caches[i], meta)
            return self.norm(hidden)
        weights = self._host_decode_weights(hidden.shape[0], meta)
        if weights is not None:
            first = self.layers[0].self_attn
            hidden = torch.ops.deepinfer.llama_decode_layers(
                hidden, *rope, k_caches, v_caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens,
                meta.decode_query_len, meta.block_size, first.scale, first.num_heads, first.num_kv_heads,
                self.layers[0].mlp.intermediate_size, self.norm.eps, *weights, **self._fp8_decode_scales())
        else:
            for i, layer in enumerate(self.layers):
                hidden = layer(rope, hidden, k_caches[i], v_caches[i], meta)
        return fused.rms_norm(hidden, self.norm.weight, self.norm.eps)

    def _forward_capturing(self, rope: tuple[torch.Tensor, torch.Tensor],
                           hidden: torch.Tensor,  # [T, hidden] embedded
                           k_caches: torch.Tensor, v_caches: torch.Tensor,  # [L, num_slots, Hkv, D]
                           meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden], final-normed
        """The layer-by-layer path (the one-op C++ decode loop keeps no intermediate states), keeping the outputs of
        ``capture_layer_ids``; one rank, no context parallelism (the drafter's proposer refuses both)."""
        ids = self.capture_layer_ids
        kept = [hidden] if -1 in ids else []
        for i, layer in enumerate(self.layers):
            hidden = layer(rope, hidden, k_caches[i], v_caches[i], meta)
            if i in ids:
                kept.append(hidden)
        self.captured_hidden = torch.cat(kept, dim=-1)
        return self.norm(hidden)

    def _host_decode_weights(self, num_tokens: int,
                             meta: AttentionMetadata) -> tuple[list[torch.Tensor], list[torch.Tensor], int] | None:
        """(norms, projections, GEMM path[, packed format, packed path]) for ``deepinfer::llama_decode_layers``
        (kernels/csrc/llama_decode.cpp: the eager host path's ops from one C++ loop, same results) when this step is
        in its scope: decode tokens only, one rank, no biases, every projection on the GEMM that ``linear`` picks at
        this row count (the blocked kernel needs SiLU's width a multiple of its tile). Else None: the module path."""
        if meta.num_prefills or meta.num_decode_tokens != num_tokens or self.par.world_size > 1:
            return None
        if self._decode_weight_lists is None:
            self._decode_weight_lists = self._collect_decode_weights()
        if not self._decode_weight_lists:
            return None
        norms, blocked, packed, plain, quantized = self._decode_weight_lists
        if quantized is not None:  # weight_format=packed: (tiles, format, path)
            return (norms, *quantized[:1], 3, *quantized[1:])
        if blocked is not None and self.gemv_policy.use_blocked(num_tokens):  # as linear() picks
            return (norms, blocked, 0) if blocked else None
        return (norms, packed, 1) if packed else (norms, plain, 2)

    def _fp8_decode_scales(self) -> dict[str, list[float] | float]:
        """The one-op decode loop's fp8 arguments (each layer's k_scale / v_scale, the largest code's value); none
        for a model-dtype cache."""
        if not self.kv_fp8:
            return {}
        quants = [layer.self_attn.kv_quant for layer in self.layers]
        return {"k_scales": [q.k_scale for q in quants], "v_scales": [q.v_scale for q in quants],
                "fp8_max": quants[0].fp8_max}

    def _collect_decode_weights(self) -> tuple:
        """(norms, blocked, oneDNN-packed, plain, quantized) weight lists, a list None where the projections lack
        that layout (blocked: [] where SiLU's width does not fit the kernel's tiles; quantized: (packed tiles,
        format, path) under weight_format=packed); () when the C++ loop cannot serve this model (biases, mixed
        packed formats)."""
        layers = self.layers
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(m.bias is not None for m in linears):
            return ()
        norms = [n.weight for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        blocked = [m.blocked for m in linears] if all(m.blocked is not None for m in linears) else None
        if blocked and any(layer.mlp.intermediate_size % TILE for layer in layers):
            blocked = []
        packed = [m.packed.packed for m in linears] if all(m.packed is not None for m in linears) else None
        quantized = None
        if any(m.quantized is not None for m in linears):
            # weight_format=packed: the C++ loop calls the packed GEMM when every projection is in one GGUF format
            # on the built kernel (else the module path: a projection dequantized at load, the torch reference)
            kinds = {(m.quantized.fmt, m.quantized_path, m.quantized_kernel) if m.quantized is not None else None
                     for m in linears}
            kind = next(iter(kinds))
            if len(kinds) != 1 or kind is None or not kind[2] or not kind[0].startswith("q"):
                return ()
            quantized = ([m.quantized_data for m in linears], kind[0], kind[1])
        return norms, blocked, packed, [m.weight for m in linears], quantized

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden [N, hidden] -> [N, vocab] float32
        """Every rank gets the full vocabulary row (all-gathered from the ranks' vocabulary shards)."""
        head = self._head_module()
        if head.quantized is not None:  # weight_format=packed: the packed GEMM on the head's (or embedding's) blocks
            logits = packed_linear_buffers(hidden, head.quantized_data, head.quantized_scales, None,
                                           head.quantized, head.quantized_kernel, head.quantized_path).float()
        elif self.blocked_head is not None and self.gemv_policy.use_blocked(hidden.shape[0]):
            logits = blocked_linear_float(hidden, self.blocked_head, self._head_weight().shape[0])
        else:
            logits = linear(hidden, self._head_weight(), None, self.packed_head, None, self.gemv_policy).float()
        return self.par.all_gather_last(logits)

    def greedy_token_ids(self, hidden: torch.Tensor,  # [N, hidden]
                         bitmask: torch.Tensor | None = None,  # [N, ceil(V/32)] int32 grammar masks, host
                         ) -> torch.Tensor | None:  # [N] int64, or None
        """``compute_logits(hidden)``'s argmax to the index, from a screened head where ``compute_logits`` would
        take the blocked kernel: the int8 copy (kernels/int8_head_screen.py) for a few rows (4 bf16, 6 fp32), the
        bf16 copy of an fp32 head (kernels/head_screen.py) for more, else the head's argmax without storing its
        logits (a bf16 head past 4 rows, or rows a screen gives up on: a value not finite, too many candidates);
        None: compute the logits. With ``bitmask`` (structured output), each row's argmax over the tokens its mask
        allows, from the same screens (kernels/masked_head_screen.py), else None."""
        rows = hidden.shape[0]
        if torch.compiler.is_compiling() or not self.gemv_policy.use_blocked(rows):
            return None
        if bitmask is not None:
            if not self.greedy_argmax:
                return None
            return masked_greedy_tokens(hidden, bitmask, ScreenedHead(
                self.blocked_head, self._head_weight().shape[0], self.head_screen, self.screen_blocked_head,
                self.int8_screen, self.screen_int8_blocked_head))
        screened = None
        if self.int8_screen is not None and rows <= self.int8_screen.max_rows:
            screened = self.int8_screen.argmax(hidden, self.screen_int8_blocked_head, self.blocked_head)
        elif self.head_screen is not None:
            screened = self.head_screen.argmax(hidden, self.screen_blocked_head, self.blocked_head)
        if screened is None and self.greedy_argmax:  # every logit, none stored
            return blocked_linear_argmax(hidden, self.blocked_head, self._head_weight().shape[0])
        return screened

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _head_module(self) -> Linear | VocabEmbedding:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def pack_for_cpu(self, plan: HostGemmPlan = HostGemmPlan()) -> None:
        """Every projection and the head on the host's packed GEMMs (see Linear.pack_for_cpu). An untied
        ``lm_head`` is packed once, as the head (compute_logits never calls the module)."""
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                module.pack_for_cpu(plan)
        self.gemv_policy = plan.policy
        self._decode_weight_lists = None  # new layouts: the lists are rebuilt on the next decode step
        if self._head_module().quantized is not None:  # the packed GEMM alone (compute_logits)
            return
        self.packed_head = PackedWeight(self._head_weight()) if plan.onednn else None
        if plan.blocked:
            self.blocked_head = block_weight(self._head_weight())
        self.head_screen, self.screen_blocked_head = None, None
        self.int8_screen, self.screen_int8_blocked_head = None, None
        self.greedy_argmax = plan.screen_head and self.blocked_head is not None and self.par.world_size == 1
        if self.greedy_argmax:
            head = self._head_weight()
            if self.blocked_head.dtype == torch.float32 and HeadScreen.supported():
                self.head_screen = HeadScreen.of(head)
                self.screen_blocked_head = HeadScreen.approx_head(head)
            if Int8HeadScreen.supported():
                self.int8_screen, self.screen_int8_blocked_head = Int8HeadScreen.build(head)
        self.gemv_policy = plan.policy
        self._decode_weight_lists = None  # new layouts: the lists are rebuilt on the next decode step

    def use_cpu_attention(self) -> None:
        """Decode attention on the C++ host kernel, and each layer's norms, SiLU gate and RoPE + KV write on the
        fused host ops (eager steps); the caller has loaded them (kernels.cpu_kernels)."""
        self.host_fused = True
        for layer in self.layers:
            layer.self_attn.cpu_decode_kernel = True
            layer.host_fused = layer.self_attn.host_fused = True

    def use_fp8_kv(self, fp8_max: float) -> str:
        """K and V stored as e4m3 codes (kernels/kv_fp8.py) with per-layer scales: the checkpoint's where it has
        them, else 1.0 (vLLM's default; fixed, so a block's bytes depend only on its tokens). Returns where the
        scales came from, for the load log."""
        layers = [layer.self_attn for layer in self.layers]
        found = sum(1 for attn in layers if attn.checkpoint_kv_scales)
        for attn in layers:
            scales = attn.checkpoint_kv_scales
            attn.kv_quant = KVQuant(scales.get("k", 1.0), scales.get("v", 1.0), fp8_max)
        self.kv_fp8 = True
        if found == 0:
            return "k_scale = v_scale = 1.0 (the checkpoint has none)"
        return f"k_scale / v_scale from the checkpoint ({found} of {len(layers)} layers; 1.0 elsewhere)"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFBlocks]]) -> None:
        """Fill every parameter from Hugging Face-named tensors; a missing or unknown weight is an error. GGUF blocks
        (weight_format=packed) become each projection's packed weight once all its parts arrived."""
        loaded: set[str] = set()
        quantized: dict[nn.Module, list[tuple[int, GGUFBlocks, torch.Tensor, str]]] = {}
        for name, tensor in weights:
            scale = KV_SCALE.fullmatch(name)
            if scale is not None:  # optional: used only with kv_cache_dtype=fp8_e4m3
                index, value = int(scale.group("index")), read_shard(tensor, None)
                if index >= len(self.layers) or value.numel() != 1 or not float(value.float()) > 0:
                    raise ValueError(f"unexpected KV scale {name!r} (shape {tuple(value.shape)}; a positive "
                                     f"per-tensor scale of one of the {len(self.layers)} layers expected)")
                which = scale.group("a") or scale.group("b")
                self.layers[index].self_attn.checkpoint_kv_scales[which] = float(value.float().reshape(()))
                continue
            target = weight_target(self, name)
            if target is None:
                continue
            key, view, shard = target
            part = read_shard(tensor, shard)
            if isinstance(part, GGUFBlocks):
                if tuple(part.shape) != tuple(view.shape):
                    raise ValueError(f"weight {name!r}: checkpoint shape {tuple(part.shape)} does not match the "
                                     f"model's {tuple(view.shape)}")
                module, row = quantized_target(self, name)
                quantized.setdefault(module, []).append((row, part, view, name))
            else:
                copy_into(view, part, name)
            loaded.add(key)
        missing = sorted(expected_keys(self) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[:5]}")
        for module, parts in quantized.items():
            install_gguf_parts(module, parts, self.options.packed_gemm_path if self.options else "auto")
