"""DeepSeek-V3's fp8 latent record (kernels/mla_fp8.py): its bytes against a plain torch reference, MLA decode and
prefill over records equal to the same over the dequantized cache, and the engine (chunked prefill, preemption, MTP
speculation, two ranks) equal to the same engine on the dequantized reference cache."""
from __future__ import annotations

import pytest
import torch

import backend_lib.models.deepseek_v3.layers as deepseek_layers
from backend_lib.core.config import EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from kernels.mla import mla_decode_absorbed, mla_decode_expanded, mla_prefill, split_kv_b, write_latent_cache
from kernels.mla_fp8 import MLARecord, decode_records, encode_records


def _reference_record(latent: torch.Tensor, k_rope: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Plain torch: per 128 values scale = 2^ceil(log2(amax / fp8_max)) (at least 2^-14), e4m3 of value / scale,
    the scale's fp32 bytes, RoPE's bf16 bytes."""
    rows = []
    for t in range(latent.shape[0]):
        codes, scales = [], []
        for group in latent[t].split(128):
            scale = torch.exp2(torch.log2(group.abs().amax() / fp8_max).ceil()).clamp_min(2.0**-14)
            codes.append((group / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).view(torch.uint8))
            scales.append(scale.reshape(1).to(torch.float32).view(torch.uint8))
        rows.append(torch.cat([*codes, *scales, k_rope[t].to(torch.bfloat16).view(torch.uint8)]))
    return torch.stack(rows)


@pytest.mark.parametrize("fp8_max", [448.0, 224.0])
def test_record_bytes_match_the_plain_reference(fp8_max):
    record = MLARecord(512, 64, fp8_max)
    assert record.num_bytes == 656  # DeepSeek-V3: against 1,152 (bf16) and 2,304 (fp32)
    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(9, 512, generator=gen) * torch.exp2(torch.randint(-8, 6, (9, 1), generator=gen).float())
    latent[1, :128] = 0.0  # an all-zero group: the smallest scale
    latent[2, 5] = fp8_max  # amax / fp8_max exactly 1: scale 1, not 2
    latent[3, 300] = -fp8_max * 4
    k_rope = torch.randn(9, 64, generator=gen) * 3
    records = encode_records(latent, k_rope, record)
    assert records.dtype == torch.uint8 and records.shape == (9, 656)
    assert torch.equal(records, _reference_record(latent, k_rope, fp8_max))
    values = decode_records(records, record)
    expected = torch.cat([records[:, :512].view(torch.float8_e4m3fn).float()
                          * records[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, dim=1),
                          records[:, 528:].contiguous().view(torch.bfloat16).float()], dim=1)
    assert torch.equal(values, expected)
    assert (values[:, :512] - latent).abs().max() <= latent.abs().amax() / 16  # half an e4m3 step at most
    assert torch.equal(decode_records(records, record, torch.bfloat16), expected.to(torch.bfloat16))


def test_small_ranks_use_one_partial_group():
    record = MLARecord(32, 8)
    assert (record.groups, record.num_bytes) == (1, 32 + 4 + 16)
    latent, k_rope = torch.randn(3, 32), torch.randn(3, 8)
    padded = torch.nn.functional.pad(latent, (0, 96))
    full = encode_records(padded, k_rope, MLARecord(128, 8))
    small = encode_records(latent, k_rope, record)
    assert torch.equal(small[:, :32], full[:, :32]) and torch.equal(small[:, 32:], full[:, 128:])


def test_mla_over_records_equals_mla_over_the_dequantized_cache():
    gen = torch.Generator().manual_seed(1)
    rank, rope, heads, dn, dv, bs = 64, 16, 4, 16, 16, 4
    record = MLARecord(rank, rope)
    cache = torch.zeros(12 * bs, record.num_bytes, dtype=torch.uint8)
    write_latent_cache(cache, torch.arange(12 * bs), torch.randn(12 * bs, rank, generator=gen),
                       torch.randn(12 * bs, rope, generator=gen), record)
    values = decode_records(cache, record)
    blocks, value_blocks = cache.view(-1, bs, record.num_bytes), values.view(-1, bs, rank + rope)
    kv_b = torch.randn(heads * (dn + dv), rank, generator=gen) * 0.1
    w_uk, w_uv = split_kv_b(kv_b, heads, dn)
    tables = torch.tensor([[3, 7, 1], [0, 11, 2]], dtype=torch.int32)
    lens = torch.tensor([10, 7], dtype=torch.int32)
    q_nope, q_rope = torch.randn(2, 2, heads, dn, generator=gen), torch.randn(2, 2, heads, rope, generator=gen)
    got = mla_decode_absorbed(q_nope, q_rope, blocks, tables, lens, w_uk, w_uv, 0.3, record)
    assert torch.equal(got, mla_decode_absorbed(q_nope, q_rope, value_blocks, tables, lens, w_uk, w_uv, 0.3))
    torch.testing.assert_close(got, mla_decode_expanded(q_nope, q_rope, blocks, tables, lens, kv_b, 0.3, record),
                               atol=1e-5, rtol=1e-5)
    prefill = mla_prefill(q_nope[0], q_rope[0], blocks, tables[0], 10, kv_b, 0.3, record)
    assert torch.equal(prefill, mla_prefill(q_nope[0], q_rope[0], value_blocks, tables[0], 10, kv_b, 0.3))


# ---- the engine --------------------------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 17, 99, 3, 42, 7], list(range(3, 40)), [11] * 20, [200, 100, 50, 25, 12, 6, 3]]


def _write_through_record(cache, slot_mapping, latent, k_rope, record=None):
    """The reference cache's store: the values an fp8 record of them decodes to, in the cache's own dtype."""
    if record is None and cache.dtype.is_floating_point:
        fp8 = MLARecord(latent.shape[-1], k_rope.shape[-1])
        values = decode_records(encode_records(latent, k_rope, fp8), fp8, latent.dtype)
        latent, k_rope = values[:, :fp8.rank], values[:, fp8.rank:]
    write_latent_cache(cache, slot_mapping, latent, k_rope, record)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    return str(make_tiny("deepseek_v3", tmp_path_factory.mktemp("v3") / "v3", mtp_layers=1))


def _run(path, fp8: bool, prompts=PROMPTS, **settings):
    flat = {"model": path, "max_model_len": 128, "num_blocks": 128, "max_num_batched_tokens": 16,
            "kv_cache_dtype": "fp8" if fp8 else "auto", **settings}
    with LLM(config=EngineConfig.from_flat(flat)) as llm:
        if fp8:
            assert llm.engine.runner.kv_caches[0].dtype == torch.uint8
        return llm.generate(prompts, GREEDY), llm.engine.stats()


@pytest.mark.parametrize("settings", [{}, {"num_blocks": 5, "max_num_seqs": 4},
                                      {"method": "mtp", "num_speculative_tokens": 2}])
def test_v3_fp8_equals_the_dequantized_reference_cache(tiny_v3, monkeypatch, settings):
    """Chunked prefill (16-token budget), preemption (5 blocks), MTP drafts (their own latent records)."""
    got, stats = _run(tiny_v3, True, **settings)
    monkeypatch.setattr(deepseek_layers, "write_latent_cache", _write_through_record)
    want, _ = _run(tiny_v3, False, **settings)
    for a, b in zip(got, want):
        assert a.error is None and a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
    if settings.get("num_blocks") == 5:
        assert stats.num_preemptions > 0
    if settings.get("method") == "mtp":
        assert stats.spec_draft_tokens > 0


@pytest.mark.slow
def test_v3_fp8_two_ranks_match_one(tiny_v3):
    one, _ = _run(tiny_v3, True)
    two, _ = _run(tiny_v3, True, tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_v3_fp8_pool_holds_656_byte_records(tiny_v3):
    sizes = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(EngineConfig.from_flat({"model": tiny_v3, "max_model_len": 128, "kv_cache_dtype": kv,
                                                   "kv_cache_memory_gb": 2.0**-8}))
        cache = engine.runner.kv_caches[0]
        sizes[kv] = (engine.num_blocks, cache.shape[-1] * cache.element_size())
        args = engine.model.args
    record = MLARecord(args.kv_lora_rank, args.qk_rope_head_dim)
    assert sizes["fp8"][1] == record.num_bytes and sizes["auto"][1] == 4 * (record.rank + record.rope_dim)
    assert sizes["fp8"][0] == int(2**22 // (record.num_bytes * 16 * args.num_hidden_layers))


def test_v3_fp8_compiled_regions_equal_eager(tiny_v3):
    """Decode graphs (aot_eager, static MoE) write and decode the records as the eager steps do."""
    eager, _ = _run(tiny_v3, True, max_num_seqs=4)
    graphs, _ = _run(tiny_v3, True, max_num_seqs=4, compile_backend="aot_eager", batch_buckets="1,2,4",
                     width_buckets="8", compile_progress=False)
    for a, b in zip(eager, graphs):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
