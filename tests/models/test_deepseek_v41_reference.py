"""The V4.1 oracle (tests/helpers/deepseek_v41_reference.py) against itself: its cached path (chunks cut anywhere,
then one token a call) equals its uncached forward, on tiny V4.1 checkpoints with every layer kind."""
from __future__ import annotations

import pytest
import torch

from backend_lib.tools.tiny import make_tiny
from tests.helpers.deepseek_v41_reference import ReferenceV41, candidate_pool, fake_quant_fp4, top_k_mask

# (overrides, prompt length): the default schedule (window, ratio-2 source + 2 reuse, ratio-1 source that cuts the
# pool, reuse, reindex inside the pool, reuse); a second with two ratio-2 groups, a top-k wider than the pool and
# an index source right after the candidate source (a pool of 4 entries, narrower than its top-6)
CONFIGS = {
    "default": ({}, 60),
    "two_groups": (dict(num_hidden_layers=7, compress_ratios=[2, 2, 0, 2, 1, 1, 1], kv_source_layer_ids=[0, 3, 4],
                        index_source_layer_ids=[0, 3, 4, 5], candidate_source_layer_id=4, candidate_topk_blocks=1,
                        candidate_block_size=4, index_topk=6, sliding_window=5), 45),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    overrides, length = CONFIGS[request.param]
    path = make_tiny("deepseek_v41", tmp_path_factory.mktemp(f"v41_{request.param}"), overrides=overrides, seed=3)
    return path, length


def _chunked(ref: ReferenceV41, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    cache, out, start = ref.new_cache(), [], 0
    for end in cuts + [ids.shape[0]]:
        if end > start:
            out.append(ref.forward(ids[start:end], cache))
            start = end
    return torch.cat(out)


def test_cached_equals_uncached_without_qat(tiny):
    path, length = tiny
    ref = ReferenceV41(path, qat=False)
    ids = torch.randint(3, ref.args.vocab, (length,), generator=torch.Generator().manual_seed(1))
    whole = ref.forward(ids)
    # the discrete choices are live: some query's top-k leaves visible entries out, and so does the pool
    log, a = ref.last_shared.log, ref.args
    visible = {i: ((torch.arange(length) + 1) // a.ratios[i]).clamp(max=m.shape[1]) for i, m in log.items()
               if isinstance(i, int)}
    assert any((log[i].sum(1) < visible[i]).any() for i in visible)
    assert (log["candidates"].sum(1) < visible[a.candidate_source]).any()
    chunked = _chunked(ref, ids, [1, 4, 5, 13, 14, 30] + list(range(31, length)))
    assert (chunked - whole).abs().max().item() < 1e-4


def test_cached_greedy_equals_uncached_with_qat(tiny):
    path, _ = tiny
    ref = ReferenceV41(path, qat=True)
    prompt = torch.randint(3, ref.args.vocab, (9,), generator=torch.Generator().manual_seed(2))
    cache = ref.new_cache()
    ids, logits = prompt.clone(), ref.forward(prompt, cache)
    worst = 0.0
    for _ in range(24):
        token = logits[-1].argmax()
        uncached = ref.forward(ids)[-1]
        assert uncached.argmax() == token
        worst = max(worst, (uncached - logits[-1]).abs().max().item())
        ids = torch.cat([ids, token.view(1)])
        logits = ref.forward(token.view(1), cache)
    print(f"largest cached - uncached logit difference with QAT: {worst:.2e}")


def test_ties_in_entry_order_and_the_pool():
    scores = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0, float("-inf")]])
    assert top_k_mask(scores, 3).tolist() == [[True, True, False, True, False, False]]
    assert top_k_mask(scores, 9).tolist() == [[True, True, True, True, True, False]]  # -inf never picked
    # blocks of 2: [0, 2] [0, 2] [0, -inf]; the newest visible block (entry 4 -> block 2) is forced in, then block 0
    pool = candidate_pool(scores, torch.tensor([5]), 2, 2)
    assert pool.tolist() == [[True, True, False, False, True, True]]


def test_router_ties_go_to_the_lower_expert_id():
    """Our rule where scores + bias tie exactly (no implementation defines one; torch.topk's order among equals is
    unspecified): the lower expert id first, in the engine's router and in the oracle alike."""
    from backend_lib.models.deepseek_v41.layers import V41MoE
    from backend_lib.models.deepseek_v4.layers import V4MoEDims
    from backend_lib.models.parallel import ParallelContext
    moe = V41MoE(V4MoEDims(8, 4, 8, 2, 16, 1.5, "sqrtsoftplus", 10.0, False), ParallelContext(), (32, 32), 1.0, True)
    moe.gate.bias = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # zero logits: experts 1, 3, 6, 7 tie
    weights, ids = moe.route(torch.randn(3, 8), torch.zeros(3, dtype=torch.long))
    assert ids.tolist() == [[1, 3]] * 3
    assert torch.allclose(weights, torch.full((3, 2), 0.75))  # equal scores, normalised, times 1.5
    scores = torch.full((3, 8), float(torch.nn.functional.softplus(torch.tensor(0.0)).sqrt())) + moe.gate.bias
    assert top_k_mask(scores, 2).nonzero()[:, 1].view(-1, 2).tolist() == ids.tolist()


def test_fp4_rounds_to_nearest_even():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 6.0, 0.1, 0.3, 4.9, 0.0, 1.0, 2.0, 3.0]])
    got = fake_quant_fp4(x, 16, e4m3_scales=False)  # amax 6 -> scale 1
    assert got.tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, 6.0, 0.0, 0.5, 4.0, 0.0, 1.0, 2.0, 3.0]]
