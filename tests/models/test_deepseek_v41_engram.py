"""DeepSeek-V4.1's released Engram (backend_lib/models/deepseek_v41/engram.py) against the oracle's own port
(tests/helpers/deepseek_v41_reference.py, QAT off), teacher-forced: Engram on the first and a middle layer, prefill
chunks cut anywhere (the n-gram look-back crosses them from the request's real history), then decode steps."""
from __future__ import annotations

import pytest
import torch

from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from tests.helpers.deepseek_v41_cases import tokens
from tests.helpers.deepseek_v41_reference import ReferenceV41
from tests.helpers.paged_runner import HybridPagedRunner


class HistoryRunner(HybridPagedRunner):
    """PagedRunner plus the ids before each token (what the model runner sends models with ``token_history``)."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.width, self.seen = model.token_history, {}

    def step(self, decodes, prefills):
        rows = []
        for rid, toks in decodes + prefills:
            before = self.seen.get(rid, [])
            sequence = [-1] * self.width + before + list(toks)
            rows += [sequence[len(before) + j:len(before) + j + self.width] for j in range(len(toks))]
            self.seen[rid] = before + list(toks)
        self.history = torch.tensor(rows, dtype=torch.long)
        return super().step(decodes, prefills)

    def _meta_hook(self, meta):
        meta = super()._meta_hook(meta)
        meta.token_history = self.history
        return meta


# the fp32 table is the long one (an uncached oracle pass per position): make test only
@pytest.mark.parametrize("fp8_table", [pytest.param(False, marks=pytest.mark.slow), True])
def test_engram_teacher_forced_equals_the_oracle(tmp_path, fp8_table):
    # seed 9 with the fp8 table met an exact router tie (two experts' score + bias equal in fp32 at layer 0, position
    # 50), where torch.topk's order decides; a seed without one
    path = make_tiny("deepseek_v41", tmp_path, seed=10, engram_layers=[0, 3], engram_fp8_table=fp8_table)
    ref = ReferenceV41(path, qat=False)
    ids = tokens(110, 4)
    expected = ref.forward(torch.tensor(ids))
    cache = ref.new_cache()  # the oracle's own cached path first (its look-back kept across calls)
    cached = torch.cat([ref.forward(torch.tensor(ids[a:b]), cache) for a, b in ((0, 7), (7, 8), (8, 110))])
    assert (cached - expected).abs().max() <= 1e-4
    model = load_model(str(path), torch.float32, progress=False)
    model.qat = False
    run = HistoryRunner(model, num_blocks=60)
    rows, start = [], 0
    for n in (1, 2, 13, 61, 3):
        rows.append(run.step([], [("r", ids[start:start + n])]))
        start += n
    rows += [run.step([("r", [t])], []) for t in ids[start:]]
    assert (torch.cat(rows) - expected).abs().max() <= 1e-4
    # the Engram layers do something: without them the logits move
    for layer in (0, 3):
        model.layers[layer].engram = None
    assert (HistoryRunner(model, num_blocks=60).step([], [("r", ids[:40])]) - expected[:40]).abs().max() > 1e-2


def test_engine_greedy_with_engram_equals_the_oracle(tmp_path, monkeypatch):
    """Through the engine (its runner sends the ids before each token): batched prompts in 61-token chunks."""
    from backend_lib.core.config import EngineConfig
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.llm_engine import LLMEngine
    from backend_lib.models.deepseek_v41.model import DeepseekV41ForCausalLM
    monkeypatch.setattr(DeepseekV41ForCausalLM, "qat_activations", False)
    path = make_tiny("deepseek_v41", tmp_path, seed=10, engram_layers=[0, 3])
    ref = ReferenceV41(path, qat=False)
    engine = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 512, "block_size": 16,
                                               "max_num_seqs": 4, "max_num_batched_tokens": 61}))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = {f"r{n}": tokens(n, 90 + n) for n in (4, 75)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, prompt in prompts.items():
        assert outputs[rid] == ref.greedy(prompt, 16), rid
