"""EPLB through the executor at EP=2 (two gloo ranks): with redundant slots and a re-placement every two steps (so
several land in the middle of the batch, weights moving between the ranks), every greedy token equals EP without
EPLB, for tiny DeepSeek-V3 in fp32 and fp8 (block-fp8 checkpoint, experts widened at load) and DeepSeek-V4
(top-k layers on slots, hash-routed layers contiguous); the KV pool is whole afterwards and the driver's window
counted every MoE layer."""
from __future__ import annotations

import pytest

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny

PROMPTS = ["What is the capital of France?", "Once upon a time there was", "0123456789 + - * / =",
           "The quick brown fox", "In the beginning"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True, "num_blocks": 128, "max_num_batched_tokens": 64}
# `make test` only (not test-fast): two expert-parallel ranks per engine, two engines a model.
pytestmark = pytest.mark.slow
EPLB = {"enable_eplb": True, "num_redundant_experts": 2, "eplb_window_steps": 4, "eplb_interval_steps": 2}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eplb")
    return {"deepseek": make_tiny("deepseek_v3", root / "deepseek"),
            "deepseek_fp8": make_tiny("deepseek_v3", root / "deepseek_fp8", fp8=True),
            "deepseek_v4": make_tiny("deepseek_v4", root / "deepseek_v4")}


@pytest.mark.parametrize("model, settings", [
    ("deepseek", {}),
    ("deepseek_fp8", {}),  # packed fp8 needs 128-aligned TP splits the tiny model has not
    ("deepseek_v4", {}),
])
def test_rebalancing_mid_batch_changes_no_token(tiny_dirs, model, settings):
    path = str(tiny_dirs[model])
    with LLM(path, **EP2, **settings) as llm:
        reference = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    with LLM(path, **EP2, **settings, **EPLB) as llm:
        results = llm.generate(PROMPTS, GREEDY)
        stats = llm.engine.stats()
        llm.engine.scheduler.check_integrity()
        balancer = llm.engine.executor.balancer
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.token_ids for r in results] == reference
    assert stats.kv_blocks_used == 0  # every block back in the pool (check_integrity: none held twice)
    assert stats.eplb.rebalances >= 3 and stats.eplb.moved_slots > 0  # the weights did move, mid-batch
    assert len(stats.eplb.layer_imbalance) == len(balancer.layers) >= 1
    assert all(value >= 1.0 for value in stats.eplb.layer_imbalance)
