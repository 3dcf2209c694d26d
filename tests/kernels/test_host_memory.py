"""The blocked weights' huge-page buffer (kernels/host_memory.py): same values, one buffer, aligned views."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernels.host_memory import ALIGN_BYTES, HUGE_PAGE_BYTES, move_buffers_to_huge_pages


class Holder(torch.nn.Module):
    def __init__(self, *tensors: torch.Tensor | None) -> None:
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_buffer(f"blocked{i}", t, persistent=False)


def test_buffers_move_into_one_aligned_buffer_with_their_values():
    g = torch.Generator().manual_seed(0)
    originals = [torch.randn(3, 5, 16, generator=g), torch.randn(7, generator=g).bfloat16(),
                 torch.randn(40, 2, generator=g).t(), torch.empty(0)]  # odd sizes, a non-contiguous view, empty
    holders = [Holder(t.clone()) for t in originals]
    move_buffers_to_huge_pages([(h, "blocked0") for h in holders])
    moved = [h.blocked0 for h in holders]
    for before, after in zip(originals, moved):
        assert after.dtype == before.dtype and after.shape == before.shape and after.is_contiguous()
        assert torch.equal(after, before)
        assert after.data_ptr() % ALIGN_BYTES == 0
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1  # one buffer
    assert moved[0].data_ptr() % HUGE_PAGE_BYTES == 0  # the range starts on a huge page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_linux_takes_the_advice_where_transparent_huge_pages_are_on():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel has transparent huge pages off")
    holder = Holder(torch.ones(HUGE_PAGE_BYTES // 4))
    assert move_buffers_to_huge_pages([(holder, "blocked0")]) is True
    assert torch.equal(holder.blocked0, torch.ones(HUGE_PAGE_BYTES // 4))


def test_a_missing_buffer_is_refused_by_name():
    with pytest.raises(ValueError, match="CPU tensor"):
        move_buffers_to_huge_pages([(Holder(None), "blocked0")])
