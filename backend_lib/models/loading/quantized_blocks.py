"""``GGUFBlocks``: a GGUF weight kept as the file's block bytes (``weight_format=packed``), as the GGUF loader yields
it in place of a dequantized tensor, with the ``shape`` / ``narrow`` surface the model loaders use on tensors.

Rows (output features) are independent in every GGUF block format, so a row shard is a plain row range; a column
shard (a row-parallel projection's inputs) must start and end on a block boundary (32 inputs for Q8_0 / Q4_0 /
Q4_1, 256 for Q4_K), else it is refused, naming the split.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from backend_lib.models.layers import Linear, VocabEmbedding, copy_into
from kernels.packed_weights import GGUF_LAYOUTS, GGUF_TYPE_NAMES, pack_gguf

# gguf type -> the packed kernels' format name (kernels/packed_weights.py)
PACKABLE_GGUF_TYPES = {GGMLQuantizationType[name]: fmt for fmt, name in GGUF_TYPE_NAMES.items()}


@dataclass(frozen=True)
class GGUFBlocks:
    """A [out, in] weight as GGUF rows of blocks (``rows`` [out, in / block_k * block_bytes] uint8, the file's bytes,
    rows already in Hugging Face order)."""

    name: str
    qtype: str  # q8_0, q4_0, q4_1, q4_k
    rows: torch.Tensor  # [out, row_bytes] uint8
    in_features: int

    @property
    def block_k(self) -> int:
        return GGUF_LAYOUTS[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGUF_LAYOUTS[self.qtype][1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows.shape[0], self.in_features))

    def narrow(self, dim: int, start: int, length: int) -> "GGUFBlocks":
        if dim == 0:
            return GGUFBlocks(self.name, self.qtype, self.rows.narrow(0, start, length), self.in_features)
        if dim != 1:
            raise ValueError(f"GGUFBlocks.narrow: dim must be 0 or 1, got {dim}")
        if start % self.block_k or length % self.block_k:
            raise ValueError(f"weight_format=packed: the tensor-parallel split of {self.name!r} takes inputs "
                             f"[{start}, {start + length}), not on its {self.qtype} blocks of {self.block_k} inputs; "
                             "use weight_format=dequantize or another tensor_parallel_size")
        first, count = start // self.block_k, length // self.block_k
        part = self.rows.narrow(1, first * self.block_bytes, count * self.block_bytes)
        return GGUFBlocks(self.name, self.qtype, part, length)

    def load(self) -> "GGUFBlocks":  # parallel.read_shard's whole tensor: the rows are in memory already
        return self

    def dequantize(self) -> torch.Tensor:  # [out, in] float32, what weight_format=dequantize loads
        values = dequantize(self.rows.contiguous().numpy(), GGMLQuantizationType[GGUF_TYPE_NAMES[self.qtype]])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    @staticmethod
    def cat(parts: list["GGUFBlocks"], name: str) -> "GGUFBlocks":
        """Row-wise concatenation (a fused projection's q / k / v or gate / up); the parts must share a format."""
        if len({(p.qtype, p.in_features) for p in parts}) != 1:
            raise ValueError(f"GGUFBlocks.cat: {name} parts differ in format or width: "
                             f"{[(p.name, p.qtype, p.in_features) for p in parts]}")
        return GGUFBlocks(name, parts[0].qtype, torch.cat([p.rows for p in parts]), parts[0].in_features)


def install_gguf_parts(module: Linear | VocabEmbedding,
                       parts: list[tuple[int, GGUFBlocks, torch.Tensor, str]], path: str = "auto") -> None:
    """A projection's (or the embedding's) GGUF parts as (first row in the fused weight, blocks, the weight's rows
    they fill, checkpoint name) -> one packed weight, rows in the fused order (q / k / v, gate / up); parts in
    different formats (a mixed quantization, or some parts in a format the packed GEMMs lack, which arrived
    dequantized) are dequantized into ``weight`` instead."""
    parts = sorted(parts, key=lambda p: p[0])
    blocks = [p[1] for p in parts]
    rows = module.out_features if isinstance(module, Linear) else module.num_embeddings
    if len({(b.qtype, b.in_features) for b in blocks}) == 1 and sum(b.shape[0] for b in blocks) == rows:
        whole = GGUFBlocks.cat(blocks, parts[0][3])
        module.set_quantized(pack_gguf(whole.rows.numpy(), whole.qtype, whole.in_features), path)
        return
    for _, part, view, name in parts:
        copy_into(view, part.dequantize(), name)
