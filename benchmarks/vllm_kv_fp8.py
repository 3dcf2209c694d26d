"""vLLM CPU's greedy continuations of the shared workload with its default KV cache and with
``kv_cache_dtype=fp8_e4m3``: the peer of benchmarks/kv_fp8.py's agreement section, run by it in the same sitting.
Runs in the anchor's venv, through /tmp/anchors/run_vllm_anchor.sh (../shared/bench/anchors/setup.sh makes it);
prints one JSON line per cache: the dtype, the cache, and each prompt's token ids and chosen-token logprobs.
Usage: run_vllm_anchor.sh benchmarks/vllm_kv_fp8.py WORKLOAD_PY MODEL_DIR DTYPE NEW_TOKENS"""
import importlib.util
import json
import sys


def continuations(model: str, dtype: str, kv: str, prompts: list, new_tokens: int) -> list[dict]:
    from vllm import LLM, SamplingParams
    extra = {} if kv == "auto" else {"kv_cache_dtype": kv}
    # Prefix caching off: the workload repeats prompts, and a shared block would be read, not recomputed.
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=32, enable_prefix_caching=False, **extra)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outs = llm.chat(prompts, params, use_tqdm=False)
    rows = []
    for out in outs:
        done = out.outputs[0]
        chosen = [step[token].logprob for token, step in zip(done.token_ids, done.logprobs)]
        rows.append({"token_ids": list(done.token_ids), "logprobs": chosen})
    return rows


def main() -> None:
    workload_path, model, dtype, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    spec = importlib.util.spec_from_file_location("workload", workload_path)
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    for kv in ("auto", "fp8_e4m3"):
        rows = continuations(model, dtype, kv, workload.prompts(), new_tokens)
        print(json.dumps({"engine": "vllm-cpu", "dtype": dtype, "kv_cache_dtype": kv, "outputs": rows}), flush=True)


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard keeps it from re-running main
    main()
