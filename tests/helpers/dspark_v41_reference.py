"""A test oracle for DeepSeek-V4.1's DSpark drafter (``mtp.{0,1,2}``), in plain torch on one sequence, from the
checkpoint ``deepinfer make-tiny --arch deepseek_v41 --dspark`` writes (the release's tensor names). The target is
``tests/helpers/deepseek_v41_reference.py`` (transformers main's V4.1), which also lends its small math (RMSNorm,
interleaved RoPE, the mHC mixes / expansion, the clamped SwiGLU expert).

Where each piece comes from:
- the three blocks: NeMo AutoModel ``nemo_automodel/components/models/deepseek_v41/dspark.py`` (commit 014468d5)
  ``_DeepseekV41DSparkBlock.forward``: single-pass mHC (attention collapses with the previous site's ``pre``, one-hot
  stream 0 before ``mtp.0``; the FFN with this block's attention ``pre``), ``attn_norm`` / ``ffn_norm``, a MoE of
  ``dspark_n_routed_experts`` experts, top ``dspark_num_experts_per_tok``, with the V4.1 router and the shared
  expert (NeMo builds it from ``MoEConfig(score_func="sqrtsoftplus", route_scale=routed_scaling_factor,
  norm_topk_prob)``);
- the attention: NeMo ``_DeepseekV41DSparkAttention.forward``: window-only MLA (q LoRA, no q norm after ``wq_b``),
  the plain ``rope_theta`` rotary (ratio 0: no YaRN), keys = values = ``rope(kv_norm(wkv(.)))`` of
  ``[main_x (context) ; the block's normed input]`` (the context's keys come from ``main_x`` itself, no
  ``attn_norm``), a per-head sink logit in the denominator only (NeMo's zero-valued extra key), scale
  ``head_dim^-0.5``, inverse RoPE and the grouped ``wo_a`` / ``wo_b`` (``_project_output``). No fake quantization
  (NeMo's drafter has none);
- the mask: NeMo ``build_attention_mask``: every block query sees the ``sliding_window`` context positions ending at
  the block's context end, and the whole block (non-causal); positions: NeMo ``build_position_ids``, the block at
  the ``block_size`` positions right after the context end;
- ``main_x = main_norm(main_proj(cat(features)))`` on ``mtp.0`` (NeMo ``DeepseekV41DSparkBackbone.forward``); the
  final collapse with the last FFN ``pre`` gives the pre-norm ``h`` (the confidence head's input), ``mtp.2.norm(h)``
  the normed state the target's ``head`` reads;
- the features: the residual streams at ``dspark_target_layer_ids`` averaged over the ``hc_mult`` streams, taken
  at each layer's **input** (the streams the previous layer's post-mix left, before that layer's Engram): vLLM
  ``deepseek_v41/nvidia/dspark.py`` captures ``previous_post.mean(dim=1)`` at those indices and transformers calls
  it the layers' "attention input" (DeepSpec's ``hidden_states[id + 1]`` would be the output; the release follows
  the former, so do we);
- the Markov head ``logits_i = base_i + head(embed(prev_i))`` (NeMo ``_DeepseekV41DSparkMarkovHead``, vanilla,
  rank ``dspark_markov_rank``), greedy drafts sampled slot by slot (``prev_0`` the anchor; vLLM ``DSparkSpeculator``);
- the confidence ``c_i = sigmoid(proj([h_i ; embed(prev_i)]))`` in fp32 without bias (NeMo
  ``_DeepseekV41DSparkConfidenceHead``), the survival ``S_k = prod_{i<=k} c_i``.

Inference convention (the design note's open point 4; affects acceptance, not losslessness): the anchor is the newest
token ``t_p`` at position ``p``, whose target state does not exist yet; the context is the target's rows ``< p``
(window ``p - W .. p - 1``), the block ``[t_p, noise x (B - 1)]`` sits at ``p .. p + B - 1`` and slot ``i`` drafts
the token at ``p + i + 1`` (vLLM's: the bonus token at its own position; NeMo's mask and positions with context end
``p - 1``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.helpers.deepseek_v41_reference import ReferenceV41, inv_freq, rms_norm, rope


@dataclass(frozen=True)
class RefDSparkArgs:
    layers: int
    block_size: int
    noise_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_experts: int
    n_activated: int

    @classmethod
    def from_config(cls, cfg: dict) -> "RefDSparkArgs":
        t = cfg.get("text_config", cfg)
        return cls(t["num_nextn_predict_layers"], t["dspark_block_size"], t["dspark_noise_token_id"],
                   tuple(t["dspark_target_layer_ids"]), t["dspark_markov_rank"], t["dspark_n_routed_experts"],
                   t["dspark_num_experts_per_tok"])


class CapturingReferenceV41(ReferenceV41):
    """The V4.1 target oracle, also keeping the hc-mean of the streams entering ``capture`` layers."""

    def __init__(self, path: str | Path, capture: tuple[int, ...], **kw) -> None:
        super().__init__(path, **kw)
        self.capture, self.captured, self._before_engram = capture, {}, {}

    def _engram(self, i: int, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self._before_engram[i] = streams
        return super()._engram(i, streams, rows)

    def _layer(self, i, streams, pre_mix, pos, state, shared):
        if i in self.capture:
            self.captured[i] = self._before_engram.pop(i, streams).mean(1)
        return super()._layer(i, streams, pre_mix, pos, state, shared)

    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [S] -> logits [S, V], [S, n D]
        logits = self.forward(ids)
        return logits, torch.cat([self.captured[i] for i in self.capture], dim=-1)


class ReferenceV41DSpark:
    def __init__(self, path: str | Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        self.d = RefDSparkArgs.from_config(cfg)
        self.target = CapturingReferenceV41(path, self.d.target_layer_ids, weights=weights)
        self.a, self.w = self.target.args, self.target.w
        self.freqs = inv_freq(self.a.rope_dim, self.a.rope_theta, None)  # draft layers are window-only

    @torch.no_grad()
    def block(self, features: torch.Tensor,  # [C, n * D] the target's features at context positions
              ctx_pos: torch.Tensor,  # [C] int64
              block_ids: torch.Tensor,  # [B] int64
              block_pos: torch.Tensor,  # [B] int64
              ) -> tuple[torch.Tensor, torch.Tensor]:  # pre-norm h [B, D], base logits [B, V]
        """One draft block over the given context (every context row visible: the caller cuts the window)."""
        a, w = self.a, self.w
        main_x = rms_norm(features @ w["mtp.0.main_proj.weight"].T, w["mtp.0.main_norm.weight"], a.eps)
        streams = w["embed.weight"][block_ids][:, None, :].expand(-1, a.hc, -1).clone()
        pre = torch.zeros(block_ids.shape[0], a.hc)
        pre[:, 0] = 1.0
        for j in range(self.d.layers):
            p = f"mtp.{j}."
            attn_pre, post, comb = self.target._mixes(streams, p + "hc_attn_")
            x = rms_norm((pre[..., None] * streams).sum(1), w[p + "attn_norm.weight"], a.eps)
            streams = self.target._expand(self._attention(p, x, main_x, ctx_pos, block_pos), streams, post, comb)
            pre, post, comb = self.target._mixes(streams, p + "hc_ffn_")
            x = rms_norm((attn_pre[..., None] * streams).sum(1), w[p + "ffn_norm.weight"], a.eps)
            streams = self.target._expand(self._moe(p, x), streams, post, comb)
        h = (pre[..., None] * streams).sum(1)
        last = f"mtp.{self.d.layers - 1}."
        return h, rms_norm(h, w[last + "norm.weight"], a.eps) @ w["head.weight"].T

    def _attention(self, p: str, x: torch.Tensor, main_x: torch.Tensor, ctx_pos: torch.Tensor,
                   block_pos: torch.Tensor) -> torch.Tensor:
        a, w = self.a, self.w
        q_res = rms_norm(x @ w[p + "attn.wq_a.weight"].T, w[p + "attn.q_norm.weight"], a.eps)
        q = rope((q_res @ w[p + "attn.wq_b.weight"].T).view(-1, a.n_heads, a.head_dim), self.freqs, block_pos)
        source, pos = torch.cat([main_x, x]), torch.cat([ctx_pos, block_pos])
        kv = rope(rms_norm(source @ w[p + "attn.wkv.weight"].T, w[p + "attn.kv_norm.weight"], a.eps), self.freqs, pos)
        scores = torch.einsum("shd,kd->shk", q, kv) * a.head_dim ** -0.5
        sink = w[p + "attn.attn_sink"][None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = rope(torch.einsum("shk,kd->shd", probs, kv), self.freqs, block_pos, inverse=True)
        groups = out.reshape(out.shape[0], a.o_groups, -1)
        wo_a = w[p + "attn.wo_a.weight"].view(a.o_groups, a.o_lora_rank, -1)
        return torch.einsum("sgi,gri->sgr", groups, wo_a).flatten(1) @ w[p + "attn.wo_b.weight"].T

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        a, w, f = self.a, self.w, p + "ffn."
        scores = F.softplus((x @ w[f + "gate.weight"].T) / a.gate_temp).sqrt()
        ids = (scores + w[f + "gate.bias"]).topk(self.d.n_activated, dim=-1).indices
        weights = scores.gather(1, ids)
        if a.norm_topk_prob and self.d.n_activated > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * a.route_scale
        out = self.target._expert(f + "shared_experts.", x) @ w[f + "shared_experts.w2.weight"].T
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            h = self.target._expert(f"{f}experts.{e}.", x[rows]) * weights[rows, slot, None]
            out = out.index_add(0, rows, h @ w[f"{f}experts.{e}.w2.weight"].T)
        return out

    @torch.no_grad()
    def heads(self, h: torch.Tensor,  # [B, D] pre-norm block states
              base: torch.Tensor,  # [B, V] base logits
              anchor: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:  # drafts, confidence [B], survival [B]
        w, last = self.w, f"mtp.{self.d.layers - 1}."
        prev, drafts, conf = anchor, [], []
        for i in range(h.shape[0]):
            e = w[last + "markov_head.embed.weight"][prev]
            logits = base[i] + e @ w[last + "markov_head.head.weight"].T
            conf.append(torch.sigmoid(torch.cat([h[i], e]) @ w[last + "confidence_head.proj.weight"][0]))
            prev = int(logits.argmax())
            drafts.append(prev)
        c = torch.stack(conf)
        return drafts, c, torch.cumprod(c, 0)

    def propose(self, tokens: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Drafts after ``tokens`` (the last one the anchor at position ``p = len - 1``; the target ran the rest),
        with the block's confidences and survivals."""
        p = len(tokens) - 1
        _, feats = self.target.features(torch.tensor(tokens[:p]))
        lo = max(0, p - self.a.window)
        B = self.d.block_size
        block_ids = torch.tensor([tokens[p]] + [self.d.noise_id] * (B - 1))
        h, base = self.block(feats[lo:p], torch.arange(lo, p), block_ids, p + torch.arange(B))
        return self.heads(h, base, tokens[p])
