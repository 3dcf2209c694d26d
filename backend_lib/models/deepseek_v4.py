"""DeepSeek-V4 causal LM (transformers 5.24 ``DeepseekV4ForCausalLM``) over the hybrid KV cache.

The model declares its cache with ``hybrid_cache_shapes`` (``backend_lib/core/hybrid_kv.py`` owns the bookkeeping):

* paged, per block of ``block_size`` positions, ``ceil(block_size / rate)`` rows per compressed-entry tensor (the
  windows that close in the block): ``csa_entries [n_csa, rows, D]``, ``index_entries [n_csa, rows, Di]``,
  ``hca_entries [n_hca, rows, D]``. A long context costs compressed memory only.
* fixed, one row per state slot (a running request, or a session kept between turns), rings of the last positions
  (``kernels/state_ring.py``; each ring also holds ``max_drafts`` positions a draft verification may roll back):
  ``window [L, S, sliding_window, D]`` (K = V of every layer), ``csa_state [n_csa, S, 2 * rate, 4D]`` and
  ``index_state [n_csa, S, 2 * rate, 4Di]`` (the overlapping compressors' ``[kv_a | kv_b | gate_a | gate_b]``),
  ``hca_state [n_hca, S, rate, 2D]`` (``[kv | gate]`` of the open window).

Attention reads the window from the ring (this step's tokens fresh) and the entries of closed windows through the
block table; a step pools a candidate entry for every token and keeps those of the windows that close, so a chunk
may end anywhere. Ring state is only valid at the position a request reached, so prefix caching is off for V4.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backend_lib.models.deepseek_layers import BlockLinear, RMSNorm, build_rope
from backend_lib.models.deepseek_v4_attention import (
    CSA, HCA, LAYER_TYPES, SLIDING, Compressor, LayerCache, StepContext, V4Attention, V4AttentionDims, V4Rope,
    compress_rope_scaling,
)
from backend_lib.models.deepseek_v4_layers import (
    HASH_MOE, MOE_IMPLS, SCORING_FUNCS, TOPK_MOE, V4DecoderLayer, V4MoE, V4MoEDims,
)
from backend_lib.models.deepseek_v4_mtp import V4MTPLayer
from backend_lib.models.parallel import ParallelContext, Shard, vocab_parallel_embedding
from kernels.attention_metadata import AttentionMetadata
from kernels.compressed_attention import ChunkPages, TokenPages, entry_rows_per_block
from kernels.cpu_kernels import load_cpu_kernels
from kernels.hyper_connections import HyperConnectionSpec, hc_head_collapse
from kernels.quant import DEFAULT_BLOCK
from kernels.v4_fp8 import EntryRecord, IndexKeyRecord

if TYPE_CHECKING:
    from backend_lib.models.load_options import LoadOptions

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

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "DeepseekV4Args":
        names = {f.name for f in fields(cls)} - {"layer_types", "mlp_layer_types", "compress_rates",
                                                  "rope_head_dim", "compress_rope_scaling"}
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

    def rate(self, layer_type: str) -> int:
        return dict(self.compress_rates).get(layer_type, 0) if layer_type != SLIDING else 0

    def count(self, layer_type: str) -> int:
        return sum(1 for t in self.layer_types if t == layer_type)


_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
# what transformers' save_pretrained writes -> the release names our modules carry
_SAVED_NAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_QUANTIZED = (torch.float8_e4m3fn, torch.int8, torch.uint8)
_KEEP_FP32 = re.compile(r"(hc_\w+|attn_sink|\.ape|ffn\.gate\.\w+|ffn\.\w+_scale|norm\.weight)$")


def _whole(tensor: Any) -> torch.Tensor:
    """A checkpoint tensor read whole (a lazy tensor reads on ``narrow``; a torch tensor returns itself)."""
    return tensor.narrow(0, 0, tensor.shape[0])


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, args: DeepseekV4Args, dtype: torch.dtype = torch.float32,
                 par: ParallelContext = ParallelContext(), moe_impl: str = "dynamic",
                 dequantize_fp8_at_load: bool = False) -> None:
        super().__init__()
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
        self.args, self.dtype, self.par = args, dtype, par
        self.dequantize_fp8_at_load = dequantize_fp8_at_load
        self.records: tuple[EntryRecord, IndexKeyRecord] | None = None  # fp8 paged entries (use_fp8_kv)
        a = args
        main = build_rope(a.rope_head_dim, a.rope_theta, None, a.max_position_embeddings, True)
        compress = build_rope(a.rope_head_dim, a.compress_rope_theta, a.compress_rope_scaling,
                              a.max_position_embeddings, True)
        self.main_rope = V4Rope(main.inv_freq, main.attention_factor)
        self.compress_rope = V4Rope(compress.inv_freq, compress.attention_factor)
        self.hc = HyperConnectionSpec(a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        self.vocab_start, vocab_local = par.even(a.vocab_size, "vocab_size")
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.zeros(vocab_local, a.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(self._layer(i, moe_impl) for i in range(a.num_hidden_layers))
        # the checkpoint's nextn depths (dropped at load when it has no mtp.* tensors); drafts chain mtp[0]
        self.mtp = nn.ModuleList(self._layer(i, moe_impl, mtp=True) for i in range(a.num_nextn_predict_layers))
        self.keep_streams = False  # set by the MTP proposer: forward then keeps its pre-hc_head streams
        self.last_streams: torch.Tensor | None = None
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.head = BlockLinear(a.hidden_size, vocab_local)
        self.hc_head_fn = nn.Parameter(torch.zeros(a.hc_mult, a.hc_mult * a.hidden_size), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.zeros(a.hc_mult), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.shards = {"embed.weight": Shard(0, self.vocab_start, vocab_local),
                       "head.weight": Shard(0, self.vocab_start, vocab_local)}
        # each layer's index inside its cache tensor (kv: every layer; csa / hca: layers of that type)
        self.cache_index = [sum(1 for t in a.layer_types[:i] if t == a.layer_types[i])
                            for i in range(a.num_hidden_layers)]
        self.to(dtype)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if _KEEP_FP32.search(name) and tensor.is_floating_point():
                tensor.data = tensor.data.float()

    def _layer(self, index: int, moe_impl: str, mtp: bool = False) -> V4DecoderLayer:
        """Main layer ``index``, or (``mtp``) nextn depth ``index``: sliding-only attention, top-k MoE."""
        a = self.args
        layer_type = SLIDING if mtp else a.layer_types[index]
        dims = V4AttentionDims(a.hidden_size, a.num_attention_heads, a.head_dim, a.q_lora_rank, a.o_groups,
                               a.o_lora_rank, a.sliding_window, a.rms_norm_eps, layer_type, a.rate(layer_type),
                               a.index_n_heads, a.index_head_dim, a.index_topk)
        attn = V4Attention(dims, self.main_rope, self.compress_rope, self.par, a.fp8_block_size)
        moe = V4MoEDims(a.hidden_size, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok,
                        a.vocab_size, a.routed_scaling_factor, a.scoring_func, a.swiglu_limit,
                        not mtp and a.mlp_layer_types[index] == HASH_MOE)
        packed = a.expert_dtype == "fp4" and not self.dequantize_fp8_at_load
        ffn = V4MoE(moe, self.par, a.fp8_block_size, impl=moe_impl, packed_fp4=packed)
        return (V4MTPLayer if mtp else V4DecoderLayer)(attn, ffn, a.hidden_size, a.rms_norm_eps, self.hc)

    @classmethod
    def from_hf_config(cls, config: dict, dtype: torch.dtype, options: "LoadOptions | None" = None,
                       par: ParallelContext | None = None) -> "DeepseekV4ForCausalLM":
        dequantize = bool(getattr(options, "dequantize_fp8_at_load", False))
        par = par or getattr(options, "par", None) or ParallelContext()  # the loader's rank, unless given here
        return cls(DeepseekV4Args.from_hf_config(config), dtype=dtype, par=par, dequantize_fp8_at_load=dequantize)

    def set_moe_impl(self, impl: str) -> None:
        """"dynamic" (grouped dispatch, eager) or "static" (fixed shapes, for compiled regions)."""
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
        for layer in [*self.layers, *self.mtp]:
            layer.ffn.impl = impl

    def pack_for_cpu(self, plan: Any = None) -> None:
        """Host engines (``executor/rank.py`` calls this before building compiled regions): the static MoE of a
        compiled region runs the grouped experts as one opaque op (``kernels/grouped_experts.py``), the work and
        results of an eager step; with the blocked layout (``plan.blocked``, or no plan) the experts run as one C++
        op on weights blocked here (``V4MoE.block_experts``), eagerly and in compiled regions alike. So do the
        fp32 / bf16 projections for the row counts ``plan.policy`` gives them (``BlockLinear.block_for_cpu``). mHC's
        mixes (Sinkhorn included) run as one C++ op where the ops are built."""
        if load_cpu_kernels():
            self.hc = replace(self.hc, cpp_mixes=True)
        if plan is not None and plan.blocked:
            for module in self.modules():
                if isinstance(module, BlockLinear):
                    module.block_for_cpu(plan.policy)
            for module in self.modules():  # projections of one input as one GEMM, once all are blocked
                if hasattr(module, "fuse_for_cpu"):
                    module.fuse_for_cpu()
        for layer in [*self.layers, *self.mtp]:
            layer.hc = self.hc
            layer.ffn.opaque_experts = True
            if plan is None or plan.blocked:
                layer.ffn.block_experts()

    def use_cpu_attention(self) -> None:
        """Host engines (``host_attention="cpp"``, the C++ ops built): fp32 attention in one C++ pass per token, and
        the tail RoPE of attention, compressors and indexers and every RMS norm in one C++ call each."""
        for layer in self.layers:
            layer.attn.cpp_attention = True
        for module in self.modules():
            if hasattr(module, "cpp_rope"):
                module.cpp_rope = True
            if isinstance(module, RMSNorm):
                module.cpp = True

    # ---- the model-runner contract -------------------------------------------------------------------
    def hybrid_cache_shapes(self, num_blocks: int, block_size: int, num_state_slots: int,
                            max_drafts: int = 0) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """(paged tensors for ``num_blocks`` blocks, fixed tensors for ``num_state_slots`` slots); the runner adds
        the scratch block and the scratch slot. ``max_drafts``: positions a verification may roll back. A model
        with MTP weights adds the drafting depth's sliding-window ring ``[1, S, sliding_window + max_drafts, D]``:
        its rows sit at the main positions, so the same drafts roll back."""
        a = self.args
        d, di, n_csa, n_hca = a.head_dim, a.index_head_dim, a.count(CSA), a.count(HCA)
        csa_rate, hca_rate = max(a.rate(CSA), 1), max(a.rate(HCA), 1)
        csa_rows = num_blocks * entry_rows_per_block(block_size, csa_rate)
        hca_rows = num_blocks * entry_rows_per_block(block_size, hca_rate)
        ed, id_ = (d, di) if self.records is None else (r.num_bytes for r in self.records)  # fp8: record bytes
        paged = [(n_csa, csa_rows, ed), (n_csa, csa_rows, id_), (n_hca, hca_rows, ed)]
        state = [(a.num_hidden_layers, num_state_slots, a.sliding_window + max_drafts, d),
                 (n_csa, num_state_slots, 2 * csa_rate + max_drafts, 4 * d),
                 (n_csa, num_state_slots, 2 * csa_rate + max_drafts, 4 * di),
                 (n_hca, num_state_slots, hca_rate + max_drafts, 2 * d)]
        if self.has_mtp_weights:
            state.append((1, num_state_slots, a.sliding_window + max_drafts, d))
        return paged, state

    def use_fp8_kv(self, fp8_max: float) -> str:
        """Compressed entries and indexer keys as fp8 records (kernels/v4_fp8.py); the rings keep the model dtype
        (the runner allocates the paged tensors in uint8, the state in the model dtype)."""
        a = self.args
        self.records = (EntryRecord(a.head_dim, a.rope_head_dim, fp8_max), IndexKeyRecord(a.index_head_dim, fp8_max))
        for name, module in self.named_modules():
            if isinstance(module, Compressor):
                module.record = self.records[1 if ".indexer." in f".{name}." else 0]
        return (f"compressed entries {self.records[0].num_bytes} B, indexer keys {self.records[1].num_bytes} B "
                f"(power-of-two scales from each entry's amax); sliding-window rings in {self.dtype}")

    def mtp_window(self, caches: list) -> torch.Tensor:  # the drafting depth's ring [S + 1, window + drafts, D]
        return caches[7][0]

    def _layer_cache(self, index: int, caches: list) -> LayerCache:
        """``caches``: the paged tensors then the fixed ones, in ``hybrid_cache_shapes`` order."""
        csa_entries, index_entries, hca_entries, window, csa_state, index_state, hca_state = caches[:7]
        layer_type, k = self.args.layer_types[index], self.cache_index[index]
        if layer_type == SLIDING:
            return LayerCache(window[index])
        if layer_type == HCA:
            return LayerCache(window[index], state=hca_state[k], entries=hca_entries[k])
        return LayerCache(window[index], state=csa_state[k], entries=csa_entries[k], index_state=index_state[k],
                          index_entries=index_entries[k])

    def _pages(self, positions: torch.Tensor, meta: AttentionMetadata) -> TokenPages:
        """Each token's block table: decode rows repeated per query, prefill rows per chunk token. Columns past a
        table's end read block 0: every entry there is masked (past the token's position)."""
        tables = []
        if meta.num_decodes:
            tables.append(meta.decode_block_tables.repeat_interleave(meta.decode_query_len, dim=0))
        if meta.num_prefills:
            lens = torch.tensor(meta.prefill_query_lens, device=positions.device)
            tables.append(meta.prefill_block_tables.repeat_interleave(lens, dim=0,
                                                                      output_size=sum(meta.prefill_query_lens)))
        width = max(t.shape[1] for t in tables)
        padded = [torch.nn.functional.pad(t.long(), (0, width - t.shape[1]), value=0) for t in tables]
        return TokenPages(positions, torch.cat(padded), meta.block_size)

    @staticmethod
    def _groups(pages: TokenPages, meta: AttentionMetadata) -> tuple:
        """Decode rows keep per-token keys; each prefill chunk shares one gather of its context's keys."""
        groups: list = []
        nd = meta.num_decode_tokens
        if nd:
            groups.append((0, nd, TokenPages(pages.positions[:nd], pages.block_tables[:nd], meta.block_size)))
        start = nd
        for i, length in enumerate(meta.prefill_query_lens):
            first = meta.prefill_seq_lens[i] - length
            table = meta.prefill_block_tables[i:i + 1].long()
            groups.append((start, start + length, ChunkPages(first, length, table, meta.block_size)))
            start += length
        return tuple(groups)

    def forward(self, input_ids: torch.Tensor,  # [T] int64
                positions: torch.Tensor,  # [T] int64
                kv_caches: list,  # see hybrid_cache_shapes: layer-major roots, or per-layer views (compiled regions)
                meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] (with ``keep_streams``, ``last_streams`` keeps the pre-hc_head
        streams [T, hc, hidden] for the MTP drafts)."""
        h = self.embed_tokens(input_ids)
        ctx = self.step_context(positions, meta, h.dtype)
        streams = h.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            streams = layer(streams, input_ids, ctx, self._layer_cache(i, kv_caches))
        if self.keep_streams:
            self.last_streams = streams
        collapsed = hc_head_collapse(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.hc)
        return self.norm(collapsed)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        return vocab_parallel_embedding(input_ids, self.embed.weight, self.vocab_start, self.par)

    def step_context(self, positions: torch.Tensor,  # [T] int64
                     meta: AttentionMetadata, dtype: torch.dtype) -> StepContext:
        """What every layer of a step shares (the MTP passes build theirs here too)."""
        if meta.state is None:
            raise ValueError("DeepSeek-V4 needs meta.state (its requests' state slots): run it through a runner that "
                             "allocates hybrid_cache_shapes")
        pages = self._pages(positions, meta)
        chunks = ([meta.decode_query_len] if meta.num_decodes else []) + list(meta.prefill_query_lens)
        return StepContext(pages, meta.slot_mapping, meta.state, self.main_rope.at(positions, dtype),
                           self.compress_rope.at(positions, dtype), self._groups(pages, meta),
                           meta.decode_query_len, max(chunks, default=None))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.par.all_gather_last(self.head(hidden)).float()

    # ---- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Release-layout tensors (``layers.N.attn.wq_a.weight``, with or without ``model.``), as transformers'
        ``save_pretrained`` writes them. Tensors may be lazy: each rank ``narrow``s out its shard before reading."""
        shards = {f"{prefix}.{key}" if prefix else key: shard for prefix, module in self.named_modules()
                  for key, shard in getattr(module, "shards", {}).items()}
        loaded: set[str] = set()
        pending: dict[str, dict[str, Any]] = {}  # quantized module -> {"weight", "scale"} until both arrived
        for raw_name, tensor in weights:
            name = raw_name[len("model."):] if raw_name.startswith("model.") else raw_name
            name = _SAVED_NAMES.get(name, name)
            if self._is_mtp(name) and not (name.startswith("mtp.") and self.mtp):
                continue  # V3-style nextn layers past num_hidden_layers, or depths the config does not declare
            base, _, leaf = name.rpartition(".")
            if leaf in ("scale", "weight_scale_inv") or (leaf == "weight" and tensor.dtype in _QUANTIZED):
                entry = pending.setdefault(base, {})
                entry["weight" if leaf == "weight" else "scale"] = tensor
                if len(entry) == 2:
                    self._set_quantized(base, raw_name, pending.pop(base), shards)
                    loaded.add(base + ".weight")
                continue
            expert = _EXPERT.match(name)
            if expert:
                self._set_expert(expert, tensor, None)
                loaded.add(name)
                continue
            shard = shards.get(name)
            value = shard.take(tensor) if shard is not None else _whole(tensor)
            self._set(name, raw_name, value)
            loaded.add(name)
        if pending:
            raise ValueError(f"quantized weights without their scale (or scales without weights): {sorted(pending)}")
        if not any(n.startswith("mtp.") for n in loaded):
            self.mtp = nn.ModuleList()  # a checkpoint without its nextn depths (transformers' save drops them)
        if "head.weight" not in loaded and self.args.tie_word_embeddings:
            self.head.weight = self.embed.weight
            loaded.add("head.weight")
        missing = sorted(self._expected_names() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _set_expert(self, expert: re.Match, weight: Any, scale: Any) -> None:
        moe = getattr(self, expert.group(1))[int(expert.group(2))].ffn
        local = moe.local_expert(int(expert.group(3)))
        if local is not None:  # else another rank's expert (expert parallelism)
            moe.set_expert(local, expert.group(4), weight, scale)

    def _set_quantized(self, base: str, raw_name: str, entry: dict[str, Any], shards: dict[str, Shard]) -> None:
        """An fp8 projection (kept fp8, dequantized block-wise inside the linear) or an fp4 / fp8 expert."""
        expert = _EXPERT.match(base + ".weight")
        if expert:
            self._set_expert(expert, entry["weight"], entry["scale"])
            return
        target = self.get_submodule(base) if base else None
        if not isinstance(target, BlockLinear) or entry["weight"].dtype != torch.float8_e4m3fn:
            raise ValueError(f"unexpected quantized checkpoint tensor {raw_name!r}")
        weight, scale = entry["weight"], entry["scale"]
        shard = shards.get(base + ".weight")
        if shard is not None:
            block = self.args.fp8_block_size[shard.dim]
            if shard.start % block or (shard.size % block and shard.start + shard.size != weight.shape[shard.dim]):
                raise ValueError(f"{raw_name}: this rank's shard ({shard}) does not fall on the {block}-wide fp8 "
                                 f"scale blocks; choose a tensor_parallel_size that keeps shards block-aligned")
            weight = shard.take(weight)
            scale = Shard(shard.dim, shard.start // block, -(-shard.size // block)).take(scale)
        target.set_weight(_whole(weight), _whole(scale).float(), self.dtype, self.dequantize_fp8_at_load)

    def _is_mtp(self, name: str) -> bool:
        layer = _LAYER.match(name)
        return name.startswith("mtp.") or (layer is not None and int(layer.group(1)) >= self.args.num_hidden_layers)

    def _set(self, name: str, raw_name: str, value: torch.Tensor) -> None:
        owner, _, leaf = name.rpartition(".")
        try:
            target = self.get_submodule(owner)
        except AttributeError as err:
            raise ValueError(f"unexpected checkpoint tensor {raw_name!r}") from err
        if isinstance(target, BlockLinear) and leaf == "weight":
            target.set_weight(value, None, self.dtype, False)
            return
        current = getattr(target, leaf, None)
        if not isinstance(current, torch.Tensor) or isinstance(target, BlockLinear):
            raise ValueError(f"unexpected checkpoint tensor {raw_name!r}")
        if tuple(current.shape) != tuple(value.shape):
            raise ValueError(f"{raw_name}: shape {tuple(value.shape)} != expected {tuple(current.shape)}")
        with torch.no_grad():
            current.copy_(value.to(current.dtype))

    def _expected_names(self) -> set[str]:
        names = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, BlockLinear)}
        names |= {n for n, _ in self.named_parameters()}
        names |= {n for n, _ in self.named_buffers() if n.endswith(("gate.bias", "gate.tid2eid"))}
        names -= {n for n in names if n.endswith((".gate_up", ".down"))}
        for prefix, layers in (("layers", self.layers), ("mtp", self.mtp)):
            for i, layer in enumerate(layers):
                moe = layer.ffn
                names |= {f"{prefix}.{i}.ffn.experts.{moe.first_expert + local}.{w}.weight"
                          for local in range(moe.num_local_experts) for w in ("w1", "w2", "w3")}
        return names

    @property
    def arch(self) -> DeepseekV4Args:
        """The engine reads ``model.arch.vocab_size``."""
        return self.args

    @property
    def has_mtp_weights(self) -> bool:
        """Whether the checkpoint brought its nextn depths (``spec_method=mtp`` drafts with ``mtp[0]``)."""
        return len(self.mtp) > 0
