"""A plain-torch port of DeepSpec's DSpark drafter at inference (deepseek-ai/DeepSpec: ``modeling/dspark/qwen3/
modeling.py`` ``_forward_backbone`` with its eval cache, ``markov_head.py``'s three heads, ``common.py:
AcceptRatePredictor`` and ``eval/dspark/draft_ops.py``'s confidence inputs), on one sequence, from a state dict in
DeepSpec's names. Written from the reference's formulas, independently of backend_lib: dense eager attention over
[context ; block] with the reference's mask (context positions below the anchor, the whole block), rotate-half RoPE
computed here, greedy sampling (``temperature=0``)."""
from __future__ import annotations

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:  # x [N, heads, D]
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return x * emb.cos()[:, None, :] + _rotate_half(x) * emb.sin()[:, None, :]


def block_hidden(w: dict[str, torch.Tensor], cfg: dict, target_hidden: torch.Tensor,  # [C, n * H] positions 0..C-1
                 block_embeds: torch.Tensor,  # [B, H] embed([anchor, mask, ...])
                 anchor_pos: int) -> torch.Tensor:  # [B, H] after the final norm
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nh
    qk_norm = cfg.get("model_type") == "qwen3"
    main_x = _rms(target_hidden @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    C, B = main_x.shape[0], block_embeds.shape[0]
    positions = torch.cat([torch.arange(C), anchor_pos + torch.arange(B)])
    visible = torch.cat([torch.arange(C) < anchor_pos, torch.ones(B, dtype=torch.bool)])
    x = block_embeds
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, nh, d)
        kv_in = torch.cat([main_x, h])  # the context from main_x, the block from its own normed states
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).reshape(C + B, nkv, d)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).reshape(C + B, nkv, d)
        if qk_norm:
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, positions[C:], theta), _rope(k, positions, theta)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        scores = scores.masked_fill(~visible[None, None, :], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(B, nh * d)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)


def markov_greedy(w: dict[str, torch.Tensor], kind: str, base_logits: torch.Tensor,  # [B, V]
                  anchor: int, hidden: torch.Tensor) -> tuple[list[int], list[int]]:  # hidden [B, H]
    """DeepSpec's ``sample_block_tokens`` at temperature 0: (drafts, the previous token of each slot)."""
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    prev, drafts, prevs = anchor, [], []
    state = torch.zeros(w1.shape[1])
    for i in range(base_logits.shape[0]):
        e = w1[prev]
        if kind == "vanilla":
            bias = e @ w2.T
        elif kind == "gated":
            gate = torch.sigmoid(torch.cat([hidden[i], e]) @ w["markov_head.gate_proj.weight"].T
                                 + w["markov_head.gate_proj.bias"])
            bias = (gate * e) @ w2.T
        else:  # rnn
            z = torch.cat([state, e, hidden[i]]) @ w["markov_head.joint_proj.weight"].T + w["markov_head.joint_proj.bias"]
            g, c, o = z.chunk(3)
            g = torch.sigmoid(g)
            state = g * state + (1 - g) * torch.tanh(c)
            bias = torch.tanh(o) @ w2.T
        prevs.append(prev)
        prev = int((base_logits[i] + bias).argmax())
        drafts.append(prev)
    return drafts, prevs


def confidence(w: dict[str, torch.Tensor], hidden: torch.Tensor,  # [B, H]
               prev_ids: list[int], with_markov: bool) -> torch.Tensor:  # [B] sigmoid(proj([h ; W1[prev]]))
    features = torch.cat([hidden, w["markov_head.markov_w1.weight"][prev_ids]], dim=-1) if with_markov else hidden
    return torch.sigmoid(features @ w["confidence_head.proj.weight"][0] + w["confidence_head.proj.bias"][0])
