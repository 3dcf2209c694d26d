"""Host memory for the weights the CPU kernels stream every decode step: one buffer on transparent huge pages.

Why: a decode step reads every blocked weight once (540 MB for SmolLM2 in fp32); on 4 KiB pages that is a TLB
miss every 64 cache lines. Zen 4, a decode step's blocked GEMVs alternating in one process between the same
weights on 4 KiB pages and on 2 MiB pages: 0.95x the time in fp32, 0.92x in bf16. torch's allocator does not ask
for huge pages (only with THP_MEM_ALLOC_ENABLE set), and Linux's default THP mode is ``madvise``: a range gets
them only when asked before its first touch.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from dataclasses import dataclass

import torch

log = logging.getLogger("deepinfer.kernels")

MADV_HUGEPAGE = 14  # <linux/mman.h>
HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # one cache line: every copy starts on one, as the kernels' vector loads like


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [address, address + length); False off Linux or where the kernel refuses (no
    THP support), with the reason logged."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, length, MADV_HUGEPAGE) != 0:
        log.warning("madvise(MADV_HUGEPAGE) refused (errno %d): weights stay on 4 KiB pages", ctypes.get_errno())
        return False
    return True


def move_buffers_to_huge_pages(slots: list[tuple[torch.nn.Module, str]]) -> bool:
    """Moves each ``(module, buffer name)``'s CPU tensor into one new buffer, one after the other in the order
    given (each cache-line aligned, contiguous), whose 2 MiB-aligned range is advised onto huge pages before
    anything touches it. One buffer at a time, so the old copy is freed as its successor lands (peak: the new
    buffer plus one tensor). Returns whether Linux took the advice (else plain pages: same values, same layout)."""
    tensors = [getattr(module, name) for module, name in slots]
    for (module, name), t in zip(slots, tensors):
        if t is None or t.device.type != "cpu":
            raise ValueError(f"move_buffers_to_huge_pages: {type(module).__name__}.{name} must be a CPU tensor, got "
                             f"{None if t is None else t.device}")
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    del tensors
    length = -(-end // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    buffer = torch.empty(length + HUGE_PAGE_BYTES, dtype=torch.uint8)  # large: mapped, not yet touched
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    huge = length > 0 and _advise_huge_pages(buffer.data_ptr() + start, length)
    for (module, name), offset in zip(slots, offsets):
        old = getattr(module, name)
        nbytes = old.numel() * old.element_size()
        copy = buffer[start + offset:start + offset + nbytes].view(old.dtype).view(old.shape).copy_(old)
        setattr(module, name, copy)
    return huge
