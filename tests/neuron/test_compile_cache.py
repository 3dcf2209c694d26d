"""The compiled engine's persistent compile cache (backend_lib/neuron/compile_cache.py) and the buckets it compiles.

The start-up test runs two engine starts in fresh processes on one cache directory (inductor, a tiny Llama on the
host's packed GEMM: the graphs that used to bypass the cache) and checks the second one loads every graph from the
cache and gives the same greedy ids as the first and as the eager engine.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend_lib.core.config import CompileConfig, EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from backend_lib.neuron.buckets import BucketSpec
from backend_lib.neuron.compile_cache import (INDUCTOR_ENV, NEURON_CC_FLAGS_ENV, NEURON_ENV,
                                                      compile_cache_scope, resolve_cache_dir)
from backend_lib.neuron.platform import Platform
from kernels.onednn_gemm import PackedWeight, onednn_gemm_available

ROOT = Path(__file__).resolve().parents[2]
HOST = Platform("cpu", "inductor", False, (), fp8_max=448.0, kv_fp8_max=448.0)
NEURON = Platform("neuron", "neuron", False, (0,), fp8_max=240.0, kv_fp8_max=224.0)
PROMPT = [5, 17, 3, 42, 8, 9]
NEW_TOKENS = 6

# One engine start: prints its greedy ids and what the AOTAutograd cache did during the warm-up.
CHILD = """
import json, sys
from backend_lib.core.config import EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
llm = LLM(config=EngineConfig.from_flat(json.loads(sys.argv[1])))
ids = llm.generate([json.loads(sys.argv[2])], SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0,
                                                              ignore_eos=True))[0].token_ids
model = llm.engine.runner.model
print("RESULT " + json.dumps({"ids": ids, "hits": model.stats.cache.hits, "misses": model.stats.cache.misses,
                              "bypasses": model.stats.cache.bypasses, "compiled_steps": model.stats.compiled_steps}))
"""


def _flat(model_dir: Path, **extra) -> dict:
    # 32-token contexts in 16-token blocks: one decode graph (1 row, 2 blocks), its lm_head, the greedy sampler.
    return {"model": str(model_dir), "num_blocks": 8, "max_num_seqs": 1, "max_model_len": 32,
            "max_num_batched_tokens": 32, "num_threads": 1, **extra}


def _start(flat: dict) -> dict:
    # Scalar C++ kernels: the cache works the same, and gcc compiles them faster than the AVX-512 ones.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "0"}
    env.pop(INDUCTOR_ENV, None)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(flat), json.dumps(PROMPT), str(NEW_TOKENS)],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow  # two inductor starts; the cold one runs gcc on three graphs
@pytest.mark.timeout(1800)  # minutes when the 2 cores are shared with other jobs
@pytest.mark.skipif(not onednn_gemm_available(torch.device("cpu"), torch.float32), reason="needs oneDNN")
def test_second_start_loads_every_graph_from_the_cache_and_gives_the_same_ids(tmp_path):
    model_dir = make_tiny("llama", tmp_path / "tiny", seed=1)
    flat = _flat(model_dir, compile_backend="inductor", batch_buckets="1", width_buckets="2",
                 compile_cache_dir=str(tmp_path / "cache"), compile_progress=False)
    cold = _start(flat)
    warm = _start(flat)
    with LLM(config=EngineConfig.from_flat(_flat(model_dir))) as llm:
        eager = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                      ignore_eos=True))[0].token_ids
    # decode + lm_head + greedy sampler; none bypasses the cache (the packed GEMM's opaque weight used to)
    assert (cold["hits"], cold["misses"], cold["bypasses"]) == (0, 3, 0)
    assert (warm["hits"], warm["misses"], warm["bypasses"]) == (3, 0, 0)
    assert cold["compiled_steps"] == warm["compiled_steps"] >= NEW_TOKENS - 1
    assert cold["ids"] == warm["ids"] == eager
    assert any((tmp_path / "cache" / "inductor").iterdir())


def test_cache_dir_precedence_config_then_environment_then_per_user_default(tmp_path):
    env = {"HOME": str(tmp_path / "home"), INDUCTOR_ENV: "/srv/inductor", NEURON_ENV: "s3://bucket/neff"}
    assert resolve_cache_dir(str(tmp_path / "c"), HOST, env).path == str(tmp_path / "c" / "inductor")
    assert resolve_cache_dir("", HOST, env).path == "/srv/inductor"
    assert resolve_cache_dir("", NEURON, env).path == "s3://bucket/neff"
    assert resolve_cache_dir("", NEURON, {**env, NEURON_CC_FLAGS_ENV: "-O1 --cache_dir=/n"}).path == "/n"
    assert resolve_cache_dir("", HOST, {"XDG_CACHE_HOME": "/x"}).path == "/x/deepinfer/compile/inductor"
    default = resolve_cache_dir("", NEURON, {"HOME": "/h"})
    assert default.owned and default.path.endswith(os.path.join("deepinfer", "compile", "neuron"))
    with pytest.raises(ValueError, match="compile_cache_dir.*conflicts with --cache_dir"):
        resolve_cache_dir("/a", NEURON, {NEURON_CC_FLAGS_ENV: "--cache_dir /n"})


def test_inductor_cache_dir_is_scoped_to_the_compile(tmp_path, monkeypatch):
    monkeypatch.setenv(INDUCTOR_ENV, str(tmp_path / "theirs"))
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    with compile_cache_scope(str(tmp_path / "ours"), HOST, "inductor") as cache:
        assert cache_dir() == cache.path == str(tmp_path / "ours" / "inductor")
    assert os.environ[INDUCTOR_ENV] == str(tmp_path / "theirs")
    with compile_cache_scope(str(tmp_path / "ours"), HOST, "aot_eager") as cache:
        assert cache is None


def test_unwritable_cache_dir_fails_naming_the_setting(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="compile_cache_dir: cannot create"):
        with compile_cache_scope(str(blocker), HOST, "inductor"):
            pass
    with pytest.raises(ValueError, match="compile_sampler_variants"):
        CompileConfig(compile_sampler_variants="some")


def test_buckets_past_what_the_scheduler_produces_are_refused():
    spec = BucketSpec.build(max_num_seqs=24, max_model_len=300, block_size=16)
    assert spec.batch_sizes == (1, 2, 4, 8, 16, 24) and spec.block_table_widths == (8, 16, 19)
    for kwargs, field in (({"batch_sizes": (1, 32)}, "batch_buckets"), ({"block_table_widths": (8, 20)},
                          "width_buckets"), ({"prefill_lengths": (512,)}, "prefill_buckets")):
        with pytest.raises(ValueError, match=field):
            BucketSpec.build(max_num_seqs=24, max_model_len=300, block_size=16, **kwargs)


def test_packed_weight_pickles_to_a_stable_key_and_never_unpickles():
    weight = torch.randn(8, 4)
    if not onednn_gemm_available(weight.device, weight.dtype):
        pytest.skip("needs oneDNN")
    a, b = pickle.dumps(PackedWeight(weight)), pickle.dumps(PackedWeight(torch.randn(8, 4)))
    assert a == b  # a graph input's key: its shape and dtype, not its values
    with pytest.raises(TypeError, match="cannot be unpickled"):
        pickle.loads(a)
