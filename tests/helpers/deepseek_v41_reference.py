"""A test oracle for DeepSeek-V4.1's text model: transformers main's pure-PyTorch ``deepseek_v41`` (commit 0a2080b4,
``src/transformers/models/deepseek_v41/modeling_deepseek_v41.py``), re-written in plain torch for one sequence on the
host, reading the checkpoints ``deepinfer make-tiny --arch deepseek_v41`` writes (the release's tensor names).

Where each piece comes from (transformers' names in brackets):
- RMSNorm with the config's eps (1e-20 released) on every norm, the unweighted one on the flattened mHC streams
  [``DeepseekV41RMSNorm``, ``DeepseekV41UnweightedRMSNorm``];
- two rotaries: window-only layers ``rope_theta`` plain, compressed layers (and every indexer) ``compress_rope_theta``
  with YaRN and no magnitude scaling; interleaved pairs on the trailing ``qk_rope_head_dim`` channels, undone on the
  attention output with the conjugate rotation [``DeepseekV41RotaryEmbedding``, ``apply_rotary_pos_emb``];
- the compressor of a KV source: ratio 1 ``norm(wkv(x))`` per token, ratio 2 fp32 ``wkv`` / ``wgate`` projections
  pooled in pairs with a channel-wise softmax of the gate, then the norm; an open pair waits in the cache's buffer
  across calls [``DeepseekV41Compressor``, ``DeepseekV41CSACache.store_compression_weights``];
- index keys ``k_norm(wk(latent))`` of the *pre-RoPE* latent, rotated at each group's first position; compressed
  entries are the latent rotated there [``DeepseekV41Indexer.forward`` step 1, ``DeepseekV41Attention.forward``];
- the indexer score ``sum_h relu(q_h . k_t) * Di^-0.5 * w_h``, ``w = weights_proj(x) * Hi^-0.5``, entry ``t`` visible
  iff ``t < (pos + 1) // ratio``; the candidate pool of the candidate source (block max over
  ``candidate_block_size`` entries, the block of the newest visible entry forced in, the best
  ``candidate_topk_blocks`` blocks), which masks every later index source's scores [``select_candidate_blocks``];
- attention over the window (``sliding_window`` positions up to the query) plus the selected entries, with a per-head
  sink logit in the denominator only, scale ``head_dim^-0.5``, then the grouped ``wo_a`` and ``wo_b``
  [``eager_attention_forward``, ``DeepseekV41GroupedLinear``];
- the router ``sqrt(softplus(logits / gate_temp))``, experts chosen by ``scores + bias``, weights the unbiased scores
  normalised (+1e-20) times ``routed_scaling_factor``; clamped SwiGLU experts and the shared expert
  [``DeepseekV41TopKRouter``, ``DeepseekV41Expert``, ``DeepseekV41SparseMoeBlock``];
- single-pass mHC: each site computes (pre, post, comb) from its own input streams but collapses with the previous
  site's ``pre`` (one-hot stream 0 before layer 0); the final collapse uses the last FFN ``pre``; no ``hc_head``
  [``DeepseekV41DecoderLayer.hc_mixes / forward``, ``DeepseekV41TextModel.forward``];
- quantization-aware activations (``qat``): window KV after RoPE fp8 e4m3 in 32-blocks with power-of-two scales over
  all channels, compressed entries after RoPE fp4 e2m1 in 16-blocks with e4m3 scales, indexer queries and keys fp4
  in 32-blocks with power-of-two scales [``_fake_quant_fp8_block``, ``_fake_quant_fp4_block``]. Off by default:
  fp32 summation-order noise flips their roundings, so only greedy ids can be compared with them on.

Three departures from the stored transformers file, on purpose:
- **uncached KV sources replace**: its uncached forward appends each KV source's entries and index keys to the
  previous source's (``shared["compress_kv"] = cat(...)``), so any forward with two sources attends a mix; a newer
  upstream resets them. Here each KV source publishes exactly its own entries and keys, cached or not, and a source
  with no entry yet clears the top-k of the one before it;
- **ties in entry order**: ``torch.topk`` orders equal scores by memory layout, and the indexer's quantized, ReLU'd
  scores tie exactly and often; here the larger score comes first and equal scores the earlier entry (block) first,
  the engine's rule (``kernels/compressed_attention.py: top_k_in_order``), written independently with a stable sort;
  the router's ``scores + bias`` likewise (an exact tie goes to the lower expert id);
- ``qat`` is a switch (transformers always applies it).
- Engram [``DeepseekV41NgramHashState``, ``DeepseekV41Engram``]: the compressed ids of the checkpoint's
  ``tokenizer.json`` (raw decode of each id, the normaliser sequence, first-seen numbering), primes searched upward
  from ``engram_vocab_size`` per (layer, order) and never reused, multipliers from ``default_rng(10007 * layer)``,
  the XOR-rolled hash ``% prime + offset`` with the compressed pad id before the start; rows through ``wkv`` into
  per-stream keys and a value, the signed-sqrt sigmoid gate, ``h + gate * value`` before the layer's mHC mixes.
- image tokens (vLLM ``deepseek_v41/nvidia/vl_model.py``): ``forward(..., embeds=)`` replaces the embedding rows
  where given (an image span's, from tests/helpers/deepseek_v41_vision_reference.py) before the hc expansion, and
  the router biases positions whose id is ``image_token_id`` with ``bias_vl`` instead of ``bias``.
  Engram treats image tokens as DEAD: a look-back slot from one on is padding, and their gate is zero.
DSpark ``mtp.*`` is not in this oracle.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.fp4 import dequantize_fp4
from tests.helpers.deepseek_v41_engram_hash import EngramHash
from kernels.quant import dequantize_block_fp8


# ---------------------------------------------------------------------------------------------- config and weights

@dataclass(frozen=True)
class RefArgsV41:
    """The ``text_config`` fields the math reads, parsed here on their own (not through the engine's config)."""

    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    ratios: tuple[int, ...]
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_heads: int
    index_dim: int
    index_topk: int
    n_experts: int
    n_activated: int
    gate_temp: float
    norm_topk_prob: bool
    route_scale: float
    swiglu_limit: float
    hc: int
    sinkhorn_iters: int
    hc_eps: float
    eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: dict | None

    @classmethod
    def from_config(cls, cfg: dict) -> "RefArgsV41":
        t = cfg.get("text_config", cfg)
        n = t["num_hidden_layers"]
        kv = tuple(t["kv_source_layer_ids"])
        scaling = dict(t.get("rope_scaling") or {})
        yarn = scaling if scaling.get("type", scaling.get("rope_type")) == "yarn" else None
        cand = t.get("candidate_source_layer_id")
        return cls(
            vocab=t["vocab_size"], dim=t["hidden_size"], n_layers=n, n_heads=t["num_attention_heads"],
            head_dim=t["head_dim"], rope_dim=t["qk_rope_head_dim"], q_lora_rank=t["q_lora_rank"],
            o_groups=t["o_groups"], o_lora_rank=t["o_lora_rank"], window=t["sliding_window"],
            ratios=tuple(t["compress_ratios"][:n]), kv_sources=kv, index_sources=tuple(t["index_source_layer_ids"]),
            candidate_source=kv[-1] if cand is None else cand, candidate_topk_blocks=t["candidate_topk_blocks"],
            candidate_block_size=t["candidate_block_size"], index_heads=t["index_n_heads"],
            index_dim=t["index_head_dim"], index_topk=t["index_topk"], n_experts=t["n_routed_experts"],
            n_activated=t["num_experts_per_tok"], gate_temp=t.get("gate_temp", 1.0),
            norm_topk_prob=t.get("norm_topk_prob", True), route_scale=t["routed_scaling_factor"],
            swiglu_limit=t.get("swiglu_limit") or 0.0, hc=t["hc_mult"], sinkhorn_iters=t["hc_sinkhorn_iters"],
            hc_eps=t["hc_eps"], eps=t["rms_norm_eps"], rope_theta=t["rope_theta"],
            compress_rope_theta=t["compress_rope_theta"], yarn=yarn)


def load_v41_weights(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the release's names in fp32 (transformers' ``model.`` / ``lm_head`` renames
    undone), fp8 / fp4 weights dequantized (with the engine's kernels: the oracle checks the math over the same
    dequantized weights, the packing is checked by kernels' own tests)."""
    from safetensors.torch import load_file

    raw: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        raw.update(load_file(str(file)))
    cfg = json.loads((Path(path) / "config.json").read_text())
    block = tuple((cfg.get("quantization_config") or {}).get("weight_block_size") or (32, 32))
    out = {}
    for name, tensor in raw.items():
        if name.endswith(".scale"):
            continue
        scale = raw.get(name.removesuffix(".weight") + ".scale") if name.endswith(".weight") else None
        if scale is not None and tensor.dtype == torch.float8_e4m3fn:  # 32x32 blocks (Engram rows: 1x32), ue8m0
            tensor = dequantize_block_fp8(tensor, scale.float(), (1, 32) if ".engram.embed." in name else block)
        elif scale is not None:  # fp4 e2m1 routed experts, two a byte, a scale per 32 inputs
            tensor = dequantize_fp4(tensor, scale.float())
        name = name.removeprefix("model.").replace("lm_head.", "head.")
        out[name] = tensor.float()
    return out


# ---------------------------------------------------------------------------------------------- small math

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def inv_freq(dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """[dim / 2] inverse frequencies; YaRN blends interpolated (/ factor) and original frequencies with a linear ramp
    between the beta_fast and beta_slow correction dims (transformers' ``_compute_yarn_parameters``, truncated)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs
    original = yarn["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(yarn.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return freqs / yarn["factor"] * ramp + freqs * (1 - ramp)


def rope(x: torch.Tensor,  # [S, ..., D]
         freqs: torch.Tensor, positions: torch.Tensor,  # [P / 2], [S]
         inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent channel pairs of the trailing ``2 * len(freqs)`` channels at ``positions``."""
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[0],)
    cos, sin = cos.view(shape), sin.view(shape)
    width = 2 * freqs.shape[0]
    even, odd = x[..., -width::2], x[..., -width + 1::2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-width], rotated], dim=-1)


def _pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) for positive normal floats: the ue8m0 scale's rounding."""
    mantissa, exponent = torch.frexp(t)  # t = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(t), exponent - (mantissa == 0.5).to(exponent.dtype))


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _round_e2m1(q: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e2m1 magnitudes (|q| <= 6): a midpoint goes to the even code."""
    mag = q.abs()
    mids = (_E2M1[1:] + _E2M1[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
    up_at_tie = torch.arange(1, 8) % 2 == 0  # passing midpoint i lands on code i + 1: round up at a tie if even
    passed = torch.where(up_at_tie, mag[..., None] >= mids, mag[..., None] > mids)
    return torch.copysign(_E2M1[passed.sum(-1)], q)


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e4m3 in ``block``-channel groups with a power-of-two scale each (``amax / 448`` rounded up)."""
    if x.shape[-1] % block:
        return x
    b = x.unflatten(-1, (-1, block))
    scale = _pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)
    q = (b / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """e2m1 in ``block``-channel groups: an e4m3 scale (``amax / 6``) or a power-of-two one (rounded up)."""
    if x.shape[-1] % block:
        return x
    b = x.unflatten(-1, (-1, block))
    amax = b.abs().amax(-1, keepdim=True)
    if e4m3_scales:
        scale = (amax.clamp_min(6.0 * 2.0 ** -9) / 6.0).to(torch.float8_e4m3fn).float()
    else:
        scale = _pow2_ceil(amax.clamp_min(6.0 * 2.0 ** -126) / 6.0)
    return (_round_e2m1((b / scale).clamp(-6.0, 6.0)) * scale).flatten(-2)


def top_k_mask(scores: torch.Tensor,  # [S, N], -inf where not eligible
               k: int) -> torch.Tensor:  # [S, N] bool
    """The ``k`` best eligible columns per row, equal scores the earlier column first (stable sort)."""
    picked = torch.zeros_like(scores, dtype=torch.bool)
    k = min(k, scores.shape[-1])
    if k > 0:
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        picked.scatter_(-1, order, True)
    return picked & (scores > float("-inf"))


def candidate_pool(scores: torch.Tensor,  # [S, N] -inf where not visible
                   visible: torch.Tensor,  # [S] int64 entries each query sees
                   top_blocks: int, block: int) -> torch.Tensor:  # [S, N] bool
    n = scores.shape[-1]
    padded = F.pad(scores, (0, -n % block), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(-1)  # [S, B]
    newest = ((visible - 1) // block)[:, None]  # -1 when nothing is visible: no block forced
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1])[None, :] == newest, float("inf"))
    return top_k_mask(blocks, top_blocks).repeat_interleave(block, dim=-1)[:, :n]


# ---------------------------------------------------------------------------------------------- the cache

@dataclass
class LayerState:
    """One layer's cache: its window K = V with positions; on a KV source the open group's fp32 ``(kv, gate)``
    projections, the compressed entries (rotated) and the index keys (rotated) [``DeepseekV41CSACache``]."""

    window: torch.Tensor  # [K, D]
    window_pos: torch.Tensor  # [K] int64
    buffer_kv: torch.Tensor | None = None  # [b, D] fp32, b < ratio
    buffer_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # [N, D]
    index_keys: torch.Tensor | None = None  # [N, Di]


@dataclass
class RefCache:
    layers: list[LayerState]
    length: int = 0  # positions written
    ids: list[int] = field(default_factory=list)  # every id so far (Engram's look-back)


@dataclass
class _Shared:
    """What one forward's layers pass on: the latest KV source's entries and keys, the latest index source's
    top-k, the candidate pool [``shared`` dict]."""

    entries: torch.Tensor | None = None  # [N, D]
    index_keys: torch.Tensor | None = None  # [N, Di]
    topk: torch.Tensor | None = None  # [S, N] bool
    candidates: torch.Tensor | None = None  # [S, N] bool
    ratio: int = 0
    log: dict = field(default_factory=dict)  # layer -> its top-k, "candidates" -> the pool (tests read it)


# ---------------------------------------------------------------------------------------------- the model

class ReferenceV41:
    def __init__(self, path: str | Path, qat: bool = False,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        path = Path(path)
        self.args = RefArgsV41.from_config(json.loads((path / "config.json").read_text()))
        self.w = weights if weights is not None else load_v41_weights(path)
        self.qat = qat
        a = self.args
        self.main_freqs = inv_freq(a.rope_dim, a.rope_theta, None)
        self.compress_freqs = inv_freq(a.rope_dim, a.compress_rope_theta, a.yarn)
        config = json.loads((path / "config.json").read_text())
        self.image_token_id = int(config.get("image_token_id", 129264))
        text = config["text_config"]
        self.engram = EngramHash(text, path / "tokenizer.json") if text.get("engram_layer_ids") else None

    def new_cache(self) -> RefCache:
        d = self.args.head_dim
        return RefCache([LayerState(torch.zeros(0, d), torch.zeros(0, dtype=torch.long))
                         for _ in range(self.args.n_layers)])

    @torch.no_grad()
    def forward(self, ids: torch.Tensor,  # [S] int64
                cache: RefCache | None = None,
                embeds: dict[int, torch.Tensor] | None = None,  # row -> [hidden] input embedding given
                ) -> torch.Tensor:  # [S, vocab] fp32 logits
        """Uncached (``cache`` None): the sequence from position 0. Cached: continues at ``cache.length``."""
        a = self.args
        start = 0 if cache is None else cache.length
        pos = torch.arange(start, start + ids.shape[0])
        history = ids.tolist() if cache is None else cache.ids + ids.tolist()
        if cache is not None:
            cache.ids = history
        hashes = None if self.engram is None else self.engram(history, self.image_token_id)[start:]  # [S, L_e, cols]
        x = self.w["embed.weight"][ids]
        if embeds:
            x = x.clone()
            for row, value in embeds.items():
                x[row] = value.float()
        self._image = ids == self.image_token_id
        streams = x[:, None, :].expand(-1, a.hc, -1).clone()
        pre = torch.zeros(ids.shape[0], a.hc)
        pre[:, 0] = 1.0
        shared = _Shared()
        self.last_shared = shared
        for i in range(a.n_layers):
            if self.engram is not None and i in self.engram.layers:
                streams = self._engram(i, streams, hashes[:, self.engram.layers.index(i)])
            streams, pre = self._layer(i, streams, pre, pos, None if cache is None else cache.layers[i], shared)
        if cache is not None:
            cache.length += ids.shape[0]
        h = rms_norm((pre[..., None] * streams).sum(1), self.w["norm.weight"], a.eps)
        return h @ self.w["head.weight"].T

    def greedy(self, prompt: list[int], new_tokens: int, embeds: dict[int, torch.Tensor] | None = None) -> list[int]:
        """Greedy continuation through the cache (equal to uncached forwards: tests/models/
        test_deepseek_v41_reference.py)."""
        cache = self.new_cache()
        logits, out = self.forward(torch.tensor(prompt), cache, embeds), []
        for _ in range(new_tokens):
            out.append(int(logits[-1].argmax()))
            logits = self.forward(torch.tensor(out[-1:]), cache)
        return out

    def _layer(self, i: int, streams: torch.Tensor, pre_mix: torch.Tensor, pos: torch.Tensor,
               state: LayerState | None, shared: _Shared) -> tuple[torch.Tensor, torch.Tensor]:
        a, w, p = self.args, self.w, f"layers.{i}."
        attn_pre, post, comb = self._mixes(streams, p + "hc_attn_")
        x = rms_norm((pre_mix[..., None] * streams).sum(1), w[p + "attn_norm.weight"], a.eps)
        streams = self._expand(self._attention(i, x, pos, state, shared), streams, post, comb)
        ffn_pre, post, comb = self._mixes(streams, p + "hc_ffn_")
        x = rms_norm((attn_pre[..., None] * streams).sum(1), w[p + "ffn_norm.weight"], a.eps)
        return self._expand(self._moe(i, x), streams, post, comb), ffn_pre

    def _mixes(self, streams: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, hc = self.args, self.args.hc
        fn, base, scale = (self.w[prefix + k] for k in ("fn", "base", "scale"))
        mixes = rms_norm(streams.flatten(1), None, a.eps) @ fn.T
        pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + a.hc_eps
        post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = torch.softmax((mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc), dim=-1) + a.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + a.hc_eps)
        for _ in range(a.sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + a.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + a.hc_eps)
        return pre, post, comb

    @staticmethod
    def _expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Stream k: ``post_k * out + sum_j comb[j, k] * residual_j``."""
        return post[..., None] * out[:, None, :] + torch.einsum("sjk,sjd->skd", comb, residual)

    # ---- attention -------------------------------------------------------------------------------------
    def _attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, state: LayerState | None,
                   shared: _Shared) -> torch.Tensor:
        a, w, p = self.args, self.w, f"layers.{i}.attn."
        ratio = a.ratios[i]
        freqs = self.compress_freqs if ratio else self.main_freqs
        q_res = rms_norm(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], a.eps)
        q = rope((q_res @ w[p + "wq_b.weight"].T).view(-1, a.n_heads, a.head_dim), freqs, pos)
        kv = rope(rms_norm(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], a.eps), freqs, pos)
        if self.qat:
            kv = fake_quant_fp8(kv, 32)
        keys, key_pos = kv, pos
        if state is not None:
            keys, key_pos = torch.cat([state.window, kv]), torch.cat([state.window_pos, pos])
            state.window, state.window_pos = keys[-a.window:], key_pos[-a.window:]
        allowed = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - a.window)
        if ratio:
            if i in a.kv_sources:
                self._publish(i, x, state, shared)
            if i in a.index_sources:
                self._index(i, x, q_res, pos, shared)
            if shared.entries is not None and shared.topk is not None:
                keys = torch.cat([keys, shared.entries])
                allowed = torch.cat([allowed, shared.topk], dim=1)
        scores = torch.einsum("shd,kd->shk", q, keys) * a.head_dim ** -0.5
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        sink = w[p + "attn_sink"][None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = rope(torch.einsum("shk,kd->shd", probs, keys), freqs, pos, inverse=True)
        groups = out.reshape(out.shape[0], a.o_groups, -1)  # [S, G, H * D / G]
        wo_a = w[p + "wo_a.weight"].view(a.o_groups, a.o_lora_rank, -1)  # block-diagonal: group g's own rows
        return torch.einsum("sgi,gri->sgr", groups, wo_a).flatten(1) @ w[p + "wo_b.weight"].T

    def _publish(self, i: int, x: torch.Tensor, state: LayerState | None, shared: _Shared) -> None:
        """A KV source: compress the groups this call completes, append them to the cache, and publish its entries
        and index keys (replacing the previous source's)."""
        a, w, p = self.args, self.w, f"layers.{i}.attn."
        ratio = a.ratios[i]
        done = 0 if state is None or state.entries is None else state.entries.shape[0]
        if ratio == 1:
            latent = rms_norm(x @ w[p + "compressor.wkv.weight"].T, w[p + "compressor.norm.weight"], a.eps)
        else:
            kv, gate = x.float() @ w[p + "compressor.wkv.weight"].T, x.float() @ w[p + "compressor.wgate.weight"].T
            if state is not None and state.buffer_kv is not None:
                kv, gate = torch.cat([state.buffer_kv, kv]), torch.cat([state.buffer_gate, gate])
            usable = kv.shape[0] // ratio * ratio
            if state is not None:
                state.buffer_kv, state.buffer_gate = kv[usable:], gate[usable:]
            kv, gate = kv[:usable].view(-1, ratio, a.head_dim), gate[:usable].view(-1, ratio, a.head_dim)
            latent = rms_norm((kv * gate.softmax(dim=1)).sum(1), w[p + "compressor.norm.weight"], a.eps)
        first = torch.arange(done, done + latent.shape[0]) * ratio  # each group's first position
        keys = rope(rms_norm(latent @ w[p + "indexer.wk.weight"].T, w[p + "indexer.k_norm.weight"], a.eps),
                    self.compress_freqs, first)
        entries = rope(latent, self.compress_freqs, first)
        if self.qat:
            keys, entries = fake_quant_fp4(keys, 32), fake_quant_fp4(entries, 16, e4m3_scales=True)
        if state is not None:
            state.entries = entries if state.entries is None else torch.cat([state.entries, entries])
            state.index_keys = keys if state.index_keys is None else torch.cat([state.index_keys, keys])
            entries, keys = state.entries, state.index_keys
        shared.entries, shared.index_keys, shared.ratio = entries, keys, ratio
        shared.topk = None  # until this source's own indexer (every KV source is an index source) picks

    def _index(self, i: int, x: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor, shared: _Shared) -> None:
        """An index source (a KV source, or a Reindex layer over the latest source's keys): score, (cut or apply the
        candidate pool), and publish the top-k."""
        a, w, p = self.args, self.w, f"layers.{i}.attn.indexer."
        keys = shared.index_keys
        if keys is None or keys.shape[0] == 0:
            shared.topk = None
            return
        q = rope((q_res @ w[p + "wq_b.weight"].T).view(-1, a.index_heads, a.index_dim), self.compress_freqs, pos)
        if self.qat:
            q = fake_quant_fp4(q, 32)
        scores = torch.relu(torch.einsum("shd,nd->shn", q, keys)) * a.index_dim ** -0.5
        weights = (x @ w[p + "weights_proj.weight"].T) * a.index_heads ** -0.5
        scores = (scores * weights[..., None]).sum(1)  # [S, N]
        visible = (pos + 1) // a.ratios[i]
        scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] >= visible[:, None], float("-inf"))
        if i == a.candidate_source:
            shared.candidates = candidate_pool(scores, visible, a.candidate_topk_blocks, a.candidate_block_size)
            shared.log["candidates"] = shared.candidates
        elif 0 <= a.candidate_source < i and shared.candidates is not None:
            scores = scores.masked_fill(~shared.candidates, float("-inf"))
        shared.topk = top_k_mask(scores, a.index_topk)
        shared.log[i] = shared.topk

    def _engram(self, i: int, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        a, w, p = self.args, self.w, f"layers.{i}.engram."
        kv = w[p + "embed.weight"][rows].flatten(1) @ w[p + "wkv.weight"].T
        key, value = kv[:, :a.hc * a.dim].view(-1, a.hc, a.dim), kv[:, a.hc * a.dim:]
        rstd = torch.rsqrt(streams.square().mean(-1) + a.eps) * torch.rsqrt(key.square().mean(-1) + a.eps)
        dot = (streams * w[p + "q_weight"] * w[p + "k_weight"] * key).sum(-1) * rstd * a.dim ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        gate = gate * ~self._image[:, None]  # image tokens are DEAD: no memory added
        return streams + gate[..., None] * value[:, None, :]

    # ---- MoE -------------------------------------------------------------------------------------------
    def _expert(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        w, limit = self.w, self.args.swiglu_limit
        gate, up = x @ w[prefix + "w1.weight"].T, x @ w[prefix + "w3.weight"].T
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        return F.silu(gate) * up

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        a, w, p = self.args, self.w, f"layers.{i}.ffn."
        scores = F.softplus((x @ w[p + "gate.weight"].T) / a.gate_temp).sqrt()
        bias = torch.where(self._image[:, None], w[p + "gate.bias_vl"], w[p + "gate.bias"])
        ids = top_k_mask(scores + bias, a.n_activated).nonzero()[:, 1].view(-1, a.n_activated)
        weights = scores.gather(1, ids)
        if a.norm_topk_prob and a.n_activated > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * a.route_scale
        out = self._expert(p + "shared_experts.", x) @ w[p + "shared_experts.w2.weight"].T
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            h = self._expert(f"{p}experts.{e}.", x[rows]) * weights[rows, slot, None]
            out = out.index_add(0, rows, h @ w[f"{p}experts.{e}.w2.weight"].T)
        return out

