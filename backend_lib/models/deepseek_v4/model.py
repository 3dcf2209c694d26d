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
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backend_lib.models.interfaces import ModelCapabilities, ServedModel
from backend_lib.models.deepseek_v3.layers import BlockLinear, RMSNorm, build_rope
from backend_lib.models.deepseek_v4.args import DeepseekV4Args
from backend_lib.models.deepseek_v4.attention import (
    CSA, HCA, SLIDING, Compressor, LayerCache, StepContext, V4Attention, V4AttentionDims, V4Rope,
)
from backend_lib.models.deepseek_v4.layers import HASH_MOE, MOE_IMPLS, V4DecoderLayer, V4MoE, V4MoEDims
from backend_lib.models.deepseek_v4.mtp import V4MTPLayer
from backend_lib.models.deepseek_v4.step_pages import chunk_groups, token_pages
from backend_lib.models.engram.layer import (
    EngramPrefetch, attach_engram_layers, engram_gather, engram_ring_shape, engram_vocabulary_of,
)
from backend_lib.models.engram.loading import EngramLoader
from backend_lib.models.parallel import ParallelContext, Shard, vocab_parallel_embedding
from kernels.attention_metadata import AttentionMetadata
from kernels.compressed_attention import entry_rows_per_block
from kernels.cpu_kernels import load_cpu_kernels
from kernels.hyper_connections import HyperConnectionSpec, hc_head_collapse
from kernels.v4_fp8 import EntryRecord, IndexKeyRecord

if TYPE_CHECKING:
    from backend_lib.models.loading.options import LoadOptions

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


class DeepseekV4ForCausalLM(ServedModel):
    # packed_weights: the fp8 projections; splits_context_rows: its compressors and rings need every row
    capabilities = ModelCapabilities(fp8_kv=True, hybrid_cache=True, mtp="ring", engram=True, packed_weights=True,
                                     context_parallel=True, splits_context_rows=False, static_moe=True,
                                     host_packing=True, cpu_attention=True)

    def __init__(self, args: DeepseekV4Args, dtype: torch.dtype = torch.float32,
                 par: ParallelContext = ParallelContext(), moe_impl: str = "dynamic",
                 dequantize_fp8_at_load: bool = False, packed: bool = False, engram_vocab: Any = None) -> None:
        super().__init__()
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
        self.args, self.dtype, self.par = args, dtype, par
        self.dequantize_fp8_at_load, self.packed = dequantize_fp8_at_load, packed
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
        # token ids before each step token that the runner sends (AttentionMetadata.token_history): Engram's n-grams
        self.token_history = attach_engram_layers(self.layers, a.engram, engram_vocab, a.hidden_size, a.hc_mult,
                                                  dtype, par)
        self.engram_prefetch = EngramPrefetch(overlap=par.world_size == 1)
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
        args = DeepseekV4Args.from_hf_config(config)
        vocab = None if args.engram is None else engram_vocabulary_of(getattr(options, "checkpoint_dir", ""))
        return cls(args, dtype=dtype, par=par, dequantize_fp8_at_load=dequantize,
                   packed=bool(getattr(options, "packed", False)), engram_vocab=vocab)

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
    # Context parallelism (models/deepseek_v4_attention.py ``_attend_held``): the compressed entries are split across
    # the context ranks by block; the rings and every row stay on every rank (the compressors read all of them).

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
        if a.engram is not None:  # the ShortConv's past normed values, per Engram layer
            state.append(engram_ring_shape(a.engram, num_state_slots, max_drafts, a.hc_mult * a.hidden_size))
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

    def engram_gather(self, input_ids: torch.Tensor,  # [T] int64
                      token_history: torch.Tensor | None) -> torch.Tensor:  # [T, H] int64 -> [L_e, T, width]
        return engram_gather(self.layers, self.args.engram, input_ids, token_history)

    def _engram(self, index: int, caches: list, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
        engram = self.args.engram
        if engram is None or index not in engram.layer_ids:
            return {}
        k = engram.layer_ids.index(index)
        return {"engram_ring": caches[7 + self.has_mtp_weights][k], "engram_rows": meta.engram_rows[k]}

    def _layer_cache(self, index: int, caches: list, meta: AttentionMetadata) -> LayerCache:
        """``caches``: the paged tensors then the fixed ones, in ``hybrid_cache_shapes`` order."""
        csa_entries, index_entries, hca_entries, window, csa_state, index_state, hca_state = caches[:7]
        layer_type, k = self.args.layer_types[index], self.cache_index[index]
        engram = self._engram(index, caches, meta)
        if layer_type == SLIDING:
            return LayerCache(window[index], **engram)
        if layer_type == HCA:
            return LayerCache(window[index], state=hca_state[k], entries=hca_entries[k], **engram)
        return LayerCache(window[index], state=csa_state[k], entries=csa_entries[k], index_state=index_state[k],
                          index_entries=index_entries[k], **engram)

    def forward(self, input_ids: torch.Tensor,  # [T] int64
                positions: torch.Tensor,  # [T] int64
                kv_caches: list,  # see hybrid_cache_shapes: layer-major roots, or per-layer views (compiled regions)
                meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] (with ``keep_streams``, ``last_streams`` keeps the pre-hc_head
        streams [T, hc, hidden] for the MTP drafts)."""
        pending = None
        if self.token_history and meta.engram_rows is None:  # eager: gathered here (regions gather before the graph)
            pending = self.engram_prefetch.start(partial(self.engram_gather, input_ids, meta.token_history))
        h = self.embed_tokens(input_ids)
        ctx = self.step_context(positions, meta, h.dtype)
        streams = h.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            if pending is not None and layer.engram is not None:  # the first Engram layer waits for the rows
                meta, pending = replace(meta, engram_rows=pending.result()), None
            streams = layer(streams, input_ids, ctx, self._layer_cache(i, kv_caches, meta))
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
        pages = token_pages(positions, meta)
        chunks = ([meta.decode_query_len] if meta.num_decodes else []) + list(meta.prefill_query_lens)
        return StepContext(pages, meta.slot_mapping, meta.state, self.main_rope.at(positions, dtype),
                           self.compress_rope.at(positions, dtype), chunk_groups(pages, meta),
                           meta.decode_query_len, max(chunks, default=None), context=meta.context)

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
        engram = EngramLoader(self.layers, self.dtype)
        for raw_name, tensor in weights:
            name = raw_name[len("model."):] if raw_name.startswith("model.") else raw_name
            name = _SAVED_NAMES.get(name, name)
            if engram.owns(name):
                engram.take(name, tensor)
                continue
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
        engram.finish()
        missing = sorted({n for n in self._expected_names() if ".engram." not in n} - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if self.packed:  # the fp4 routed experts into the packed GEMM's tiles, once every expert is in
            for module in self.modules():
                if isinstance(module, V4MoE):
                    module.pack_experts()

    def _set_expert(self, expert: re.Match, weight: Any, scale: Any) -> None:
        moe = getattr(self, expert.group(1))[int(expert.group(2))].ffn
        for local in moe.local_slots(int(expert.group(3))):  # none: another rank's expert (expert parallelism)
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
        # weight_format=packed: the fp8 projections in packed tiles, but wo_a, read whole (dense_weight) by its
        # block-diagonal grouped product at every step; the fp4 routed experts keep their own packed form
        packed = self.packed and not base.endswith("wo_a")
        target.set_weight(_whole(weight), _whole(scale).float(), self.dtype, self.dequantize_fp8_at_load, packed)

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
                names |= {f"{prefix}.{i}.ffn.experts.{expert}.{w}.weight"
                          for expert in moe.held_experts() for w in ("w1", "w2", "w3")}
        return names

    @property
    def arch(self) -> DeepseekV4Args:
        """The engine reads ``model.arch.vocab_size``."""
        return self.args

    @property
    def has_mtp_weights(self) -> bool:
        """Whether the checkpoint brought its nextn depths (``spec_method=mtp`` drafts with ``mtp[0]``)."""
        return len(self.mtp) > 0
