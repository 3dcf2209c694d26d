"""The screened greedy head (kernels/head_screen.py): its tokens are the full fp32 head's argmax, to the index."""
import dataclasses

import pytest
import torch

from kernels.cpu_kernels import load_cpu_kernels
from kernels.gemv import block_weight, blocked_linear, blocked_linear_float
from kernels.head_screen import HeadScreen, screen_coefficient
from kernels.sampling import row_argmax
from tests.screen_cases import check_ties_and_pads, near_tie_case

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="host C++ kernels not built")


class Screened:
    """A head with its screen and both blocked layouts, as the model holds them."""

    def __init__(self, weight: torch.Tensor, screen: HeadScreen | None = None) -> None:
        self.screen = screen or HeadScreen.of(weight)
        self.approx_head, self.exact_head = HeadScreen.approx_head(weight), block_weight(weight)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.screen.argmax(x, self.approx_head, self.exact_head)

    def full_argmax(self, x: torch.Tensor) -> torch.Tensor:
        return row_argmax(blocked_linear(x, self.exact_head, None, self.screen.vocab_size))


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("vocab,width", [(4096, 576), (1000, 64), (37, 100)])
def test_screened_tokens_equal_the_full_heads_argmax(rows, vocab, width):
    torch.manual_seed(vocab + rows)
    weight = torch.randn(vocab, width) / width ** 0.5
    screen = Screened(weight)
    for scale in (1.0, 8.0, 0.01):
        x = scale * torch.randn(rows, width)
        assert torch.equal(screen.argmax(x), screen.full_argmax(x))


def test_near_ties_the_bf16_head_gets_wrong_are_still_exact():
    weight, rows = near_tie_case()
    screen = Screened(weight)
    wrong_cheap = sum(int(row_argmax(blocked_linear_float(x.to(torch.bfloat16), screen.approx_head, 4096)) !=
                          screen.full_argmax(x)) for x in rows)
    assert wrong_cheap >= 8  # the case is a hard one
    assert all(torch.equal(screen.argmax(x), screen.full_argmax(x)) for x in rows)
    # and the bound is what makes it exact: one far below the errors keeps the wrong columns alone
    tight = Screened(weight, dataclasses.replace(screen.screen, coefficient=screen.screen.coefficient * 1e-6))
    assert not all(torch.equal(tight.argmax(x), tight.full_argmax(x)) for x in rows)


def test_ties_go_to_the_first_index_and_the_last_partial_tile_counts():
    check_ties_and_pads(Screened)


def test_non_finite_rows_fall_back_to_the_full_head():
    weight = torch.randn(64, 32)
    screen = Screened(weight)
    x = torch.randn(2, 32)
    x[1, 5] = float("nan")
    assert screen.argmax(x) is None
    x[1, 5] = 1e37  # bounds past 1e30: logits near fp32's range, the rounding argument no longer safe
    assert screen.argmax(x) is None
    x[1, 5] = 1e20  # large but far from it: screened, and exact
    assert torch.equal(screen.argmax(x), screen.full_argmax(x))


def test_the_bound_holds():
    torch.manual_seed(2)
    width, vocab = 576, 4096
    weight = torch.randn(vocab, width) / width ** 0.5
    screen = Screened(weight)
    x = 3 * torch.randn(32, width)
    exact = blocked_linear(x, screen.exact_head, None, vocab)
    approx = blocked_linear_float(x.to(torch.bfloat16), screen.approx_head, vocab)
    ratio = (exact - approx).abs() / (x.norm(dim=1)[:, None] * screen.screen.row_norms[None, :])
    assert 0 < ratio.max() <= screen.screen.coefficient


def test_the_engine_s_greedy_tokens_are_the_same_with_and_without_the_screen(smollm2_path):
    """SmolLM2 fp32, a batch of 8 (the bf16 copy) and one stream (the int8 copy where the CPU has VNNI): the
    screened engine's tokens are the full head's; a row asking for logprobs takes the full logits (and gets them)
    beside screened ones. Then bf16 at 8 rows (the fused argmax)."""
    from backend_lib.core.config import EngineConfig
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.offline import LLM
    from kernels.int8_head_screen import Int8HeadScreen

    prompts = [[{"role": "user", "content": text}] for text in (
        "Name three prime numbers.", "What is the capital of France?", "Write a haiku about rain.",
        "Explain recursion briefly.", "Count from one to ten.", "Say hello in Spanish.", "What is 12 times 12?",
        "List the planets.")]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for screened in (True, False):
        llm = LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 256, "max_num_seqs": 8,
                                                 "greedy_head_screen": screened}))
        assert (llm.engine.model.head_screen is not None) == screened
        assert (llm.engine.model.int8_screen is not None) == (screened and Int8HeadScreen.supported())
        tokens[screened] = [r.token_ids for r in llm.generate(prompts, greedy)]
        tokens[screened].append(llm.generate(prompts[:1], greedy)[0].token_ids)
        if screened:
            with_logprobs = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
            results = llm.generate(prompts[:2], [with_logprobs, greedy])
            assert len(results[0].logprobs) == 8 and not results[1].logprobs
            assert results[0].token_ids == tokens[True][0][:8] and results[1].token_ids == tokens[True][1]
        llm.close()
    assert tokens[True] == tokens[False]
    # n-gram speculation verifies its drafts from the screened tokens too (greedy_verify): the same continuations
    ngram = LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 256, "max_num_seqs": 8,
                                               "method": "ngram", "num_speculative_tokens": 4}))
    assert ngram.engine.model.head_screen is not None
    assert [r.token_ids for r in ngram.generate(prompts, greedy)] == tokens[False][:-1]
    ngram.close()
    # bf16, 8 rows: past the int8 copy's 4, the head's fused argmax (blocked_linear_argmax) gives the tokens
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    bf16_tokens = {}
    for screened in (True, False):
        llm = LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 256, "max_num_seqs": 8,
                                                 "dtype": "bfloat16", "greedy_head_screen": screened}))
        assert llm.engine.model.greedy_argmax == screened
        bf16_tokens[screened] = [r.token_ids for r in llm.generate(prompts, short)]
        llm.close()
    assert bf16_tokens[True] == bf16_tokens[False]
