"""Tensor / expert parallelism on the host: N gloo ranks (worker processes the engine starts) give the same greedy
ids as one rank, and log-probabilities (log-softmaxed logits) within 1e-4; bad sizes and lost ranks fail loudly."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from backend_lib.worker.executor.workers import RankFailure

# `make test` only (not test-fast): each test starts multi-rank engines (processes, gloo groups, the model loaded per
# rank).
pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Once upon a time there was", "0123456789 + - * / ="]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        "llama": make_tiny("llama", root / "llama"),
        "deepseek": make_tiny("deepseek_v3", root / "deepseek", mtp_layers=1),
        "deepseek_fp8": make_tiny("deepseek_v3", root / "deepseek_fp8", fp8=True, mtp_layers=1),
        "deepseek_v4": make_tiny("deepseek_v4", root / "deepseek_v4", mtp_layers=1),
    }


def _generate(model: str, params: SamplingParams = GREEDY, **settings):
    with LLM(model, num_blocks=128, max_num_batched_tokens=64, **settings) as llm:
        return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def one_rank(tiny_dirs):
    """(model name, params) -> one rank's results: the reference the multi-rank runs are checked against, computed
    once for the module (several tests and params compare against the same one)."""
    done: dict[tuple[str, str], list] = {}

    def reference(name: str, params: SamplingParams = GREEDY) -> list:
        key = (name, repr(params))
        if key not in done:
            done[key] = _generate(str(tiny_dirs[name]), params)
        return done[key]
    return reference


def _assert_same(reference, results) -> None:
    for ref, got in zip(reference, results):
        assert got.error is None and got.token_ids == ref.token_ids
        if ref.prompt_logprobs is not None:  # the driver's prompt rows: the ranks' head calls pair up
            assert len(got.prompt_logprobs.entries) == len(ref.prompt_logprobs.entries) == ref.num_prompt_tokens - 1
        for ref_lp, lp in zip(ref.logprobs + (ref.prompt_logprobs.entries if ref.prompt_logprobs else []),
                              got.logprobs + (got.prompt_logprobs.entries if got.prompt_logprobs else [])):
            assert abs(ref_lp.logprob - lp.logprob) < 1e-4
            for (ref_id, ref_v), (got_id, got_v) in zip(ref_lp.top, lp.top):
                assert abs(ref_v - got_v) < 1e-4


@pytest.mark.parametrize("model, settings", [
    ("llama", {}),
    ("deepseek", {}),
    ("deepseek", {"enable_expert_parallel": True}),
    ("deepseek_fp8", {}),
    ("deepseek_fp8", {"enable_expert_parallel": True}),
    ("deepseek_v4", {}),
    ("deepseek_v4", {"enable_expert_parallel": True}),
])
def test_two_ranks_match_one(tiny_dirs, one_rank, model, settings):
    _assert_same(one_rank(model), _generate(str(tiny_dirs[model]), tensor_parallel_size=2, **settings))


@pytest.mark.parametrize("name, method", [("deepseek_fp8", "mtp"), ("deepseek_fp8", "ngram"), ("deepseek_v4", "mtp")])
def test_speculative_decoding_across_ranks(tiny_dirs, one_rank, name, method):
    model = str(tiny_dirs[name])
    spec = {"method": method, "num_speculative_tokens": 2}
    reference = one_rank(name, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    results = _generate(model, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        tensor_parallel_size=2, enable_expert_parallel=True, **spec)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]


def test_seeded_sampling_across_ranks(tiny_dirs, one_rank):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    model = str(tiny_dirs["llama"])
    assert ([r.token_ids for r in _generate(model, params, tensor_parallel_size=2)]
            == [r.token_ids for r in one_rank("llama", params)])


def test_smollm2_uneven_heads_match_one_rank():
    """SmolLM2 has 3 KV heads: two ranks take 2 + 1 KV-head groups (6 + 3 query heads)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    _assert_same(_generate("", params), _generate("", params, tensor_parallel_size=2))


@pytest.mark.parametrize("model, size, message", [
    ("llama", 4, "tensor_parallel_size=4 exceeds num_key_value_heads (2)"),
    ("deepseek", 3, "tensor_parallel_size=3 does not divide vocab_size (320)"),
])
def test_bad_rank_count_fails_the_load_and_leaves_no_worker(tiny_dirs, model, size, message, child_worker_pids):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(tiny_dirs[model]), num_blocks=64, tensor_parallel_size=size)
    assert child_worker_pids() == []


def test_killed_worker_fails_the_step_naming_the_rank(tiny_dirs, child_worker_pids):
    llm = LLM(str(tiny_dirs["llama"]), num_blocks=64, tensor_parallel_size=2, distributed_timeout_s=20)
    try:
        (pid,) = child_worker_pids()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 10
        with pytest.raises(RankFailure, match="rank 1"):  # the engine stays failed
            llm.engine.step()
    finally:
        llm.close()
    assert child_worker_pids() == []


def test_workers_die_with_the_driver(tiny_dirs, tmp_path):
    """SIGKILL of the driver process leaves no worker behind (parent-death signal)."""
    script = (f"from backend_lib.engine.offline import LLM\nimport time\n"
              f"llm = LLM({str(tiny_dirs['llama'])!r}, num_blocks=64, tensor_parallel_size=2)\n"
              f"print('ready', flush=True)\ntime.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
        workers = subprocess.run(["pgrep", "-f", "-P", str(driver.pid), "backend_lib.worker.executor.worker"],
                                 capture_output=True, text=True).stdout.split()
        assert len(workers) == 1
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{workers[0]}"):
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{workers[0]}")
    finally:
        driver.kill()


def test_two_nodes_on_localhost_match_one(tiny_dirs):
    """Node 0 is this process (the driver, nnodes=2); node 1 is `deepinfer worker`, which runs its rank under
    torchrun and joins through the driver's rendezvous store."""
    from backend_lib.core.processes import free_port

    port = free_port()
    model = str(tiny_dirs["deepseek"])
    node1 = subprocess.Popen([sys.executable, "-m", "backend_lib.frontend.cli.main", "worker", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "120"])
    try:
        results = _generate(model, tensor_parallel_size=2, nnodes=2, master_port=port)
        assert node1.wait(timeout=30) == 0  # the driver's shutdown message ends node 1's ranks
    finally:
        node1.kill()
    _assert_same(_generate(model), results)


def test_neuron_layout_reads_the_sharding_code():
    """The layout report (docs/NEURON.md) comes from the model's own shards: DeepSeek-V3 at TP=64 + EP holds about
    1/64 of the sharded weights per rank plus the replicated latent projections, router and norms."""
    from backend_lib.tools.layout import deepseek_v3_layout

    whole, split = deepseek_v3_layout(1, False), deepseek_v3_layout(64, True)
    sharded = whole.weight_bytes - split.replicated_bytes
    assert split.weight_bytes - split.replicated_bytes == pytest.approx(sharded / 64, rel=0.02)
    assert split.allreduces_per_step == 2 * 61 + 1 and whole.allreduces_per_step == 0
    assert split.kv_bytes_per_token == whole.kv_bytes_per_token  # the latent is not split by heads


def test_compiled_regions_per_rank_match_eager(tiny_dirs, one_rank):
    """Each rank compiles its own regions with the all-reduces inside the graphs (fullgraph: a collective that broke
    the graph would fail the build); greedy ids equal the one-rank eager engine."""
    model = str(tiny_dirs["llama"])
    compiled = _generate(model, tensor_parallel_size=2, compile_backend="aot_eager", batch_buckets="1,2,4",
                         width_buckets="8", max_model_len=128)
    _assert_same(one_rank("llama"), compiled)


def test_graph_lint_accepts_static_collectives_and_names_others():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from backend_lib.neuron.graph_lint import GraphLintError, LintBackend, lint_region

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.group.WORLD

        def reduce(x):  # what ParallelContext.all_reduce does on Neuron (no shared-memory op there)
            dist.all_reduce(x, group=group)
            return x * 2

        backend = LintBackend("reduce")
        torch._dynamo.reset()
        torch.compile(reduce, backend=backend, fullgraph=True, dynamic=False)(torch.ones(4))
        assert backend.graphs_checked >= 1
        assert lint_region(reduce, torch.ones(4), region="all-reduce").tolist() == [2.0] * 4

        def exchange(x):
            return funcol.all_to_all_single(x, [4], [4], group) + 1

        with pytest.raises(GraphLintError, match=r"\[collective\]"):
            lint_region(exchange, torch.ones(4), region="all-to-all")
    finally:
        dist.destroy_process_group()


def test_lint_graphs_per_rank():
    from backend_lib.tools.lint.ranks import lint_with_ranks

    results = lint_with_ranks(["llama"], 2)
    assert {r.rank for r in results} == {0, 1}
    assert [r for r in results if r.error] == []
    assert any(r.rank == 1 and "decode" in r.region for r in results)


def test_a_small_dev_shm_falls_back_to_gloo_saying_how_to_give_it_room(caplog):
    """tmpfs accepts a segment larger than its room and SIGBUSes the rank that touches past it (Docker's /dev/shm
    is 64 MB: TP 8 needs 64 MiB + headroom), so the ranks check first."""
    from backend_lib.worker.executor.process_group import _shm_has_room, shm_segment_bytes

    free = shutil.disk_usage("/dev/shm").free
    assert shm_segment_bytes(8) == 8 * (64 + 2 * (4 << 20))
    assert _shm_has_room(2, rank=0) == (free > shm_segment_bytes(2) + (16 << 20))
    too_many = free // shm_segment_bytes(1) + 1  # more than this machine's /dev/shm holds
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert not _shm_has_room(too_many, rank=0)
    assert "--shm-size=1g" in caplog.text and f"tensor_parallel_size {too_many}" in caplog.text
