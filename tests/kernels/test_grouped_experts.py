"""The routed experts in one C++ call on blocked weights (kernels/csrc/grouped_experts.cpp) against a plain
per-expert PyTorch loop: fp32 and bf16 weights, experts of other ranks (ids outside [0, E), expert parallelism),
experts with no tokens, more rows than one micro-kernel block; and a compiled region keeps it as one opaque call."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv import gemv_available
from kernels.grouped_experts import block_experts, blocked_grouped_experts, clipped_swiglu

LIMIT = 1.5  # small enough that the clamps bite on these inputs


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    assert gemv_available(torch.device("cpu"), torch.float32), "the C++ kernels did not build"


def _reference(x, weights, ids, gate_up, down, limit):  # float64, one expert at a time
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            h = clipped_swiglu(*F.linear(x[token].double(), gate_up[e].double()).chunk(2, dim=-1), limit)
            out.index_add_(0, token, F.linear(h, down[e].double()) * weights[token, slot, None].double())
    return out


def _case(tokens: int, experts: int, hidden: int, inter: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    # ids drawn from [-2, experts + 2): some pairs belong to other ranks; expert 1 is never picked
    ids = torch.randint(-2, experts + 2, (tokens, top_k), generator=gen)
    ids[ids == 1] = 0
    return x, torch.rand(tokens, top_k, generator=gen), ids, gate_up, down


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_matches_a_per_expert_loop(weight_dtype, tokens):
    hidden, inter = 72, 40  # not multiples of the 16-row tile; odd pair counts for bf16 are covered by gemv's tests
    x, weights, ids, gate_up, down = _case(tokens, 6, hidden, inter, 3, seed=tokens)
    gate_up, down = gate_up.to(weight_dtype), down.to(weight_dtype)
    got = blocked_grouped_experts(x, weights, ids, block_experts(gate_up), block_experts(down), inter, LIMIT)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _reference(x, weights, ids, gate_up, down, LIMIT), atol=1e-5, rtol=1e-5)


def test_every_pair_on_another_rank_gives_zeros():
    x, weights, ids, gate_up, down = _case(4, 3, 32, 16, 2, seed=0)
    got = blocked_grouped_experts(x, weights, ids.abs() + 3, block_experts(gate_up), block_experts(down), 16, LIMIT)
    assert torch.equal(got, torch.zeros_like(x))


def test_bad_input_names_the_field():
    x, weights, ids, gate_up, down = _case(4, 3, 32, 16, 2, seed=0)
    with pytest.raises(RuntimeError, match="down"):
        blocked_grouped_experts(x, weights, ids, block_experts(gate_up), block_experts(down[:2]), 16, LIMIT)
    with pytest.raises(RuntimeError, match="local_ids"):
        blocked_grouped_experts(x, weights, ids.int(), block_experts(gate_up), block_experts(down), 16, LIMIT)


def test_compiled_region_keeps_one_opaque_call():
    x, weights, ids, gate_up, down = _case(8, 4, 32, 16, 2, seed=3)
    gate_up, down = block_experts(gate_up), block_experts(down)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    fn = torch.compile(lambda *a: blocked_grouped_experts(*a, 16, LIMIT), backend=backend, fullgraph=True)
    got = fn(x, weights, ids, gate_up, down)
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "grouped_experts" in str(n.target)]
    assert len(calls) == 1
    assert torch.equal(got, blocked_grouped_experts(x, weights, ids, gate_up, down, 16, LIMIT))
