"""The DSpark drafter's math against a plain-torch port of DeepSpec's (tests/helpers/dspark_reference.py) on random
weights: the block's hidden states (Llama-style and Qwen3-style q / k norms), the three Markov heads' sequential
greedy drafts and the confidence head; the position convention and capture point we chose; the directory round trip
and the refusals naming the setting."""
from __future__ import annotations

import pytest
import torch

from backend_lib.models.dspark.config import DrafterConfig, deepspec_config
from backend_lib.models.dspark.heads import confidence_logits, draft_sequentially
from backend_lib.models.dspark.model import DSparkDrafter, init_random, load_drafter, save_drafter
from backend_lib.models.llama.config import LlamaArchConfig
from tests.helpers import dspark_reference as ref

TARGET = LlamaArchConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                         tie_word_embeddings=True, max_position_embeddings=256)


def _drafter(seed: int = 0, **fields) -> tuple[DSparkDrafter, dict]:
    defaults = dict(num_draft_layers=2, block_size=5, mask_token_id=95, target_layer_ids=(0, 2), markov_rank=16,
                    markov_head_type="vanilla", confidence_head=True, confidence_head_with_markov=True)
    config = deepspec_config(TARGET, **{**defaults, **fields})
    drafter = DSparkDrafter(DrafterConfig.from_dict(config), 256)
    init_random(drafter, torch.Generator().manual_seed(seed), std=0.2)
    return drafter.eval(), config


def _ours(drafter: DSparkDrafter, target_hidden: torch.Tensor, block_embeds: torch.Tensor,
          anchor_pos: int) -> torch.Tensor:  # [B, H]
    C = target_hidden.shape[0]
    main_x = drafter.project_context(target_hidden)
    context = [(k[None], v[None]) for k, v in drafter.context_kv(main_x, torch.arange(C))]
    B = block_embeds.shape[0]
    return drafter.block_hidden(block_embeds[None], (anchor_pos + torch.arange(B))[None], context,
                                (torch.arange(C) < anchor_pos)[None])[0]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@torch.no_grad()
def test_block_hidden_matches_the_reference(model_type):
    drafter, config = _drafter()
    if model_type == "qwen3":  # q / k norms over each head
        config = {**config, "model_type": "qwen3"}
        drafter = DSparkDrafter(DrafterConfig.from_dict(config), 256)
        init_random(drafter, torch.Generator().manual_seed(1), std=0.2)
        for layer in drafter.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(3)
    target_hidden = torch.randn(11, 2 * 32, generator=g)
    block = torch.randn(5, 32, generator=g)
    for anchor_pos in (1, 7, 11):  # context positions < anchor only: 11 = all of it, 1 = the first token alone
        want = ref.block_hidden(drafter.state_dict(), config, target_hidden, block, anchor_pos)
        torch.testing.assert_close(_ours(drafter, target_hidden, block, anchor_pos), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_context_past_the_anchor_is_not_read():
    """The capture convention: the anchor's own position has no target hidden state yet, so nothing at or past the
    anchor may change the block (the engine's cache holds rejected drafts' garbage there)."""
    drafter, _ = _drafter()
    g = torch.Generator().manual_seed(4)
    target_hidden, block = torch.randn(9, 64, generator=g), torch.randn(5, 32, generator=g)
    changed = target_hidden.clone()
    changed[6:] = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(_ours(drafter, target_hidden, block, 6), _ours(drafter, changed, block, 6))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@torch.no_grad()
def test_markov_drafts_and_confidence_match_the_reference(kind):
    drafter, config = _drafter(seed=2, markov_head_type=kind)
    w = drafter.state_dict()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 5, 32, generator=g)
    base = torch.randn(3, 5, 96, generator=g)
    anchors = torch.tensor([4, 17, 60])
    drafts = draft_sequentially(base, anchors, hidden, drafter.markov_head)
    prev = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)
    conf = torch.sigmoid(confidence_logits(drafter.confidence_head, drafter.markov_head, True, hidden, prev))
    for s in range(3):
        want_drafts, want_prev = ref.markov_greedy(w, kind, base[s], int(anchors[s]), hidden[s])
        assert drafts[s].tolist() == want_drafts
        assert prev[s].tolist() == want_prev
        torch.testing.assert_close(conf[s], ref.confidence(w, hidden[s], want_prev, True), atol=1e-6, rtol=1e-5)
    # the bias matters: without the Markov head the drafts are the plain argmax (DFlash)
    assert draft_sequentially(base, anchors, hidden, None).tolist() == base.argmax(-1).tolist()


def test_directory_round_trip_and_refusals(tmp_path):
    drafter, config = _drafter(markov_head_type="gated")
    save_drafter(drafter, str(tmp_path / "d"), config)
    loaded = load_drafter(str(tmp_path / "d"), 256)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="target_layer_ids"):  # the last layer's output is final-normed
        deepspec_config(TARGET, num_draft_layers=1, block_size=4, mask_token_id=0, target_layer_ids=(1, 3))
    with pytest.raises(ValueError, match="markov_head_type"):
        DrafterConfig.from_dict({**config, "markov_head_type": "lstm"})
    with pytest.raises(ValueError, match="model_type"):
        DrafterConfig.from_dict({**config, "model_type": "gemma4"})
    with pytest.raises(ValueError, match="config.json"):
        load_drafter(str(tmp_path), 256)
