"""Our DeepSeek-V4.1 (backend_lib/models/deepseek_v41/) against the oracle (tests/helpers/deepseek_v41_reference.py,
fp32, QAT activations off), teacher-forced at every position: prefill chunks of odd sizes, then one decode step per
token, over shuffled paged blocks and a state slot (the model runner's inputs, built by hand)."""
from __future__ import annotations

import pytest
import torch

from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from tests.helpers.deepseek_v41_cases import CONFIGS, tokens
from tests.helpers.deepseek_v41_reference import ReferenceV41
from tests.test_deepseek_v4 import PagedRunner

# (context length, tokens prefilled before the teacher-forced decode steps); default runs past 1,000 positions
LENGTHS = {"default": (1040, 900), "two_groups": (300, 180), "reindex_r2": (300, 180), "wide": (300, 180)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second OpenMP thread only waits on a busy 2-core machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    path = make_tiny("deepseek_v41", tmp_path_factory.mktemp(name), seed=7, overrides=CONFIGS[name])
    return name, path


def _ours_teacher_forced(path, ids: list[int], prefill_len: int, qat: bool = False,
                         chunks=(13, 7, 61, 1, 29)) -> torch.Tensor:
    model = load_model(str(path), torch.float32, progress=False)
    model.qat = qat
    run = PagedRunner(model, num_blocks=len(ids) // 4 + 8)
    rows, start, i = [], 0, 0
    while start < prefill_len:
        n = min(chunks[i % len(chunks)], prefill_len - start)
        rows.append(run.step([], [("r", ids[start:start + n])]))
        start, i = start + n, i + 1
    rows += [run.step([("r", [t])], []) for t in ids[prefill_len:]]
    return torch.cat(rows)


def test_teacher_forced_logits_equal_the_oracle_at_every_position(case):
    name, path = case
    length, prefill_len = LENGTHS[name]
    ids = tokens(length, 2)
    expected = ReferenceV41(path, qat=False).forward(torch.tensor(ids))
    diff = (_ours_teacher_forced(path, ids, prefill_len) - expected).abs().amax(dim=-1)
    assert diff.max() <= 1e-4, f"first position off: {int((diff > 1e-4).nonzero()[0])}, max {diff.max():.2e}"
