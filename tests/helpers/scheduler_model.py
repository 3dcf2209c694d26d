"""A scheduler driven without a model: FakeModel writes each scheduled token into its slot and samples a hash of
the sequence it reads back from the slots (so a wrong block table or slot shows up as a wrong token)."""
from __future__ import annotations

from backend_lib.core.config import CacheConfig, SchedulerConfig
from backend_lib.core.outputs import RunnerOutput, SchedulerOutput
from backend_lib.core.request import Request
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.core.scheduler import Scheduler

VOCAB = 64


EOS = 0


def next_token(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 1000003 + t + 1) % (1 << 61)
    return 1 + h % (VOCAB - 1)  # never EOS unless a test asks for it


class FakeModel:
    def __init__(self, block_size: int, next_fn=next_token) -> None:
        self.bs = block_size
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token id)
        self.next_fn = next_fn

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sampled = []
        for chunk in out.chunks:
            tokens = chunk.request.all_token_ids
            assert len(chunk.block_ids) * self.bs >= chunk.start + chunk.num_tokens, "block table too short"
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                self.kv[self._slot(chunk.block_ids, p)] = (p, tokens[p])
            if not chunk.samples:
                sampled.append([])
                continue
            seq = []
            for p in range(chunk.start + chunk.num_tokens):
                pos, token = self.kv[self._slot(chunk.block_ids, p)]
                assert pos == p, f"slot for position {p} holds position {pos}"
                seq.append(token)
            sampled.append([self.next_fn(seq)])
        return RunnerOutput(sampled_token_ids=sampled)

    def _slot(self, blocks: list[int], p: int) -> int:
        return blocks[p // self.bs] * self.bs + p % self.bs


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_model_len=256, prefix=True, chunked=True,
         clock=None) -> Scheduler:
    kwargs = {} if clock is None else {"clock": clock}
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
                     num_blocks, max_model_len, **kwargs)


def req(rid, prompt, max_tokens=8, session_id=None, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(request_id=rid, prompt_token_ids=list(prompt), seed=0, eos_token_ids=frozenset({EOS}),
                   sampling_params=SamplingParams(max_tokens=max_tokens, **params), session_id=session_id)


def step(sched: Scheduler, model: FakeModel) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    changed = sched.update_from_output(out, model.execute(out))
    sched.check_integrity()
    return out, changed


def run(sched: Scheduler, model: FakeModel, max_steps: int = 20000) -> dict[str, Request]:
    done = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return done
        for r in step(sched, model)[1]:
            if r.is_finished:
                done[r.request_id] = r
    raise AssertionError("scheduler did not drain")


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]
