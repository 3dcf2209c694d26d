"""Shared fixtures: the real SmolLM2 GGUF, transformers as the oracle, a tiny random Llama written by transformers."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from backend_lib.core.model_path import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    """transformers' tokenizer from the GGUF file (its conversion takes ~7 s: once per pytest worker)."""
    from transformers import AutoTokenizer
    directory, name = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path, hf_smollm2_tokenizer):
    """(model, tokenizer) from transformers, loading the same GGUF file in fp32."""
    from transformers import AutoModelForCausalLM
    directory, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
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


def hf_greedy(model, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers greedy decoding with EOS ignored; returns the tokens and each one's logprob."""
    ids = torch.tensor([input_ids])
    past = None
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(torch.argmax(logp))
            tokens.append(token)
            logprobs.append(float(logp[token]))
            ids = torch.tensor([[token]])
    return tokens, logprobs


@pytest.fixture
def child_worker_pids():
    """A function listing this test process's live worker ranks (the engine's child processes)."""
    def pids() -> list[int]:
        out = subprocess.run(["pgrep", "-f", "-P", str(os.getpid()), "backend_lib.worker.executor.worker"],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    return pids
