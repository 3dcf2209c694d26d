"""Engram tensors of a checkpoint (``layers.{i}.engram.*``) into the model's Engram layers, the same for every
backbone: this rank's rows of each table (fp8 tables with their scales, kept fp8), the rest checked by shape, and a
load that fails naming what is missing or wrong."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

_NAME = re.compile(r"^layers\.(\d+)\.engram\.(.+)$")
_TABLE = "multi_head_embedding.embedding."


def _whole(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.narrow(0, 0, tensor.shape[0])


class EngramLoader:
    def __init__(self, layers: nn.ModuleList, dtype: torch.dtype) -> None:
        self.layers, self.dtype = layers, dtype
        self.loaded: set[str] = set()
        self._fp8: dict[int, dict[str, Any]] = {}  # layer -> {"weight", "scale"} of an fp8 table until both arrived

    @staticmethod
    def owns(name: str) -> bool:
        """``name`` without the ``model.`` prefix."""
        return _NAME.match(name) is not None

    def _layer(self, name: str) -> tuple[int, nn.Module, str]:
        match = _NAME.match(name)
        index = int(match.group(1))
        if not 0 <= index < len(self.layers) or getattr(self.layers[index], "engram", None) is None:
            raise ValueError(f"unexpected checkpoint tensor {name!r}: layer {index} is not in config.json's "
                             f"engram.layer_ids")
        return index, self.layers[index].engram, match.group(2)

    def take(self, name: str, tensor: Any) -> None:
        index, engram, rest = self._layer(name)
        if rest.startswith(_TABLE):
            self._table(name, index, engram, rest[len(_TABLE):], tensor)
            return
        try:
            param = engram.get_parameter(rest)
        except AttributeError as err:
            raise ValueError(f"unexpected checkpoint tensor {name!r}") from err
        value = _whole(tensor)
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} != expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        self.loaded.add(name)

    def _table(self, name: str, index: int, engram: nn.Module, leaf: str, tensor: Any) -> None:
        table = engram.multi_head_embedding
        if leaf not in ("weight", "scale"):
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        if tensor.shape[0] != table.total_rows:
            raise ValueError(f"{name}: the Engram table has {tensor.shape[0]} rows, but engram_vocab_size's primes "
                             f"for layer {index} ({engram.hasher.primes.tolist()}) add up to {table.total_rows}")
        shard = table.shards["embedding.weight"]
        if leaf == "scale" or tensor.dtype == torch.float8_e4m3fn:
            parts = self._fp8.setdefault(index, {})
            parts[leaf] = shard.take(tensor)
            if len(parts) == 2:
                table.set_fp8(_whole(parts["weight"]), _whole(parts["scale"]), self.dtype)
                del self._fp8[index]
                self.loaded.add(name.rpartition(".")[0] + ".weight")
            return
        value = _whole(shard.take(tensor))
        weight = table.embedding.weight
        if tuple(weight.shape) != tuple(value.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} != expected {tuple(weight.shape)}")
        with torch.no_grad():
            weight.copy_(value.to(weight.dtype))
        self.loaded.add(name)

    def finish(self) -> None:
        """Fails the load on an fp8 table without its scales (or scales without a table) or a missing tensor."""
        if self._fp8:
            raise ValueError(f"Engram tables of layers {sorted(self._fp8)}: an fp8 table needs both its weight "
                             f"and its scale")
        expected = {f"layers.{i}.engram.{n}" for i, layer in enumerate(self.layers)
                    if getattr(layer, "engram", None) is not None for n, _ in layer.engram.named_parameters()}
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing Engram weights for: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
        for layer in self.layers:
            if getattr(layer, "engram", None) is not None:
                layer.engram.fuse()
