"""Greedy continuations against transformers where exact equality is not promised (bf16): where two continuations
first differ, how far apart the reference's logits of the two tokens were. In bf16 two correct implementations
round differently (summation order, fused ops), so at a step whose top two logits are within a few bf16 ulps
either token is a correct greedy pick, and everything after it legitimately differs. Used by tests/models/test_bf16.py
and benchmarks/bf16.py. And transformers' greedy continuation itself (hf_greedy, hf_greedy_choices): the oracle
where equality is promised (fp32)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# A step is a near-tie when the reference's top logit exceeds its logit of our token by at most this many bf16 ulps
# of that top logit (bf16 keeps 8 significant bits: an ulp is 2^-5 for logits in [4, 8), 2^-3 in [16, 32)): a few
# roundings of the error that 30 bf16 layers leave in the final hidden state.
NEAR_TIE_ULPS = 4


def near_tie_bound(top_logit: float) -> float:
    """NEAR_TIE_ULPS bf16 ulps at the magnitude of ``top_logit``."""
    exponent = math.floor(math.log2(max(abs(top_logit), 2.0 ** -126)))
    return NEAR_TIE_ULPS * 2.0 ** (exponent - 7)


@dataclass(frozen=True)
class Divergence:
    index: int  # first output position where the two continuations differ
    ours: int  # our token there
    theirs: int  # the reference's token there
    gap: float  # the reference's logit of its token minus its logit of ours at that step (>= 0)
    bound: float  # near_tie_bound of the reference's logit of its token

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.bound


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
            top = float(step[reference])
            return Divergence(index, mine, reference, top - float(step[mine]), near_tie_bound(top))
    return None


def hf_greedy_choices(model, input_ids: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy choice after each prefix of ``tokens`` and that choice's logprob, from ONE forward over
    input_ids + tokens (teacher forcing). The choices equal ``tokens`` exactly when ``tokens`` is transformers'
    greedy continuation (by induction over the positions), at the cost of one forward instead of one a token."""
    ids = torch.tensor([input_ids + tokens[:-1]])
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(input_ids) - 1:].float(), dim=-1)  # [n, vocab]
    best = logp.argmax(dim=-1)
    return best.tolist(), logp.gather(1, best[:, None])[:, 0].tolist()


def hf_greedy(model, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers greedy decoding with EOS ignored; returns the tokens and each one's logprob."""
    ids = torch.tensor([input_ids])
    past = None
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(torch.argmax(logp))
            tokens.append(token)
            logprobs.append(float(logp[token]))
            ids = torch.tensor([[token]])
    return tokens, logprobs
