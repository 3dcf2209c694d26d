"""Fixtures of the model tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: every op is latency bound, and on a busy 2-core machine a 2-thread OpenMP pool waits for a
    descheduled worker on each parallel op (softmax, index_add_: ~5 ms each), which made the V4 files 3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
