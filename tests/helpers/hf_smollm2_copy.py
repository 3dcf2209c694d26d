"""transformers' own reading of the SmolLM2 GGUF, converted once and kept as a plain fp32 HF directory.

transformers dequantizes a GGUF in Python (~45 s for SmolLM2 on 2 cores, the tokenizer alone ~7 s), and every
pytest worker that needs the oracle paid it. The first worker converts and saves under pytest's cache directory;
the others (and later runs) wait on a file lock and load the saved copy in about a second. The saved weights are
exactly the dequantized tensors transformers produced (fp32, safetensors), so the oracle is unchanged.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from filelock import FileLock


def _key(gguf_path: str) -> str:
    import transformers
    stat = os.stat(gguf_path)
    return f"{os.path.basename(gguf_path)}-{stat.st_size}-{int(stat.st_mtime)}-tf{transformers.__version__}"


def _convert(gguf_path: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    state = model.state_dict()
    if any(v.dtype != torch.float32 for v in state.values()):
        raise RuntimeError("transformers did not dequantize every GGUF tensor to fp32")
    config = model.config
    if hasattr(config, "quantization_config"):  # a GGUF load is marked quantized though its weights are dense fp32
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain.load_state_dict(state, strict=True)
    plain.generation_config = model.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def hf_smollm2_directory(gguf_path: str, cache_root: Path) -> Path:
    """The converted directory for ``gguf_path`` under ``cache_root``, converting it first if no worker has."""
    cache_root.mkdir(parents=True, exist_ok=True)
    final = cache_root / _key(gguf_path)
    with FileLock(str(final) + ".lock"):
        if not (final / "config.json").exists():
            partial = cache_root / (final.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            _convert(gguf_path, partial)
            partial.rename(final)
    return final
