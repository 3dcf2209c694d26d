"""The fused sampler and its kernels: exact against references, seeded draws batch-invariant, and the
empirical distribution equal to the filtered softmax (chi-square)."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.worker.sampler import Sampler, SamplingMetadata, SamplingRow
from kernels import sampling as ops
from kernels.cpu_kernels import load_cpu_kernels

V = 64
INT32_MAX = 2**31 - 1


def row(seed: int = 0, position: int = 0, prompt=(), output=(), eos=frozenset(), **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), seed=seed, output_position=position,
                       prompt_token_ids=list(prompt), output_token_ids=list(output), eos_token_ids=frozenset(eos))


def sample(rows: list[SamplingRow], logits: torch.Tensor):
    meta = SamplingMetadata.build(rows, logits.shape[-1], "cpu")
    return Sampler()(logits, meta), meta


def random_logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def aten_ops(fn, *args) -> set[str]:
    graph = make_fx(fn)(*args).graph
    return {str(n.target) for n in graph.nodes if n.op == "call_function"}


# ------------------------------------------------------------------ greedy


def test_greedy_is_argmax_and_fast_path_has_no_sort_or_noise():
    logits = random_logits(5)
    rows = [row(temperature=0.0, seed=i) for i in range(5)]
    out, meta = sample(rows, logits)
    assert meta.all_greedy and not meta.any_filter and not meta.any_penalty
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None
    names = aten_ops(lambda x: Sampler()(x, meta).token_ids, logits)
    assert not any("sort" in n or "log" in n or "bitwise" in n for n in names), names


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    logits = random_logits(4)
    rows = [row(temperature=0.0), row(temperature=1.0, top_k=3, seed=5), row(temperature=0.0, top_p=0.1),
            row(temperature=0.7, seed=9)]
    out, _ = sample(rows, logits)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_sampled_batch_has_no_host_sync_or_data_dependent_shape():
    logits = random_logits(3)
    rows = [row(seed=1, top_k=5, top_p=0.8, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                frequency_penalty=0.2, prompt=[1, 2], output=[3, 3], min_tokens=4, eos={2}, logprobs=3),
            row(temperature=0.0), row(seed=3, temperature=0.5)]
    meta = SamplingMetadata.build(rows, V, "cpu")
    names = aten_ops(lambda x: Sampler()(x, meta).token_ids, logits)
    assert sum("sort" in n for n in names) == 1, names  # one sort for the whole batch
    forbidden = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "remainder")
    assert not [n for n in names if any(f in n for f in forbidden)], names


@pytest.mark.parametrize("vocab", [1, 15, 16, 49159])
def test_host_row_argmax_is_torch_max_index(vocab):
    """The C++ kernel greedy rows take on the host: the first index of the maximum, a NaN counting as the maximum,
    for vocabularies inside one vector, on its edge and past it with a tail."""
    assert load_cpu_kernels(), "the C++ host kernels (kernels/csrc) did not build"
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1] = 0.0  # every entry tied
    x[2, [vocab - 1, vocab // 2]] = 100.0  # a tie between a late vector (or the tail) and an earlier one
    x[3, [vocab // 3, vocab - 1]] = float("nan")
    x[4] = float("-inf")
    x[5, vocab - 1] = float("inf")
    expected = x.max(dim=-1).indices
    assert torch.equal(torch.ops.deepinfer.row_argmax(x), expected)
    assert torch.equal(ops.row_argmax(x), expected)
    assert torch.equal(ops.row_argmax(x[:1]), expected[:1])


# ------------------------------------------------------------------ seeded noise


def test_hash_matches_python_reference():
    seeds = torch.tensor([0, 1, 12345, INT32_MAX])
    positions = torch.tensor([0, 7, 100_000, 2047])
    h = ops.seeded_hash(seeds, positions, 40)
    expected = [[ops.seeded_hash_reference(int(s), int(p), i) for i in range(40)] for s, p in zip(seeds, positions)]
    assert h.tolist() == expected
    u = ops.seeded_uniform(seeds, positions, 40)
    assert u.tolist() == [[ops.seeded_uniform_reference(int(s), int(p), i) for i in range(40)]
                          for s, p in zip(seeds, positions)]


def test_seeded_uniform_is_uniform_in_open_interval_and_batch_independent():
    from scipy.stats import chisquare
    seeds = torch.arange(64, dtype=torch.int64) * 7919
    positions = torch.arange(64, dtype=torch.int64) % 9
    u = ops.seeded_uniform(seeds, positions, 1000)  # [64, 1000]
    assert u.dtype == torch.float32 and float(u.min()) > 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=50, min=0.0, max=1.0)
    assert chisquare(counts.numpy()).pvalue > 1e-3
    # Consecutive vocabulary indices must not be correlated.
    a, b = u[:, :-1].flatten(), u[:, 1:].flatten()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02
    for i in (0, 17, 63):
        assert torch.equal(ops.seeded_uniform(seeds[i:i + 1], positions[i:i + 1], 1000), u[i:i + 1])


def test_hash_constants_fit_in_int32():
    """Neuron rejects int64 constants outside the int32 range: check the source and the traced graph."""
    hash_fns = (ops._low32, ops._mix32, ops.seeded_hash, ops.seeded_uniform)
    for fn in hash_fns:
        tree = ast.parse(inspect.getsource(fn))
        for node in ast.walk(tree):
            value = None
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                value = node.value
            elif isinstance(node, ast.Name) and isinstance(getattr(ops, node.id, None), int):
                value = getattr(ops, node.id)
            if value is not None:
                assert abs(value) <= INT32_MAX, (fn.__name__, ast.dump(node), value)
    graph = make_fx(lambda s, p: ops.seeded_uniform(s, p, 16))(torch.tensor([3]), torch.tensor([4])).graph
    scalars = [a for n in graph.nodes if n.op == "call_function" for a in n.args if isinstance(a, int)]
    assert scalars and all(abs(a) <= INT32_MAX for a in scalars), scalars


# ------------------------------------------------------------------ batch invariance and seeds


def test_same_seed_same_tokens_alone_and_inside_a_batch():
    target = dict(seed=1234, temperature=0.9, top_k=20, top_p=0.95)
    others = [dict(seed=s, temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r)
              for s, t, k, p, m, r in [(1, 1.0, -1, 1.0, 0.0, 1.0), (2, 0.0, -1, 1.0, 0.0, 1.0),
                                       (3, 0.5, 5, 0.5, 0.0, 1.2), (4, 1.3, -1, 0.9, 0.1, 1.0),
                                       (5, 0.7, 2, 1.0, 0.0, 1.0), (6, 1.0, -1, 0.3, 0.0, 0.8),
                                       (1234, 1.0, -1, 1.0, 0.2, 1.0), (8, 2.0, 50, 0.99, 0.0, 1.0)]]
    alone, batched = [], []
    for position in range(30):
        logits = random_logits(9, seed=position)
        out_alone, _ = sample([row(position=position, **target)], logits[4:5])
        rows = [row(position=position + 3 * i, output=[1, 2], **kw) for i, kw in enumerate(others)]
        rows.insert(4, row(position=position, **target))
        out_batch, _ = sample(rows, logits)
        alone.append(int(out_alone.token_ids[0]))
        batched.append(int(out_batch.token_ids[4]))
    assert alone == batched
    assert len(set(alone)) > 5  # really sampling, not collapsing to argmax


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, V)  # uniform distribution: any seed dependence shows
    draws = {}
    for seed in (0, 1, 2):
        draws[seed] = [int(sample([row(seed=seed, position=p)], logits)[0].token_ids[0]) for p in range(20)]
    assert draws[0] != draws[1] and draws[1] != draws[2] and draws[0] != draws[2]
    again = [int(sample([row(seed=0, position=p)], logits)[0].token_ids[0]) for p in range(20)]
    assert again == draws[0]


# ------------------------------------------------------------------ distribution (chi-square)

FILTERS = [dict(), dict(top_k=5), dict(top_p=0.7), dict(min_p=0.1), dict(top_k=8, top_p=0.9, min_p=0.02)]


@pytest.mark.parametrize("filters", FILTERS, ids=[str(f) or "none" for f in FILTERS])
def test_empirical_frequencies_match_filtered_softmax(filters):
    from scipy.stats import chisquare
    vocab, n, temperature = 12, 6000, 0.8
    base = torch.linspace(-2.0, 2.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))]
    logits = base.expand(n, vocab).contiguous()
    rows = [row(seed=777, position=p, temperature=temperature, **filters) for p in range(n)]
    out, _ = sample(rows, logits)
    counts = torch.bincount(out.token_ids, minlength=vocab).double()

    filtered = ops.filter_reference(base[None] / temperature, [filters.get("top_k", -1)],
                                    [filters.get("top_p", 1.0)], [filters.get("min_p", 0.0)])[0]
    kept = torch.isfinite(filtered)
    assert counts[~kept].sum() == 0, "a filtered-out token was sampled"
    if filters:
        assert int(kept.sum()) < vocab  # the filter really removed something
    expected = torch.softmax(filtered.double(), dim=-1)[kept] * n
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3


def test_filters_match_reference_masks():
    logits = random_logits(6)
    top_k = [-1, 1, 5, 64, 10, 3]
    top_p = [0.5, 1.0, 0.9, 0.3, 1.0, 0.95]
    min_p = [0.0, 0.0, 0.05, 0.0, 0.2, 0.01]
    k = torch.tensor([V if x == -1 else x for x in top_k])
    got = ops.apply_top_k_top_p(ops.apply_min_p(logits, torch.tensor(min_p)), k, torch.tensor(top_p), True, True)
    expected = ops.filter_reference(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])  # survivors keep their value


# ------------------------------------------------------------------ penalties and min_tokens


def test_penalties_match_reference():
    logits = random_logits(3)
    prompts = [[1, 2, 3, 3], [], [10, 11]]
    outputs = [[3, 4, 4, 4], [5, 6, 5], []]
    rep, pres, freq = [1.3, 0.7, 2.0], [0.5, -1.0, 1.0], [0.25, 0.5, -2.0]
    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=r, presence_penalty=p,
                                       frequency_penalty=f), 0, len(o), pr, o)
            for pr, o, r, p, f in zip(prompts, outputs, rep, pres, freq)]
    meta = SamplingMetadata.build(rows, V, "cpu")
    got = Sampler().process_logits(logits, meta)
    expected = ops.penalties_reference(logits, prompts, outputs, rep, pres, freq)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits)
    out = Sampler()(logits, meta)
    assert torch.equal(out.token_ids, expected.argmax(-1))


def test_unpenalized_rows_are_untouched_in_a_penalized_batch():
    logits = random_logits(2)
    rows = [row(temperature=0.0, repetition_penalty=1.5, prompt=[1], output=[2]),
            row(temperature=0.0, prompt=[1, 2, 3], output=[4, 5])]
    meta = SamplingMetadata.build(rows, V, "cpu")
    assert torch.equal(Sampler().process_logits(logits, meta)[1], logits[1])


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 2] = 50.0  # eos
    logits[0, 7] = 40.0  # a stop token id
    logits[0, 9] = 30.0
    for params in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        blocked = row(position=1, eos={2}, min_tokens=3, stop_token_ids=[7], **params)
        assert int(sample([blocked], logits)[0].token_ids[0]) == 9
        free = row(position=3, eos={2}, min_tokens=3, stop_token_ids=[7], **params)
        assert int(sample([free], logits)[0].token_ids[0]) == 2
    ignoring = row(temperature=0.0, position=0, eos={2}, min_tokens=3, ignore_eos=True, stop_token_ids=[7])
    assert int(sample([ignoring], logits)[0].token_ids[0]) == 2  # eos is no stop under ignore_eos


def test_logit_bias_moves_a_rows_argmax_and_sampling_but_not_its_logprobs():
    logits = random_logits(3)
    top = int(logits[0].argmax())
    other = (top + 1) % V
    rows = [row(temperature=0.0, logit_bias={other: 100.0}, logprobs=1),
            row(temperature=0.0),  # no bias: its logits are untouched
            row(temperature=1.0, seed=4, logit_bias={t: -100.0 for t in range(V) if t != 5})]
    out, meta = sample(rows, logits)
    assert meta.processes_logits and not meta.raw_greedy
    assert out.token_ids.tolist() == [other, int(logits[1].argmax()), 5]
    assert torch.equal(Sampler().process_logits(logits, meta)[1], logits[1])
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[other])  # the raw model's
    # A biased row never takes the raw-logits fast path (the model's screened greedy head is for plain rows).
    assert not SamplingMetadata.build([row(temperature=0.0, logit_bias={1: 0.5})], V, "cpu").plain_greedy


def test_build_rejects_out_of_vocab_ids():
    with pytest.raises(ValueError, match="stop / eos token id must be in \\[0, 63\\]"):
        SamplingMetadata.build([row(min_tokens=2, stop_token_ids=[64])], V, "cpu")
    with pytest.raises(ValueError, match="output token id"):
        SamplingMetadata.build([row(frequency_penalty=1.0, output=[99])], V, "cpu")
    with pytest.raises(ValueError, match="logit_bias token id must be in \\[0, 63\\]"):
        SamplingMetadata.build([row(logit_bias={64: 1.0})], V, "cpu")
    with pytest.raises(ValueError, match="at least one row"):
        SamplingMetadata.build([], V, "cpu")


# ------------------------------------------------------------------ logprobs


def test_logprobs_are_raw_log_softmax_and_top_n_sorted():
    logits = random_logits(3)
    rows = [row(seed=1, temperature=0.5, repetition_penalty=1.5, prompt=[0, 1, 2], logprobs=5),
            row(temperature=0.0, logprobs=2), row(seed=2, top_k=3)]
    out, meta = sample(rows, logits)
    assert meta.max_num_logprobs == 5 and meta.num_logprobs == [5, 2, None]
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_ids))
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))


def test_logprobs_zero_gives_sampled_logprob_only():
    logits = random_logits(1)
    out, _ = sample([row(temperature=0.0, logprobs=0)], logits)
    assert out.top_ids is None and out.logprobs is not None
    torch.testing.assert_close(out.logprobs[0], torch.log_softmax(logits[0], -1).max())


def test_sampler_compiles_as_one_graph():
    """fullgraph=True fails on any graph break (host sync, data-dependent branch) inside the sampler."""
    logits = random_logits(3)
    rows = [row(seed=1, top_k=5, top_p=0.8, min_p=0.05, repetition_penalty=1.3, prompt=[1], output=[3],
                min_tokens=4, eos={2}, logprobs=3), row(temperature=0.0), row(seed=3, temperature=0.5)]
    meta = SamplingMetadata.build(rows, V, "cpu")
    sampler = Sampler()
    compiled = torch.compile(lambda x: sampler(x, meta), fullgraph=True, backend="aot_eager", dynamic=False)
    got, expected = compiled(logits), sampler(logits, meta)
    assert torch.equal(got.token_ids, expected.token_ids) and torch.equal(got.top_ids, expected.top_ids)
