"""Hard cases both screened greedy heads are tested on (tests/kernels/test_head_screen.py: the bf16 copy of an fp32 head;
tests/kernels/test_int8_head_screen.py: the int8 copy): near-ties a cheap copy gets wrong, ties and the zero pads."""
import torch


def near_tie_case(spread: float = 1e-4) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A head whose best columns (every 100th, each in a tile of its own, ``spread`` apart) lie within a cheap
    copy's error of each other, and rows whose logits there are small against ||x|| ||W_j||: the copy often picks
    another. (fp32 head and rows; the int8 screen's tests take it with a wider spread.)"""
    torch.manual_seed(3)
    width, vocab = 576, 4096
    weight = 0.001 * torch.randn(vocab, width)
    base = torch.randn(width) / width ** 0.5
    weight[::100] = base + spread * torch.randn(len(range(0, vocab, 100)), width)
    rows = []
    for _ in range(64):
        x = 3 * torch.randn(width)
        x += (0.3 - x @ base) / (base @ base) * base  # x . base = 0.3
        rows.append(x[None, :])
    return weight, rows


def check_ties_and_pads(screened_of, dtype: torch.dtype = torch.float32) -> None:
    """Ties go to the first index, the last partial tile counts and its zero pads never win (``screened_of(weight)``
    has ``argmax`` and ``full_argmax``)."""
    torch.manual_seed(1)
    width, vocab = 64, 50  # 4 tiles, the last holding 2 columns and 14 zero pads
    weight = torch.randn(vocab, width) * 0.1
    weight[49] = weight[3] = torch.randn(width)  # an exact tie, the larger logits
    weight = weight.to(dtype)
    screen = screened_of(weight)
    x = weight[3][None, :].clone()
    assert screen.argmax(x).tolist() == [3] == screen.full_argmax(x).tolist()
    weight[3] = 0.0
    screen = screened_of(weight)
    assert screen.argmax(x).tolist() == [49] == screen.full_argmax(x).tolist()
    # every logit negative: the zero pads past the vocabulary must not win
    x = -weight[49][None, :]
    assert screen.argmax(x).tolist() == screen.full_argmax(x).tolist()
    assert screen.argmax(x).item() < vocab
