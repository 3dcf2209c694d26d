"""DeepSpec's DSpark training objective (``deepspec/modeling/dspark/loss.py``, ``common.py``; written anew) over one
target sequence, on the engine's own drafter module (backend_lib/models/dspark/model.py), so what is trained is what
serves.

A sequence brings its tokens, the target's hidden states at the drafter's layers and its final-normed hidden state.
``num_anchors`` anchors are sampled among positions whose next token is supervised; anchor ``a``'s block
``[t_a, mask x (B - 1)]`` at positions ``a .. a + B - 1`` sees the context ``< a``, and slot ``i`` is supervised on
``t_{a+i+1}`` while the slots before it are (a contiguous prefix inside the sequence and the loss mask). Per slot,
weighted by ``exp(-i / loss_decay_gamma)``:
    ce_alpha * CE(draft, t) + l1_alpha * |softmax(draft) - softmax(target)|_1 + conf_alpha * BCE(c, 1 - TV)
with the target's logits at the position predicting the same token, ``1 - TV`` the probability a sampled draft
would survive (the confidence head's target, detached), and the Markov head biased by the true previous tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend_lib.models.dspark.heads import confidence_logits
from backend_lib.models.dspark.model import DSparkDrafter


@dataclass(frozen=True)
class Objective:
    ce_alpha: float = 0.1  # DeepSpec's Qwen3 recipes: 0.1 CE, 0.9 L1, 1.0 confidence, decay 4
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    loss_decay_gamma: float = 4.0
    num_anchors: int = 32


@dataclass
class TargetSequence:
    token_ids: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, n * H] the target's hidden states at the drafter's layers
    last_hidden: torch.Tensor  # [T, H] final-normed (the target's head gives its logits)
    loss_mask: torch.Tensor  # [T] bool: tokens to supervise (the target's own output)


@dataclass
class StepLosses:
    loss: torch.Tensor
    ce: float
    l1: float
    confidence: float
    accept_by_slot: list[float]  # mean 1 - TV per slot


def sample_anchors(mask: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:  # [T] bool -> [N]
    valid = torch.nonzero(mask[:-1] & mask[1:]).flatten()
    if valid.numel() == 0:
        return valid
    order = torch.randperm(valid.numel(), generator=generator)[:count]
    return valid[order].sort().values


def step_losses(drafter: DSparkDrafter, embed: torch.Tensor,  # [V, H] the target's embedding (frozen)
                head: torch.Tensor,  # [V, H] the target's head (frozen)
                seq: TargetSequence, objective: Objective, generator: torch.Generator) -> StepLosses | None:
    config = drafter.config
    B, T = config.block_size, seq.token_ids.shape[0]
    anchors = sample_anchors(seq.loss_mask, objective.num_anchors, generator)
    if anchors.numel() == 0:
        return None
    N = anchors.shape[0]
    main_x = drafter.project_context(seq.features)
    context = [(k[None].expand(N, -1, -1, -1), v[None].expand(N, -1, -1, -1))
               for k, v in drafter.context_kv(main_x, torch.arange(T))]
    ids = torch.full((N, B), config.mask_token_id, dtype=torch.int64)
    ids[:, 0] = seq.token_ids[anchors]
    offsets = torch.arange(B)
    hidden = drafter.block_hidden(F.embedding(ids, embed), anchors[:, None] + offsets, context,
                                  torch.arange(T)[None, :] < anchors[:, None])
    labels = anchors[:, None] + offsets + 1  # [N, B] the position each slot drafts
    inside = labels < T
    safe = labels.clamp(max=T - 1)
    supervised = (inside & seq.loss_mask[safe]).to(torch.int32).cumprod(dim=1).bool()
    target_ids = seq.token_ids[safe]
    prev = torch.cat([ids[:, :1], target_ids[:, :-1]], dim=1)
    logits = hidden @ head.T
    if drafter.markov_head is not None:
        logits = drafter.markov_head.teacher_forced(logits, prev, hidden)
    target_logits = seq.last_hidden[safe - 1] @ head.T  # the target's prediction of the same token
    weight = supervised.float() * torch.exp(-offsets.float() / objective.loss_decay_gamma)
    denominator = weight.sum().clamp(min=1e-6)
    ce = (F.cross_entropy(logits.flatten(0, 1).float(), target_ids.flatten(), reduction="none").view(N, B)
          * weight).sum() / denominator
    l1_per_slot = (logits.float().softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)
    l1 = (l1_per_slot * weight).sum() / denominator
    accept = (1.0 - 0.5 * l1_per_slot).clamp(0.0, 1.0).detach()
    loss = objective.ce_alpha * ce + objective.l1_alpha * l1
    confidence = torch.zeros(())
    if drafter.confidence_head is not None:
        pred = confidence_logits(drafter.confidence_head, drafter.markov_head, config.confidence_head_with_markov,
                                 hidden, prev)
        confidence = (F.binary_cross_entropy_with_logits(pred, accept, reduction="none") * weight).sum() / denominator
        loss = loss + objective.confidence_alpha * confidence
    counts = supervised.float().sum(0).clamp(min=1.0)
    accept_by_slot = ((accept * supervised).sum(0) / counts).tolist()
    return StepLosses(loss, ce.item(), l1.item(), confidence.item(), accept_by_slot)
