"""GEMMs on packed quantized weights (kernels/packed_gemm.py, kernels/csrc/packed_gemm.cpp) against plain torch
dequantize-then-matmul, on every instruction set this CPU runs (forced by name), and the repack layouts
(kernels/packed_weights.py) against the checkpoint bytes.

fp32-widening paths: the reference's function up to summation order, |err| <= 1e-5 * (|x| @ |W|^T) elementwise.
int8 paths (GGUF, activations rounded to int8 per 32 inputs): (a) the reference on the rounded activations up to
summation order, same tolerance; (b) against the fp32 reference, |err| <= int8_error_bound (half a rounding step
per input times |W|, computed per output), and the measured error is printed (pytest -s).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from kernels.fp4 import quantize_fp4
from kernels.packed_gemm import (int8_error_bound, packed_kernels_available, packed_linear,
                                 packed_linear_int8_reference, packed_linear_reference, quantize_activations,
                                 supported_isas)
from kernels.packed_weights import (GGUF_LAYOUTS, PackedGGUF, pack_fp4, pack_fp8, pack_gguf,
                                    repack_source_index)
from kernels.quant import quantize_block_fp8

ROWS = (1, 2, 7, 32, 129)


@pytest.fixture(scope="module")
def isas() -> list[str]:
    assert packed_kernels_available(), "the packed GEMMs did not build"
    return supported_isas()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_weight(out: int, inp: int, gen: torch.Generator, block=(128, 128), scale_fmt="float", raw=False):
    if raw:  # every e4m3 code but NaN (subnormals included), random fp32 scales
        codes = torch.randint(0, 255, (out, inp), generator=gen, dtype=torch.uint8)
        codes[codes == 0x7F] = 0x7E
        grid = (-(-out // block[0]), -(-inp // block[1]))
        scale = torch.rand(grid, generator=gen) * 0.01 + 1e-3
        return pack_fp8(codes.view(torch.float8_e4m3fn), scale, block)
    q, scale = quantize_block_fp8(torch.randn(out, inp, generator=gen), block, scale_fmt)
    return pack_fp8(q, scale, block)


def _fp4_weight(out: int, inp: int, gen: torch.Generator, raw=False):
    if raw:  # every code, e8m0 scales as the checkpoint's float8_e8m0fnu bytes
        codes = torch.randint(0, 256, (out, inp // 2), generator=gen, dtype=torch.uint8)
        exps = torch.randint(118, 130, (out, inp // 32), generator=gen, dtype=torch.uint8)
        return pack_fp4(codes.view(torch.int8), exps.view(torch.float8_e8m0fnu))
    packed, scale = quantize_fp4(torch.randn(out, inp, generator=gen))
    return pack_fp4(packed, scale)


def _gguf_bytes(qtype: str, out: int, inp: int, seed: int) -> np.ndarray:  # [out, row_bytes] uint8
    rng = np.random.default_rng(seed)
    if qtype == "q4_k":  # gguf 0.19 has no Q4_K quantizer: random blocks with sane d / dmin
        blocks = rng.integers(0, 256, size=(out, inp // 256, 144), dtype=np.uint8)
        blocks[..., 0:2] = (rng.uniform(1e-3, 4e-3, (out, inp // 256, 1))
                            .astype(np.float16).view(np.uint8))
        blocks[..., 2:4] = (rng.uniform(1e-3, 8e-3, (out, inp // 256, 1))
                            .astype(np.float16).view(np.uint8))
        return blocks.reshape(out, -1)
    weight = rng.standard_normal((out, inp)).astype(np.float32) * 0.05
    return gguf_quantize(weight, GGMLQuantizationType[qtype.upper()])


def _gguf_weight(qtype: str, out: int, inp: int, seed: int) -> PackedGGUF:
    return pack_gguf(_gguf_bytes(qtype, out, inp, seed), qtype, inp)


def _check_fp32_path(x, weight, bias, got, reference_w):
    """|got - x @ W^T - bias| <= 1e-5 (|x| @ |W|^T) (+ a bf16 output's rounding); returns the worst ratio."""
    want = x.double() @ reference_w.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ reference_w.double().abs().T
    tol = 1e-5 * scale + 1e-30
    if got.dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * want.abs()
    err = (got.double() - want).abs()
    assert got.shape == want.shape
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, worst err / tol {(err / tol).max().item():.3g}"
    return (err / scale.clamp_min(1e-30)).max().item()


FP8_CASES = [  # (out, in, block, scale format, raw codes)
    (37, 53, (128, 128), "float", False),
    (16, 128, (128, 128), "ue8m0", False),
    (300, 257, (128, 128), "ue8m0", True),
    (50, 130, (32, 48), "float", True),
]


@pytest.mark.parametrize("out,inp,block,scale_fmt,raw", FP8_CASES)
def test_fp8_matches_dequantize_then_matmul(isas, out, inp, block, scale_fmt, raw):
    gen = _gen(out * 1000 + inp)
    weight = _fp8_weight(out, inp, gen, block, scale_fmt, raw)
    w = weight.dequantize()
    bias = torch.randn(out, generator=gen)
    worst = 0.0
    for rows in ROWS:
        x = torch.randn(rows, inp, generator=gen)
        for isa in isas:
            for b in (None, bias) if rows == 7 else (None,):
                worst = max(worst, _check_fp32_path(x, weight, b, packed_linear(x, weight, b, "fp32", isa), w))
    print(f"fp8 {out}x{inp} block {block}: max |err| / (|x| @ |W|^T) = {worst:.2e}")


@pytest.mark.parametrize("out,inp,raw", [(37, 64, False), (16, 32, True), (100, 320, True)])
def test_fp4_matches_dequantize_then_matmul(isas, out, inp, raw):
    gen = _gen(out * 1000 + inp)
    weight = _fp4_weight(out, inp, gen, raw)
    w = weight.dequantize()
    worst = 0.0
    for rows in ROWS:
        x = torch.randn(rows, inp, generator=gen)
        for isa in isas:
            worst = max(worst, _check_fp32_path(x, weight, None, packed_linear(x, weight, None, "fp32", isa), w))
    print(f"fp4 {out}x{inp}: max |err| / (|x| @ |W|^T) = {worst:.2e}")


GGUF_CASES = [("q8_0", 37, 96), ("q8_0", 16, 32), ("q4_0", 37, 96), ("q4_0", 50, 320), ("q4_1", 37, 96),
              ("q4_1", 33, 576), ("q4_k", 37, 256), ("q4_k", 20, 512)]


@pytest.mark.parametrize("qtype,out,inp", GGUF_CASES)
def test_gguf_fp32_path_matches_dequantize_then_matmul(isas, qtype, out, inp):
    weight = _gguf_weight(qtype, out, inp, seed=out + inp)
    w = weight.dequantize()
    gen = _gen(out + inp)
    bias = torch.randn(out, generator=gen)
    worst = 0.0
    for rows in ROWS:
        x = torch.randn(rows, inp, generator=gen)
        for isa in isas:
            for b in (None, bias) if rows == 2 else (None,):
                worst = max(worst, _check_fp32_path(x, weight, b, packed_linear(x, weight, b, "fp32", isa), w))
    print(f"{qtype} {out}x{inp} fp32 path: max |err| / (|x| @ |W|^T) = {worst:.2e}")


@pytest.mark.parametrize("qtype,out,inp", GGUF_CASES)
def test_gguf_int8_path_within_its_documented_bound(isas, qtype, out, inp):
    weight = _gguf_weight(qtype, out, inp, seed=out + inp)
    w = weight.dequantize()
    gen = _gen(7 * out + inp)
    worst_exact, worst_bound, worst_rel = 0.0, 0.0, 0.0
    for rows in ROWS:
        x = torch.randn(rows, inp, generator=gen)
        x[0, :32] *= 50  # one block with a large outlier: coarse steps there
        want_rounded = packed_linear_int8_reference(x, weight).double()
        want = x.double() @ w.double().T
        bound = int8_error_bound(x, weight, w).double()
        q, d, _ = quantize_activations(x)
        x_rounded = (q.float().view(rows, -1, 32) * d[..., None]).view(rows, inp)
        rounded_scale = x_rounded.double().abs() @ w.double().abs().T
        for isa in isas:
            got = packed_linear(x, weight, None, "int8", isa).double()
            # (a) the reference's function of the rounded activations, up to summation order
            err = (got - want_rounded).abs()
            assert bool((err <= 1e-5 * rounded_scale + 1e-30).all()), (isa, rows, (err / rounded_scale).max())
            worst_exact = max(worst_exact, (err / rounded_scale.clamp_min(1e-30)).max().item())
            # (b) against dequantize-then-matmul on the exact activations: within the bound computed here
            err = (got - want).abs()
            assert bool((err <= bound).all()), (isa, rows, (err / bound).max())
            worst_bound = max(worst_bound, (err / bound).max().item())
            worst_rel = max(worst_rel, (err.norm() / want.norm()).item())
    print(f"{qtype} {out}x{inp} int8 path: vs rounded-activation reference {worst_exact:.2e} of |x^| @ |W|^T; "
          f"vs fp32 reference max err / bound {worst_bound:.3f}, max ||err|| / ||y|| {worst_rel:.2e}")


def test_int8_activation_blocks_equal_the_torch_form_bit_for_bit(isas):
    x = torch.randn(9, 320, generator=_gen(3)) * torch.logspace(-3, 3, 320)
    x[2, 32:64] = 0  # an all-zero block: d = 0, q = 0
    x[4, 5] = 0.5 * (x[4, :32].abs().max() / 127)  # near a rounding tie
    q, d, s = torch.ops.deepinfer.packed_quantize_rows(x)
    tq, td, ts = quantize_activations(x)
    assert torch.equal(q, tq) and torch.equal(d, td) and torch.equal(s, ts)
    assert int(q.abs().max()) <= 127


def test_bf16_activations_and_every_isa_agree(isas):
    weight = _gguf_weight("q4_1", 40, 256, seed=5)
    x = torch.randn(5, 256, generator=_gen(5))
    for path in ("fp32", "int8"):
        outs = [packed_linear(x.bfloat16(), weight, None, path, isa) for isa in isas]
        assert all(o.dtype == torch.bfloat16 and o.shape == (5, 40) for o in outs)
        want = packed_linear(x.bfloat16().float(), weight, None, path, isas[-1])
        for o in outs:  # the same fp32 sums (up to order), rounded to bf16 once
            torch.testing.assert_close(o.float(), want, rtol=2 ** -7, atol=1e-4)
    fp8 = _fp8_weight(40, 200, _gen(6))
    _check_fp32_path(x[:, :200].bfloat16().float(), fp8, None,
                     packed_linear(x[:, :200].bfloat16(), fp8, None, "auto"), fp8.dequantize())


@pytest.mark.parametrize("qtype", sorted(GGUF_LAYOUTS))
def test_gguf_repack_is_a_documented_permutation_of_the_file_bytes(qtype):
    block_k = GGUF_LAYOUTS[qtype][0]
    file_bytes = torch.from_numpy(_gguf_bytes(qtype, 37, 2 * block_k, seed=11).copy())
    weight = pack_gguf(file_bytes.numpy(), qtype)
    index = repack_source_index(weight)
    flat = file_bytes.flatten()
    valid = index >= 0
    # a bijection onto the file's bytes, plus zero bytes for the padding rows (37 -> 48)
    assert torch.equal(index[valid].sort().values, torch.arange(flat.numel()))
    assert torch.equal(weight.data[valid], flat[index[valid]]) and not bool(weight.data[~valid].any())
    assert torch.equal(weight.file_bytes(), file_bytes)
    # the documented positions (kernels/packed_weights.py): tile t, block b, row j, group g, byte i
    row_bytes = file_bytes.shape[1]
    block_bytes = GGUF_LAYOUTS[qtype][1]
    t, b, j = 1, 1, 5
    src = (16 * t + j) * row_bytes + b * block_bytes  # the row's block in the file
    packed = weight.data[t, b]
    assert int(index[t, b, 2 * j]) == src and int(index[t, b, 2 * j + 1]) == src + 1  # d
    if qtype == "q4_1":
        assert int(index[t, b, 32 + 2 * j]) == src + 2  # m
        for g, i in ((0, 0), (3, 2)):
            assert int(index[t, b, 64 + 64 * g + 4 * j + i]) == src + 4 + 4 * g + i  # qs
    if qtype == "q4_k":
        assert int(index[t, b, 32 + 2 * j]) == src + 2  # dmin
        for s in (0, 11):
            assert int(index[t, b, 64 + 16 * s + j]) == src + 4 + s  # scales, byte-major
        for g, i in ((0, 0), (31, 3)):
            assert int(index[t, b, 256 + 64 * g + 4 * j + i]) == src + 16 + 4 * g + i
    if qtype in ("q8_0", "q4_0"):
        assert int(index[t, b, 32 + 64 * 1 + 4 * j + 3]) == src + 2 + 4 + 3
    assert packed.numel() == 16 * block_bytes


def test_fp8_and_fp4_repacks_are_permutations():
    fp8 = _fp8_weight(37, 53, _gen(1), raw=True)
    index = repack_source_index(fp8)
    codes = fp8.codes().view(torch.uint8)
    valid = index >= 0
    assert torch.equal(index[valid].sort().values, torch.arange(codes.numel()))
    assert torch.equal(fp8.data[valid], codes.flatten()[index[valid]])
    assert fp8.data.shape == (3, 53, 16) and int(index[1, 7, 3]) == (16 + 3) * 53 + 7  # data[t, k, j] = W[16t+j, k]
    fp4 = _fp4_weight(37, 64, _gen(2), raw=True)
    index = repack_source_index(fp4)
    valid = index >= 0
    assert torch.equal(fp4.data[valid], fp4.codes().flatten()[index[valid]])
    assert fp4.data.shape == (3, 32, 16) and fp4.scales.shape == (3, 2, 16)


def test_q4_1_holds_0_625_bytes_per_weight_and_the_real_file_matches(smollm2_path, isas):
    from backend_lib.models.loading.gguf_file import GGUFFile
    tensor = next(t for t in GGUFFile(smollm2_path).tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    rows = np.asarray(tensor.data)  # [576 out, 960 bytes]: 1536 inputs
    weight = pack_gguf(rows, "q4_1")
    assert (weight.out_features, weight.in_features) == (576, 1536)
    assert weight.nbytes == rows.nbytes and weight.bytes_per_weight == 0.625  # 20 bytes a 32-weight block
    assert torch.equal(weight.file_bytes(), torch.from_numpy(rows.copy()))
    w = weight.dequantize()
    x = torch.randn(3, 1536, generator=_gen(9))
    _check_fp32_path(x, weight, None, packed_linear(x, weight, None, "fp32"), w)
    err = (packed_linear(x, weight, None, "int8").double() - x.double() @ w.double().T).abs()
    assert bool((err <= int8_error_bound(x, weight, w)).all())


def test_compiled_region_keeps_one_opaque_call(isas):
    weight = _gguf_weight("q4_0", 32, 64, seed=1)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x, data):
        return torch.ops.deepinfer.packed_linear(x, data, weight.scales, None, "q4_0", 32, [], "auto", "auto") * 2

    x = torch.randn(2, 64)
    got = torch.compile(f, backend=backend, fullgraph=True)(x, weight.data)
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "packed_linear" in str(n.target)]
    assert len(calls) == 1
    torch.testing.assert_close(got, 2 * packed_linear(x, weight), rtol=0, atol=0)


def test_bad_input_names_the_field(isas):
    weight = _gguf_weight("q4_1", 20, 64, seed=2)
    with pytest.raises(RuntimeError, match="in_features 96"):
        packed_linear(torch.randn(2, 96), weight)
    with pytest.raises(RuntimeError, match="int8 path is for GGUF"):
        packed_linear(torch.randn(2, 53), _fp8_weight(20, 53, _gen(0)), None, "int8")
    with pytest.raises(RuntimeError, match="isa must be"):
        packed_linear(torch.randn(2, 64), weight, None, "auto", "sse9")
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_fp8(torch.zeros(8, 8).to(torch.float8_e4m3fn), torch.ones(1, 1), (8, 8))
    with pytest.raises(ValueError, match="powers of two"):
        pack_fp4(torch.zeros(4, 16, dtype=torch.int8), torch.full((4, 1), 0.3))
    with pytest.raises(ValueError, match="1536 inputs"):
        pack_gguf(np.zeros((4, 960), np.uint8), "q4_1", 1000)
    with pytest.raises(ValueError, match="path must be"):
        packed_linear(torch.randn(2, 64), weight, None, "fp16")


def test_reference_fallback_is_the_same_function():
    weight = _gguf_weight("q4_k", 16, 256, seed=4)
    x = torch.randn(3, 256, generator=_gen(4))
    _check_fp32_path(x, weight, None, packed_linear_reference(x, weight), weight.dequantize())
