"""DeepSeek-V4.1 causal LM (``DeepseekV41ForCausalLM``) over the hybrid KV cache; a checkpoint with ``vision.*``
also loads its vision encoder (``vision/``), whose image spans enter ``forward`` as ``embed_rows``.

``hybrid_cache_shapes`` (``backend_lib/core/hybrid_kv.py`` keeps the books):

* paged, only for the KV sources (a V4.1 request holds far less than a V4.0 one: Reuse and Reindex layers own no
  entries): ``entries_r2 [n2, rows2, D]`` and ``keys_r2 [n2, rows2, Di]`` of the ratio-2 sources
  (``ceil(block_size / 2)`` rows a block), ``entries_r1 [n1, rows1, D]`` and ``keys_r1 [n1, rows1, Di]`` of the
  ratio-1 sources (one row per position);
* fixed, per state slot: the window ring of every layer ``[L, S, sliding_window + drafts, D]`` and, for the
  ratio-2 sources, the open pair's fp32 ``[kv | gate]`` projections ``[n2, S, 2 + drafts, 2D]`` (a verification
  may roll back ``drafts`` positions). Ratio 1 keeps no state.

With ``kv_cache_dtype=fp8_e4m3`` the paged tensors hold fp4 records (``use_fp8_kv``). Ring state is valid only at
the position its request reached, so prefix caching is off, as for V4. Context parallelism splits the paged entries
by block (attention.py); every rank keeps every row and ring. Not yet here: Engram tables sharded over ranks, Engram
with context ranks, compiled regions. The ``mtp.*`` tensors (skipped here, said in the load log) are the DSpark
drafter's: models/dspark/deepseek_v41.py.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backend_lib.models.deepseek_v3.layers import BlockLinear, RMSNorm, build_rope
from backend_lib.models.deepseek_v41.attention import V41Attention, V41Dims, V41Step
from backend_lib.models.deepseek_v41.config import FULL, DeepseekV41Config, DeepseekV41TextArgs
from backend_lib.models.deepseek_v41.engram import V41Engram, V41EngramHash
from backend_lib.models.deepseek_v41.layers import V41DecoderLayer, V41MoE
from backend_lib.models.deepseek_v41.vision.config import VisionArgs
from backend_lib.models.deepseek_v41.vision.encoder import V41VisionEncoder, is_vision_tensor
from backend_lib.models.deepseek_v4.attention import LayerCache, StepContext, V4Rope
from backend_lib.models.deepseek_v4.layers import V4MoEDims
from backend_lib.models.deepseek_v4.step_pages import chunk_groups, token_pages
from backend_lib.models.interfaces import InputEmbeddingRows, ModelCapabilities, ServedModel
from backend_lib.models.parallel import ParallelContext, Shard, vocab_parallel_embedding
from kernels.attention_metadata import AttentionMetadata
from kernels.compressed_attention import entry_rows_per_block
from kernels.csa2_records import Fp4Record, entry_record, index_key_record
from kernels.hyper_connections import HyperConnectionSpec, hc_collapse

if TYPE_CHECKING:
    from backend_lib.models.loading.options import LoadOptions

_LOG = logging.getLogger(__name__)
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_IGNORED = re.compile(r"^mtp\.")
_QUANTIZED = (torch.float8_e4m3fn, torch.int8, torch.uint8)
_KEEP_FP32 = re.compile(r"(hc_\w+|attn_sink|ffn\.gate\.\w+|norm\.weight)$")


def _whole(tensor: Any) -> torch.Tensor:
    """A checkpoint tensor read whole (a lazy tensor reads on ``narrow``)."""
    return tensor.narrow(0, 0, tensor.shape[0])


class DeepseekV41ForCausalLM(ServedModel):
    # fp8_kv: the paged entries and index keys as fp4 records; packed_weights: the fp8 projections in packed tiles
    # context_parallel / splits_context_rows: the entries split by block, every row on every rank (compressors)
    capabilities = ModelCapabilities(fp8_kv=True, hybrid_cache=True, engram=True, packed_weights=True,
                                     context_parallel=True, splits_context_rows=False, captures_hidden=True,
                                     checkpoint_drafter=True, images=True)
    # the quantization-aware activations are the model's math (on); exact fp32 comparisons turn them off, since
    # summation-order noise flips their roundings
    qat_activations = True

    def __init__(self, config: DeepseekV41Config, dtype: torch.dtype = torch.float32,
                 par: ParallelContext = ParallelContext(), qat: bool | None = None,
                 engram_hash: V41EngramHash | None = None, packed: bool = False) -> None:
        super().__init__()
        qat = self.qat_activations if qat is None else qat
        a = config.text
        self.config, self.args, self.dtype, self.par, self.qat = config, a, dtype, par, qat
        # built by load_weights when the checkpoint has vision.*; kept off the module tree, so that moving the model
        # to a device (Neuron) leaves the tower in host memory and only its output goes to the device
        self._host_modules: dict[str, V41VisionEncoder] = {}
        self.packed = packed  # weight_format=packed: the fp8 projections as packed tiles (packed GEMMs)
        self.records: tuple[Fp4Record, Fp4Record] | None = None  # kv_cache_dtype=fp8_e4m3 (use_fp8_kv)
        block = (config.quantization.weight_block_size if config.quantization else (32, 32))
        # fp4 routed experts stay packed (two codes a byte, a ue8m0 scale per 32 inputs), dequantized per expert
        # when it runs; fp8 projections stay fp8, dequantized block-wise inside the linear
        self.packed_fp4 = config.quantization is not None and config.quantization.expert_dtype == "fp4"
        main = build_rope(a.qk_rope_head_dim, a.rope_theta, None, a.max_position_embeddings, True)
        compress = build_rope(a.qk_rope_head_dim, a.compress_rope_theta, a.compress_rope_scaling,
                              a.max_position_embeddings, True)
        self.main_rope = V4Rope(main.inv_freq, main.attention_factor)
        self.compress_rope = V4Rope(compress.inv_freq, compress.attention_factor)
        self.hc = HyperConnectionSpec(a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        dims = V41Dims(a.hidden_size, a.num_attention_heads, a.head_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank,
                       a.sliding_window, a.rms_norm_eps, a.index_n_heads, a.index_head_dim, a.index_topk,
                       a.candidate_topk_blocks, a.candidate_block_size, block)
        moe = V4MoEDims(a.hidden_size, a.moe_intermediate_size, a.n_routed_experts, a.num_experts_per_tok,
                        a.vocab_size, a.routed_scaling_factor, a.scoring_func, a.swiglu_limit, False)
        self.vocab_start, vocab_local = par.even(a.vocab_size, "vocab_size")
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.zeros(vocab_local, a.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(
            V41DecoderLayer(V41Attention(dims, role, self.main_rope, self.compress_rope, par),
                            V41MoE(moe, par, block, a.gate_temp, a.norm_topk_prob, packed_fp4=self.packed_fp4,
                                   image_token_id=config.image_token_id),
                            a.hidden_size, a.rms_norm_eps,
                            self.hc)
            for role in a.roles)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.head = BlockLinear(a.hidden_size, vocab_local)
        self.shards = {"embed.weight": Shard(0, self.vocab_start, vocab_local),
                       "head.weight": Shard(0, self.vocab_start, vocab_local)}
        # each KV source's index among the sources of its ratio (its row of entries_r{ratio} / keys_r{ratio})
        self.sources = {r: [role.layer for role in a.roles if role.mode == FULL and role.ratio == r] for r in (1, 2)}
        # Engram: the runner sends the N - 1 ids before each token (AttentionMetadata.token_history)
        self.engram_hash = engram_hash
        # Set by the DSpark proposer (worker/spec_decode/dspark_v41.py): forward then keeps the hc-mean of the streams
        # entering these layers (before their Engram; vLLM's ``previous_post.mean``), concatenated, in
        # ``captured_hidden`` [T, len(ids) * hidden].
        self.capture_layer_ids: tuple[int, ...] = ()
        self.captured_hidden: torch.Tensor | None = None
        self.token_history = a.engram_max_ngram_size - 1 if a.engram_layer_ids else 0
        if a.engram_layer_ids and engram_hash is None:
            raise ValueError("DeepSeek-V4.1 with Engram needs the checkpoint's tokenizer.json (its hash)")
        for k, (layer, rows) in enumerate(zip(a.engram_layer_ids, a.engram_num_embeddings)):
            self.layers[layer].engram = V41Engram(a, rows, block, config.image_token_id)
        self.to(dtype)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if _KEEP_FP32.search(name) and tensor.is_floating_point():
                tensor.data = tensor.data.float()

    @classmethod
    def from_hf_config(cls, config: dict, dtype: torch.dtype, options: "LoadOptions | None" = None,
                       par: ParallelContext | None = None) -> "DeepseekV41ForCausalLM":
        par = par or getattr(options, "par", None) or ParallelContext()
        parsed = DeepseekV41Config.from_hf_config(config)
        engram = None
        if parsed.text.engram_layer_ids:
            engram = V41EngramHash.build(parsed.text, Path(getattr(options, "checkpoint_dir", "")) / "tokenizer.json",
                                         parsed.image_token_id)
        return cls(parsed, dtype=dtype, par=par, engram_hash=engram, packed=bool(getattr(options, "packed", False)))

    # ---- the model-runner contract -------------------------------------------------------------------
    @property
    def supports_context_parallel(self) -> bool:
        # Engram with context ranks is not checked against the oracle yet: refused by the runner, naming the model
        return not self.args.engram_layer_ids

    def hybrid_cache_shapes(self, num_blocks: int, block_size: int, num_state_slots: int,
                            max_drafts: int = 0) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        a = self.args
        d, di, n1, n2 = a.head_dim, a.index_head_dim, len(self.sources[1]), len(self.sources[2])
        rows1 = num_blocks * entry_rows_per_block(block_size, 1)
        rows2 = num_blocks * entry_rows_per_block(block_size, 2)
        ed, id_ = (d, di) if self.records is None else (r.num_bytes for r in self.records)  # fp8: record bytes
        paged = [(n2, rows2, ed), (n2, rows2, id_), (n1, rows1, ed), (n1, rows1, id_)]
        state = [(a.num_hidden_layers, num_state_slots, a.sliding_window + max_drafts, d),
                 (n2, num_state_slots, 2 + max_drafts, 2 * d)]
        return paged, state

    def use_fp8_kv(self, fp8_max: float) -> str:
        """Compressed entries and index keys as fp4 records (kernels/csa2_records.py: NVFP4 / 16 and MXFP4 / 32,
        the QAT's own grids, so with QAT on the logits do not change); the rings keep the model dtype. ``fp8_max``
        does not apply: the records' only fp8 bytes are e4m3 scales of amax / 6."""
        a = self.args
        self.records = (entry_record(a.head_dim), index_key_record(a.index_head_dim))
        for layer in self.layers:
            layer.attn.records = self.records
        return (f"compressed entries {self.records[0].num_bytes} B (NVFP4), index keys {self.records[1].num_bytes} "
                f"B (MXFP4) a record; the sliding-window rings keep the model dtype")

    def _layer_cache(self, index: int, caches: list) -> LayerCache:
        entries_r2, keys_r2, entries_r1, keys_r1, window, state_r2 = caches[:6]
        role = self.args.roles[index]
        if not role.ratio:
            return LayerCache(window[index])
        k = self.sources[role.ratio].index(role.kv_source)
        entries, keys = (entries_r1, keys_r1) if role.ratio == 1 else (entries_r2, keys_r2)
        state = state_r2[k] if role.ratio == 2 and role.mode == FULL else None
        return LayerCache(window[index], state=state, entries=entries[k], index_entries=keys[k])

    def step_context(self, positions: torch.Tensor,  # [T] int64
                     meta: AttentionMetadata, dtype: torch.dtype) -> StepContext:
        if meta.state is None:
            raise ValueError("DeepSeek-V4.1 needs meta.state (its requests' state slots): run it through a runner "
                             "that allocates hybrid_cache_shapes")
        pages = token_pages(positions, meta)
        chunks = ([meta.decode_query_len] if meta.num_decodes else []) + list(meta.prefill_query_lens)
        return StepContext(pages, meta.slot_mapping, meta.state, self.main_rope.at(positions, dtype),
                           self.compress_rope.at(positions, dtype), chunk_groups(pages, meta),
                           meta.decode_query_len, max(chunks, default=None), context=meta.context)

    def forward(self, input_ids: torch.Tensor,  # [T] int64
                positions: torch.Tensor,  # [T] int64
                kv_caches: list,  # hybrid_cache_shapes' tensors, paged then fixed
                meta: AttentionMetadata,
                embed_rows: InputEmbeddingRows | None = None,  # image spans' rows: they enter before the hc expansion
                ) -> torch.Tensor:  # [T, hidden] final-normed hidden states
        h = vocab_parallel_embedding(input_ids, self.embed.weight, self.vocab_start, self.par)
        if embed_rows is not None:
            h = h.index_copy(0, embed_rows.rows, embed_rows.embeddings.to(h.dtype))
        step = V41Step(self.step_context(positions, meta, h.dtype), self.qat)
        streams = h.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()
        pre = torch.zeros(h.shape[0], self.args.hc_mult, device=h.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0: the embedding itself
        hashes = None
        if self.engram_hash is not None:  # once for every Engram layer
            if meta.token_history is None:
                raise ValueError("DeepSeek-V4.1 with Engram needs meta.token_history (model.token_history ids)")
            hashes = self.engram_hash(input_ids, meta.token_history)
        engram_index = {layer: k for k, layer in enumerate(self.args.engram_layer_ids)}
        kept = []
        for i, layer in enumerate(self.layers):
            if i in self.capture_layer_ids:
                kept.append(streams.mean(1))
            rows = hashes[:, engram_index[i]] if i in engram_index else None
            streams, pre = layer(streams, pre, input_ids, step, self._layer_cache(i, kv_caches), rows)
        if kept:
            self.captured_hidden = torch.cat(kept, dim=-1)
        return self.norm(hc_collapse(streams, pre))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.par.all_gather_last(self.head(hidden)).float()

    # ---- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Release-layout tensors (``layers.N.attn.wq_a.weight``; transformers main's ``model.`` and ``lm_head``
        accepted). ``mtp.*`` is skipped (logged); ``vision.*``, ``aligner.*`` and ``image_*`` go to the vision encoder,
        built only when the checkpoint has them (vision/encoder.py)."""
        shards = {f"{prefix}.{key}" if prefix else key: shard for prefix, module in self.named_modules()
                  for key, shard in getattr(module, "shards", {}).items()}
        loaded: set[str] = set()
        skipped = 0
        pending: dict[str, dict[str, Any]] = {}  # quantized module -> {"weight", "scale"} until both arrived
        vision: list[tuple[str, Any]] = []
        for raw_name, tensor in weights:
            name = raw_name.removeprefix("model.").replace("lm_head.", "head.")
            if is_vision_tensor(name):
                vision.append((name, tensor))
                continue
            if _IGNORED.match(name):
                skipped += 1
                continue
            base, _, leaf = name.rpartition(".")
            if leaf == "scale" or (leaf == "weight" and tensor.dtype in _QUANTIZED):
                entry = pending.setdefault(base, {})
                entry[leaf] = tensor
                if len(entry) == 2:
                    self._set_quantized(base, raw_name, pending.pop(base), shards.get(base + ".weight"))
                    loaded.add(base + ".weight")
                continue
            expert = _EXPERT.match(name)
            if expert:
                self._set_expert(expert, tensor, None)
            else:
                shard = shards.get(name)
                self._set(name, raw_name, shard.take(tensor) if shard is not None else _whole(tensor))
            loaded.add(name)
        if pending:
            raise ValueError(f"quantized weights without their scale (or scales without weights): {sorted(pending)}")
        if skipped:
            _LOG.info("DeepSeek-V4.1: %d tensors of mtp.* (DSpark) skipped", skipped)
        missing = sorted(self._expected_names() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if vision:
            self._load_vision(vision)

    def _load_vision(self, tensors: list[tuple[str, Any]]) -> None:
        if self.config.vision is None:
            raise ValueError("checkpoint has vision.* tensors but config.json has no vision_config")
        # replicated on every rank (tensor parallelism splits only the text model); only the driver runs it
        encoder = V41VisionEncoder(VisionArgs.from_dict(self.config.vision, self.args.hidden_size), self.dtype,
                                   self.config.image_token_id)
        encoder.load_weights(tensors)
        self._host_modules["image_encoder"] = encoder
        _LOG.info("DeepSeek-V4.1: vision tower loaded (%d layers of width %d): images in, text out",
                  encoder.args.num_hidden_layers, encoder.args.hidden_size)

    def _set_expert(self, expert: re.Match, weight: Any, scale: Any) -> None:
        moe = self.layers[int(expert.group(1))].ffn
        for local in moe.local_slots(int(expert.group(2))):  # none: another rank's expert (expert parallelism)
            moe.set_expert(local, expert.group(3), weight, scale)

    def _set_quantized(self, base: str, raw_name: str, entry: dict[str, Any], shard: Shard | None) -> None:
        """An fp8 projection (32x32 blocks; a rank's shard must fall on them) or a routed expert (fp4, or fp8)."""
        weight, scale = entry["weight"], entry["scale"]
        expert = _EXPERT.match(base + ".weight")
        if expert:
            self._set_expert(expert, weight, scale)
            return
        if base.endswith(".engram.embed"):  # an fp8 table: kept fp8, rows dequantized as they are gathered
            table = self.get_submodule(base)
            if tuple(weight.shape) != tuple(table.weight.shape):
                raise ValueError(f"{raw_name}: shape {tuple(weight.shape)} != expected {tuple(table.weight.shape)}")
            table.weight, table.scale = _whole(weight), _whole(scale).float()
            return
        try:
            target = self.get_submodule(base)
        except AttributeError as err:
            raise ValueError(f"unexpected checkpoint tensor {raw_name!r}") from err
        if not isinstance(target, BlockLinear) or weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"unexpected quantized checkpoint tensor {raw_name!r}")
        if shard is not None:
            block = target.block_size[shard.dim]
            if shard.start % block or (shard.size % block and shard.start + shard.size != weight.shape[shard.dim]):
                raise ValueError(f"{raw_name}: this rank's shard ({shard}) does not fall on the {block}-wide fp8 "
                                 f"scale blocks; choose a tensor_parallel_size that keeps shards block-aligned")
            weight = shard.take(weight)
            scale = Shard(shard.dim, shard.start // block, -(-shard.size // block)).take(scale)
        # weight_format=packed: packed tiles, but wo_a, read whole (dense_weight) by the grouped product every step
        packed = self.packed and not base.endswith("wo_a")
        target.set_weight(_whole(weight), _whole(scale).float(), self.dtype, False, packed)

    def _set(self, name: str, raw_name: str, value: torch.Tensor) -> None:
        owner, _, leaf = name.rpartition(".")
        try:
            target = self.get_submodule(owner)
        except AttributeError as err:
            raise ValueError(f"unexpected checkpoint tensor {raw_name!r} (not in this schedule's layers)") from err
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
        buffers = ("gate.bias", "gate.bias_vl", "engram.embed.weight")
        names |= {n for n, _ in self.named_buffers() if n.endswith(buffers)}
        for i, layer in enumerate(self.layers):
            names |= {f"layers.{i}.ffn.experts.{e}.{w}.weight" for e in layer.ffn.held_experts()
                      for w in ("w1", "w2", "w3")}
        return names

    @property
    def image_encoder(self) -> V41VisionEncoder | None:
        return self._host_modules.get("image_encoder")

    @property
    def arch(self) -> DeepseekV41TextArgs:
        """The engine reads ``model.arch.vocab_size`` and ``max_position_embeddings``."""
        return self.args
