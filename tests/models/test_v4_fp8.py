"""DeepSeek-V4's fp8 paged records (kernels/v4_fp8.py): compressed entries and indexer keys against a plain torch
reference, and the engine (chunked prefill, preemption, sessions, MTP drafts, two ranks, compiled graphs) equal to
the same engine on the dequantized reference cache."""
from __future__ import annotations

import pytest
import torch

import backend_lib.models.deepseek_v4.attention as v4_attention
from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from kernels.v4_fp8 import EntryRecord, IndexKeyRecord, store_entries
from tests.helpers.engines import drive

# `make test` only (not test-fast): the tiny V4 through the engine with and without fp8 KV, on one and two ranks,
# compiled.
pytestmark = pytest.mark.slow


def _pow2_scale(values: torch.Tensor, fp8_max: float) -> torch.Tensor:
    return torch.exp2(torch.log2(values.abs().amax() / fp8_max).ceil()).clamp_min(2.0**-14)


def _reference_entry(x: torch.Tensor, rope_dim: int, fp8_max: float) -> torch.Tensor:
    """Plain torch, FlashMLA's V4 order: NoPE e4m3 (a power-of-two scale per 64), RoPE bf16, ue8m0 scales, pad."""
    rows = []
    for row in x:
        nope, rope = row[:-rope_dim], row[-rope_dim:]
        codes, scales = [], []
        for group in nope.split(64):
            scale = _pow2_scale(group, fp8_max)
            codes.append((group / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).view(torch.uint8))
            scales.append((torch.log2(scale).to(torch.int32) + 127).to(torch.uint8).reshape(1))
        record = torch.cat([*codes, rope.to(torch.bfloat16).view(torch.uint8), *scales])
        rows.append(torch.cat([record, torch.zeros(-len(record) % 8, dtype=torch.uint8)]))
    return torch.stack(rows)


def _reference_index_key(x: torch.Tensor, fp8_max: float) -> torch.Tensor:
    rows = []
    for row in x:
        scale = _pow2_scale(row, fp8_max)
        rows.append(torch.cat([(row / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).view(torch.uint8),
                               scale.reshape(1).view(torch.uint8)]))
    return torch.stack(rows)


@pytest.mark.parametrize("fp8_max", [448.0, 224.0])
def test_entry_and_index_key_bytes_match_the_plain_reference(fp8_max):
    entry, key = EntryRecord(512, 64, fp8_max), IndexKeyRecord(128, fp8_max)
    assert (entry.num_bytes, key.num_bytes) == (584, 132)  # V4's dimensions: 448 + 128 + 7 + 1; 128 + 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 512, generator=gen) * torch.exp2(torch.randint(-6, 6, (6, 1), generator=gen).float())
    x[1, :64] = 0.0  # an all-zero group
    x[2, 70] = fp8_max  # amax / fp8_max exactly 1
    records = entry.encode(x)
    assert torch.equal(records, _reference_entry(x, 64, fp8_max))
    decoded = entry.decode(records)
    assert torch.equal(decoded[:, 448:], x[:, 448:].to(torch.bfloat16).float())
    assert (decoded[:, :448] - x[:, :448]).abs().max() <= x.abs().amax() / 16
    keys = torch.randn(5, 128, generator=gen) * 7
    key_records = key.encode(keys)
    assert torch.equal(key_records, _reference_index_key(keys, fp8_max))
    expected = (key_records[:, :128].view(torch.float8_e4m3fn).float()
                * key_records[:, 128:].contiguous().view(torch.float32))
    assert torch.equal(key.decode(key_records), expected)


def test_tiny_dimensions_pad_to_eight_bytes():
    record = EntryRecord(32, 8)  # tiny V4: head_dim 32, RoPE 8
    assert (record.groups, record.num_bytes) == (1, 48)  # 24 + 16 + 1 -> 48
    x = torch.randn(4, 32)
    assert torch.equal(record.encode(x), _reference_entry(x, 8, 448.0))


# ---- the engine --------------------------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 9, 10], list(range(3, 50)), [11, 12] * 12, [200, 100, 50, 25, 12, 6, 3]]


def _store_through_record(entries, rows, values, record=None):
    """The reference cache's store: the values a record of them decodes to, in the cache's own dtype."""
    if record is None and entries.dtype.is_floating_point:
        width = values.shape[-1]
        fp8 = IndexKeyRecord(width) if width == TINY_INDEX_DIM else EntryRecord(width, TINY_ROPE)
        values = fp8.decode(fp8.encode(values), values.dtype)
    store_entries(entries, rows, values, record)


TINY_INDEX_DIM, TINY_ROPE = 16, 8


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    return str(make_tiny("deepseek_v4", tmp_path_factory.mktemp("v4") / "v4", mtp_layers=1))


def _run(path, fp8: bool, prompts=PROMPTS, **settings):
    flat = {"model": path, "max_model_len": 128, "num_blocks": 64, "max_num_batched_tokens": 16,
            "kv_cache_dtype": "fp8" if fp8 else "auto", **settings}
    with LLM(config=EngineConfig.from_flat(flat)) as llm:
        caches = llm.engine.runner.kv_caches
        if fp8:  # paged records in bytes, the rings in the model dtype
            assert [c.dtype for c in caches[:3]] == [torch.uint8] * 3
            assert all(c.dtype == torch.float32 for c in caches[3:])
        return llm.generate(prompts, GREEDY), llm.engine.stats()


@pytest.mark.parametrize("settings", [{}, {"num_blocks": 6, "max_num_seqs": 4},
                                      {"method": "mtp", "num_speculative_tokens": 2},
                                      {"host_attention": "torch"}])
def test_v4_fp8_equals_the_dequantized_reference_cache(tiny_v4, monkeypatch, settings):
    got, stats = _run(tiny_v4, True, **settings)
    monkeypatch.setattr(v4_attention, "store_entries", _store_through_record)
    want, _ = _run(tiny_v4, False, **settings)
    for a, b in zip(got, want):
        assert a.error is None and a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
    if settings.get("num_blocks") == 6:
        assert stats.num_preemptions > 0
    if settings.get("method") == "mtp":
        assert stats.spec_draft_tokens > 0


def test_v4_fp8_sessions(tiny_v4, monkeypatch):
    outputs = []
    for reference in (False, True):
        if reference:
            monkeypatch.setattr(v4_attention, "store_entries", _store_through_record)
        engine = LLMEngine(EngineConfig.from_flat({"model": tiny_v4, "max_model_len": 128, "num_blocks": 64,
                                                   "kv_cache_dtype": "auto" if reference else "fp8"}))
        turns = []
        for i, (tokens, start, end) in enumerate([(list(range(5, 25)), True, False), ([7, 8, 9], False, False),
                                                  ([30, 31], False, True)]):
            engine.add_request(f"t{i}", tokens, GREEDY, SessionControl("s", start=start, end=end))
            turns += [(o.request_id, o.new_token_ids, [lp.logprob for lp in o.new_logprobs or []])
                      for o in drive(engine)[f"t{i}"]]
        outputs.append(turns)
    assert outputs[0] == outputs[1] and len(outputs[0]) > 3


def test_v4_fp8_two_ranks_and_graphs_match_eager_one_rank(tmp_path):
    # one layer of each attention kind and 4 Sinkhorn steps (not 4 layers and 20): the graphs' tracing is most of
    # this test, and every record kind is still written and read
    small = dict(num_hidden_layers=3, hc_sinkhorn_iters=4, mlp_layer_types=["hash_moe", "moe", "moe"],
                 layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    path = str(make_tiny("deepseek_v4", tmp_path / "v4", overrides=small))
    one, _ = _run(path, True, max_num_seqs=4)
    others = [_run(path, True, max_num_seqs=4, tensor_parallel_size=2)[0],
              _run(path, True, max_num_seqs=4, compile_backend="aot_eager", batch_buckets="1,2,4",
                   width_buckets="8", compile_progress=False)[0]]
    for other in others:
        for a, b in zip(one, other):
            assert a.token_ids == b.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_v4_fp8_pool_counts_record_bytes_and_keeps_the_state_slots(tiny_v4):
    engines = {kv: LLMEngine(EngineConfig.from_flat({"model": tiny_v4, "max_model_len": 128, "kv_cache_dtype": kv,
                                                     "kv_cache_memory_gb": 2.0**-6, "max_num_seqs": 4}))
               for kv in ("auto", "fp8")}
    paged = {kv: sum(c.numel() * c.element_size() for c in e.runner.kv_caches[:3]) / (e.num_blocks + 1)
             for kv, e in engines.items()}
    state = {kv: [c.shape for c in e.runner.kv_caches[3:]] for kv, e in engines.items()}
    assert state["auto"] == state["fp8"]  # the rings are the same in both
    assert paged["fp8"] < paged["auto"] / 2  # fp32 entries 128 B and 64 B a row; records 48 B and 20 B
    assert engines["fp8"].num_blocks > 2 * engines["auto"].num_blocks
