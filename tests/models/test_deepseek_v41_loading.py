"""make-tiny --arch deepseek_v41 writes the release layout, the engine loads it (and transformers main's renamed
form), and bad V4.1 checkpoints fail the load naming what is wrong."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import main, make_tiny
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


@pytest.fixture(scope="module")
def tiny_engram(tmp_path_factory):
    return make_tiny("deepseek_v41", tmp_path_factory.mktemp("v41_engram"), seed=7, engram_layers=[0])


def _reuse_before_any_source(config, tensors):
    # layer 0 becomes a compressed (ratio 2) layer ahead of the first KV source: it would reuse nothing
    config["text_config"]["compress_ratios"][0] = 2


def _no_compressor(config, tensors):
    del tensors["layers.4.attn.compressor.wkv.weight"]


def _source_not_scoring(config, tensors):
    config["text_config"]["index_source_layer_ids"] = [4, 6]  # the ratio-2 KV source no longer scores


def _rows_below_the_primes(config, tensors):
    config["text_config"]["engram_num_embeddings"][0] -= 20  # the tiny table is a few rows past its primes


def _table_rows_disagree(config, tensors):
    table = tensors["layers.0.engram.embed.weight"]
    tensors["layers.0.engram.embed.weight"] = table[:-1]  # one row short of engram_num_embeddings


@pytest.mark.parametrize("engram, edit, message", [
    (False, _reuse_before_any_source, r"text_config\.kv_source_layer_ids: compressed layer 0 has no KV source"),
    (False, _no_compressor, r"missing weights for: \['layers\.4\.attn\.compressor\.wkv\.weight'\]"),
    (False, _source_not_scoring, r"text_config\.index_source_layer_ids must include every KV source; missing \[1\]"),
    (True, _rows_below_the_primes,
     r"text_config\.engram_num_embeddings\[0\] \(\d+ rows, layer 0\) is below the sum of its primes"),
    (True, _table_rows_disagree, r"layers\.0\.engram\.embed\.weight: shape \(\d+, 32\) != expected"),
], ids=["reuse_before_any_source", "no_compressor", "source_not_scoring", "rows_below_the_primes",
        "table_rows_disagree"])
def test_bad_checkpoints_fail_the_load_naming_what_is_wrong(tiny, tiny_engram, tmp_path, engram, edit, message):
    source = tiny_engram if engram else tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (bad / file).write_text((source / file).read_text())
    config, tensors = json.loads((source / "config.json").read_text()), _tensors(source)
    edit(config, tensors)
    (bad / "config.json").write_text(json.dumps(config))
    _rewrite(bad, tensors)
    with pytest.raises(ValueError, match=message):
        load_model(str(bad), torch.float32, progress=False)
