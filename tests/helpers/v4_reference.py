"""A test oracle for DeepSeek-V4: the model as DeepSeek's own inference code defines it (``inference/model.py`` and
``inference/kernel.py`` of the V4 release), re-written in plain torch fp32 for the host, reading the checkpoints
``deepinfer make-tiny`` writes.

Where each piece comes from (the release's names in brackets):
- the step structure is the release's: one prefill call at position 0 over the whole prompt, then decode calls of one
  token each (``Transformer.forward(tokens, start_pos)``); every buffer it keeps is kept here the same way: the
  sliding window as a ring of ``window`` rows indexed by ``position % window`` (``Attention.kv_cache[:, :win]``), the
  compressed entries after it (``kv_cache[:, win:]``), each compressor's open window(s) of projections and gate
  scores (``Compressor.kv_state`` / ``score_state``, overlapping compressors keep the previous window in the first
  ``ratio`` rows) and the indexer's own compressed keys (``Indexer.kv_cache``);
- attention reads keys through per-query index lists with -1 for "none" (``get_window_topk_idxs``,
  ``get_compress_topk_idxs``, the indexer's top-k plus ``offset``), as the release's ``sparse_attn`` kernel does;
- stand-ins for the release's GPU kernels (``kernel.py``): ``sparse_attn`` (softmax over the listed keys with the
  per-head sink logit in the denominator only), ``hc_split_sinkhorn`` (pre = sigmoid + eps, post = 2 sigmoid, comb =
  row softmax + eps, a column normalisation, then ``iters - 1`` row / column rounds), the Walsh-Hadamard transform of
  ``rotate_activation`` (normalised by ``dim ** -0.5``);
- the release simulates its quantisation-aware training in bf16 (``act_quant(..., inplace=True)`` on the window
  and compressed keys' non-RoPE channels, ``fp4_act_quant`` on the indexer's queries and keys). In fp32 these are
  left out here, as in our engine: they round activations to fp8 / fp4 grids, so two fp32 computations that differ
  in the last bit would land on different grid points and no 1e-4 comparison could hold. fp8 / fp4 weights are
  dequantized at load;
- ``torch.topk`` leaves the order of equal scores unspecified, and the indexer's scores tie often (a block whose
  every index head's ReLU is 0 scores exactly 0). The rule used here and in the engine: the larger score first,
  equal scores in order of the entry (the earlier window first). ``ambiguous`` records the positions where the
  release itself could have picked otherwise, for comparisons with implementations that break ties their own way.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.fp4 import dequantize_fp4
from kernels.quant import dequantize_block_fp8

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class RefArgs:
    """The release's ``ModelArgs``, read from a transformers-style ``config.json``."""

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
    ratios: tuple[int, ...]  # per layer: 0 (sliding), CSA's rate (overlapping, with the indexer) or HCA's
    csa_ratio: int
    hash_layers: tuple[bool, ...]
    n_experts: int
    n_activated: int
    score_func: str
    route_scale: float
    swiglu_limit: float
    index_heads: int
    index_dim: int
    index_topk: int
    hc: int
    sinkhorn_iters: int
    hc_eps: float
    eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: dict | None  # the compress rotary's YaRN parameters, None for plain RoPE

    @classmethod
    def from_config(cls, cfg: dict) -> "RefArgs":
        rates = cfg["compress_rates"]
        ratio = {SLIDING: 0, CSA: rates[CSA], HCA: rates[HCA]}
        rope = dict(cfg.get("rope_parameters") or {})
        compress = rope.get("compress", rope)
        yarn = dict(compress) if compress.get("rope_type") == "yarn" else None
        return cls(
            vocab=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"],
            rope_dim=int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0)), q_lora_rank=cfg["q_lora_rank"],
            o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"], window=cfg["sliding_window"],
            ratios=tuple(ratio[t] for t in cfg["layer_types"]), csa_ratio=rates[CSA],
            hash_layers=tuple(t == "hash_moe" for t in cfg["mlp_layer_types"]), n_experts=cfg["n_routed_experts"],
            n_activated=cfg["num_experts_per_tok"], score_func=cfg["scoring_func"],
            route_scale=cfg["routed_scaling_factor"], swiglu_limit=cfg.get("swiglu_limit") or 0.0,
            index_heads=cfg["index_n_heads"], index_dim=cfg["index_head_dim"], index_topk=cfg["index_topk"],
            hc=cfg["hc_mult"], sinkhorn_iters=cfg["hc_sinkhorn_iters"], hc_eps=cfg["hc_eps"],
            eps=cfg["rms_norm_eps"], rope_theta=rope.get("main", {}).get("rope_theta", cfg["rope_theta"]),
            compress_rope_theta=compress.get("rope_theta", cfg["compress_rope_theta"]), yarn=yarn)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the release's names, fp8 / fp4 weights dequantized to fp32."""
    from safetensors.torch import load_file

    raw: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        raw.update(load_file(str(file)))
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is not None and t.dtype == torch.float8_e4m3fn:  # Engram tables: one row by 128 columns a scale
            t = dequantize_block_fp8(t, scale, (1, 128) if ".engram." in name else (128, 128))
        elif scale is not None:
            t = dequantize_fp4(t, scale)
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace(".attn.norm.", ".attn.kv_norm.")
        name = name.replace("hc_head.hc_", "hc_head_")
        out[name] = t.float()
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def rope_table(dim: int, length: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """``precompute_freqs_cis``: complex rotations [length, dim / 2], YaRN's ramp between beta_fast and beta_slow
    and no magnitude scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is not None:
        original, factor = yarn["original_max_position_embeddings"], yarn["factor"]

        def correction(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction(yarn.get("beta_fast", 32))), 0)
        high = min(math.ceil(correction(yarn.get("beta_slow", 1))), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the last ``2 * table.shape[-1]`` channels; ``table`` [S, P / 2] broadcasts over heads."""
    rd = 2 * table.shape[-1]
    pairs = torch.view_as_complex(x[..., -rd:].float().contiguous().unflatten(-1, (-1, 2)))
    table = table.conj() if inverse else table
    table = table.view(table.shape[0], *[1] * (pairs.dim() - 2), table.shape[-1])
    out = x.clone()
    out[..., -rd:] = torch.view_as_real(pairs * table).flatten(-2)
    return out


def hadamard(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == n, f"the Hadamard rotation needs a power-of-two width, got {n}"
    return (x @ h) * n ** -0.5


def ordered_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the ``k`` largest scores per row, ties to the lower index; and whether the ``k``-th and the next
    are equal and finite (the release's ``topk`` could have chosen otherwise there)."""
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    if k < scores.shape[-1]:
        ambiguous = (values[..., k - 1] == values[..., k]) & torch.isfinite(values[..., k])
    else:
        ambiguous = torch.zeros(scores.shape[:-1], dtype=torch.bool)
    return order[..., :k], ambiguous


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attention(q: torch.Tensor,  # [S, H, D]
                     kv: torch.Tensor,  # [N, D]
                     sink: torch.Tensor,  # [H]
                     idx: torch.Tensor,  # [S, K] int64, -1: none
                     scale: float) -> torch.Tensor:  # [S, H, D]
    valid = idx >= 0
    keys = kv[idx.clamp_min(0)]  # [S, K, D]
    scores = torch.einsum("shd,skd->shk", q, keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - top)
    denom = weights.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - top)
    return torch.einsum("shk,skd->shd", weights / denom, keys)


class Compressor:
    """Gated pooling of every ``ratio`` tokens' projections into one entry; ``overlap``: two series, entry ``w``
    pools series A of window ``w - 1`` with series B of window ``w`` (the release's ``Compressor``)."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, ratio: int, dim: int, args: RefArgs,
                 freqs: torch.Tensor, rotate_out: bool) -> None:
        self.wkv, self.wgate = w[prefix + "wkv.weight"], w[prefix + "wgate.weight"]
        self.ape, self.norm = w[prefix + "ape"], w[prefix + "norm.weight"]
        self.ratio, self.dim, self.overlap, self.eps = ratio, dim, ratio == args.csa_ratio, args.eps
        self.freqs, self.rotate_out = freqs, rotate_out
        rows, width = (2 * ratio, 2 * dim) if self.overlap else (ratio, dim)
        self.kv_state = torch.zeros(rows, width)
        self.score_state = torch.full((rows, width), float("-inf"))
        self.entries: list[torch.Tensor] = []

    def _finish(self, pooled: torch.Tensor, first_positions: torch.Tensor) -> torch.Tensor:  # [n, D]
        out = rotate(rms_norm(pooled, self.norm, self.eps), self.freqs[first_positions])
        return hadamard(out) if self.rotate_out else out

    def prefill(self, x: torch.Tensor) -> None:  # [S, dim_model]
        r, d, s = self.ratio, self.dim, x.shape[0]
        kv, score = x @ self.wkv.T, x @ self.wgate.T
        cut = s - s % r
        offset = r if self.overlap else 0
        if self.overlap and cut >= r:
            self.kv_state[:r] = kv[cut - r:cut]
            self.score_state[:r] = score[cut - r:cut] + self.ape
        if s % r:
            self.kv_state[offset:offset + s % r] = kv[cut:]
            self.score_state[offset:offset + s % r] = score[cut:] + self.ape[:s % r]
        if cut == 0:
            return
        kv = kv[:cut].unflatten(0, (-1, r))
        score = score[:cut].unflatten(0, (-1, r)) + self.ape
        if self.overlap:
            kv, score = self._overlap(kv, 0.0), self._overlap(score, float("-inf"))
        pooled = (kv * score.softmax(dim=1)).sum(dim=1)
        self.entries += list(self._finish(pooled, torch.arange(0, cut, r)))

    def _overlap(self, t: torch.Tensor, fill: float) -> torch.Tensor:  # [n, r, 2D] -> [n, 2r, D]
        r, d = self.ratio, self.dim
        out = t.new_full((t.shape[0], 2 * r, d), fill)
        out[:, r:] = t[:, :, d:]
        out[1:, :r] = t[:-1, :, :d]
        return out

    def decode(self, x: torch.Tensor, pos: int) -> None:  # [1, dim_model]
        r, d = self.ratio, self.dim
        kv, score = (x @ self.wkv.T)[0], (x @ self.wgate.T)[0] + self.ape[pos % r]
        row = (r if self.overlap else 0) + pos % r
        self.kv_state[row], self.score_state[row] = kv, score
        if (pos + 1) % r:
            return
        if self.overlap:
            kv_win = torch.cat([self.kv_state[:r, :d], self.kv_state[r:, d:]])
            score_win = torch.cat([self.score_state[:r, :d], self.score_state[r:, d:]])
            pooled = (kv_win * score_win.softmax(dim=0)).sum(0, keepdim=True)
            self.kv_state[:r], self.score_state[:r] = self.kv_state[r:].clone(), self.score_state[r:].clone()
        else:
            pooled = (self.kv_state * self.score_state.softmax(dim=0)).sum(0, keepdim=True)
        self.entries += list(self._finish(pooled, torch.tensor([pos + 1 - r])))


class Indexer:
    """The lightning indexer: its own overlapping compressor at ``index_dim`` (Hadamard-rotated keys), scores
    ``sum_h w[h] * relu(q[h] . k) / sqrt(index_dim * index_heads)``, the ``index_topk`` best closed entries."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, args: RefArgs, freqs: torch.Tensor) -> None:
        self.args, self.freqs = args, freqs
        self.wq_b, self.weights_proj = w[prefix + "wq_b.weight"], w[prefix + "weights_proj.weight"]
        self.compressor = Compressor(w, prefix + "compressor.", args.csa_ratio, args.index_dim, args, freqs, True)
        self.ambiguous: list[int] = []  # positions whose top-k the release's own topk leaves open

    def __call__(self, x: torch.Tensor, qr: torch.Tensor, start: int, offset: int) -> torch.Tensor:  # [S, K]
        a, s = self.args, x.shape[0]
        r, end = a.csa_ratio, start + s
        q = rotate((qr @ self.wq_b.T).unflatten(-1, (a.index_heads, a.index_dim)), self.freqs[start:end])
        q = hadamard(q)
        if start == 0:
            self.compressor.prefill(x)
        else:
            self.compressor.decode(x, start)
        weights = (x @ self.weights_proj.T) * (a.index_dim ** -0.5 * a.index_heads ** -0.5)
        closed = end // r
        keys = torch.stack(self.compressor.entries[:closed]) if closed else x.new_zeros(0, a.index_dim)
        scores = (torch.einsum("shd,td->sht", q, keys).relu() * weights[..., None]).sum(1)  # [S, T]
        visible = torch.arange(closed)[None, :] < (torch.arange(start, end) + 1)[:, None] // r
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(a.index_topk, closed)
        if k == 0:
            return torch.zeros(s, 0, dtype=torch.long)
        picks, ambiguous = ordered_topk(scores, k)
        self.ambiguous += [start + i for i in ambiguous.nonzero().flatten().tolist()]
        picks = torch.where(visible.gather(1, picks), picks + offset, -1)
        return picks


class Attention:
    def __init__(self, w: dict[str, torch.Tensor], i: int, args: RefArgs) -> None:
        p = f"layers.{i}.attn."
        self.args, self.ratio = args, args.ratios[i]
        self.w = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}
        length = 1 << 16
        if self.ratio:
            self.freqs = rope_table(args.rope_dim, length, args.compress_rope_theta, args.yarn)
        else:
            self.freqs = rope_table(args.rope_dim, length, args.rope_theta, None)
        self.compressor = Compressor(w, p + "compressor.", self.ratio, args.head_dim, args, self.freqs, False) \
            if self.ratio else None
        self.indexer = Indexer(w, p + "indexer.", args, self.freqs) if self.ratio == args.csa_ratio else None
        self.window = torch.zeros(args.window, args.head_dim)

    def _window_idx(self, s: int, start: int) -> torch.Tensor:  # ``get_window_topk_idxs``
        win = self.args.window
        if start == 0:
            base = torch.arange(s)[:, None]
            idx = (base - win + 1).clamp(min=0) + torch.arange(min(s, win))[None, :]
            return torch.where(idx > base, -1, idx)
        if start >= win - 1:
            return torch.arange(win)[None, :]  # every ring row holds one of the last ``win`` positions
        return F.pad(torch.arange(start + 1), (0, win - start - 1), value=-1)[None, :]

    def _compress_idx(self, s: int, start: int, offset: int) -> torch.Tensor:  # ``get_compress_topk_idxs``
        r = self.ratio
        if start > 0:
            return (torch.arange((start + 1) // r) + offset)[None, :]
        idx = torch.arange(s // r).repeat(s, 1)
        return torch.where(idx >= (torch.arange(1, s + 1) // r)[:, None], -1, idx + offset)

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:  # [S, dim]
        a, w, s = self.args, self.w, x.shape[0]
        table = self.freqs[start:start + s]
        qr = rms_norm(x @ w["wq_a.weight"].T, w["q_norm.weight"], a.eps)
        q = (qr @ w["wq_b.weight"].T).unflatten(-1, (a.n_heads, a.head_dim))
        q = rotate(rms_norm(q, None, a.eps), table)
        kv = rotate(rms_norm(x @ w["wkv.weight"].T, w["kv_norm.weight"], a.eps), table)
        idx = self._window_idx(s, start).expand(s, -1)
        if self.ratio:
            offset = s if start == 0 else a.window
            extra = self.indexer(x, qr, start, offset) if self.indexer is not None \
                else self._compress_idx(s, start, offset).expand(s, -1)
            idx = torch.cat([idx, extra], dim=1)
        if start == 0:
            for p in range(max(0, s - a.window), s):
                self.window[p % a.window] = kv[p]
            keys = kv
            if self.compressor is not None:
                self.compressor.prefill(x)
                if self.compressor.entries:
                    keys = torch.cat([kv, torch.stack(self.compressor.entries)])
        else:
            self.window[start % a.window] = kv[0]
            keys = self.window
            if self.compressor is not None:
                self.compressor.decode(x, start)
                if self.compressor.entries:
                    keys = torch.cat([self.window, torch.stack(self.compressor.entries)])
        o = sparse_attention(q, keys, w["attn_sink"], idx, a.head_dim ** -0.5)
        o = rotate(o, table, inverse=True)
        groups = o.reshape(s, a.o_groups, -1)
        wo_a = w["wo_a.weight"].view(a.o_groups, a.o_lora_rank, -1)
        return torch.einsum("sgd,grd->sgr", groups, wo_a).flatten(1) @ w["wo_b.weight"].T


class MoE:
    def __init__(self, w: dict[str, torch.Tensor], i: int, args: RefArgs) -> None:
        p = f"layers.{i}.ffn."
        self.args, self.hash = args, args.hash_layers[i]
        self.w = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}

    def _expert(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, limit = self.w, self.args.swiglu_limit
        gate, up = x @ w[name + "w1.weight"].T, x @ w[name + "w3.weight"].T
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        return (F.silu(gate) * up) @ w[name + "w2.weight"].T

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [S, dim], [S]
        a, w = self.args, self.w
        scores = x @ w["gate.weight"].T
        if a.score_func == "softmax":
            scores = scores.softmax(-1)
        elif a.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        if self.hash:
            picks = w["gate.tid2eid"].long()[ids]
        else:
            picks = (scores + w["gate.bias"]).topk(a.n_activated, dim=-1).indices
        weights = scores.gather(1, picks)
        if a.score_func != "softmax":
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * a.route_scale
        y = torch.zeros_like(x)
        for e in range(a.n_experts):
            rows, slot = torch.where(picks == e)
            if rows.numel():
                y[rows] += self._expert(x[rows], f"experts.{e}.") * weights[rows, slot, None]
        return y + self._expert(x, "shared_experts.")


class Block:
    def __init__(self, w: dict[str, torch.Tensor], i: int, args: RefArgs) -> None:
        self.args, self.attn, self.ffn = args, Attention(w, i, args), MoE(w, i, args)
        p = f"layers.{i}."
        self.w = {k[len(p):]: v for k, v in w.items() if k.startswith(p) and "." not in k[len(p):]}
        self.attn_norm, self.ffn_norm = w[p + "attn_norm.weight"], w[p + "ffn_norm.weight"]

    def _pre(self, h: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, w = self.args, self.w
        flat = h.flatten(1)
        mixes = (flat @ w[f"hc_{kind}_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + a.eps)
        pre, post, comb = sinkhorn_split(mixes, w[f"hc_{kind}_scale"], w[f"hc_{kind}_base"], a.hc,
                                         a.sinkhorn_iters, a.hc_eps)
        return (pre[..., None] * h).sum(1), post, comb

    @staticmethod
    def _post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # stream j: post[j] * out + sum_i comb[i, j] * residual[i]
        return post[..., None] * out[:, None, :] + torch.einsum("sij,sid->sjd", comb, residual)

    def __call__(self, h: torch.Tensor, start: int, ids: torch.Tensor) -> torch.Tensor:  # [S, hc, dim]
        x, post, comb = self._pre(h, "attn")
        h = self._post(self.attn(rms_norm(x, self.attn_norm, self.args.eps), start), h, post, comb)
        x, post, comb = self._pre(h, "ffn")
        return self._post(self.ffn(rms_norm(x, self.ffn_norm, self.args.eps), ids), h, post, comb)


class ReferenceV4:
    """``prefill(ids)`` at position 0, then ``decode(token)`` one token at a time; each returns the logits of every
    position it ran (the release's head keeps only the last; the per-position math is the same)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.args = RefArgs.from_config(json.loads((path / "config.json").read_text()))
        self.weights = load_weights(path)
        self.reset()

    def reset(self) -> None:
        self.layers = [Block(self.weights, i, self.args) for i in range(self.args.n_layers)]
        self.length = 0

    @property
    def ambiguous(self) -> list[int]:
        """Positions where some indexer's top-k boundary fell inside a tie (the release's choice is open there)."""
        return sorted({p for b in self.layers if b.attn.indexer is not None for p in b.attn.indexer.ambiguous})

    def _forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:  # [S] -> [S, vocab]
        a, w = self.args, self.weights
        h = w["embed.weight"][ids][:, None, :].repeat(1, a.hc, 1)
        for block in self.layers:
            h = block(h, start, ids)
        flat = h.flatten(1)
        mixes = (flat @ w["hc_head_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + a.eps)
        pre = torch.sigmoid(mixes * w["hc_head_scale"] + w["hc_head_base"]) + a.hc_eps
        x = rms_norm((pre[..., None] * h).sum(1), w["norm.weight"], a.eps)
        return x @ w["head.weight"].T

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.reset()
        self.length = len(ids)
        return self._forward(torch.tensor(ids), 0)

    @torch.inference_mode()
    def decode(self, token: int) -> torch.Tensor:  # [vocab]
        out = self._forward(torch.tensor([token]), self.length)[0]
        self.length += 1
        return out

    def teacher_forced(self, ids: list[int], prefill_len: int) -> torch.Tensor:  # [len(ids), vocab]
        """Logits at every position: a prefill of the first ``prefill_len`` tokens, then the rest decoded."""
        rows = [self.prefill(ids[:prefill_len])]
        rows += [self.decode(t)[None] for t in ids[prefill_len:]]
        return torch.cat(rows)

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        out = [int(self.prefill(prompt)[-1].argmax())]
        while len(out) < new_tokens:
            out.append(int(self.decode(out[-1]).argmax()))
        return out


# The tiny V4 settings the reference is checked on (tests/models/test_deepseek_v4_reference.py); the context
# parallel test reuses one.
RELEASE_SMALL = dict(  # the release's layer schedule in small, two index heads (many exact-zero ties), top-4
    num_hidden_layers=6, head_dim=64, num_attention_heads=4, partial_rotary_factor=0.25, sliding_window=8,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    index_topk=4, index_n_heads=2, index_head_dim=32)


REFERENCE_CONFIGS = {
    "release_small": RELEASE_SMALL,
    # rates that divide neither the block size nor each other, YaRN on the compress rotary, sigmoid routing,
    # 8 query heads in 4 output groups, top-2 of two index heads
    "odd_rates": dict(compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5},
                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32, "beta_slow": 1},
                      sliding_window=6, index_topk=2, index_n_heads=2, index_head_dim=16, o_groups=4,
                      num_attention_heads=8, scoring_func="sigmoid",
                      layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                   "sliding_attention", "compressed_sparse_attention"],
                      mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"]),
    # one entry per query, two streams and few Sinkhorn rounds
    "top1": dict(index_topk=1, index_n_heads=4, hc_mult=2, hc_sinkhorn_iters=3),
    # more picks than closed windows at every length tested: the indexer keeps all
    "top_wide": dict(index_topk=96, index_n_heads=2, index_head_dim=16),
}
