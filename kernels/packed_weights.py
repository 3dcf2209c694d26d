"""Quantized weights kept in their checkpoint's format in memory (``weight_format=packed``): the containers, the
one-time repack at load, and plain-torch dequantizers (the references of kernels/packed_gemm.py's GEMMs).

Every format is repacked once into tiles of 16 output rows, each tile's bytes contiguous (a thread streams its
tiles; the kernel keeps no per-call packing). The repack only moves bytes: the packed tensor is a fixed
permutation of the checkpoint's bytes (``repack_source_index`` gives, for every packed byte, the checkpoint byte it
holds), plus zero rows padding ``out`` to a multiple of 16 (a zero GGUF scale or fp8 code contributes nothing).
Resident bytes per weight are the checkpoint's: fp8 1 (+ one fp32 scale per 128x128), fp4 0.5 + 1/32, Q8_0
34/32, Q4_0 18/32, Q4_1 20/32 = 0.625, Q4_K 144/256 = 0.5625.

Layouts ([shape] uint8; t a tile, j a row of the tile (output row 16 t + j), k an input index):

- ``fp8_e4m3`` (DeepSeek-V3 / V4 projections): ``data [tiles, in, 16]``, ``data[t, k, j] = W[16t+j, k]`` (the e4m3fn
  byte); ``scales [ceil(out / bn), ceil(in / bk)]`` fp32, the checkpoint's ``weight_scale_inv`` grid (ue8m0 scales
  as their fp32 powers of two). One 16-byte vector per k: the kernel widens it to 16 fp32 and FMAs it.
- ``fp4_e2m1`` (V4 routed experts, kernels/fp4.py): ``data [tiles, in / 2, 16]``, ``data[t, p, j] = packed[16t+j, p]``
  (the byte of inputs 2p (low nibble) and 2p+1 (high)); ``scales [tiles, in / 32, 16]``, the e8m0 exponent byte of
  row 16t+j's scale of inputs 32g..32g+31 (a checkpoint's float8_e8m0fnu bytes; fp32 powers of two converted).
- GGUF (llama.cpp block formats; a row of ``in`` inputs is ``in / bk`` blocks of ``B`` bytes, gguf_file.py's
  ``[out, row_bytes]`` array): ``data [tiles, in / bk, 16 * B]``: block b of the tile's 16 rows, split into the
  block's fields, each field stored for the 16 rows in turn. Fields (byte offsets in one row's block -> offset in
  the tile's block):

  ======  ==  ===  =====================================================================================
  format  bk  B    tile block (16 rows)
  ======  ==  ===  =====================================================================================
  Q8_0    32  34   d fp16 [16] @0; qs [8 groups g][16 rows][4] @32: qs bytes 4g..4g+3 (inputs 4g..4g+3)
  Q4_0    32  18   d [16] @0; qs [4 g][16][4] @32: qs bytes 4g..4g+3 (low nibbles: inputs 4g..4g+3, high:
                   16+4g..16+4g+3)
  Q4_1    32  20   d [16] @0; m [16] @32; qs [4 g][16][4] @64 (as Q4_0)
  Q4_K    256 144  d [16] @0; dmin [16] @32; scales [12 bytes s][16 rows] @64 (byte s of each row's 12 packed
                   6-bit scale / min bytes); qs [32 g][16][4] @256: qs bytes 4g..4g+3 (low nibbles: inputs
                   64 (g // 8) + 4 (g % 8) + i, high: 32 more; sub-blocks 2 (g // 8) and 2 (g // 8) + 1)
  ======  ==  ===  =====================================================================================

  A group is one 64-byte vector: 16 rows x 4 bytes, so a 32-bit lane is one output row and ``vpdpbusd`` against
  4 broadcast activation bytes sums straight into that row; the low / high nibble split of Q4_0's bytes
  (inputs i and i + 16 in one byte) is kept as the file has it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kernels.fp4 import FP4_GROUP, dequantize_fp4
from kernels.quant import dequantize_block_fp8

TILE = 16  # output rows per tile

# GGUF: format -> (inputs per block, bytes per block, fields as (offset, bytes, unit)): a field of ``bytes`` bytes
# is stored for the 16 rows in ``unit``-byte pieces: [bytes / unit pieces][16 rows][unit].
GGUF_LAYOUTS: dict[str, tuple[int, int, tuple[tuple[int, int, int], ...]]] = {
    "q8_0": (32, 34, ((0, 2, 2), (2, 32, 4))),
    "q4_0": (32, 18, ((0, 2, 2), (2, 16, 4))),
    "q4_1": (32, 20, ((0, 2, 2), (2, 2, 2), (4, 16, 4))),
    "q4_k": (256, 144, ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4))),
}
# gguf.GGMLQuantizationType names
GGUF_TYPE_NAMES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k": "Q4_K"}


def _tiles(out_features: int) -> int:
    return -(-out_features // TILE)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:  # [out, ...] -> [rows, ...] with zero rows appended
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _tile_block_permutation(block_bytes: int, fields: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
    """[16 * B] int64: position i of a packed tile block holds byte perm[i] of the 16 rows' blocks read as one
    [16, B] row-major array."""
    rows = torch.arange(TILE * block_bytes).view(TILE, block_bytes)
    parts = []
    for offset, size, unit in fields:
        field = rows[:, offset:offset + size].reshape(TILE, size // unit, unit)  # [16, pieces, unit]
        parts.append(field.transpose(0, 1).reshape(-1))  # [pieces, 16, unit]
    perm = torch.cat(parts)
    assert perm.numel() == TILE * block_bytes and torch.equal(perm.sort().values, torch.arange(perm.numel()))
    return perm


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in one of the packed formats. ``data`` and ``scales`` are plain tensors (module buffers in
    phase 2: compiled regions take them as graph inputs)."""

    data: torch.Tensor  # [tiles, ., .] uint8
    scales: torch.Tensor  # format-specific (empty for GGUF: the scales are inside ``data``)
    out_features: int
    in_features: int

    fmt: ClassVar[str] = ""

    @property
    def block(self) -> tuple[int, ...]:  # the op's ``block`` argument
        return ()

    @property
    def nbytes(self) -> int:
        """Resident bytes (padding rows included)."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def bytes_per_weight(self) -> float:
        return self.nbytes / (self.out_features * self.in_features)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        raise NotImplementedError


@dataclass(frozen=True)
class PackedFp8(PackedWeight):
    """float8_e4m3fn with a scale per (bn x bk) block."""

    block_size: tuple[int, int] = (128, 128)  # (bn, bk): bn a multiple of 16

    fmt: ClassVar[str] = "fp8_e4m3"

    @property
    def block(self) -> tuple[int, ...]:
        return tuple(self.block_size)

    def codes(self) -> torch.Tensor:  # [out, in] float8_e4m3fn, the checkpoint's tensor
        return self.data.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].view(torch.float8_e4m3fn)

    def dequantize(self) -> torch.Tensor:
        return dequantize_block_fp8(self.codes(), self.scales, self.block_size)


@dataclass(frozen=True)
class PackedFp4(PackedWeight):
    """e2m1 codes two a byte, an e8m0 scale per row per 32 inputs (``scales`` [tiles, in / 32, 16] uint8)."""

    fmt: ClassVar[str] = "fp4_e2m1"

    def codes(self) -> torch.Tensor:  # [out, in / 2] uint8, the checkpoint's bytes
        return self.data.transpose(1, 2).reshape(-1, self.in_features // 2)[:self.out_features]

    def scale_exponents(self) -> torch.Tensor:  # [out, in / 32] uint8 (e8m0)
        return self.scales.transpose(1, 2).reshape(-1, self.in_features // FP4_GROUP)[:self.out_features]

    def dequantize(self) -> torch.Tensor:
        exps = self.scale_exponents().to(torch.int32) - 127
        scale = torch.ldexp(torch.ones(exps.shape), exps)
        return dequantize_fp4(self.codes(), scale)


@dataclass(frozen=True)
class PackedGGUF(PackedWeight):
    """A GGUF block format (``qtype``: q8_0, q4_0, q4_1, q4_k); ``data`` [tiles, in / bk, 16 * B]."""

    qtype: str = "q4_1"

    @property
    def fmt(self) -> str:  # type: ignore[override]
        return self.qtype

    def file_bytes(self) -> torch.Tensor:  # [out, in / bk * B] uint8: the GGUF tensor's bytes, as the file has them
        block_k, block_bytes, fields = GGUF_LAYOUTS[self.qtype]
        perm = _tile_block_permutation(block_bytes, fields)
        tiles, blocks = self.data.shape[:2]
        rows = torch.empty_like(self.data)
        rows[..., perm] = self.data
        rows = rows.view(tiles, blocks, TILE, block_bytes).permute(0, 2, 1, 3)
        return rows.reshape(tiles * TILE, blocks * block_bytes)[:self.out_features].contiguous()

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        qtype = GGMLQuantizationType[GGUF_TYPE_NAMES[self.qtype]]
        values = dequantize(self.file_bytes().numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.out_features,
                                                                                         self.in_features)


def pack_fp8(weight: torch.Tensor,  # [out, in] float8_e4m3fn
             scale_inv: torch.Tensor,  # [ceil(out / bn), ceil(in / bk)] fp32 / bf16 / float8_e8m0fnu
             block_size: tuple[int, int] = (128, 128)) -> PackedFp8:
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"pack_fp8: weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    out_features, in_features = weight.shape
    bn, bk = block_size
    if bn % TILE:
        raise ValueError(f"pack_fp8: the block's output size ({bn}) must be a multiple of {TILE}: a tile of "
                         f"{TILE} output rows shares one scale per input block")
    grid = (math.ceil(out_features / bn), math.ceil(in_features / bk))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"pack_fp8: scale grid {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)} with block {tuple(block_size)}: expected {grid}")
    tiles = _tiles(out_features)
    codes = _pad_rows(weight.view(torch.uint8), tiles * TILE)
    data = codes.view(tiles, TILE, in_features).transpose(1, 2).contiguous()  # [tiles, in, 16]
    return PackedFp8(data, scale_inv.to(torch.float32).contiguous(), out_features, in_features, (bn, bk))


def e8m0_exponents(scale: torch.Tensor) -> torch.Tensor:  # powers of two (fp32 or float8_e8m0fnu) -> uint8
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    s = scale.to(torch.float32)
    mantissa, exponent = torch.frexp(s)
    if not bool(((mantissa == 0.5) & (s > 0)).all()) or bool(((exponent - 1 + 127) < 1).any()) or bool(
            ((exponent - 1 + 127) > 254).any()):
        raise ValueError("pack_fp4: scales must be powers of two in [2^-126, 2^127] (ue8m0)")
    return (exponent - 1 + 127).to(torch.uint8)


def pack_fp4(packed: torch.Tensor,  # [out, in / 2] int8 / uint8: element 2p in the low nibble, 2p + 1 high
             scale: torch.Tensor,  # [out, in / 32] fp32 powers of two or float8_e8m0fnu
             ) -> PackedFp4:
    if packed.dim() != 2:
        raise ValueError(f"pack_fp4: packed codes must be [out, in / 2], got {tuple(packed.shape)}")
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    if in_features % FP4_GROUP or tuple(scale.shape) != (out_features, in_features // FP4_GROUP):
        raise ValueError(f"pack_fp4: scale shape {tuple(scale.shape)} does not match codes {tuple(packed.shape)}: "
                         f"expected one scale per {FP4_GROUP} inputs, in % {FP4_GROUP} == 0")
    tiles = _tiles(out_features)
    codes = _pad_rows(packed.contiguous().view(torch.uint8), tiles * TILE)
    data = codes.view(tiles, TILE, in_features // 2).transpose(1, 2).contiguous()  # [tiles, in / 2, 16]
    exps = _pad_rows(e8m0_exponents(scale), tiles * TILE)
    scales = exps.view(tiles, TILE, in_features // FP4_GROUP).transpose(1, 2).contiguous()  # [tiles, in / 32, 16]
    return PackedFp4(data, scales, out_features, in_features)


def pack_gguf(file_bytes: np.ndarray | torch.Tensor,  # [out, in / bk * B] uint8: a GGUF tensor's rows
              qtype: str,  # q8_0, q4_0, q4_1, q4_k (or the gguf type name)
              in_features: int | None = None) -> PackedGGUF:
    qtype = qtype.lower()
    if qtype not in GGUF_LAYOUTS:
        raise ValueError(f"pack_gguf: unsupported type {qtype!r}; supported: {sorted(GGUF_LAYOUTS)}")
    block_k, block_bytes, fields = GGUF_LAYOUTS[qtype]
    rows = file_bytes.numpy() if isinstance(file_bytes, torch.Tensor) else np.asarray(file_bytes)
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] % block_bytes:
        raise ValueError(f"pack_gguf: expected [out, row_bytes] uint8 rows of whole {block_bytes}-byte {qtype} "
                         f"blocks, got {rows.dtype} {tuple(rows.shape)}")
    blocks = rows.shape[1] // block_bytes
    if in_features is not None and in_features != blocks * block_k:
        raise ValueError(f"pack_gguf: {blocks} {qtype} blocks a row hold {blocks * block_k} inputs, not "
                         f"{in_features}")
    out_features = rows.shape[0]
    tiles = _tiles(out_features)
    if tiles * TILE != out_features:  # zero rows to a whole tile
        rows = np.concatenate([rows, np.zeros((tiles * TILE - out_features, rows.shape[1]), np.uint8)])
    # numpy reads the (memory-mapped, read-only) file rows once: one copy, in the packed order
    tile_blocks = rows.reshape(tiles, TILE, blocks, block_bytes).transpose(0, 2, 1, 3)
    data = tile_blocks.reshape(tiles, blocks, TILE * block_bytes)[..., _tile_block_permutation(block_bytes, fields)
                                                                  .numpy()]
    return PackedGGUF(torch.from_numpy(np.ascontiguousarray(data)), torch.empty(0, dtype=torch.uint8),
                      out_features, blocks * block_k, qtype)


def repack_source_index(weight: PackedWeight) -> torch.Tensor:
    """int64, ``weight.data``'s shape: for each packed byte the flat index of the checkpoint byte it holds (fp8:
    into the [out, in] codes; fp4: into the [out, in / 2] codes; GGUF: into the [out, row_bytes] rows), -1 for a
    padding row's byte. The repack is ``data.flatten() == file.flatten()[index]`` (zeros where -1)."""
    out, tiles = weight.out_features, weight.data.shape[0]
    if isinstance(weight, (PackedFp8, PackedFp4)):
        width = weight.data.shape[1]
        index = torch.arange(tiles * TILE * width).view(tiles * TILE, width)
        index[out:] = -1
        return index.view(tiles, TILE, width).transpose(1, 2).contiguous()
    assert isinstance(weight, PackedGGUF)
    _, block_bytes, fields = GGUF_LAYOUTS[weight.qtype]
    blocks = weight.data.shape[1]
    index = torch.arange(tiles * TILE * blocks * block_bytes).view(tiles * TILE, blocks * block_bytes)
    index[out:] = -1
    index = index.view(tiles, TILE, blocks, block_bytes).permute(0, 2, 1, 3).reshape(tiles, blocks, -1)
    return index[..., _tile_block_permutation(block_bytes, fields)].contiguous()
