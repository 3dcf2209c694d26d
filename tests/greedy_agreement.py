"""Greedy continuations against transformers where exact equality is not promised (bf16): where two continuations
first differ, how far apart the reference's logits of the two tokens were. In bf16 two correct implementations
round differently (summation order, fused ops), so at a step whose top two logits are within a few bf16 ulps
either token is a correct greedy pick, and everything after it legitimately differs. Used by tests/test_bf16.py
and benchmarks/bf16.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# A step is a near-tie when the reference's top logit exceeds its logit of our token by at most this much: 4 bf16
# ulps of a logit in [4, 8) (an ulp there is 2^-5), a few roundings of the final hidden state's error.
NEAR_TIE_BOUND = 0.125


@dataclass(frozen=True)
class Divergence:
    index: int  # first output position where the two continuations differ
    ours: int  # our token there
    theirs: int  # the reference's token there
    gap: float  # the reference's logit of its token minus its logit of ours at that step (>= 0)

    @property
    def near_tie(self) -> bool:
        return self.gap <= NEAR_TIE_BOUND


def hf_greedy_with_logits(model, input_ids: list[int],  # transformers causal LM, prompt token ids
                          max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation (EOS ignored, KV cache, no padding) and each step's logits [V] float32."""
    ids = torch.tensor([input_ids])
    past = None
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            step = out.logits[0, -1].float()
            tokens.append(int(torch.argmax(step)))
            logits.append(step)
            ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


def first_divergence(ours: list[int], theirs: list[int],
                     their_logits: list[torch.Tensor]) -> Divergence | None:  # their_logits: per step [V]
    """None when the continuations are equal (over the shorter length)."""
    for index, (mine, reference) in enumerate(zip(ours, theirs)):
        if mine != reference:
            step = their_logits[index]
            return Divergence(index, mine, reference, float(step[reference] - step[mine]))
    return None
