"""Engram layers for a tiny checkpoint (``deepinfer make-tiny --engram-layers 1,3``): the config's ``engram``
object and random tensors under the reference's names (``layers.{i}.engram.*``), in a shard of their own."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from backend_lib.models.engram.config import EngramConfig
from backend_lib.models.engram.ngram_hash import head_table_sizes
from backend_lib.models.engram.layer import FP8_ROW_BLOCK
from kernels.quant import quantize_block_fp8

TINY_ENGRAM: dict[str, Any] = dict(engram_vocab_size=[400, 300], max_ngram_size=3, n_embed_per_ngram=32,
                                   n_head_per_ngram=4, pad_id=2, seed=0, kernel_size=4)
_SHARD = "model-engram.safetensors"


def _tensors(config: EngramConfig, layer_id: int, rows: int, hidden: int, streams: int,
             gen: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen)

    width, p = config.embed_width, f"layers.{layer_id}.engram."
    out = {p + "multi_head_embedding.embedding.weight": randn(rows, config.head_dim, scale=1.0),
           p + "value_proj.weight": randn(hidden, width, scale=width ** -0.5),
           p + "value_proj.bias": randn(hidden, scale=0.1),
           p + "short_conv.conv.weight": randn(streams * hidden, 1, config.kernel_size, scale=0.5)}
    for s in range(streams):
        out[p + f"key_projs.{s}.weight"] = randn(hidden, width, scale=width ** -0.5)
        out[p + f"key_projs.{s}.bias"] = randn(hidden, scale=0.1)
        for norm in (f"norm1.{s}", f"norm2.{s}", f"short_conv.norms.{s}"):
            out[p + norm + ".weight"] = 1.0 + randn(hidden, scale=0.1)
    return out


def add_engram(out: Path, layer_ids: list[int], gen: torch.Generator,
               overrides: dict[str, Any] | None = None, fp8_table: bool = False) -> EngramConfig:
    """Add Engram on ``layer_ids`` to the checkpoint in ``out`` (config.json + one more safetensors shard);
    ``fp8_table``: tables in e4m3 with ue8m0 scales per row and 128 columns."""
    cfg = json.loads((out / "config.json").read_text())
    settings = {**TINY_ENGRAM, **(overrides or {}), "layer_ids": list(layer_ids)}
    config = EngramConfig.from_dict(settings)
    config.check_layers(cfg["num_hidden_layers"])
    hidden, streams = cfg["hidden_size"], int(cfg.get("hc_mult", 1))
    sizes = head_table_sizes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer_id in config.layer_ids:
        rows = sum(p for order in sizes[layer_id] for p in order)
        tensors.update(_tensors(config, layer_id, rows, hidden, streams, gen))
        if fp8_table:
            name = f"layers.{layer_id}.engram.multi_head_embedding.embedding."
            tensors[name + "weight"], tensors[name + "scale"] = quantize_block_fp8(
                tensors[name + "weight"], FP8_ROW_BLOCK, "ue8m0")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / _SHARD), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # a single-file checkpoint: index it so the loader reads both files
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"].update({k: _SHARD for k in tensors})
    index_path.write_text(json.dumps(index, indent=2))
    cfg["engram"] = settings
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return config
