"""Our one-pass GGUF header reader against gguf's own GGUFReader on the SmolLM2 file (Q4_1, Q8_0, F32)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from backend_lib.models.loading.gguf_file import GGUFFile


def test_fields_and_tensors_equal_gguf_readers(smollm2_path):
    ours, theirs = GGUFFile(smollm2_path), GGUFReader(smollm2_path)
    reference = {k: v.contents() for k, v in theirs.fields.items() if not k.startswith("GGUF.")}  # its pseudo-keys
    assert ours.fields == reference and len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.shape, a.tensor_type) == (tuple(int(d) for d in b.shape), b.tensor_type)
        assert np.array_equal(dequantize(a.data, a.tensor_type), dequantize(b.data, b.tensor_type)), a.name
    assert {t.tensor_type.name for t in ours.tensors} == {"Q4_1", "Q8_0", "F32"}


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))
