"""make-tiny --arch deepseek_v41 writes the release layout, the engine loads it (and transformers main's renamed
form), and bad V4.1 checkpoints fail the load naming what is wrong."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import main
from tests.helpers.deepseek_v41_cases import tokens
from tests.helpers.paged_runner import HybridPagedRunner


def _tensors(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _rewrite(path, tensors: dict[str, torch.Tensor]) -> None:
    for file in path.glob("*.safetensors"):
        file.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41")
    assert main(["--arch", "deepseek_v41", "--out", str(path)]) == 0
    return path


def test_make_tiny_writes_the_release_layout(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert {"text_config", "vision_config", "image_token_id"} <= set(config)
    names = set(_tensors(tiny))
    # layer 1: ratio-2 KV source, 2: reuse, 4: ratio-1 KV source (no wgate), 6: reindex
    for name in ("embed.weight", "norm.weight", "head.weight", "layers.0.hc_attn_fn", "layers.0.attn.attn_sink",
                 "layers.1.attn.compressor.wgate.weight", "layers.1.attn.indexer.wk.weight",
                 "layers.4.attn.compressor.wkv.weight", "layers.6.attn.indexer.wq_b.weight",
                 "layers.3.ffn.gate.bias_vl", "layers.3.ffn.experts.7.w3.weight", "layers.0.attn.kv_norm.weight"):
        assert name in names, name
    for absent in ("layers.4.attn.compressor.wgate.weight", "layers.2.attn.compressor.wkv.weight",
                   "layers.6.attn.indexer.wk.weight", "layers.5.attn.indexer.wq_b.weight", "hc_head_fn"):
        assert absent not in names, absent


def test_transformers_renamed_form_loads_the_same(tiny, tmp_path):
    ids = tokens(30, 0)
    expected = HybridPagedRunner(load_model(str(tiny), torch.float32, progress=False)).step([], [("r", ids)])
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (renamed / file).write_text((tiny / file).read_text())
    tensors = {("lm_head.weight" if n == "head.weight" else f"model.{n}"): t for n, t in _tensors(tiny).items()}
    tensors["mtp.0.attn_norm.weight"] = torch.ones(4)  # DSpark layers: skipped (logged) by a text-only load
    _rewrite(renamed, tensors)
    got = HybridPagedRunner(load_model(str(renamed), torch.float32, progress=False)).step([], [("r", ids)])
    assert torch.equal(got, expected)


def test_a_source_without_its_compressor_fails_naming_it(tiny, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bad / file).write_text((tiny / file).read_text())
    tensors = _tensors(tiny)
    del tensors["layers.4.attn.compressor.wkv.weight"]
    _rewrite(bad, tensors)
    with pytest.raises(ValueError, match=r"missing weights for: \['layers\.4\.attn\.compressor\.wkv\.weight'\]"):
        load_model(str(bad), torch.float32, progress=False)
    config = json.loads((tiny / "config.json").read_text())
    config["text_config"]["index_source_layer_ids"] = [4, 6]  # the ratio-2 source no longer scores
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"text_config\.index_source_layer_ids must include every KV source"):
        load_model(str(bad), torch.float32, progress=False)
