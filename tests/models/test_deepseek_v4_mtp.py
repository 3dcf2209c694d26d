"""DeepSeek-V4 MTP drafts (``spec_method=mtp``) on a tiny random V4 with one nextn depth (make-tiny ``--mtp-layers 1``).

The oracle is transformers' own V4 modules: transformers has no V4 MTP (it ignores ``mtp.*`` on load), so the
depth is assembled from them - a one-layer sliding-only, top-k ``DeepseekV4ForCausalLM`` loaded with the ``mtp.0.*``
block, hc head and norm, its ``DeepseekV4RMSNorm`` for ``enorm`` / ``hnorm``, the main model's pre-hc_head streams
(hooked at its ``hc_head``), embedding and lm head. Only ``e_proj`` / ``h_proj`` are plain ``F.linear``. The engine's
drafts are checked against the oracle's from-scratch drafts through chunked prefill, batching, preemption, forced
accepts / rejects and session turns."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.models.loading.loader import load_model
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.worker.spec_decode.mtp_v4 import V4MTPProposer
from backend_lib.tools.tiny import make_tiny
from kernels.attention_metadata import AttentionMetadata, StateRows
from tests.helpers.engines import drive, make_engine, new_tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
BLOCK = 4


class Oracle:
    """The MTP depth from transformers modules (see the module docstring)."""

    def __init__(self, path, scratch) -> None:
        from transformers import AutoModelForCausalLM, DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm
        tensors: dict[str, torch.Tensor] = {}
        for file in path.glob("*.safetensors"):
            tensors.update(load_file(str(file)))
        self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        config = json.loads((path / "config.json").read_text())
        one = {**config, "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"],
               "num_nextn_predict_layers": 0}
        DeepseekV4Config(**one).save_pretrained(str(scratch))
        depth = {name: tensors[name] for name in ("model.embed_tokens.weight", "head.weight")}
        for name, t in tensors.items():
            if not name.startswith("mtp.0."):
                continue
            rest = name[len("mtp.0."):]
            if rest.startswith("hc_head_"):
                depth["model.hc_head.hc_" + rest[len("hc_head_"):]] = t
            elif rest == "norm.weight":
                depth["model.norm.weight"] = t
            elif rest.split(".")[0] not in ("enorm", "hnorm", "e_proj", "h_proj"):
                depth["model.layers.0." + rest] = t
        save_file(depth, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        self.depth = AutoModelForCausalLM.from_pretrained(str(scratch), dtype=torch.float32).eval()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.enorm, self.hnorm = DeepseekV4RMSNorm(hidden, eps), DeepseekV4RMSNorm(hidden, eps)
        with torch.no_grad():
            self.enorm.weight.copy_(tensors["mtp.0.enorm.weight"])
            self.hnorm.weight.copy_(tensors["mtp.0.hnorm.weight"])
        self.e_proj, self.h_proj = tensors["mtp.0.e_proj.weight"], tensors["mtp.0.h_proj.weight"]

    def main_streams(self, ids: list[int]) -> torch.Tensor:  # [1, L, hc, D] before the main hc_head
        kept = []
        hook = self.hf.model.hc_head.register_forward_hook(lambda module, args, out: kept.append(args[0]))
        try:
            self.hf(torch.tensor([ids]))
        finally:
            hook.remove()
        return kept[0]

    def glue(self, streams: torch.Tensor, next_ids: list[int]) -> torch.Tensor:  # [1, n, hc, D]
        embeds = self.hf.model.embed_tokens(torch.tensor([next_ids]))
        return F.linear(self.hnorm(streams), self.h_proj) + F.linear(self.enorm(embeds), self.e_proj).unsqueeze(-2)

    def block(self, x: torch.Tensor) -> torch.Tensor:  # rows at positions 0..n-1 -> [1, n, hc, D]
        from transformers.masking_utils import create_sliding_window_causal_mask
        model = self.depth.model
        pos = torch.arange(x.shape[1])[None]
        flat = x[:, :, 0]
        mask = create_sliding_window_causal_mask(config=self.depth.config, inputs_embeds=flat, attention_mask=None,
                                                 cache=None, position_ids=pos)
        rope = {kind: model.rotary_emb(flat, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        return model.layers[0](x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=None,
                               cache=None)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:  # [1, n, hc, D] -> [1, n, V]
        return self.hf.lm_head(self.depth.model.norm(self.depth.model.hc_head(streams)))

    def first_pass_logits(self, ids: list[int]) -> torch.Tensor:  # rows 0..L-2 (row p: h_p, t_{p+1}) -> [L-1, V]
        with torch.inference_mode():
            return self.logits(self.block(self.glue(self.main_streams(ids[:-1]), ids[1:])))[0]

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """Drafts after ``tokens`` recomputed from scratch: the first pass over rows 0..L-2, then ``k - 1`` chained
        rows (each: the previous row's streams and draft)."""
        with torch.inference_mode():
            x = self.glue(self.main_streams(tokens[:-1]), tokens[1:])
            out = []
            for _ in range(k):
                last = self.block(x)[:, -1:]
                out.append(int(self.logits(last).argmax(-1)))
                x = torch.cat([x, self.glue(last, [out[-1]])], dim=1)
        return out


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    path = make_tiny("deepseek_v4", tmp_path_factory.mktemp("v4mtp"), seed=12, mtp_layers=1)
    return path, Oracle(path, tmp_path_factory.mktemp("v4mtp_depth"))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_meta(start: int, end: int, table: torch.Tensor) -> AttentionMetadata:
    """One prefill chunk of positions [start, end) of the request in state slot 0."""
    n, pos = end - start, torch.arange(start, end)
    return AttentionMetadata(
        block_size=BLOCK, slot_mapping=table[pos // BLOCK].long() * BLOCK + pos % BLOCK, num_decodes=0,
        decode_query_len=1, decode_block_tables=torch.zeros((0, 1), dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32), num_prefills=1, prefill_query_lens=[n],
        prefill_seq_lens=[end], prefill_block_tables=table[None], state=StateRows(
            torch.zeros(n, dtype=torch.int64), torch.full((n,), start), torch.full((n,), end)))


def test_make_tiny_writes_mtp_tensors_that_transformers_ignores(tiny_mtp):
    path, oracle = tiny_mtp
    names = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    for name in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
                 "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_attn_fn", "mtp.0.attn.wq_a.weight",
                 "mtp.0.ffn.gate.bias", "mtp.0.ffn.experts.7.w2.weight", "mtp.0.ffn.shared_experts.w3.weight"):
        assert name in names, name
    assert not any(n.startswith("mtp.0.attn.compressor") or n.endswith("tid2eid") for n in names if "mtp" in n)
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any("mtp" in n for n, _ in oracle.hf.named_parameters())  # transformers loads the file, without mtp


def test_mtp_logits_match_transformers_modules_across_chunks(tiny_mtp):
    """The first pass over a 21-token prompt (longer than the window of 8) prefilled in two chunks: every row's
    draft logits (row p: main streams at p, token p + 1) equal the oracle's."""
    path, oracle = tiny_mtp
    model = load_model(str(path), torch.float32, progress=False)
    paged, state = model.hybrid_cache_shapes(8 + 1, BLOCK, 1 + 1, 1)
    caches = [torch.zeros(s) for s in paged + state]
    proposer = V4MTPProposer(model, caches, 1)
    ids = _tokens(21, 70)
    table = torch.tensor([5, 2, 7, 0, 3, 6], dtype=torch.int32)  # shuffled blocks
    rows = []
    with torch.inference_mode():
        for start, end in ((0, 13), (13, 20)):
            meta = _prefill_meta(start, end, table)
            positions = torch.arange(start, end)
            hidden = model(torch.tensor(ids[start:end]), positions, caches, meta)
            streams = proposer.first_pass(torch.tensor(ids[start + 1:end + 1]), hidden, positions, meta)
            rows.append(model.compute_logits(proposer.layer.head_hidden(streams)))
    assert (torch.cat(rows) - oracle.first_pass_logits(ids)).abs().max() <= 1e-4


ENGINE = {"max_model_len": 128, "block_size": BLOCK, "max_num_seqs": 4, "num_blocks": 14, "max_num_batched_tokens": 9}


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_are_lossless_and_equal_the_oracle_chain(tiny_mtp, k):
    """Prompts shorter (3) and longer (20, 11) than the window, prefilled in chunks of 9 next to each other in a pool
    small enough to preempt: greedy ids equal the plain engine's; every draft of request "a" equals the oracle's
    from-scratch drafts, also after forced verification outcomes the random depth rarely produces (all accepted,
    then accept + reject), so its ring is right after roll-backs; no block or state slot leaks."""
    path, oracle = tiny_mtp
    prompts = {"a": _tokens(20, 71), "b": _tokens(3, 72), "c": _tokens(11, 73)}

    def run(on_step=None, **settings) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = make_engine(path, ENGINE, **settings)
        return new_tokens(drive(engine, {rid: (prompt, GREEDY) for rid, prompt in prompts.items()},
                                on_step=on_step)), engine

    plain, _ = run()
    checked, forced = [], [0]

    def check_and_force(engine: LLMEngine) -> None:
        request = engine.scheduler.get_request("a")
        if request is None or not request.draft_token_ids:
            return
        assert request.draft_token_ids == oracle.drafts(request.all_token_ids, k)
        checked.append(request.num_tokens)
        done = request.num_output_tokens
        truth = plain["a"][done:done + k]
        forced[0] += 1
        if forced[0] == 1 and len(truth) == k:
            request.draft_token_ids = truth
        elif forced[0] == 2 and k > 1 and len(truth) == k:
            request.draft_token_ids = [truth[0], (truth[1] + 1) % 300] + truth[2:]

    spec, engine = run(check_and_force, method="mtp", num_speculative_tokens=k)
    assert spec == plain
    assert len(checked) >= 4
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0 and stats.num_preemptions > 0
    kv = engine.scheduler.kv_cache
    assert stats.kv_blocks_used == 0 and kv.num_free_state_slots == kv.num_state_slots
    engine.scheduler.check_integrity()


def test_mtp_with_compiled_regions_is_refused_before_compiling(tiny_mtp):
    """V4 drafts read the streams the eager forward keeps: an engine with compiled regions refuses, naming the field."""
    path, _ = tiny_mtp
    with pytest.raises(ValueError, match="compile_backend"):
        make_engine(path, ENGINE, method="mtp", num_speculative_tokens=1, compile_backend="aot_eager")


def test_mtp_drafts_across_session_turns_equal_the_oracle(tiny_mtp):
    """A session keeps its state slot, MTP ring included, between turns: the second turn prefills only its new
    tokens and its drafts equal the oracle's over the whole history; ids equal the plain engine's."""
    from backend_lib.core.outputs import SessionControl
    path, oracle = tiny_mtp
    first, second = _tokens(11, 74), _tokens(6, 75)

    def run(on_step=None, **settings) -> tuple[list[int], list[int], LLMEngine]:
        engine = make_engine(path, ENGINE, num_blocks=48, **settings)
        engine.add_request("t1", first, GREEDY, session=SessionControl("s", start=True))
        turn1 = new_tokens(drive(engine))["t1"]
        engine.add_request("a", second, GREEDY, session=SessionControl("s", end=True))
        return turn1, new_tokens(drive(engine, on_step=on_step))["a"], engine

    plain = run()[:2]
    checked = []

    def check(engine: LLMEngine) -> None:
        request = engine.scheduler.get_request("a")
        if request is not None and request.draft_token_ids:
            assert request.all_token_ids[:len(first) + len(plain[0])] == first + plain[0]  # the turn's history
            assert request.draft_token_ids == oracle.drafts(request.all_token_ids, 2)
            checked.append(request.num_tokens)

    *spec, engine = run(check, method="mtp", num_speculative_tokens=2)
    assert spec == list(plain) and len(checked) >= 4
    kv = engine.scheduler.kv_cache
    assert engine.stats().kv_blocks_used == 0 and kv.num_free_state_slots == kv.num_state_slots
