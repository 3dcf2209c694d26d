"""Shared fixtures: the real SmolLM2 GGUF, transformers as the oracle, a tiny random Llama written by transformers.

The `slow` mark keeps a test out of `make test-fast` (the inner loop, <= 5 minutes) and in `make test`: multi-rank
engines, SmolLM2 against transformers or compiled, the V4 oracles per config, inductor's codegen, the full graph lint.
Shared code (engine builder, drive loop, oracles, server) is in tests/helpers/; no test imports another."""
from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Rough seconds of the slowest files in `make test` (2-core Xeon, 2026-12-03, both workers busy: the slowest tests
# of that run plus each file's setup and other tests, standalone runs x ~1.5). xdist hands out whole files
# (--dist loadfile) in collection order; these go first, so that the last files a worker picks up are short ones
# (longest first): a slow file handed out last keeps one worker busy while the other idles. A file not listed goes
# after them; a stale number only moves a file in the queue.
HEAVY_FILES = {
    "tests/models/test_deepseek_v4.py": 200, "tests/models/test_deepseek_v41_engine.py": 150,
    "tests/models/test_deepseek_v41_engram.py": 70, "tests/worker/test_context_parallel.py": 180,
    "tests/worker/test_tensor_parallel.py": 170, "tests/neuron/test_graph_lint.py": 160,
    "tests/e2e/test_spec_e2e.py": 150, "tests/models/test_packed_models.py": 140,
    "tests/engine/test_engine_oracle.py": 130, "tests/neuron/test_engine.py": 130,
    "tests/e2e/test_reliability.py": 110, "tests/e2e/test_openai_e2e.py": 100, "tests/e2e/test_triton_e2e.py": 100,
    "tests/kernels/test_head_screen.py": 90, "tests/neuron/test_regions.py": 90,
    "tests/worker/test_kv_fp8_engine.py": 90, "tests/e2e/test_deepseek_e2e.py": 90, "tests/models/test_v4_fp8.py": 70,
    "tests/e2e/test_tensor_parallel_e2e.py": 60, "tests/engine/test_engine.py": 60, "tests/e2e/test_soak.py": 60,
    "tests/models/test_llama_model.py": 60, "tests/e2e/test_packed_e2e.py": 60,
    "tests/e2e/test_model_load_errors.py": 60, "tests/models/test_engram.py": 60,
    "tests/neuron/test_compile_cache.py": 50, "tests/e2e/test_kv_fp8_e2e.py": 50,
    "tests/e2e/test_context_parallel_e2e.py": 40, "tests/e2e/test_limits_e2e.py": 40,
}


def pytest_configure(config):
    # xdist re-sorts the files by their number of tests (most first) unless told not to, which hands the slow
    # few-test files (servers, compiled engines) out last: keep the order pytest_collection_modifyitems gives.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """The listed heavy files first (slowest first), then the rest by number of tests (xdist's own order)."""
    counts = Counter(item.nodeid.split("::")[0] for item in items)

    def key(item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        return -HEAVY_FILES.get(path, 0), -counts[path]
    items.sort(key=key)  # stable: a file's tests stay together and in their own order


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from backend_lib.core.model_path import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2_dir(smollm2_path, request, tmp_path_factory) -> Path:
    """transformers' fp32 reading of the GGUF, converted once for all workers and runs (tests/helpers/hf_smollm2_copy.py)."""
    from tests.helpers.hf_smollm2_copy import hf_smollm2_directory
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: a per-run directory
    root = Path(cache.mkdir("hf_smollm2")) if cache is not None else tmp_path_factory.mktemp("hf_smollm2")
    return hf_smollm2_directory(smollm2_path, root)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(hf_smollm2_dir):
    """transformers' tokenizer from the GGUF file."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(hf_smollm2_dir)


@pytest.fixture(scope="session")
def hf_smollm2(hf_smollm2_dir, hf_smollm2_tokenizer):
    """(model, tokenizer) from transformers, the same GGUF file dequantized to fp32."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_smollm2_dir, dtype=torch.float32).eval()
    return model, hf_smollm2_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, hf_smollm2_tokenizer) -> Path:
    """A tiny random Llama (HF directory) written by transformers, with SmolLM2's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM
    out = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = hf_smollm2_tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def child_worker_pids():
    """A function listing this test process's live worker ranks (the engine's child processes)."""
    def pids() -> list[int]:
        out = subprocess.run(["pgrep", "-f", "-P", str(os.getpid()), "backend_lib.worker.executor.worker"],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    return pids
