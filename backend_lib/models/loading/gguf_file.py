"""A GGUF file's metadata and tensor table, parsed in one pass over the header; tensor bytes stay memory-mapped.

gguf's own ``GGUFReader`` builds a numpy view per metadata element: SmolLM2's 49,152 tokens and 48,900 merges
cost it 2.5-5 s per open (seconds of every engine load and server start). Here strings are sliced from one bytes
buffer and numeric arrays are one ``np.frombuffer``: the same header parses in ~0.1 s. Only little-endian files
(what llama.cpp writes) are read.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# GGUF value type -> struct format of one scalar
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}
NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                11: "<i8", 12: "<f8"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost (contiguous) dimension first, as GGUFReader reports it
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8 [outer dims reversed..., bytes of one innermost row]: what gguf.quants dequantizes


class _Cursor:
    """Reads little-endian GGUF values from a buffer, front to back."""

    def __init__(self, buf: bytes | mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in NUMPY_DTYPES:
                items = np.frombuffer(self.buf, dtype=NUMPY_DTYPES[item_type], count=count, offset=self.pos)
                self.pos += items.nbytes
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        if value_type not in SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type} at byte {self.pos}")
        return self.scalar(SCALAR_FORMATS[value_type])


class GGUFFile:
    """``fields``: every metadata key -> its Python value (lists for arrays); ``tensors``: the tensor table."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(self._map, path)
        if self._map[:4] != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(self._map[:4])!r})")
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
        num_tensors, num_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            self.fields[key] = cursor.value(cursor.scalar("<I"))
        table = []
        for _ in range(num_tensors):
            name = cursor.string()
            shape = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
            table.append((name, shape, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        everything = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [GGUFTensor(name, shape, qtype,
                                   self._tensor_bytes(everything, data_start + offset, shape, qtype))
                        for name, shape, qtype, offset in table]

    @staticmethod
    def _tensor_bytes(everything: np.ndarray, start: int, shape: tuple[int, ...],
                      qtype: GGMLQuantizationType) -> np.ndarray:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = shape[0] // block_size * type_size
        outer = tuple(reversed(shape[1:]))
        count = row_bytes * int(np.prod(outer, dtype=np.int64))
        return everything[start:start + count].reshape(*outer, row_bytes)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)
