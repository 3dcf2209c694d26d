"""DeepSeek-V4.1's storage choices: the fp8 KV cache's fp4 records (kernels/csa2_records.py) byte for byte against a
plain torch quantizer and, through the engine, the fp32 cache's greedy run; ``weight_format=packed`` against the
same checkpoint dequantized."""
from __future__ import annotations

import logging

import pytest
import torch

from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from kernels.csa2 import fake_quant_fp4
from kernels.csa2_records import entry_record, index_key_record
from tests.helpers.deepseek_v41_cases import tokens
from tests.helpers.paged_runner import HybridPagedRunner

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _plain_fp4_bytes(x: torch.Tensor, block: int, e4m3_scales: bool) -> torch.Tensor:  # [T, C] -> [T, bytes]
    """The record as the formats define it, written plainly: per block a scale (amax / 6 as e4m3, or the next power
    of two as a ue8m0 byte), each channel the nearest e2m1 value of x / scale (a midpoint to the even code), two codes
    a byte with the first channel low."""
    b = x.unflatten(-1, (-1, block))
    amax = b.abs().amax(-1, keepdim=True)
    if e4m3_scales:
        scale8 = (amax.clamp_min(6 * 2.0 ** -9) / 6).to(torch.float8_e4m3fn)
        scale, scale_bytes = scale8.float(), scale8.view(torch.uint8)[..., 0]
    else:
        exponent = torch.ceil(torch.log2(amax.clamp_min(6 * 2.0 ** -126) / 6))
        scale, scale_bytes = 2.0 ** exponent, (exponent[..., 0] + 127).to(torch.uint8)
    q = (b / scale).clamp(-6, 6).flatten(-2)
    distance = (q.abs()[..., None] - _E2M1).abs() + 1e-6 * (torch.arange(8) % 2)  # a tie goes to the even code
    codes = distance.argmin(-1) + 8 * (q < 0) + 8 * ((q == 0) & torch.signbit(q))
    pairs = (codes[:, 0::2] + 16 * codes[:, 1::2]).to(torch.uint8)
    return torch.cat([pairs, scale_bytes], dim=-1)


@pytest.mark.parametrize("make, block, e4m3", [(entry_record, 16, True), (index_key_record, 32, False)])
def test_fp4_records_equal_a_plain_quantizer(make, block, e4m3):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    x[0] = 0.0  # an all-zero block
    x[1, :block] = torch.tensor([6.0, -0.25, 0.75, 2.5, 5.0, -1.25, 3.5] + [0.0] * (block - 7))  # midpoints
    record = make(64)
    stored = record.encode(x)
    assert stored.dtype == torch.uint8 and stored.shape == (64, record.num_bytes)
    assert torch.equal(stored, _plain_fp4_bytes(x, block, e4m3))
    # the record holds exactly what the quantization-aware activations compute
    assert torch.equal(record.decode(stored), fake_quant_fp4(x, block, e4m3_scales=e4m3))
    assert (entry_record(512).num_bytes, index_key_record(128).num_bytes) == (288, 68)  # vLLM's V4.1 records


def _engine(path, **settings):
    from backend_lib.core.config import EngineConfig
    from backend_lib.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "block_size": 16,
                                             "max_num_seqs": 4, "max_num_batched_tokens": 61, **settings}))


def _greedy(engine, prompts: dict[str, list[int]], n: int) -> dict[str, tuple[list[int], list[float]]]:
    from backend_lib.core.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    ids: dict[str, list[int]] = {r: [] for r in prompts}
    logprobs: dict[str, list[float]] = {r: [] for r in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
    return {r: (ids[r], logprobs[r]) for r in prompts}


@pytest.mark.slow  # two engines, ~15 s on the loaded 2-core machine
def test_fp8_kv_cache_keeps_the_fp32_cache_greedy_run(tmp_path, caplog):
    """kv_cache_dtype=fp8_e4m3 stores the entries / keys as records; with the QAT activations on (the default)
    the values are already on the records' grids, so greedy ids match the fp32 cache and the logprobs agree."""
    path = make_tiny("deepseek_v41", tmp_path, seed=7)
    prompts = {f"r{n}": tokens(n, 40 + n) for n in (6, 45)}  # past the window of 8 and the 2-block pool
    plain = _greedy(_engine(path), prompts, 12)
    with caplog.at_level(logging.INFO):
        fp8 = _greedy(_engine(path, kv_cache_dtype="fp8_e4m3"), prompts, 12)
    assert "compressed entries 18 B (NVFP4), index keys 17 B (MXFP4)" in caplog.text
    for rid in prompts:
        assert fp8[rid][0] == plain[rid][0], rid
        assert max(abs(a - b) for a, b in zip(fp8[rid][1], plain[rid][1])) <= 1e-5, rid


def _teacher_forced(model, ids: list[int], prefill_len: int) -> torch.Tensor:
    model.qat = False  # exact comparisons: fp32 noise would flip the QAT roundings
    run = HybridPagedRunner(model, num_blocks=len(ids) // 4 + 8)
    rows = [run.step([], [("r", ids[:prefill_len])])]
    rows += [run.step([("r", [t])], []) for t in ids[prefill_len:]]
    return torch.cat(rows)


@pytest.mark.slow  # the packed kernels' first call, ~15 s on the loaded 2-core machine
def test_packed_weights_equal_the_dequantized_checkpoint(tmp_path, caplog):
    """fp8 projections (32x32 blocks) as packed tiles and the fp4 routed experts kept packed, against the same
    checkpoint dequantized at load; ``auto`` picks packed on the host and the load log says so."""
    path = make_tiny("deepseek_v41", tmp_path, seed=7, fp8=True, fp4_experts=True)
    ids = tokens(70, 5)
    with caplog.at_level(logging.INFO):
        packed = load_model(str(path), torch.float32, progress=False)
    assert "packed weights (weight_format auto: fp8 checkpoint" in caplog.text
    assert "weight_format=packed:" in caplog.text  # the resident bytes line
    dense = load_model(str(path), torch.float32, progress=False, weight_format="dequantize")
    ours, exact = _teacher_forced(packed, ids, 61), _teacher_forced(dense, ids, 61)
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))
    assert (ours - exact).abs().max() <= 1e-4
