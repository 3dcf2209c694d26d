"""MTP drafts against transformers on a tiny DeepSeek-V3 whose MTP layer sits at index 61 (the only index transformers
loads): k = 1 equals transformers' own MTP generation path (``generate(use_mtp=True)``, MTPCandidateGenerator); k = 3
equals a plain reference chain built from transformers' MtpModel.forward_layer (transformers chains *different*
layers, it has no reuse-one-layer path), also after accepted and rejected drafts."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.tools.tiny import make_tiny
from tests.helpers.engines import drive, make_engine, new_tokens

TINY61 = dict(num_hidden_layers=61, first_k_dense_replace=0, hidden_size=32, intermediate_size=64,
              moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=8, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
              n_group=1, topk_group=1)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny61(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel
    path = make_tiny("deepseek_v3", tmp_path_factory.mktemp("tiny61"), seed=11, mtp_layers=1, overrides=TINY61)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf, MtpModel.from_pretrained(hf, device_map={"": "cpu"}).eval()


ENGINE = {"max_model_len": 128, "num_blocks": 64, "block_size": 4}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_drafts(hf, mtp, tokens: list[int], k: int) -> list[int]:
    """Drafts for the positions after ``tokens`` from transformers' modules, recomputed from scratch: the MTP layer
    over positions 1..L-1 (token p with the main final-norm hidden at p - 1), then k - 1 reuses on its own output."""
    from transformers.cache_utils import MtpCache
    cache = MtpCache(config=hf.config.get_mtp_config())
    with torch.inference_mode():
        hidden = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1]
        ids, pos = torch.tensor([tokens[1:]]), torch.arange(1, len(tokens))[None]
        drafts = []
        for _ in range(k):
            hidden = mtp.forward_layer(0, hidden, pos, cache, input_ids=ids)[:, -1:]
            ids = mtp._project_to_logits(hidden).argmax(-1)
            drafts.append(int(ids))
            pos = pos[:, -1:] + 1
    return drafts



def test_k1_drafts_equal_transformers_mtp_generation(tiny61):
    from transformers.generation.candidate_generator import MTPCandidateGenerator
    path, hf, _ = tiny61
    prompt = _prompt(9, 1)
    theirs: dict[int, list[int]] = {}  # sequence length -> the candidate transformers proposes after it
    original = MTPCandidateGenerator.get_candidates

    def record(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:
            theirs[input_ids.shape[1]] = ids[0, input_ids.shape[1]:].tolist()
        return ids, logits

    MTPCandidateGenerator.get_candidates = record
    try:
        with torch.inference_mode():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                    use_mtp=True)[0, len(prompt):].tolist()
    finally:
        MTPCandidateGenerator.get_candidates = original
    engine = make_engine(path, ENGINE, method="mtp", num_speculative_tokens=1)
    ours: dict[int, list[int]] = {}

    def record(engine: LLMEngine) -> None:
        r = engine.scheduler.get_request("a")
        if r is not None and r.draft_token_ids:
            ours.setdefault(r.num_tokens, list(r.draft_token_ids))
    tokens = new_tokens(drive(engine, {"a": (prompt, GREEDY)}, on_step=record))["a"]
    assert tokens == generated
    assert len(theirs) >= 5
    assert {n: d for n, d in ours.items() if n in theirs} == theirs
    assert set(theirs) <= set(ours) | {len(prompt) + GREEDY.max_tokens}


def test_k3_chain_equals_reference_after_accepts_and_rejects(tiny61):
    path, hf, mtp = tiny61
    prompt = _prompt(7, 2)
    plain = new_tokens(drive(make_engine(path, ENGINE), {"p": (prompt, GREEDY)}))["p"]
    engine = make_engine(path, ENGINE, method="mtp", num_speculative_tokens=3)
    checked = []
    step = [0]

    def check_and_force(engine: LLMEngine) -> None:
        request = engine.scheduler.get_request("a")
        if request is None or not request.draft_token_ids:
            return
        assert request.draft_token_ids == reference_drafts(hf, mtp, request.all_token_ids, 3)
        checked.append(request.num_tokens)
        # Force verification outcomes the random MTP rarely produces: all accepted, then one accepted + rejection.
        done = request.num_output_tokens
        truth = plain[done:done + 3]
        step[0] += 1
        if step[0] == 1 and len(truth) == 3:
            request.draft_token_ids = truth
        elif step[0] == 2 and len(truth) >= 2:
            request.draft_token_ids = [truth[0], (truth[1] + 1) % 300, truth[1]]

    tokens = new_tokens(drive(engine, {"a": (prompt, GREEDY)}, on_step=check_and_force))["a"]
    assert tokens == plain
    assert len(checked) >= 3
    stats = engine.stats()
    accepted = stats.spec_accepted_per_position
    assert accepted[0] >= 2 and accepted[1] >= 1 and accepted[2] >= 1
    engine.scheduler.check_integrity()
    assert stats.kv_blocks_used == 0
