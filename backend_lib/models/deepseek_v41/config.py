"""``DeepseekV41Config``: a DeepSeek-V4.1 config.json read and checked once.

The release's config.json is composite (``model_type`` ``deepseek_v41``, ``architectures``
``[DeepseekV41ForCausalLM]`` even for text-only use): ``text_config`` (the backbone), ``vision_config`` (kept as
given: the vision tower is not served here), ``quantization_config`` (fp8 32x32 blocks, fp4 routed experts) and
``image_token_id``. A flat text config (transformers' ``deepseek_v41_text``) is read too.

Field names and defaults are the released Flash values as NeMo AutoModel's ``DeepseekV41TextConfig`` and
transformers main's ``configuration_deepseek_v41.py`` (commit 0a2080b4) give them. The CSA2 schedule is resolved
into one ``LayerRole`` per backbone layer here, so the model never re-derives who owns which cache. The rules are
the union of NeMo's ``_validate_layer_schedule`` and what transformers' forward silently assumes:

- ratios are 0 (window only), 1 (one entry per token) or 2 (softmax-pooled pairs): 4 / 128 are V4.0's;
- KV and index sources are compressed layers, and every KV source is also an index source (NeMo);
- every compressed layer's latest KV source (``max(s <= layer)``, transformers' choice) and latest index source have
  its own ratio (PyPTO picks the latest source *of the same ratio* instead; requiring both to agree keeps the three
  implementations equal on every schedule we accept);
- the candidate source is a KV source (NeMo: "must share the compressed cache it filters") and no KV source follows
  it, so every index source it constrains scores the same keys its pool was cut from (transformers would mask
  another source's keys with a pool of the wrong width).
Draft (DSpark) layers past ``num_hidden_layers`` are window-only and never sources.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RATIOS = (0, 1, 2)
WINDOW, FULL, REINDEX, REUSE = "window", "full", "reindex", "reuse"
# released values (NeMo ``DeepseekV41TextConfig``; transformers main agrees)
_RELEASED_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
_RELEASED_KV_SOURCES = (2, 8, 14, 20)
_RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)


@dataclass(frozen=True)
class LayerRole:
    """One backbone layer's part in CSA2."""

    layer: int
    ratio: int  # 0 window only, 1 or 2 tokens per compressed entry
    mode: str  # WINDOW, FULL (KV source: owns the compressor and the index keys), REINDEX, REUSE
    kv_source: int | None  # the layer whose compressed entries this layer attends (None: window only)
    index_source: int | None  # the layer whose top-k this layer uses (itself for FULL / REINDEX)
    candidate_source: bool = False  # cuts the candidate pool (block max, newest block forced, top blocks)
    uses_candidates: bool = False  # an index source after the candidate source: scores only inside the pool

    @property
    def scores(self) -> bool:
        """Runs an indexer query (FULL or REINDEX)."""
        return self.mode in (FULL, REINDEX)


@dataclass(frozen=True)
class QuantizationArgs:
    """``quantization_config``: fp8 e4m3 projections with ue8m0 scales per block, routed experts fp4 or fp8."""

    weight_block_size: tuple[int, int] = (32, 32)
    expert_dtype: str = "fp4"
    scale_fmt: str = "ue8m0"


@dataclass(frozen=True)
class DeepseekV41TextArgs:
    """The ``text_config`` fields that change the math (defaults: the released Flash values)."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict | None = None  # YaRN of the compressed layers' rotary; None: plain RoPE
    max_position_embeddings: int = 1048576
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = _RELEASED_RATIOS  # backbone layers only (draft entries split off)
    kv_source_layer_ids: tuple[int, ...] = _RELEASED_KV_SOURCES
    index_source_layer_ids: tuple[int, ...] = _RELEASED_INDEX_SOURCES
    candidate_source_layer_id: int = 20  # < 0: no candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2  # NeMo: engram_pad_token_id
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 0  # DSpark draft layers (mtp.*): not served yet
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    roles: tuple[LayerRole, ...] = ()  # resolved from the schedule by ``from_dict``

    @classmethod
    def from_dict(cls, text: dict[str, Any], where: str = "text_config") -> "DeepseekV41TextArgs":
        kw: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name in ("roles", "compress_rope_scaling") or text.get(name) is None:
                continue
            value = text[name]
            kw[name] = tuple(int(v) for v in value) if isinstance(value, list) else value
        if "engram_pad_id" not in kw and text.get("engram_pad_token_id") is not None:
            kw["engram_pad_id"] = int(text["engram_pad_token_id"])
        kw["num_nextn_predict_layers"] = int(text.get("num_nextn_predict_layers") or 0)
        kw["compress_rope_scaling"] = _compress_yarn(text, where)
        n = int(kw.get("num_hidden_layers", cls.num_hidden_layers))
        ratios = tuple(kw.get("compress_ratios", _RELEASED_RATIOS if n == 40 else ()))
        if not ratios:
            raise ValueError(f"{where}.compress_ratios is required for a {n}-layer model")
        drafts = ratios[n:]
        if len(ratios) < n or len(drafts) > kw["num_nextn_predict_layers"]:
            raise ValueError(f"{where}.compress_ratios: {len(ratios)} entries, expected num_hidden_layers ({n}) "
                             f"plus at most num_nextn_predict_layers ({kw['num_nextn_predict_layers']})")
        if any(r != 0 for r in drafts):
            raise ValueError(f"{where}.compress_ratios: draft layers are window-only (0), got {list(drafts)}")
        kw["compress_ratios"] = ratios[:n]
        for name, released in (("kv_source_layer_ids", _RELEASED_KV_SOURCES),
                               ("index_source_layer_ids", _RELEASED_INDEX_SOURCES)):
            if name not in kw:
                if ratios[:n] != _RELEASED_RATIOS:
                    raise ValueError(f"{where}.{name} is required with a compress_ratios other than the release's")
                kw[name] = released
        if "candidate_source_layer_id" not in kw:
            kw["candidate_source_layer_id"] = kw["kv_source_layer_ids"][-1] if kw["kv_source_layer_ids"] else -1
        args = cls(**kw)
        return _with_roles(args, where)

    def role(self, layer: int) -> LayerRole:
        return self.roles[layer]

    @property
    def kv_sources(self) -> tuple[int, ...]:
        return self.kv_source_layer_ids


def _compress_yarn(text: dict[str, Any], where: str) -> dict | None:
    """The compressed layers' YaRN (window-only layers never scale): the release's flat ``rope_scaling``, or
    transformers' ``rope_parameters["compress"]``; YaRN's attention factor is 1 (the reference does not scale)."""
    rope = text.get("rope_parameters") or {}
    compress = dict(rope["compress"]) if isinstance(rope.get("compress"), dict) else dict(
        text.get("rope_scaling") or {})
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"{where}.rope_scaling.type must be 'yarn' (or absent), got {kind!r}")
    out = {k: v for k, v in compress.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    out["rope_type"] = "yarn"
    out["attention_factor"] = 1.0
    out.setdefault("original_max_position_embeddings", text.get("max_position_embeddings", 1048576))
    return out


def _increasing(values: tuple[int, ...], name: str, n: int, where: str) -> None:
    if list(values) != sorted(set(values)) or any(not 0 <= v < n for v in values):
        raise ValueError(f"{where}.{name} must be strictly increasing backbone layers in [0, {n}), got {list(values)}")


def _with_roles(a: DeepseekV41TextArgs, where: str) -> DeepseekV41TextArgs:
    """Check the dimensions and the CSA2 schedule (module docstring), then resolve every layer's role."""
    n, ratios = a.num_hidden_layers, a.compress_ratios
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                 "o_lora_rank", "o_groups", "index_n_heads", "index_head_dim", "sliding_window",
                 "candidate_block_size", "hc_mult"):
        if int(getattr(a, name)) < 1:
            raise ValueError(f"{where}.{name} must be >= 1, got {getattr(a, name)}")
    if a.num_key_value_heads != 1:
        raise ValueError(f"{where}.num_key_value_heads must be 1 (one shared K = V latent), got "
                         f"{a.num_key_value_heads}")
    if a.num_attention_heads % a.o_groups:
        raise ValueError(f"{where}.o_groups ({a.o_groups}) must divide num_attention_heads ({a.num_attention_heads})")
    if a.qk_rope_head_dim % 2 or not 0 < a.qk_rope_head_dim <= min(a.head_dim, a.index_head_dim):
        raise ValueError(f"{where}.qk_rope_head_dim must be even and in (0, min(head_dim, index_head_dim)], got "
                         f"{a.qk_rope_head_dim}")
    if a.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ValueError(f"{where}.scoring_func must be sqrtsoftplus, sigmoid or softmax, got {a.scoring_func!r}")
    if a.n_shared_experts != 1 or a.hidden_act != "silu":
        raise ValueError(f"{where}: n_shared_experts must be 1 and hidden_act 'silu', got {a.n_shared_experts}, "
                         f"{a.hidden_act!r}")
    if not 0 < a.num_experts_per_tok <= a.n_routed_experts:
        raise ValueError(f"{where}.num_experts_per_tok must be in [1, n_routed_experts={a.n_routed_experts}], got "
                         f"{a.num_experts_per_tok}")
    bad = [(i, r) for i, r in enumerate(ratios) if r not in RATIOS]
    if bad:
        raise ValueError(f"{where}.compress_ratios: V4.1 layers have ratio 0, 1 or 2 (4 / 128 are V4.0's), got "
                         f"layer {bad[0][0]}: {bad[0][1]}")
    kv, index = a.kv_source_layer_ids, a.index_source_layer_ids
    _increasing(kv, "kv_source_layer_ids", n, where)
    _increasing(index, "index_source_layer_ids", n, where)
    for name, sources in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        window = [s for s in sources if ratios[s] == 0]
        if window:
            raise ValueError(f"{where}.{name}: layer {window[0]} has compress_ratios 0 (window only) and cannot be a "
                             f"source")
    missing = [s for s in kv if s not in index]
    if missing:
        raise ValueError(f"{where}.index_source_layer_ids must include every KV source; missing {missing}")
    cand = a.candidate_source_layer_id
    if cand >= 0:
        if cand not in kv:
            raise ValueError(f"{where}.candidate_source_layer_id ({cand}) must be a KV source "
                             f"(kv_source_layer_ids {list(kv)}): its pool filters that source's compressed entries")
        later = [s for s in kv if s > cand]
        if later:
            raise ValueError(f"{where}.candidate_source_layer_id ({cand}): KV source {later[0]} follows it, so the "
                             f"index sources it constrains would score keys its pool was not cut from")
        if a.candidate_topk_blocks < 1:
            raise ValueError(f"{where}.candidate_topk_blocks must be >= 1, got {a.candidate_topk_blocks}")
    roles = []
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            roles.append(LayerRole(layer, 0, WINDOW, None, None))
            continue
        kv_src = max((s for s in kv if s <= layer), default=None)
        idx_src = max((s for s in index if s <= layer), default=None)
        if kv_src is None:
            raise ValueError(f"{where}.kv_source_layer_ids: compressed layer {layer} has no KV source at or before it")
        for name, src in (("kv_source_layer_ids", kv_src), ("index_source_layer_ids", idx_src)):
            if ratios[src] != ratio:
                raise ValueError(f"{where}.{name}: layer {layer} (ratio {ratio}) would use source {src}, whose ratio "
                                 f"is {ratios[src]}")
        mode = FULL if layer == kv_src else REINDEX if layer == idx_src else REUSE
        roles.append(LayerRole(layer, ratio, mode, kv_src, idx_src, candidate_source=layer == cand,
                               uses_candidates=mode == REINDEX and 0 <= cand < layer))
    bad_engram = [i for i in a.engram_layer_ids if not 0 <= i < n]
    if bad_engram or len(a.engram_num_embeddings) != len(a.engram_layer_ids):
        raise ValueError(f"{where}.engram_layer_ids / engram_num_embeddings: one table per backbone layer, got layers "
                         f"{list(a.engram_layer_ids)} and {len(a.engram_num_embeddings)} tables")
    return DeepseekV41TextArgs(**{**a.__dict__, "roles": tuple(roles)})


@dataclass(frozen=True)
class DeepseekV41Config:
    """The composite config.json."""

    text: DeepseekV41TextArgs
    quantization: QuantizationArgs | None = None  # None: an unquantized checkpoint
    image_token_id: int = 129264
    vision: dict | None = None  # vision_config as given (not served)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "DeepseekV41Config":
        composite = isinstance(config.get("text_config"), dict)
        if not composite and config.get("model_type") == "deepseek_v41":
            raise ValueError("config.json: model_type 'deepseek_v41' needs a text_config object")
        text = DeepseekV41TextArgs.from_dict(config["text_config"] if composite else config,
                                             "text_config" if composite else "config.json")
        quant = config.get("quantization_config") or (config["text_config"].get("quantization_config")
                                                      if composite else None)
        return cls(text, _quantization(quant) if quant else None, int(config.get("image_token_id", 129264)),
                   config.get("vision_config"))


def _quantization(quant: dict[str, Any]) -> QuantizationArgs:
    if quant.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method must be 'fp8', got {quant.get('quant_method')!r}")
    block = tuple(int(v) for v in (quant.get("weight_block_size") or (32, 32)))
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {list(block)}")
    expert = quant.get("expert_dtype") or "fp8"
    if expert not in ("fp8", "fp4"):
        raise ValueError(f"quantization_config.expert_dtype must be 'fp8' or 'fp4', got {expert!r}")
    scale = quant.get("scale_fmt") or "ue8m0"
    if scale != "ue8m0":
        raise ValueError(f"quantization_config.scale_fmt must be 'ue8m0' for V4.1, got {scale!r}")
    return QuantizationArgs(block, expert, scale)
