"""DeepSeek-V3 (and V2-style MLA + MoE) causal LM over a latent paged KV cache.

One cache tensor, layer-major: ``[num_layers, num_slots, kv_lora_rank + qk_rope_head_dim]`` holding each
token's normalized latent and post-rope shared key. Decode attends in the absorbed form, prefill expands
K/V from the cached latents (``kernels/mla.py``). MoE layers use the grouped sigmoid router
(``kernels/moe.py``); fp8 block-quantized checkpoints keep their projections fp8 and dequantize inside the
linear op, or dequantize once at load (``LoadOptions.dequantize_fp8_at_load``); their routed experts are dequantized
at load under ``weight_format=dequantize`` on the host (``deepseek_moe.py``), kept in fp8 tiles under ``packed``
and in fp8 stacks for Neuron graphs (``LoadOptions.host_steps``).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backend_lib.models.interfaces import ModelCapabilities, ServedModel
from backend_lib.models.deepseek_v3.layers import (
    MOE_IMPLS, BlockLinear, DecoderLayer, DenseMLP, MLADims, MLAttention, MTPLayer, RMSNorm, WeightSlot, build_rope,
    rope_cos_sin,
)
from backend_lib.models.deepseek_v3.moe import MoE, RoutedExperts
from backend_lib.models.engram.config import EngramConfig
from backend_lib.models.engram.layer import (
    EngramPrefetch, attach_engram_layers, engram_gather, engram_ring_shape, engram_vocabulary_of,
)
from backend_lib.models.engram.loading import EngramLoader
from backend_lib.models.parallel import ParallelContext, Shard, read_shard, vocab_parallel_embedding
from kernels.attention_metadata import AttentionMetadata
from kernels.mla_fp8 import MLARecord
from kernels.moe import RouterConfig
from kernels.quant import DEFAULT_BLOCK

if TYPE_CHECKING:
    from backend_lib.models.loading.options import LoadOptions


@dataclass(frozen=True)
class DeepseekV3Args:
    """The DeepseekV3Config fields that change the math (defaults: transformers' DeepseekV3Config)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0
    fp8_block_size: tuple[int, int] = DEFAULT_BLOCK
    fp8_scale_fmt: str | None = None  # "float" / "ue8m0" for fp8 checkpoints, None otherwise
    engram: EngramConfig | None = None  # config.json's ``engram`` object (DeepSeek's Engram conditional memory)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "DeepseekV3Args":
        names = {f.name for f in fields(cls)} - {"engram"}
        kw = {k: v for k, v in config.items() if k in names and v is not None}
        if config.get("engram") is not None:
            kw["engram"] = EngramConfig.from_dict(config["engram"])
        if "q_lora_rank" in config:  # None is meaningful: a plain q_proj
            kw["q_lora_rank"] = config["q_lora_rank"]
        # rope: new format ``rope_parameters`` (transformers 5) or old ``rope_theta`` + ``rope_scaling``
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        kw["rope_theta"] = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        kw["rope_scaling"] = rope if rope_type != "default" else None
        if kw["rope_scaling"] is not None:
            kw["rope_scaling"].setdefault("original_max_position_embeddings",
                                          config.get("max_position_embeddings", 4096))
        kw["num_nextn_predict_layers"] = int(config.get("num_nextn_predict_layers",
                                                        config.get("num_mtp_layers", 0)) or 0)
        quant = config.get("quantization_config")
        if quant:
            if quant.get("quant_method") != "fp8":
                raise ValueError(f"quantization_config.quant_method must be 'fp8', got {quant.get('quant_method')!r}")
            kw["fp8_block_size"] = tuple(quant.get("weight_block_size") or DEFAULT_BLOCK)
            kw["fp8_scale_fmt"] = quant.get("scale_fmt", "float")
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace must be in [0, {self.num_hidden_layers}], "
                             f"got {self.first_k_dense_replace}")
        if self.fp8_scale_fmt not in (None, "float", "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt must be 'float' or 'ue8m0', got {self.fp8_scale_fmt!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.engram is not None:
            self.engram.check_layers(self.num_hidden_layers)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def router(self) -> RouterConfig:
        return RouterConfig(top_k=self.num_experts_per_tok, num_experts=self.n_routed_experts,
                            n_group=self.n_group or 1, topk_group=self.topk_group or 1,
                            norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


class DeepseekV3ForCausalLM(ServedModel):
    # packed_weights: the fp8 projections; context_parallel: MLA attends held latents (not with Engram, below)
    # hybrid_cache: with Engram only (has_hybrid_state), its ShortConv history in state slots
    capabilities = ModelCapabilities(fp8_kv=True, hybrid_cache=True, mtp="latent", engram=True,
                                     packed_weights=True, context_parallel=True, static_moe=True)

    def __init__(self, args: DeepseekV3Args, dtype: torch.dtype = torch.float32,
                 dequantize_fp8_at_load: bool = False, moe_impl: str = "dynamic",
                 par: ParallelContext | None = None, packed: bool = False, engram_vocab: Any = None,
                 host_steps: bool = True) -> None:
        super().__init__()
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
        self.args, self.dtype, self.dequantize_fp8_at_load = args, dtype, dequantize_fp8_at_load
        self.record: MLARecord | None = None  # fp8 latent records (use_fp8_kv), else None: R + P values a row
        self.par = par = par or ParallelContext()
        # weight_format=packed: fp8 projections (BlockLinear.set_weight) and routed experts (RoutedExperts) stay in
        # packed tiles
        self.packed = packed
        # LoadOptions.host_steps: on the host, weight_format=dequantize widens the routed experts once at load
        self.widen_experts_at_load = dequantize_fp8_at_load or (host_steps and not packed)
        self.rope = build_rope(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling,
                               args.max_position_embeddings, args.rope_interleave)
        # Vocabulary-parallel embedding and head: each rank keeps 1/N of the rows.
        self.vocab_rows = Shard(0, *par.even(args.vocab_size, "vocab_size"))
        self.embed_tokens = nn.Embedding(self.vocab_rows.size, args.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self._layer(i, moe_impl) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = BlockLinear(args.hidden_size, args.vocab_size, shard=self.vocab_rows)
        n = args.num_hidden_layers
        self.mtp = nn.ModuleList(self._layer(n + j, moe_impl, mtp=True) for j in range(args.num_nextn_predict_layers))
        # Engram: ids before each token from the runner, and the ShortConv history in state slots (a hybrid cache)
        self.token_history = attach_engram_layers(self.layers, args.engram, engram_vocab, args.hidden_size, 1,
                                                  dtype, par)
        self.engram_prefetch = EngramPrefetch(overlap=par.world_size == 1)
        self.to(dtype)
        for module in self.modules():  # routing stays fp32 in every dtype
            if isinstance(module, MoE):
                module.gate.float()

    def _layer(self, index: int, moe_impl: str, mtp: bool = False) -> DecoderLayer:
        a, bs = self.args, self.args.fp8_block_size
        dims = MLADims(a.hidden_size, a.num_attention_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim,
                       a.qk_rope_head_dim, a.v_head_dim, a.attention_bias, a.rms_norm_eps)
        attn = MLAttention(dims, self.rope, bs, self.par)
        if index >= a.first_k_dense_replace:
            mlp: nn.Module = MoE(a.hidden_size, a.moe_intermediate_size, a.n_shared_experts, a.router(), bs,
                                 self.par, moe_impl, packed=self.packed)
        else:
            mlp = DenseMLP(a.hidden_size, a.intermediate_size, bs, self.par)
        if mtp:
            return MTPLayer(attn, mlp, a.hidden_size, a.rms_norm_eps, bs)
        return DecoderLayer(attn, mlp, a.hidden_size, a.rms_norm_eps)

    @classmethod
    def from_hf_config(cls, config: dict, dtype: torch.dtype,
                       options: "LoadOptions | None" = None) -> "DeepseekV3ForCausalLM":
        dequantize = bool(getattr(options, "dequantize_fp8_at_load", False))
        args = DeepseekV3Args.from_hf_config(config)
        vocab = None if args.engram is None else engram_vocabulary_of(getattr(options, "checkpoint_dir", ""))
        return cls(args, dtype=dtype, dequantize_fp8_at_load=dequantize, par=getattr(options, "par", None),
                   packed=bool(getattr(options, "packed", False)), engram_vocab=vocab,
                   host_steps=bool(getattr(options, "host_steps", True)))

    def set_moe_impl(self, impl: str) -> None:
        """"dynamic" (grouped dispatch, eager) or "static" (fixed shapes, for compiled regions)."""
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
        for module in self.modules():
            if isinstance(module, MoE):
                module.impl = impl

    # ---- the model-runner contract -------------------------------------------------------------------
    def kv_cache_shapes(self, num_slots: int) -> list[tuple[int, ...]]:
        """[L, slots, R + P] values, or [L, slots, record bytes] uint8 with an fp8 cache (use_fp8_kv)."""
        return [(self.args.num_hidden_layers, num_slots, self.latent_width)]

    @property
    def latent_width(self) -> int:
        """A cache row's width: R + P values, or the fp8 record's bytes (kernels/mla_fp8.py)."""
        return self.record.num_bytes if self.record is not None else self.args.latent_dim

    def use_fp8_kv(self, fp8_max: float) -> str:
        """The latent cache as fp8 records (MTP layers too): e4m3 latent with a power-of-two scale per 128 values
        and bf16 RoPE. Returns how the scales are chosen, for the load log."""
        self.record = MLARecord(self.args.kv_lora_rank, self.args.qk_rope_head_dim, fp8_max)
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.record = self.record
        return (f"MLA records of {self.record.num_bytes} B a token and layer (e4m3 latent, a power-of-two scale "
                f"per 128 values from each token's amax, bf16 RoPE)")

    @property
    def has_hybrid_state(self) -> bool:
        return bool(self.token_history)

    def hybrid_cache_shapes(self, num_blocks: int, block_size: int, num_state_slots: int,
                             max_drafts: int = 0) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """With Engram the cache is hybrid: the latent cache's blocks, and the ShortConv history in state slots."""
        return (self.kv_cache_shapes(num_blocks * block_size),
                [engram_ring_shape(self.args.engram, num_state_slots, max_drafts, self.args.hidden_size)])

    def engram_gather(self, input_ids: torch.Tensor,  # [T] int64
                      token_history: torch.Tensor | None) -> torch.Tensor:  # [T, H] int64 -> [L_e, T, width]
        return engram_gather(self.layers, self.args.engram, input_ids, token_history)

    def _add_engram(self, index: int, h: torch.Tensor,  # [T, hidden]
                    positions: torch.Tensor, rings: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k = self.args.engram.layer_ids.index(index)
        chunks = ([meta.decode_query_len] if meta.num_decodes else []) + list(meta.prefill_query_lens)
        added = self.layers[index].engram(h[:, None], meta.engram_rows[k], positions, meta.state, rings[k],
                                          max(chunks, default=None))
        return h + added[:, 0]

    def forward(self, input_ids: torch.Tensor,  # [T] int64
                positions: torch.Tensor,  # [T] int64
                kv_caches: list[torch.Tensor],  # [[num_layers, num_slots, R + P]]
                meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] (what compute_logits and the MTP proposer consume)."""
        pending = None
        if self.token_history and meta.engram_rows is None:  # eager: gathered here (regions gather before the graph)
            pending = self.engram_prefetch.start(partial(self.engram_gather, input_ids, meta.token_history))
        h = self.embed(input_ids)
        cos, sin = rope_cos_sin(self.rope, positions, h.dtype)
        cache = kv_caches[0]
        share = meta.context
        if share is not None:  # context parallelism: this rank's rows through the layers, every row at the end
            h = h[share.rows]
        for i, layer in enumerate(self.layers):
            if getattr(layer, "engram", None) is not None:
                if pending is not None:
                    meta, pending = replace(meta, engram_rows=pending.result()), None
                h = self._add_engram(i, h, positions, kv_caches[1], meta)
            h = layer(h, cos, sin, cache[i], meta)
        h = self.norm(h)
        return h if share is None else self.par.context.gather_rows(h, share.row_counts)

    @property
    def supports_context_parallel(self) -> bool:
        """MLA attends held latents (models/context_parallel.py); Engram's n-gram state is not split yet."""
        return not self.token_history

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        return vocab_parallel_embedding(input_ids, self.embed_tokens.weight, self.vocab_rows.start, self.par)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        """Every rank gets the full vocabulary row (all-gathered from the ranks' vocabulary shards)."""
        return self.par.all_gather_last(self.lm_head(hidden).float())

    # ---- weights -------------------------------------------------------------------------------------
    def _internal_name(self, name: str) -> str:
        if name.startswith("model.embed_tokens.") or name.startswith("model.norm."):
            return name[len("model."):]
        match = _LAYER.match(name)
        if match:
            index, rest = int(match.group(1)), match.group(2)
            n = self.args.num_hidden_layers
            if index < n:
                return f"layers.{index}.{rest}"
            if index - n < len(self.mtp):
                return f"mtp.{index - n}.{rest}"
            raise ValueError(f"checkpoint weight {name!r}: layer {index} is beyond num_hidden_layers={n} "
                             f"+ num_nextn_predict_layers={len(self.mtp)}")
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; fp8 weights pair up with their ``weight_scale_inv``."""
        pending: dict[str, dict[str, torch.Tensor]] = {}  # linear name -> {"weight", "weight_scale_inv"}
        loaded: set[str] = set()
        engram = EngramLoader(self.layers, self.dtype)
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, never loaded
            internal = self._internal_name(name)
            if engram.owns(internal):
                engram.take(internal, tensor)
                continue
            owner, _, leaf = internal.rpartition(".")
            expert = _EXPERT.match(internal)
            try:
                target = None if expert else self.get_submodule(owner)
            except AttributeError as err:
                raise ValueError(f"unexpected checkpoint tensor {name!r}") from err
            if expert or isinstance(target, BlockLinear):
                if leaf not in ("weight", "weight_scale_inv", "bias"):
                    raise ValueError(f"unexpected checkpoint tensor {name!r}")
                if leaf == "bias":
                    if target.has_bias:  # a row-parallel bias lives on the driver only
                        target.bias = read_shard(tensor, None).to(self.dtype)
                    continue
                entry = pending.setdefault(owner, {})
                entry[leaf] = tensor
                weight = entry.get("weight")
                if weight is not None and (weight.dtype != torch.float8_e4m3fn or "weight_scale_inv" in entry):
                    self._set_linear(owner, pending.pop(owner))
                    loaded.add(owner)
                continue
            if isinstance(target, WeightSlot) and leaf == "weight":
                # MTP's own embedding / head copies: the main model's are used (see spec_decode/mtp.py)
                if self.par.world_size == 1:
                    target.weight = read_shard(tensor, None).to(self.dtype)
                loaded.add(internal)
                continue
            param = getattr(target, leaf, None)
            if not isinstance(param, torch.Tensor):
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            tensor = read_shard(tensor, self.vocab_rows if internal == "embed_tokens.weight" else None)
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(internal)
        if pending:
            raise ValueError(f"fp8 weights without weight_scale_inv (or scales without weights): {sorted(pending)}")
        if "lm_head" not in loaded:
            if not self.args.tie_word_embeddings:
                raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
            self.lm_head.weight = self.embed_tokens.weight
        engram.finish()
        self._check_complete()

    def _set_linear(self, owner: str, entry: dict[str, torch.Tensor]) -> None:
        weight, scale = entry["weight"], entry.get("weight_scale_inv")
        if scale is not None and self.args.fp8_scale_fmt == "ue8m0":
            from kernels.quant import is_power_of_two_grid
            if not is_power_of_two_grid(scale):
                raise ValueError(f"{owner}.weight_scale_inv: scale_fmt is ue8m0 but the scales are not powers of two")
        expert = _EXPERT.match(owner + ".weight")
        if expert:
            experts = self.get_submodule(expert.group(1))
            assert isinstance(experts, RoutedExperts)
            # Widened once, here, on the host (the values the per-call widening computed, so the same outputs;
            # resident in the model dtype); packed keeps them in fp8 tiles, Neuron graphs in fp8 stacks
            experts.set_expert(int(expert.group(2)), expert.group(3), weight, scale, self.dtype,
                               self.widen_experts_at_load)
        else:
            # kv_b_proj is read whole (dense_weight) by MLA's absorbed decode at every step: it keeps the fp8 form
            packed = self.packed and not owner.endswith("kv_b_proj")
            self.get_submodule(owner).set_weight(weight, scale, self.dtype, self.dequantize_fp8_at_load, packed)

    def _check_complete(self) -> None:
        missing = [name for name, m in self.named_modules() if isinstance(m, BlockLinear)
                   and (m.weight is None or (m.has_bias and m.bias is None)) and not name.startswith("mtp.")]
        missing += [f"{name}.{p}" for name, m in self.named_modules() if isinstance(m, RoutedExperts)
                    and not name.startswith("mtp.") for p in m.missing()]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    @property
    def arch(self) -> DeepseekV3Args:
        """The engine reads ``model.arch.vocab_size`` (same attribute name as the Llama model)."""
        return self.args

    @property
    def has_mtp_weights(self) -> bool:
        return len(self.mtp) > 0 and all(m.eh_proj.weight is not None for m in self.mtp)
