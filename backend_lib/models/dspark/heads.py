"""DSpark's two heads over the drafter's block outputs (DeepSpec ``markov_head.py``, ``common.py:
AcceptRatePredictor``), parameter names as DeepSpec saves them.

Markov head: the block drafts all its slots in one parallel pass, so slot ``i`` does not see the token slot ``i - 1``
drafted; a low-rank bias from that previous token restores the dependency:
    logits_i = base_i + W2 f(W1[prev_i], h_i, state)
with ``prev_0`` the anchor and ``prev_i`` the draft of slot ``i - 1`` (sampled sequentially at inference, the
target's token when training). ``f``: vanilla (the embedding itself), gated (times sigmoid(gate([h ; e]))) or rnn (a
GRU-like state carried along the block). Confidence head: ``c_i = sigmoid(proj([h_i ; W1[prev_i]]))`` (or
``proj(h_i)`` without the Markov embedding), the predicted chance that slot ``i`` survives verification given its
prefix did; the survival of the first ``k`` drafts is their running product.
"""
from __future__ import annotations

import torch
from torch import nn

from backend_lib.models.dspark.config import DrafterConfig


class MarkovHead(nn.Module):
    def __init__(self, kind: str, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            # one projection of [state ; W1[prev] ; h] to [gate ; candidate ; output], as DeepSpec's RNNHead
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., rank]
        return self.markov_w1(prev_ids)

    def initial_state(self, hidden: torch.Tensor) -> torch.Tensor | None:  # hidden [..., H] -> [..., rank]
        return hidden.new_zeros(*hidden.shape[:-1], self.rank) if self.kind == "rnn" else None

    def step_bias(self, prev_ids: torch.Tensor,  # [...] int64: the token before this slot
                  hidden: torch.Tensor,  # [..., H] the slot's block output
                  state: torch.Tensor | None,  # [..., rank] (rnn) or None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:  # bias [..., V], next state
        emb = self.prev_embedding(prev_ids).to(hidden.dtype)
        if self.kind == "vanilla":
            return self.markov_w2(emb), None
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb), None
        gate, candidate, output = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state

    def teacher_forced(self, base_logits: torch.Tensor,  # [N, B, V]
                       prev_ids: torch.Tensor,  # [N, B] int64: the anchor, then the true tokens of slots 0..B-2
                       hidden: torch.Tensor,  # [N, B, H]
                       ) -> torch.Tensor:  # [N, B, V]
        """Training's logits: every slot biased by the true previous token (the rnn state unrolled along B)."""
        if self.kind != "rnn":
            return base_logits + self.step_bias(prev_ids, hidden, None)[0]
        state, out = self.initial_state(hidden[:, 0]), []
        for i in range(base_logits.shape[1]):
            bias, state = self.step_bias(prev_ids[:, i], hidden[:, i], state)
            out.append(base_logits[:, i] + bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., input_dim] -> [...] logits
        return self.proj(features).squeeze(-1)


def build_heads(config: DrafterConfig) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    hidden = config.arch.hidden_size
    markov = (MarkovHead(config.markov_head_type, config.arch.vocab_size, config.markov_rank, hidden)
              if config.markov_rank else None)
    confidence = None
    if config.enable_confidence_head:
        confidence = ConfidenceHead(hidden + (config.markov_rank if config.confidence_head_with_markov else 0))
    return markov, confidence


def confidence_logits(head: ConfidenceHead, markov: MarkovHead | None, with_markov: bool,
                      hidden: torch.Tensor,  # [..., H]
                      prev_ids: torch.Tensor,  # [...] int64
                      ) -> torch.Tensor:  # [...] float32 logits
    features = torch.cat([hidden, markov.prev_embedding(prev_ids).to(hidden.dtype)], dim=-1) if with_markov else hidden
    return head(features).float()


def draft_sequentially(base_logits: torch.Tensor,  # [S, B, V] the block's logits before the Markov bias
                       anchor_ids: torch.Tensor,  # [S] int64
                       hidden: torch.Tensor,  # [S, B, H]
                       markov: MarkovHead | None) -> torch.Tensor:  # [S, B] int64 greedy drafts
    """Greedy drafts through the Markov bias, slot by slot (each slot's bias reads the previous slot's draft).
    Greedy: deterministic drafts, which the rejection sampler verifies losslessly for sampled requests too."""
    if markov is None:
        return base_logits.argmax(dim=-1)
    prev, state, drafts = anchor_ids, markov.initial_state(hidden[:, 0]), []
    for i in range(base_logits.shape[1]):
        bias, state = markov.step_bias(prev, hidden[:, i], state)
        prev = (base_logits[:, i] + bias.float()).argmax(dim=-1)
        drafts.append(prev)
    return torch.stack(drafts, dim=1)
