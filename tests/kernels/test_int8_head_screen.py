"""The int8-screened greedy head (kernels/int8_head_screen.py): its tokens are the full head's argmax, to the index,
for fp32 and bf16 heads. The engine runs through it (fp32 and bf16 SmolLM2): tests/kernels/test_head_screen.py."""
import dataclasses

import pytest
import torch

from kernels.cpu_kernels import load_cpu_kernels
from kernels.gemv import block_weight, blocked_linear_float
from kernels.int8_head_screen import Int8HeadScreen, quantize_rows, x_levels
from kernels.sampling import row_argmax
from tests.helpers.screen_cases import check_ties_and_pads, near_tie_case

pytestmark = [pytest.mark.skipif(not load_cpu_kernels(), reason="host C++ kernels not built"),
              pytest.mark.skipif(load_cpu_kernels() and not Int8HeadScreen.supported(),
                                 reason="the int8 screen needs AVX-512 VNNI")]
DTYPES = [torch.float32, torch.bfloat16]


class Screened:
    """A head with its int8 screen and its blocked layout, as the model holds them; the screen gathers any number
    of candidate tiles (random heads have no clear winner: many candidates) unless ``gather_limit`` says."""

    def __init__(self, weight: torch.Tensor, gather_limit: float = 1.0) -> None:
        screen, self.int8_head = Int8HeadScreen.build(weight, chunk_rows=1000)
        self.screen = dataclasses.replace(screen, gather_limit=gather_limit)
        self.exact_head, self.vocab = block_weight(weight), weight.shape[0]

    def argmax(self, x: torch.Tensor, screen: Int8HeadScreen | None = None) -> torch.Tensor | None:
        return (screen or self.screen).argmax(x, self.int8_head, self.exact_head)

    def full_argmax(self, x: torch.Tensor) -> torch.Tensor:
        return row_argmax(blocked_linear_float(x, self.exact_head, self.vocab))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("vocab,width", [(4096, 576), (1000, 64), (37, 101)])
def test_screened_tokens_equal_the_full_heads_argmax(dtype, rows, vocab, width):
    torch.manual_seed(vocab + rows)
    weight = (torch.randn(vocab, width) / width ** 0.5).to(dtype)
    screen = Screened(weight)
    for scale in (1.0, 8.0, 0.01):
        x = (scale * torch.randn(rows, width)).to(dtype)
        assert torch.equal(screen.argmax(x), screen.full_argmax(x))


def test_the_int8_pass_is_exact_integer_arithmetic():
    """x to int16 levels, W to int8 per row: the kernel's sums are integers, so a torch reference matches bitwise."""
    torch.manual_seed(5)
    vocab, width = 200, 75  # a partial column group and an odd width
    weight = torch.randn(vocab, width)
    screen, int8_head = Int8HeadScreen.build(weight)
    q, scales = quantize_rows(weight)
    x = 4 * torch.randn(3, width)
    step = x.abs().amax(dim=1) / screen.levels  # fp32, as the kernel divides
    xq = torch.round(x / step[:, None])
    sums = (xq.double() @ q.double().T).float()  # |sums| < 2^24 here: exact in fp32 too
    want = sums * step[:, None] * scales[None, :]
    got = torch.ops.deepinfer.int8_head_logits(x, int8_head, screen.scales, vocab, screen.levels)
    assert torch.equal(got, want)
    # the plain loop (CPUs without VNNI) gives the same integers
    plain = torch.ops.deepinfer.int8_head_logits(x, int8_head, screen.scales, vocab, screen.levels, "plain")
    assert torch.equal(plain, want)


def test_x_levels_keep_int32_sums_from_overflowing():
    assert x_levels(576) == 16383
    wide = x_levels(7168)
    assert wide * 127 * 7168 < 2 ** 31 <= (wide + 1) * 127 * 7168 * 1.01
    weight = torch.randn(64, 576)
    screen, int8_head = Int8HeadScreen.build(weight)
    with pytest.raises(RuntimeError, match="x_levels 32000 would overflow"):
        torch.ops.deepinfer.int8_head_logits(torch.randn(1, 576), int8_head, screen.scales, 64, 32000)


@pytest.mark.parametrize("dtype", DTYPES)
def test_near_ties_the_int8_copy_gets_wrong_are_still_exact(dtype):
    weight, rows = near_tie_case(spread=1e-3)
    weight, rows = weight.to(dtype), [x.to(dtype) for x in rows]
    screen = Screened(weight)
    s = screen.screen
    cheap = [row_argmax(torch.ops.deepinfer.int8_head_logits(x, screen.int8_head, s.scales, s.vocab_size, s.levels))
             for x in rows]
    assert sum(int(c != screen.full_argmax(x)) for c, x in zip(cheap, rows)) >= 8  # the case is a hard one
    assert all(torch.equal(screen.argmax(x), screen.full_argmax(x)) for x in rows)
    # the bound is what makes it exact: one far below the errors keeps the wrong columns alone
    tight = dataclasses.replace(s, column_bounds=s.column_bounds * 1e-6)
    assert not all(torch.equal(screen.argmax(x, tight), screen.full_argmax(x)) for x in rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_index_and_the_zero_pads_never_win(dtype):
    check_ties_and_pads(Screened, dtype)


def test_non_finite_rows_fall_back_to_the_full_head():
    screen = Screened(torch.randn(64, 32))
    x = torch.randn(2, 32)
    x[1, 5] = float("nan")
    assert screen.argmax(x) is None
    x[1, 5] = 1e37
    assert screen.argmax(x) is None
    x[1, 5] = 1e20
    assert torch.equal(screen.argmax(x), screen.full_argmax(x))


def test_rows_the_screen_cannot_narrow_take_the_full_head():
    """A zero row ties every logit: every tile is a candidate, and gathering them all would cost more than the head."""
    screen = Screened(torch.randn(1000, 64), gather_limit=Int8HeadScreen.gather_limit)
    assert screen.argmax(torch.zeros(1, 64)) is None
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0
    screen = Screened(torch.eye(64) * 10 + 0.01 * torch.randn(64, 64), gather_limit=Int8HeadScreen.gather_limit)
    assert torch.equal(screen.argmax(x), screen.full_argmax(x))  # a clear winner: screened


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bound_holds(dtype):
    torch.manual_seed(2)
    width, vocab = 576, 4096
    weight = (torch.randn(vocab, width) / width ** 0.5).to(dtype)
    screen = Screened(weight)
    s = screen.screen
    x = (3 * torch.randn(4, width)).to(dtype)
    exact = blocked_linear_float(x, screen.exact_head, vocab)
    approx = torch.ops.deepinfer.int8_head_logits(x, screen.int8_head, s.scales, vocab, s.levels)
    ratio = (exact - approx).abs() / (x.float().norm(dim=1)[:, None] * s.column_bounds[None, :])
    assert 0 < ratio.max() <= 1


def test_rows_screened_by_dtype():
    """fp32 heads up to 6 rows (the int8 pass beats the bf16 copy there), bf16 heads up to 4 (it beats the head)."""
    weight = torch.randn(64, 32)
    assert Int8HeadScreen.build(weight)[0].max_rows == 6
    assert Int8HeadScreen.build(weight.to(torch.bfloat16))[0].max_rows == 4
