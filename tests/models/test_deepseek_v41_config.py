"""The composite V4.1 config.json read into ``DeepseekV41Config``: the released schedule's roles, and bad schedules
refused naming the field."""
from __future__ import annotations

import pytest

from backend_lib.models.deepseek_v41.config import FULL, REINDEX, REUSE, WINDOW, DeepseekV41Config
from backend_lib.tools.tiny_v41 import TEXT_DEFAULTS

RELEASED = {
    "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "image_token_id": 129264,
    "text_config": {"compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3, "num_nextn_predict_layers": 3,
                    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
                    "candidate_source_layer_id": 20, "engram_layer_ids": [1, 14],
                    "engram_num_embeddings": [384006168, 384016682], "engram_pad_token_id": 2,
                    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                     "original_max_position_embeddings": 65536}},
    "vision_config": {"hidden_size": 1024},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4",
                            "scale_fmt": "ue8m0", "activation_scheme": "dynamic"},
}


def test_released_schedule_roles():
    config = DeepseekV41Config.from_hf_config(RELEASED)
    t = config.text
    assert (t.num_hidden_layers, t.hidden_size, t.rms_norm_eps, t.index_topk) == (40, 5120, 1e-20, 512)
    assert config.quantization.weight_block_size == (32, 32) and config.quantization.expert_dtype == "fp4"
    modes = [r.mode for r in t.roles]
    assert modes[:2] == [WINDOW, WINDOW] and modes[2] == FULL and modes[3:8] == [REUSE] * 5
    assert [r.layer for r in t.roles if r.mode == FULL] == [2, 8, 14, 20]
    assert [r.layer for r in t.roles if r.mode == REINDEX] == [24, 28, 32, 36]
    assert [r.kv_source for r in t.roles[19:22]] == [14, 20, 20]
    assert t.roles[20].candidate_source and all(t.roles[i].uses_candidates for i in (24, 28, 32, 36))
    assert not t.roles[21].uses_candidates  # a Reuse layer takes layer 20's top-k as is
    assert t.compress_rope_scaling["factor"] == 16 and t.compress_rope_scaling["attention_factor"] == 1.0
    assert t.engram_pad_id == 2 and t.engram_layer_ids == (1, 14)


def _text(**changes):
    return {"model_type": "deepseek_v41", "text_config": {**TEXT_DEFAULTS, **changes}}


@pytest.mark.parametrize("changes, message", [
    (dict(compress_ratios=[0, 4, 4, 4, 1, 1, 1, 1]), r"compress_ratios: V4.1 layers have ratio 0, 1 or 2"),
    (dict(kv_source_layer_ids=[0, 4], index_source_layer_ids=[0, 4, 6]), r"kv_source_layer_ids: layer 0 has "
                                                                          r"compress_ratios 0"),
    (dict(index_source_layer_ids=[4, 6]), r"index_source_layer_ids must include every KV source; missing \[1\]"),
    (dict(kv_source_layer_ids=[2, 4], index_source_layer_ids=[2, 4, 6]),
     r"kv_source_layer_ids: compressed layer 1 has no KV source"),
    (dict(kv_source_layer_ids=[1], index_source_layer_ids=[1, 6], candidate_source_layer_id=-1),
     r"kv_source_layer_ids: layer 4 \(ratio 1\) would use source 1, whose ratio is 2"),
    (dict(index_source_layer_ids=[1, 3, 4, 6]), None),  # a ratio-2 reindex layer: fine
    (dict(candidate_source_layer_id=6), r"candidate_source_layer_id \(6\) must be a KV source"),
    (dict(candidate_source_layer_id=1), r"candidate_source_layer_id \(1\): KV source 4 follows it"),
    (dict(kv_source_layer_ids=[4, 1]), r"kv_source_layer_ids must be strictly increasing"),
    (dict(compress_ratios=[0, 2, 2]), r"compress_ratios: 3 entries, expected num_hidden_layers \(8\)"),
    (dict(o_groups=3), r"text_config.o_groups \(3\) must divide num_attention_heads"),
])
def test_bad_schedules_name_the_field(changes, message):
    if message is None:
        DeepseekV41Config.from_hf_config(_text(**changes))
        return
    with pytest.raises(ValueError, match="text_config." + message if not message.startswith("text_config")
                       else message):
        DeepseekV41Config.from_hf_config(_text(**changes))


def test_composite_needs_text_config_and_fp8():
    with pytest.raises(ValueError, match="needs a text_config"):
        DeepseekV41Config.from_hf_config({"model_type": "deepseek_v41", "hidden_size": 64})
    bad = {**RELEASED, "quantization_config": {"quant_method": "fp8", "scale_fmt": "float"}}
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0'"):
        DeepseekV41Config.from_hf_config(bad)
