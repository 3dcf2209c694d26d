"""An engine build decides the platform once per rank and hands that one object to everything below it."""
import ast
from pathlib import Path

from backend_lib.core.config import EngineConfig
from backend_lib.models.parallel import ParallelContext
from backend_lib.neuron.platform import detect_platform
from backend_lib.worker.executor.rank import build_rank

ROOT = Path(__file__).resolve().parents[2]


def test_a_rank_detects_the_platform_once_and_its_kv_cache_uses_that_one(tiny_llama_dir):
    # A limit the process environment does not set: the KV records can only have it from the detected platform.
    calls = []

    def detect(**kwargs):
        calls.append(kwargs)
        return detect_platform({"DEEPINFER_NEURON_FP8_MAX": "200"}, neuron_importable=False, **kwargs)

    config = EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 64, "num_blocks": 8,
                                     "max_num_seqs": 2, "kv_cache_dtype": "fp8_e4m3"})
    state = build_rank(config, ParallelContext(), detect=detect)
    assert calls == [{"device": "cpu"}]
    assert state.runner.platform.kv_fp8_max == 200.0
    assert {layer.self_attn.kv_quant.fp8_max for layer in state.model.layers} == {200.0}


def test_only_the_rank_build_calls_detect_platform():
    callers = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted((ROOT / "backend_lib").rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Name) and node.id == "detect_platform" and isinstance(node.ctx, ast.Load)]
    assert callers and all(c.startswith("backend_lib/worker/executor/rank.py") for c in callers), callers
