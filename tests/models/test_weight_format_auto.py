"""``weight_format=auto``, the default: quantized checkpoints load packed where the packed GEMMs run, float ones and
every other case dequantize, and the load log names the choice and its reason (models/loading/weight_format.py)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from backend_lib.core.config import EngineConfig, ModelConfig
from backend_lib.models.loading.gguf_file import GGUFTensor
from backend_lib.models.loading.loader import load_model
from backend_lib.models.loading.options import LoadOptions
from backend_lib.models.loading.weight_format import choose_for_gguf
from backend_lib.tools.tiny import make_tiny

LOADER_LOG = "backend_lib.models.loading.loader"


def _choice_line(caplog) -> str:
    [line] = [r.getMessage() for r in caplog.records if " weights (" in r.getMessage()]
    return line


def _packed(model: torch.nn.Module) -> bool:
    return any(getattr(m, "quantized", None) is not None for m in model.modules())


def test_bundled_q4_1_file_loads_packed_and_says_why(smollm2_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        model = load_model(smollm2_path, progress=False)
    assert _packed(model)
    assert _choice_line(caplog).endswith("packed weights (weight_format auto: GGUF Q4_1/Q8_0 tensors, "
                                         "packed_gemm_path=auto)")


def test_fp8_deepseek_directory_loads_packed_and_a_float_one_dequantized(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        fp8 = load_model(str(make_tiny("deepseek_v3", tmp_path / "v3", fp8=True)), progress=False)
    assert _packed(fp8) and "packed weights (weight_format auto: fp8 checkpoint" in _choice_line(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        plain = load_model(str(make_tiny("llama", tmp_path / "llama")), progress=False)
    assert not _packed(plain) and _choice_line(caplog).endswith("dequantize weights (weight_format auto: float "
                                                                "checkpoint)")


def _tensor(qtype: Q) -> GGUFTensor:
    return GGUFTensor("blk.0.ffn_up.weight", (64, 8), qtype, np.zeros((8, 1), dtype=np.uint8))


@pytest.mark.parametrize(("options", "device", "reason"), [
    (LoadOptions(dtype=torch.float16), "cpu",
     "dtype torch.float16: the packed GEMMs take float32 or bfloat16 activations"),
    (LoadOptions(), "neuron", "device 'neuron': the packed GEMMs are host C++ kernels"),
    (LoadOptions(host_steps=False), "cpu", "compile_backend=neuron: the packed GEMMs are host C++ kernels"),
])
def test_quantized_gguf_dequantizes_where_packed_cannot_run(options, device, reason):
    choice = choose_for_gguf(options, device, [_tensor(Q.Q4_1)])
    assert (choice.weight_format, choice.reason) == ("dequantize", f"weight_format auto: GGUF Q4_1 but {reason}")


def test_float_gguf_and_explicit_settings_are_kept():
    assert choose_for_gguf(LoadOptions(), "cpu", [_tensor(Q.F32), _tensor(Q.Q6_K)]).weight_format == "dequantize"
    explicit = choose_for_gguf(LoadOptions(weight_format="dequantize"), "cpu", [_tensor(Q.Q4_1)])
    assert (explicit.weight_format, explicit.reason) == ("dequantize", "as set")


def test_auto_passes_validation_where_packed_is_refused():
    assert ModelConfig().weight_format == "auto"
    assert ModelConfig(device="neuron", dtype="float16").weight_format == "auto"
    assert EngineConfig.from_flat({"compile_backend": "neuron"}).model.weight_format == "auto"
    with pytest.raises(ValueError, match="weight_format=packed cannot run with compile_backend=neuron"):
        EngineConfig.from_flat({"weight_format": "packed", "compile_backend": "neuron"})
