"""The screened greedy head under grammar masks (kernels/masked_head_screen.py): each row's token is the argmax of the
full head's logits masked by its bitmask (the structured-output path it replaces), to the index: both screens (the
int8 copy for a few rows, the bf16 copy of an fp32 head past them), sparse and dense masks, free rows (all ones),
near-ties the cheap copies get wrong, ties, a mask that hides the unmasked winner; None where the full path must
run. End to end (a SmolLM2 batch mixing JSON-schema and free rows gives the same tokens with and without the
screens): tests/kernels/test_head_screen.py, on its engine pair."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu_kernels import load_cpu_kernels
from kernels.gemv import block_weight, blocked_linear_float
from kernels.grammar_mask import FULL_WORD, apply_bitmask_reference, bitmask_width
from kernels.head_screen import HeadScreen
from kernels.int8_head_screen import Int8HeadScreen
from kernels.masked_head_screen import ScreenedHead, masked_greedy_tokens
from kernels.sampling import row_argmax
from tests.helpers.screen_cases import near_tie_case

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="host C++ kernels not built")


def _head(weight: torch.Tensor, screens: str) -> ScreenedHead:
    """``screens``: "both" (as an fp32 model holds them), "int8" or "bf16" (one of them only)."""
    vocab = weight.shape[0]
    head = ScreenedHead(block_weight(weight), vocab)
    if screens in ("both", "bf16") and weight.dtype == torch.float32:
        if not HeadScreen.supported():
            pytest.skip("no AVX2: no bf16-copy screen")
        head = dataclasses.replace(head, head_screen=HeadScreen.of(weight), approx_head=HeadScreen.approx_head(weight))
    if screens in ("both", "int8"):
        if not Int8HeadScreen.supported():
            pytest.skip("no AVX-512 VNNI: no int8 screen")
        screen, int8_head = Int8HeadScreen.build(weight)
        head = dataclasses.replace(head, int8_screen=screen, int8_head=int8_head)
    return head


def _masked_argmax(x: torch.Tensor, head: ScreenedHead, bitmask: torch.Tensor) -> torch.Tensor:
    """What the structured-output path computed before: every logit, masked, then the argmax."""
    logits = blocked_linear_float(x, head.exact_head, head.vocab_size)
    return row_argmax(apply_bitmask_reference(logits, bitmask))


def _random_mask(rows: int, vocab: int, density: float, generator: torch.Generator) -> torch.Tensor:
    allowed = torch.rand(rows, vocab, generator=generator) < density
    allowed[torch.arange(rows), torch.randint(vocab, (rows,), generator=generator)] = True  # never empty
    return _pack(allowed)


def _pack(allowed: torch.Tensor) -> torch.Tensor:  # [rows, V] bool -> [rows, ceil(V/32)] int32
    rows, vocab = allowed.shape
    padded = torch.nn.functional.pad(allowed, (0, 32 * bitmask_width(vocab) - vocab)).view(rows, -1, 32)
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = (padded.long() * weights).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@pytest.mark.parametrize("screens", ["both", "int8", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 6, 32])
def test_masked_tokens_equal_the_masked_full_heads_argmax(screens, dtype, rows):
    if screens == "bf16" and dtype == torch.bfloat16:
        pytest.skip("the bf16 copy screens fp32 heads only")
    generator = torch.Generator().manual_seed(rows)
    vocab, width = 3000, 256
    weight = (torch.randn(vocab, width, generator=generator) / width ** 0.5).to(dtype)
    head = _head(weight, screens)
    served = 0
    for density in (0.002, 0.05, 0.5, 1.0):
        for scale in (1.0, 8.0):
            x = (scale * torch.randn(rows, width, generator=generator)).to(dtype)
            bitmask = _random_mask(rows, vocab, density, generator)
            bitmask[0] = FULL_WORD  # a free row beside constrained ones
            tokens = masked_greedy_tokens(x, bitmask, head)
            if tokens is None:  # no screen serves these rows (int8 alone past its rows)
                continue
            served += 1
            assert torch.equal(tokens, _masked_argmax(x, head, bitmask)), (density, scale)
    int8_rows = 6 if dtype == torch.float32 else 4
    serves = (screens != "int8" and dtype == torch.float32) or (screens != "bf16" and rows <= int8_rows)
    assert (served > 0) == serves


@pytest.mark.parametrize("screens", ["int8", "bf16"])
def test_near_ties_and_a_mask_that_hides_the_winner(screens):
    """Near-ties the cheap copies get wrong: masking each row's unmasked winner (and every other near-tie column in
    turn) still gives the exact argmax of what is left."""
    weight, rows = near_tie_case(spread=1e-3 if screens == "int8" else 1e-4)
    head = _head(weight, screens)
    vocab = weight.shape[0]
    for x in rows[:16]:
        allowed = torch.ones(1, vocab, dtype=torch.bool)
        for _ in range(4):
            bitmask = _pack(allowed)
            expected = _masked_argmax(x, head, bitmask)
            assert torch.equal(masked_greedy_tokens(x, bitmask, head), expected)
            allowed[0, expected] = False  # hide the winner: the next best near-tie must come out


@pytest.mark.parametrize("screens", ["int8", "bf16"])
def test_ties_go_to_the_first_allowed_index_and_pads_never_win(screens):
    torch.manual_seed(1)
    width, vocab = 64, 50  # 4 tiles, the last holding 2 columns and 14 zero pads
    weight = torch.randn(vocab, width) * 0.1
    weight[49] = weight[3] = weight[20] = torch.randn(width)  # an exact three-way tie, the larger logits
    head = _head(weight, screens)
    if screens == "int8":  # 4 tiles: let the screen gather them all
        head = dataclasses.replace(head, int8_screen=dataclasses.replace(head.int8_screen, gather_limit=1.0))
    else:
        head = dataclasses.replace(head, gather_limit=1.0)
    x = weight[3][None, :].clone()
    allowed = torch.ones(1, vocab, dtype=torch.bool)
    assert masked_greedy_tokens(x, _pack(allowed), head).tolist() == [3]
    allowed[0, 3] = False
    assert masked_greedy_tokens(x, _pack(allowed), head).tolist() == [20]
    allowed[0, 20] = False
    assert masked_greedy_tokens(x, _pack(allowed), head).tolist() == [49]
    # every logit negative and only the last tile's columns allowed: its zero pads must not win
    x = -x
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, 48:] = True
    expected = _masked_argmax(x, head, _pack(allowed))
    assert masked_greedy_tokens(x, _pack(allowed), head).tolist() == expected.tolist()
    assert expected.item() in (48, 49)


@pytest.mark.parametrize("screens", ["int8", "bf16"])
def test_rows_the_full_path_must_take_give_none(screens):
    torch.manual_seed(2)
    vocab, width = 500, 64
    weight = torch.randn(vocab, width) / width ** 0.5
    head = _head(weight, screens)
    x = torch.randn(2, width)
    bitmask = torch.full((2, bitmask_width(vocab)), FULL_WORD, dtype=torch.int32)
    assert masked_greedy_tokens(x, bitmask, head) is not None
    empty = bitmask.clone()
    empty[1] = 0  # a row with no allowed token: the full path's argmax of all -inf is column 0
    assert masked_greedy_tokens(x, empty, head) is None
    nan = x.clone()
    nan[1, 0] = float("nan")
    assert masked_greedy_tokens(nan, bitmask, head) is None
    assert masked_greedy_tokens(x, bitmask[:1], head) is None  # a bitmask that does not cover the rows
    narrow = (dataclasses.replace(head, int8_screen=dataclasses.replace(head.int8_screen, gather_limit=0.0))
              if screens == "int8" else dataclasses.replace(head, gather_limit=0.0))
    assert masked_greedy_tokens(x, bitmask, narrow) is None  # too many candidate tiles
