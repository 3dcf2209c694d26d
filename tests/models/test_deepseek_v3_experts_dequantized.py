"""``weight_format=dequantize`` on a DeepSeek-V3 fp8 checkpoint: on the host the routed experts are widened once at
load (stacks in the model dtype, no fp8 copy, no scales) and give what the per-call widening of the fp8 stacks gave,
to the bit: the same MoE outputs, the same greedy ids and logprobs through the engine. The wider bytes are resident (and so
counted by the KV sizing, which measures the memory free after loading)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.models.deepseek_v3.moe import MoE, RoutedExperts
from backend_lib.models.layers import resident_weight_bytes
from backend_lib.models.loading.loader import load_model, safetensors_files
from backend_lib.models.parallel import ParallelContext
from backend_lib.tools.tiny import make_tiny
from backend_lib.neuron.static_moe import moe_static
from kernels.moe import moe_dynamic


@pytest.fixture(scope="module")
def tiny_v3_fp8(tmp_path_factory):
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("v3fp8") / "m", fp8=True, mtp_layers=1, seed=3)


def _checkpoint(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in safetensors_files(str(path)):
        with safe_open(file, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys() if ".mlp.experts." in name})
    return tensors


def _fp8_stacks(moe_name: str, experts: RoutedExperts, checkpoint: dict[str, torch.Tensor], num_main: int,
                dtype: torch.dtype) -> RoutedExperts:
    """The layer's experts as the model held them before: fp8 stacks, widened inside every expert call."""
    kind, index = moe_name.split(".")[:2]
    layer = int(index) + (num_main if kind == "mtp" else 0)
    old = RoutedExperts(experts.total_experts, experts.shapes["gate_proj"][1], experts.shapes["gate_proj"][0],
                        experts.block_size, ParallelContext())
    for e in range(experts.total_experts):
        for proj in RoutedExperts.PROJS:
            base = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
            weight, scale = checkpoint[base + ".weight"], checkpoint[base + ".weight_scale_inv"]
            assert weight.dtype == torch.float8_e4m3fn
            old.set_expert(e, proj, weight, scale, dtype, dequantize=False)
    return old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_are_dequantized_at_load_and_compute_what_the_fp8_stacks_did(tiny_v3_fp8, dtype):
    model = load_model(str(tiny_v3_fp8), dtype=dtype, progress=False, weight_format="dequantize")
    checkpoint = _checkpoint(tiny_v3_fp8)
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    assert any(name.startswith("mtp.") for name in moes) and len(moes) >= 2
    gen = torch.Generator().manual_seed(1)
    for name, moe in moes.items():
        experts = moe.experts
        for proj in RoutedExperts.PROJS:
            assert getattr(experts, proj).dtype == dtype and getattr(experts, proj + "_scale_inv") is None
        old = _fp8_stacks(name, experts, checkpoint, model.args.num_hidden_layers, dtype)
        assert old.gate_proj.dtype == torch.float8_e4m3fn  # the comparison's premise: the old form is fp8
        x = torch.randn(11, experts.shapes["gate_proj"][1], generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:2] for _ in range(11)])
        weights = torch.rand(11, 2, generator=gen)
        for run in (moe_dynamic, moe_static):
            assert torch.equal(run(x, weights, ids, experts.weights()), run(x, weights, ids, old.weights()))


def test_engine_greedy_ids_and_logprobs_equal_the_fp8_stacks_and_the_wider_bytes_are_resident(tiny_v3_fp8):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = ["Hello there", "0123456789", "abc abc"]
    checkpoint = _checkpoint(tiny_v3_fp8)
    with LLM(str(tiny_v3_fp8), weight_format="dequantize", num_blocks=64) as llm:
        model = llm.engine.model
        now = [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in llm.generate(prompts, params)]
        weights, resident = resident_weight_bytes(model)
        moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
        expert_weights = sum(m.experts.num_experts * sum(a * b for a, b in m.experts.shapes.values())
                             for m in moes.values())
        for name, moe in moes.items():  # back to the fp8 stacks widened at every call: the old load
            moe.experts = _fp8_stacks(name, moe.experts, checkpoint, model.args.num_hidden_layers, torch.float32)
        before = [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in llm.generate(prompts, params)]
        old_weights, old_resident = resident_weight_bytes(model)
    assert now == before
    # 4 bytes a routed-expert weight now, 1 before plus the fp32 scale grids (one per 128 x 128 block or part)
    scales = sum(m.experts.num_experts * 4 * sum(-(-a // 128) * -(-b // 128) for a, b in m.experts.shapes.values())
                 for m in moes.values())
    assert weights == old_weights and resident - old_resident == 3 * expert_weights - scales


def test_loads_for_neuron_graphs_keep_the_fp8_stacks(tiny_v3_fp8):
    """On the device the routed experts stay fp8 (the TP=64 memory plan counts a byte a weight; the static MoE widens
    inside the graph): ``host_steps=False``, which the worker passes when the regions compile for neuron."""
    model = load_model(str(tiny_v3_fp8), dtype=torch.bfloat16, progress=False, host_steps=False)
    stacks = [m.experts for m in model.modules() if isinstance(m, MoE)]
    assert stacks
    for experts in stacks:
        for proj in RoutedExperts.PROJS:
            assert getattr(experts, proj).dtype == torch.float8_e4m3fn
            assert getattr(experts, proj + "_scale_inv") is not None
