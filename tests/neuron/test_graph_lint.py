"""graph_lint: each rule caught on a small graph that breaks it; clean graphs and every engine region pass."""
from __future__ import annotations

import pytest
import torch

from backend_lib.tools.lint.cli import main
from backend_lib.neuron.graph_lint import GraphLintError, lint_region


def _rules(fn, *args) -> set[str]:
    with pytest.raises(GraphLintError) as info:
        lint_region(fn, *args, region="test")
    assert "Hint:" in str(info.value) and "node " in str(info.value)
    return {f.rule for f in info.value.findings}


x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
ints = torch.arange(12, dtype=torch.int64).reshape(3, 4)


@pytest.mark.parametrize("rule, fn, args", [
    ("int64-constant", lambda a: a * 0x9E3779B97F4A7C15 + 1, (ints,)),
    ("int64-constant", lambda a: a + 2**31, (ints,)),
    ("data-dependent", lambda a: torch.nonzero(a > 3), (x,)),
    ("data-dependent", lambda a: a * a.sum().item(), (x,)),
    ("data-dependent", lambda a: torch.unique(a), (ints,)),
    ("data-dependent", lambda a: torch.masked_select(a, a > 2), (x,)),
    ("multinomial", lambda a: torch.multinomial(torch.softmax(a, -1), 1), (x,)),
    ("bitcast", lambda a: a.view(torch.int32) + 1, (x,)),
    ("integer-topk", lambda a: torch.topk(a, 2).values, (ints,)),
    ("integer-matmul", lambda a: a @ a.T, (ints,)),
    ("remainder", lambda a: torch.remainder(a, 5), (ints,)),
    ("uint8-assembly", lambda a: (a.to(torch.uint8) << 4) | a.to(torch.uint8), (ints,)),
])
def test_each_rule_catches_a_graph_that_breaks_it(rule, fn, args):
    assert rule in _rules(fn, *args)


def test_dynamic_shapes_are_caught():
    from backend_lib.neuron.graph_lint import LintBackend
    torch._dynamo.reset()
    backend = LintBackend("dyn")
    fn = torch.compile(lambda a: a * 2, backend=backend, dynamic=True, fullgraph=True)
    with pytest.raises(Exception) as info:
        fn(x)
    assert "dynamic-shape" in str(info.value)


def test_neuron_safe_rewrites_pass():
    # the rewrites the hints ask for: a - (a // b) * b, float topk, int32 constants, int32 codes narrowed once
    out = lint_region(lambda a: (a - (a // 5) * 5, torch.topk(a.float(), 2).values, a * 0x7FEB352D,
                                 ((a << 4) | a).to(torch.uint8)), ints, region="clean")
    assert torch.equal(out[0], torch.remainder(ints, 5))


LLAMA_REGIONS = ("llama decode tokens=4", "llama prefill", "sampler greedy=False top_k=True top_p=True",
                 "verification greedy=False")
OTHER_ARCH_REGIONS = (
    "llama_fp8 decode tokens=4", "llama_fp8 prefill", "deepseek_v3_fp8 decode tokens=4", "deepseek_v3_fp8 prefill",
    "deepseek_v4_fp8 decode tokens=4", "deepseek_v3 decode tokens=4", "deepseek_v3 lm_head",
    "deepseek_v4 decode tokens=4", "deepseek_v4 prefill", "deepseek_v4 lm_head",
    "sampler greedy=False top_k=True top_p=True", "verification greedy=False")


# Llama for the inner loop; every other arch's regions (minutes of tracing) in `make test`: with the llama
# case, `deepinfer lint-graphs --arch all`'s whole catalogue, each region traced once.
@pytest.mark.parametrize("archs, regions", [("llama", LLAMA_REGIONS),
                                            pytest.param("llama_fp8,deepseek_v3,deepseek_v3_fp8,deepseek_v4,"
                                                         "deepseek_v4_fp8", OTHER_ARCH_REGIONS,
                                                         marks=pytest.mark.slow)])
def test_lint_graphs_cli_passes_on_every_region(capsys, archs, regions):
    assert main(["--arch", archs]) == 0
    out = capsys.readouterr().out
    assert "all regions pass" in out
    for region in regions:
        assert region in out
