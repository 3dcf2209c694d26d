"""EPLB through the executor at EP=2 (two gloo ranks; attention tensor-parallel over the same two ranks, the only
TP x EP the executor has: experts are partitioned over the tensor-parallel group): with redundant slots and a
re-placement every two steps (so several land in the middle of the batch, weights moving between the ranks), every
greedy token equals EP without EPLB, for tiny DeepSeek-V3 in fp32 and in block fp8 kept packed (fp8 tiles and
their scales are what moves), and DeepSeek-V4 with fp4 experts kept packed (fp4 tiles and e8m0 scales; its
hash-routed layers hold no slots: their routing is fixed by token id, so they stay contiguous and never move). The
KV pool is whole afterwards and the driver's window counted every top-k MoE layer. A run of streamed requests that
arrive, finish and are aborted while re-placements land gives the reference's tokens, delta by delta."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from backend_lib.core.outputs import EngineStats, RequestOutput
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from tests.helpers.engines import drive, new_tokens

PROMPTS = ["What is the capital of France?", "Once upon a time there was", "0123456789 + - * / =",
           "The quick brown fox", "In the beginning"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True, "num_blocks": 128, "max_num_batched_tokens": 64}
# `make test` only (not test-fast): two expert-parallel ranks per engine, two engines a model.
pytestmark = pytest.mark.slow
EPLB = {"enable_eplb": True, "num_redundant_experts": 2, "eplb_window_steps": 4, "eplb_interval_steps": 2}
# packed fp8 needs every tensor-parallel split on the 128-wide blocks: 8 heads (o_proj's 256 inputs, q_b / kv_b's
# 512 outputs) and a 256-wide shared expert split in two
FP8_ALIGNED = {"num_attention_heads": 8, "num_key_value_heads": 8, "moe_intermediate_size": 256}
PACKED = {"weight_format": "packed"}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eplb")
    return {"deepseek": make_tiny("deepseek_v3", root / "deepseek"),
            "deepseek_fp8": make_tiny("deepseek_v3", root / "deepseek_fp8", fp8=True, overrides=FP8_ALIGNED),
            "deepseek_v4_fp4": make_tiny("deepseek_v4", root / "deepseek_v4_fp4", fp4_experts=True)}


@dataclass
class V3Run:
    batch: list  # llm.generate's results for PROMPTS
    batch_stats: EngineStats
    streamed: dict[str, list[RequestOutput]]  # _stream's outputs
    rebalances_mid_stream: int


def _stream(llm: LLM) -> tuple[dict[str, list[RequestOutput]], int]:
    """Requests arrive at steps 0, 3 and 6 with different lengths, r1 is aborted after its third token: the same
    schedule on every engine (greedy, deterministic). Returns the outputs and how many re-placements landed while
    requests were streaming."""
    arrivals = {0: [1], 3: [2, 3], 6: [4]}  # step -> indices of PROMPTS; r0 is there from the start
    engine, balancer = llm.engine, llm.engine.executor.balancer
    state = {"step": 0, "rebalances": 0 if balancer is None else balancer.rebalances, "mid_stream": 0}

    def on_step(engine):
        for index in arrivals.get(state["step"], ()):
            engine.add_request(f"r{index}", PROMPTS[index], _stream_params(index))
        if balancer is not None:  # on_step runs only while requests are unfinished: the last step re-placed
            state["mid_stream"] += balancer.rebalances > state["rebalances"]
            state["rebalances"] = balancer.rebalances
        state["step"] += 1

    def on_output(out):
        if out.request_id == "r1" and out.num_output_tokens == 3 and not out.finished:
            engine.abort(out.request_id)

    engine.add_request("r0", PROMPTS[0], _stream_params(0))
    return drive(engine, on_step=on_step, on_output=on_output), state["mid_stream"]


def _stream_params(index: int) -> SamplingParams:
    return SamplingParams(max_tokens=6 + 3 * index, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def v3_runs(tiny_dirs) -> dict[str, V3Run]:
    """The fp32 V3's EP engine without EPLB and with it (one after the other: one process group a process), each
    running the batch and then the streamed requests; the two tests below read them."""
    path, runs = str(tiny_dirs["deepseek"]), {}
    for name, settings in (("reference", {}), ("eplb", EPLB)):
        with LLM(path, **EP2, **settings) as llm:
            batch = llm.generate(PROMPTS, GREEDY)
            llm.engine.scheduler.check_integrity()
            batch_stats = llm.engine.stats()
            streamed, mid_stream = _stream(llm)
            llm.engine.scheduler.check_integrity()
            assert llm.engine.stats().kv_blocks_used == 0
            runs[name] = V3Run(batch, batch_stats, streamed, mid_stream)
    return runs


def _check_rebalanced_run(results, stats: EngineStats, reference) -> None:
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.token_ids for r in results] == reference
    assert stats.kv_blocks_used == 0  # every block back in the pool (check_integrity: none held twice)
    assert stats.eplb.rebalances >= 3 and stats.eplb.moved_slots > 0  # the weights did move, mid-batch
    assert len(stats.eplb.layer_imbalance) >= 1
    assert all(value >= 1.0 for value in stats.eplb.layer_imbalance)


def test_v3_rebalancing_mid_batch_changes_no_token(v3_runs):
    reference = [r.token_ids for r in v3_runs["reference"].batch]
    _check_rebalanced_run(v3_runs["eplb"].batch, v3_runs["eplb"].batch_stats, reference)


@pytest.mark.parametrize("model, settings, stored", [
    ("deepseek_fp8", {**PACKED}, {torch.uint8, torch.float32}),  # fp8 tiles and their block scales
    ("deepseek_v4_fp4", {**PACKED}, {torch.uint8}),  # fp4 tiles (two codes a byte) and e8m0 exponents
])
def test_packed_experts_move_as_stored_and_change_no_token(tiny_dirs, model, settings, stored):
    path = str(tiny_dirs[model])
    with LLM(path, **EP2, **settings) as llm:
        reference = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    with LLM(path, **EP2, **settings, **EPLB) as llm:
        layers = llm.engine.executor.balancer.layers
        dtypes = {t.dtype for m in layers for t in m.slot_tensors().values()}
        names = {n for m in layers for n in m.slot_tensors()}
        results = llm.generate(PROMPTS, GREEDY)
        llm.engine.scheduler.check_integrity()
        _check_rebalanced_run(results, llm.engine.stats(), reference)
        assert len(llm.engine.stats().eplb.layer_imbalance) == len(layers)
    assert dtypes == stored and all("tile" in n for n in names), names  # only the packed copies, as stored
    if model == "deepseek_v4_fp4":  # mlp_layer_types: two hash_moe layers (no slots), then two top-k moe layers
        assert len(layers) == 2


def test_rebalancing_while_streaming_changes_no_token_and_leaks_no_block(v3_runs):
    reference, eplb = v3_runs["reference"], v3_runs["eplb"]
    streamed = new_tokens(eplb.streamed)
    assert streamed == new_tokens(reference.streamed)
    assert {r: len(ids) for r, ids in streamed.items()} == {  # r1: the abort stopped it
        f"r{i}": 3 if i == 1 else _stream_params(i).max_tokens for i in range(len(PROMPTS))}
    for outs in eplb.streamed.values():  # the deltas add up to the count each output reports
        assert [sum(len(o.new_token_ids) for o in outs[:i + 1]) for i in range(len(outs))] == [
            o.num_output_tokens for o in outs]
    assert eplb.rebalances_mid_stream >= 2
