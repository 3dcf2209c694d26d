"""Token embedding lookup on a GGUF embedding kept packed (``weight_format=packed``; the tied head's GEMM reads the
same bytes): each looked-up row's blocks are gathered out of the 16-row tiles (kernels/packed_weights.py's layout)
back into the file's row bytes and dequantized by gguf's own reference, so a row is exactly the row
``weight_format=dequantize`` holds. A step looks up its few tokens, so the numpy dequantizer costs microseconds.

The lookup is a registered op with a fake kernel: compiled regions keep it as one opaque call.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kernels.packed_weights import GGUF_LAYOUTS, GGUF_TYPE_NAMES, TILE, PackedGGUF, _tile_block_permutation


@functools.cache
def _row_positions(qtype: str) -> torch.Tensor:  # [16, B] int64
    """Position in a packed tile block of byte i of the tile's row j's block (the repack's inverse)."""
    _, block_bytes, fields = GGUF_LAYOUTS[qtype]
    perm = _tile_block_permutation(block_bytes, fields)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return inverse.view(TILE, block_bytes)


def gguf_rows(data: torch.Tensor,  # [tiles, blocks, 16 * B] uint8, PackedGGUF.data
              ids: torch.Tensor,  # [T] int64 row indices
              qtype: str) -> torch.Tensor:  # [T, blocks * B] uint8: the file's bytes of those rows
    tiles, blocks, _ = data.shape
    positions = _row_positions(qtype)[ids % TILE]  # [T, B]
    tile_blocks = data[ids // TILE]  # [T, blocks, 16 * B]
    rows = torch.gather(tile_blocks, 2, positions[:, None, :].expand(-1, blocks, -1))  # [T, blocks, B]
    return rows.reshape(ids.shape[0], -1)


@torch.library.custom_op("deepinfer::packed_gguf_embedding", mutates_args=())
def packed_gguf_embedding(data: torch.Tensor, ids: torch.Tensor, qtype: str,
                          in_features: int) -> torch.Tensor:  # -> [T, in] float32
    rows = gguf_rows(data, ids.reshape(-1).long(), qtype)
    values = dequantize(rows.numpy(), GGMLQuantizationType[GGUF_TYPE_NAMES[qtype]])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(ids.numel(), in_features)


@packed_gguf_embedding.register_fake
def _(data: torch.Tensor, ids: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    return data.new_empty(ids.numel(), in_features, dtype=torch.float32)


def packed_embedding(ids: torch.Tensor,  # [T] int64
                     data: torch.Tensor,  # the module's buffer holding weight.data
                     weight: PackedGGUF) -> torch.Tensor:  # [T, in] float32
    return packed_gguf_embedding(data, ids, weight.qtype, weight.in_features)
