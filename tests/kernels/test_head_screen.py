"""The screened greedy head (kernels/head_screen.py): its tokens are the full fp32 head's argmax, to the index. And
the engine end to end (SmolLM2 with and without the screens, fp32 and bf16): the same tokens, also under grammar
masks (kernels/masked_head_screen.py) and for the int8 copy's rows (kernels/int8_head_screen.py)."""
import dataclasses
import json

import jsonschema
import pytest
import torch

from kernels.cpu_kernels import load_cpu_kernels
from kernels.gemv import block_weight, blocked_linear, blocked_linear_float
from kernels.head_screen import HeadScreen, screen_coefficient
from kernels.sampling import row_argmax
from tests.helpers.screen_cases import check_ties_and_pads, near_tie_case

# `make test` only (not test-fast): SmolLM2 engines with and without the screened head.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not load_cpu_kernels(), reason="host C++ kernels not built")]


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


PROMPTS = [[{"role": "user", "content": text}] for text in (
    "Name three prime numbers.", "What is the capital of France?", "Write a haiku about rain.",
    "Explain recursion briefly.", "Count from one to ten.", "Say hello in Spanish.", "What is 12 times 12?",
    "List the planets.")]
# (prompts, max_tokens) run on both engines of a dtype. fp32: 8 rows take the bf16 copy, one stream the int8 copy
# (where the CPU has VNNI). bf16: 8 rows (past the int8 copy's 4) the head's fused argmax (blocked_linear_argmax),
# 3 rows and one stream the int8 copy.
WORKLOADS = {"float32": [(PROMPTS, 24), (PROMPTS[:1], 24)],
             "bfloat16": [(PROMPTS, 8), ([PROMPTS[0], PROMPTS[2], PROMPTS[3]], 24), (PROMPTS[:1], 24)]}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def screen_pair(request, smollm2_path):
    """(dtype, {screened: LLM}): SmolLM2 with the greedy head screen and without, up to 8 rows. One dtype's pair at a
    time (pytest closes it before the next param's), shared by the tests below instead of an engine pair each."""
    from backend_lib.core.config import EngineConfig
    from backend_lib.engine.offline import LLM

    llms = {screened: LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 256, "max_num_seqs": 8,
                                                          "weight_format": "dequantize", "dtype": request.param,
                                                          "greedy_head_screen": screened}))
            for screened in (True, False)}
    yield request.param, llms
    for llm in llms.values():
        llm.close()


def test_the_engine_s_greedy_tokens_are_the_same_with_and_without_the_screen(screen_pair, smollm2_path):
    """The screened engine's tokens are the full head's, for each dtype's row counts (WORKLOADS). fp32: a row asking
    for logprobs takes the full logits (and gets them) beside screened ones, and n-gram speculation verifies its
    drafts from the screened tokens (greedy_verify): the same continuations."""
    from backend_lib.core.config import EngineConfig
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.offline import LLM
    from kernels.int8_head_screen import Int8HeadScreen

    dtype, llms = screen_pair
    tokens = {}
    for screened, llm in llms.items():
        model = llm.engine.model
        if dtype == "float32":
            assert (model.head_screen is not None) == screened
        else:
            assert model.greedy_argmax == screened
        assert (model.int8_screen is not None) == (screened and Int8HeadScreen.supported())
        tokens[screened] = [[r.token_ids for r in llm.generate(prompts, SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True))] for prompts, n in WORKLOADS[dtype]]
    assert tokens[True] == tokens[False]
    if dtype != "float32":
        return
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    results = llms[True].generate(PROMPTS[:2], [with_logprobs, greedy])
    assert len(results[0].logprobs) == 8 and not results[1].logprobs
    assert results[0].token_ids == tokens[True][0][0][:8] and results[1].token_ids == tokens[True][0][1]
    ngram = LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 256, "max_num_seqs": 8,
                                               "weight_format": "dequantize", "method": "ngram",
                                               "num_speculative_tokens": 4}))
    assert ngram.engine.model.head_screen is not None
    assert [r.token_ids for r in ngram.generate(PROMPTS, greedy)] == tokens[False][0]
    ngram.close()


def test_rows_a_screen_gives_up_on_take_the_whole_heads_argmax(screen_pair):
    """A screen that returns None (here: no candidate tile allowed; in use: a value not finite, too many candidates)
    hands its rows to the fused head argmax, not to the logits and the sampler: the same tokens."""
    from kernels.int8_head_screen import Int8HeadScreen

    if not Int8HeadScreen.supported():
        pytest.skip("the int8 screen needs AVX-512 VNNI")
    _, llms = screen_pair
    model = llms[True].engine.model
    kept = model.int8_screen
    model.int8_screen = dataclasses.replace(kept, gather_limit=0.0)
    try:
        torch.manual_seed(3)
        hidden = (3 * torch.randn(2, model.norm.weight.shape[0])).to(model.norm.weight.dtype)  # [2, hidden]
        assert model.int8_screen.argmax(hidden, model.screen_int8_blocked_head, model.blocked_head) is None
        hidden[1, 0] = float("nan")  # a NaN row's argmax is its first NaN logit, as row_argmax gives
        assert torch.equal(model.greedy_token_ids(hidden), row_argmax(model.compute_logits(hidden)))
    finally:
        model.int8_screen = kept  # the engine is shared with the other tests of this dtype


@pytest.mark.parametrize("screen_pair", ["float32"], indirect=True)  # the fp32 pair of the fixture's two
def test_a_smollm2_batch_mixing_json_and_free_rows_gives_the_unscreened_tokens(screen_pair):
    """Greedy rows under a JSON schema beside free greedy rows, 8 and 3 streams (the bf16 copy's and the int8 copy's
    row counts), with the screens and without them (every logit, masked, argmax): the same tokens, every
    constrained output valid."""
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.structured_output.constraints import parse_constraint

    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    constraint = parse_constraint({"structured_outputs": {"json": person}})
    topics = ["a sailor", "a baker", "a pilot", "a painter", "a doctor", "a farmer", "a poet", "a chef"]
    prompts = [[{"role": "user", "content": f"Describe {t} as JSON with a name and an age."}] for t in topics]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=constraint if i % 4 else None,
                             ignore_eos=not i % 4) for i in range(len(prompts))]
    _, llms = screen_pair
    tokens = {}
    for screened, llm in llms.items():
        assert (llm.engine.model.head_screen is not None) == screened
        tokens[screened] = [r.token_ids for r in llm.generate(prompts, params)]
        tokens[screened] += [r.token_ids for r in llm.generate(prompts[:3], params[:3])]
        if screened:
            for result, p in zip(llm.generate(prompts[1:4], params[1:4]), params[1:4]):
                jsonschema.validate(json.loads(result.text), person)
    assert tokens[True] == tokens[False]
