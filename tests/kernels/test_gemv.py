"""The few-row GEMM on blocked weights (kernels/gemv.py, kernels/csrc/gemv.cpp) against torch's matmul.

Every code path this CPU can run is checked (the CPU-flag dispatch picks one; the others are forced by name),
on shapes that are not multiples of the 16-row tile or of the bf16 pair (and on whole 32-wide k blocks, which
bf16 x bf16 runs on AMX tiles where the CPU has them), at T = 1..8 and past the 8- and 32-row blocks, with and
without bias, fp32 and bf16 weights, fp32 and bf16 activations. Then the model wiring: a Linear packed
for the host equals F.linear, compiled regions keep the op as one call with the same result, and a tiny Llama
packed each way gives transformers' logits. The fused epilogues (residual add; SiLU-and-multiply of a [gate; up]
weight; fp32 output of bf16 sums) equal the unfused pair of ops to the bit on every path.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend_lib.models.layers import HostGemmPlan, Linear
from backend_lib.models.loading.loader import load_model
from backend_lib.worker.executor.rank import host_gemm_plan
from kernels.fused_layer_ops import silu_and_mul
from kernels.gemv import (GemvPolicy, block_weight, blocked_linear, blocked_linear_add, blocked_linear_argmax,
                          blocked_linear_float, blocked_linear_silu_mul, gemv_available, kernel_isa, unblock_weight)
from kernels.sampling import row_argmax

ISAS = ("amx_bf16", "avx512_bf16", "avx512", "avx2", "scalar")


@pytest.fixture(scope="module")
def isas() -> list[str]:
    assert gemv_available(torch.device("cpu"), torch.float32), "the C++ kernels did not build"
    return list(ISAS[ISAS.index(kernel_isa()):])


def _reference(x, weight, bias):  # float64 on the same (rounded) inputs
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("weight_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_kernel_matches_matmul_on_odd_shapes(isas, weight_dtype, x_dtype):
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in [(37, 53), (16, 16), (100, 577), (33, 1), (50, 130), (37, 64), (50, 576)]:
        weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
        bias = torch.randn(out_features, generator=gen)
        blocked = block_weight(weight)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 19, 70):  # 70: eight 8-row passes and a 6-row one
            x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
            for with_bias in (False, True):
                b = bias if with_bias else None
                want = _reference(x, weight, b)
                # fp32 sums in another order: ~1e-6 relative; a bf16 output rounds to 2^-8 of the value.
                tol = 1e-5 * in_features ** 0.5 if x_dtype == torch.float32 else 1e-2 * want.abs().max().item()
                for isa in isas:
                    got = blocked_linear(x, blocked, b, out_features, isa)
                    assert got.dtype == x_dtype and got.shape == (rows, out_features)
                    err = (got.double() - want).abs().max().item()
                    assert err <= tol, (isa, out_features, in_features, rows, with_bias, err)


@pytest.mark.parametrize("weight_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_fused_epilogues_equal_the_unfused_ops_to_the_bit(isas, weight_dtype, x_dtype):
    gen = torch.Generator().manual_seed(1)
    inter, in_features = 48, 37  # three gate / up tile pairs; an odd in (the bf16 pair's zero padding)
    gate_up = torch.randn(2 * inter, in_features, generator=gen).to(weight_dtype)
    proj = torch.randn(50, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(50, generator=gen).to(weight_dtype)
    for rows in (1, 3, 8, 13, 32):
        x = (2 * torch.randn(rows, in_features, generator=gen)).to(x_dtype)  # gates on both sides of SiLU's bend
        residual = torch.randn(rows, 50, generator=gen).to(x_dtype)
        for isa in isas:
            want = silu_and_mul(blocked_linear(x, block_weight(gate_up), None, 2 * inter, isa))
            assert torch.equal(blocked_linear_silu_mul(x, block_weight(gate_up), inter, isa), want), (isa, rows)
            want = blocked_linear(x, block_weight(proj), None, 50, isa).float()
            assert torch.equal(blocked_linear_float(x, block_weight(proj), 50, isa), want), (isa, rows)
            for b in (None, bias):
                want = blocked_linear(x, block_weight(proj), b, 50, isa) + residual
                got = blocked_linear_add(x, block_weight(proj), b, 50, residual, isa)
                assert torch.equal(got, want), (isa, rows, b is None)


def test_block_weight_round_trips_and_pads_with_zeros():
    for dtype, lanes in ((torch.float32, 16), (torch.bfloat16, 32)):
        weight = torch.randn(37, 53).to(dtype)
        blocked = block_weight(weight)
        assert blocked.shape == (3, 53 if dtype == torch.float32 else 27, lanes)
        assert torch.equal(unblock_weight(blocked, 37, 53), weight)
        assert torch.count_nonzero(blocked) == torch.count_nonzero(weight)  # the padding is zeros


def test_bad_input_names_the_field(isas):
    blocked = block_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="in_features 9"):
        blocked_linear(torch.randn(2, 9), blocked, None, 20)
    with pytest.raises(RuntimeError, match="out_features 40"):
        blocked_linear(torch.randn(2, 8), blocked, None, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        blocked_linear(torch.randn(2, 8), blocked, torch.randn(21), 20)
    with pytest.raises(RuntimeError, match="isa must be"):
        blocked_linear(torch.randn(2, 8), blocked, None, 20, "sse9")
    with pytest.raises(RuntimeError, match="residual must be \\[2, 20\\]"):
        blocked_linear_add(torch.randn(2, 8), blocked, None, 20, torch.randn(2, 19))
    with pytest.raises(RuntimeError, match="intermediate \\(10\\) must be a multiple of 16"):
        blocked_linear_silu_mul(torch.randn(2, 8), blocked, 10)
    with pytest.raises(ValueError, match="weight dtype"):
        block_weight(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_rows"):
        GemvPolicy(max_rows=0)


def test_host_policy_keeps_fp32_decode_batches_on_the_blocked_kernel_and_prefill_chunks_on_onednn():
    fp32 = GemvPolicy.for_host(torch.float32)
    assert fp32.use_blocked(1) and fp32.use_blocked(32) and fp32.use_blocked(128)
    assert not fp32.use_blocked(512)  # a chunked prefill
    bf16 = GemvPolicy.for_host(torch.bfloat16)
    assert bf16.use_blocked(1) and bf16.use_blocked(8) and not bf16.use_blocked(512)
    # the kernel's AMX or vdpbf16ps passes; without either, oneDNN's
    assert bf16.use_blocked(32) == (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


@pytest.mark.parametrize("plan", [HostGemmPlan(onednn=False), HostGemmPlan(policy=GemvPolicy(2))])
def test_packed_linear_equals_f_linear_eager_and_compiled(isas, plan):
    layer = Linear(70, 45, bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    layer.pack_for_cpu(plan)
    torch._dynamo.reset()  # Linear.forward's graphs per row count add up across the parametrized cases
    compiled = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=False)
    for rows in (1, 12):  # policy 2: the blocked kernel, then oneDNN
        x = torch.randn(rows, 70)
        want = F.linear(x, layer.weight, layer.bias)
        eager = layer(x)
        torch.testing.assert_close(eager, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(compiled(x), eager, atol=1e-5, rtol=0)


def test_compiled_graph_keeps_one_opaque_call(isas):
    layer = Linear(64, 32, bias=False, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
    layer.pack_for_cpu(HostGemmPlan(onednn=False))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(2, 64))
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "blocked_linear" in str(n.target)]
    assert len(calls) == 1


def test_host_gemm_plan_by_mode_and_dtype(isas):
    cpu = torch.device("cpu")
    assert host_gemm_plan("auto", cpu, torch.float32) == HostGemmPlan(onednn=True, blocked=True,
                                                                       policy=GemvPolicy.for_host(torch.float32))
    assert host_gemm_plan("gemv", cpu, torch.float32) == HostGemmPlan(onednn=False, blocked=True,
                                                                       policy=GemvPolicy(max_rows=None))
    for mode, layouts in (("onednn", (True, False)), ("mkl", (False, False))):  # no blocked weight: no policy
        plan = host_gemm_plan(mode, cpu, torch.float32)
        assert (plan.onednn, plan.blocked) == layouts
    assert host_gemm_plan("auto", cpu, torch.bfloat16).blocked


@pytest.mark.parametrize("plan", [HostGemmPlan(onednn=False), HostGemmPlan(policy=GemvPolicy(2))])
def test_tiny_llama_packed_matches_transformers_logits(isas, tiny_llama_dir, plan):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model = load_model(str(tiny_llama_dir), torch.float32).eval()
    model.pack_for_cpu(plan)
    assert model.blocked_head is not None and model.lm_head.blocked is None  # the head is packed once
    hidden = torch.randn(5, model.arch.hidden_size)
    with torch.inference_mode():
        for rows in (1, 5):  # the blocked kernel; with policy 2, 5 rows take oneDNN
            got = model.compute_logits(hidden[:rows])
            want = hf.lm_head(hidden[:rows])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("weight_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
def test_fused_argmax_picks_the_stored_logits_argmax(isas, weight_dtype, x_dtype):
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in [(37, 53), (100, 577), (50, 576), (3000, 64)]:
        weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
        weight[out_features // 2] = weight[out_features // 3]  # tied columns: the first one wins
        blocked = block_weight(weight)
        for rows in (1, 5, 13, 32, 70):
            x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
            x[rows // 2, 0] = float("nan") if rows > 1 else x[0, 0]  # a NaN logit row: its first NaN wins
            for isa in isas:
                want = row_argmax(blocked_linear_float(x, blocked, out_features, isa))
                assert torch.equal(blocked_linear_argmax(x, blocked, out_features, isa), want), (isa, rows)
