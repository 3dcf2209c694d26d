"""Grouped router vs transformers' DeepseekV3TopkRouter; static (fixed-shape) MoE == dynamic dispatch."""
from __future__ import annotations

import pytest
import torch

from backend_lib.neuron.static_moe import moe_static, routing_matrix
from kernels.moe import ExpertWeights, RouterConfig, grouped_topk, moe_dynamic
from kernels.quant import quantize_block_fp8


def _experts(num_experts: int, hidden: int, inter: int, gen: torch.Generator) -> ExpertWeights:
    return ExpertWeights(torch.randn(num_experts, inter, hidden, generator=gen) * 0.2,
                         torch.randn(num_experts, inter, hidden, generator=gen) * 0.2,
                         torch.randn(num_experts, hidden, inter, generator=gen) * 0.2)


@pytest.mark.parametrize("seed", range(4))
def test_static_equals_dynamic_for_random_routings_with_idle_experts(seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, hidden, inter, num_experts, top_k = 7, 32, 48, 16, 3
    experts = _experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    # route only among the first half of the experts: the rest receive no token
    ids = torch.stack([torch.randperm(num_experts // 2, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    assert routing_matrix(weights, ids, num_experts)[:, num_experts // 2:].abs().sum() == 0
    dyn = moe_dynamic(x, weights, ids, experts)
    sta = moe_static(x, weights, ids, experts)
    assert (dyn - sta).abs().max() <= 1e-5


def test_static_equals_dynamic_with_fp8_experts():
    gen = torch.Generator().manual_seed(5)
    e = _experts(4, 128, 256, gen)
    quant = [[quantize_block_fp8(w) for w in proj] for proj in (e.gate, e.up, e.down)]
    fp8 = ExpertWeights(*(torch.stack([q for q, _ in p]) for p in quant),
                        *(torch.stack([s for _, s in p]) for p in quant))
    x = torch.randn(5, 128, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])  # experts 2 and 3 idle
    weights = torch.rand(5, 2, generator=gen)
    assert (moe_dynamic(x, weights, ids, fp8) - moe_static(x, weights, ids, fp8)).abs().max() <= 1e-5


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (8, 3, False)])
def test_grouped_topk_matches_transformers_router(n_group, topk_group, norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = DeepseekV3Config(hidden_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 24, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
    x = torch.randn(9, 24, generator=gen)
    _, ref_w, ref_ids = router(x)
    cfg = RouterConfig(top_k=4, num_experts=16, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                       routed_scaling_factor=2.5)
    w, ids = grouped_topk(x @ router.weight.T.detach(), router.e_score_correction_bias, cfg)
    ours = routing_matrix(w, ids, 16)
    ref = routing_matrix(ref_w.detach(), ref_ids, 16)
    assert torch.equal(ours != 0, ref != 0)
    assert (ours - ref).abs().max() <= 1e-6
    if n_group > 1:  # only topk_group groups may be chosen
        groups_used = (ours != 0).view(9, n_group, -1).any(-1).sum(-1)
        assert (groups_used <= topk_group).all()


def test_correction_bias_changes_choice_not_weights():
    cfg = RouterConfig(top_k=1, num_experts=4, norm_topk_prob=False)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = grouped_topk(logits, torch.tensor([0.0, 0.0, 0.0, 5.0]), cfg)
    assert ids.tolist() == [[3]] and torch.allclose(w, torch.sigmoid(torch.tensor([[-1.0]])))


def test_router_config_validation():
    with pytest.raises(ValueError, match="n_group"):
        RouterConfig(top_k=2, num_experts=6, n_group=4)
    with pytest.raises(ValueError, match="topk_group"):
        RouterConfig(top_k=2, num_experts=8, n_group=2, topk_group=3)
