"""vLLM CPU on the shared workload with benchmarks/structured_schema.py's JSON schema, and without it: the peer of
benchmarks/structured.py, run by it in the same sitting. Runs in the anchor's venv, through
/tmp/anchors/run_vllm_anchor.sh (../shared/bench/anchors/setup.sh makes it); prints one JSON line per run:
generated tokens, seconds, tokens/s, and how many outputs parse as JSON.
Usage: run_vllm_anchor.sh benchmarks/vllm_structured.py WORKLOAD_PY [MAX_NUM_SEQS]"""
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_schema import SCHEMA  # noqa: E402


def structured_params(schema: dict):
    """vLLM's structured-output request field (``structured_outputs`` since 0.11, ``guided_decoding`` before)."""
    try:
        from vllm.sampling_params import StructuredOutputsParams
        return {"structured_outputs": StructuredOutputsParams(json=schema)}
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams
        return {"guided_decoding": GuidedDecodingParams(json=schema)}


def main() -> None:
    spec = importlib.util.spec_from_file_location("workload", sys.argv[1])
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    from vllm import LLM, SamplingParams
    llm = LLM(model="/tmp/anchors/models/smollm2-hf", dtype="float32", max_model_len=2048, max_num_seqs=seqs)
    prompts = workload.prompts()
    for constrained in (False, True):
        extra = structured_params(SCHEMA) if constrained else {}
        params = SamplingParams(temperature=0, max_tokens=workload.NEW_TOKENS, ignore_eos=not constrained, **extra)
        llm.chat(prompts[:2], params, use_tqdm=False)  # warm-up (the grammar backend's first compile included)
        start = time.time()
        outs = llm.chat(prompts, params, use_tqdm=False)
        seconds = time.time() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        valid = 0
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += 1
            except ValueError:
                pass
        print(json.dumps({"engine": "vllm-cpu", "constrained": constrained, "max_num_seqs": seqs, "tokens": tokens,
                          "seconds": round(seconds, 2), "tok_s": round(tokens / seconds, 1), "valid_json": valid}),
              flush=True)


if __name__ == "__main__":
    main()
