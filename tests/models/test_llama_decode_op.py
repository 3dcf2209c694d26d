"""deepinfer::llama_decode_layers (kernels/csrc/llama_decode.cpp): a decode step's decoder layers from one C++ loop
give the module path's results to the bit, on each GEMM path the host picks (blocked kernel, oneDNN packed, plain
F.linear), fp32 and bf16, over an fp8 KV cache too, with n-gram drafts (several query rows a request) and without; steps outside its scope
(prefill chunks) take the module path."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from kernels.cpu_kernels import load_cpu_kernels

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ host kernels did not build")

# A repeated phrase, so the n-gram drafter proposes (and the verifier accepts some) drafts.
PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat", "Count: one two three", "Hello"]


def _run(llm: LLM, use_op: bool) -> tuple[list, list, int]:
    """Token ids and logprobs of the prompts, with the C++ loop on or off; how many steps it served."""
    model = llm.engine.model
    collect = type(model)._host_decode_weights
    served = []

    def weights(num_tokens, meta):
        found = collect(model, num_tokens, meta) if use_op else None
        served.append(found is not None)
        return found

    model._host_decode_weights = weights
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate(PROMPTS, params)
    finally:
        del model._host_decode_weights
    return [o.token_ids for o in outs], [o.logprobs for o in outs], sum(served)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("host_gemm,spec", [("auto", False), ("onednn", False), ("mkl", False), ("auto", True)])
def test_one_op_decode_loop_equals_the_module_path(tiny_llama_dir, dtype, host_gemm, spec):
    flat = {"model": str(tiny_llama_dir), "dtype": dtype, "host_gemm": host_gemm, "max_num_seqs": 4,
            "max_model_len": 256, "enable_prefix_caching": False}
    if spec:
        flat.update(method="ngram", num_speculative_tokens=3)
    with LLM(config=EngineConfig.from_flat(flat)) as llm:
        want_ids, want_logprobs, _ = _run(llm, use_op=False)
        got_ids, got_logprobs, served = _run(llm, use_op=True)
    assert served > 0  # decode steps took the op
    assert got_ids == want_ids
    assert got_logprobs == want_logprobs


def test_op_refuses_mismatched_weight_lists():
    caches = torch.zeros(2, 16, 2, 16)
    with pytest.raises(RuntimeError, match="norms must hold 2 and projections 4 tensors a layer"):
        torch.ops.deepinfer.llama_decode_layers(
            torch.zeros(1, 64), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), caches, caches.clone(),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            1, 16, 0.25, 4, 2, 128, 1e-5, [torch.ones(64)], [], 0)
    with pytest.raises(RuntimeError, match="gemm_path must be 0"):
        torch.ops.deepinfer.llama_decode_layers(
            torch.zeros(1, 64), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), caches, caches.clone(),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            1, 16, 0.25, 4, 2, 128, 1e-5, [torch.ones(64)] * 4, [torch.ones(1)] * 8, 7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_op_decode_loop_over_an_fp8_cache_equals_the_module_path(tiny_llama_dir, dtype):
    flat = {"model": str(tiny_llama_dir), "dtype": dtype, "kv_cache_dtype": "fp8_e4m3", "max_num_seqs": 4,
            "max_model_len": 256, "enable_prefix_caching": False}
    with LLM(config=EngineConfig.from_flat(flat)) as llm:
        assert llm.engine.model.kv_fp8
        want_ids, want_logprobs, _ = _run(llm, use_op=False)
        got_ids, got_logprobs, served = _run(llm, use_op=True)
    assert served > 0
    assert got_ids == want_ids
    assert got_logprobs == want_logprobs
