"""The host decode attention kernel at long contexts (many 1,024-key parts merged, many 256-key softmax segments):
against the torch form over every cache dtype it takes, on any thread count, and with the softmax's mass on one
key at either end of a long context (the parts' rescaling at its extremes)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_decode_attention
from kernels.cpu_kernels import load_cpu_kernels
from kernels.kv_fp8 import KVQuant

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's layout
SCALE = HEAD_DIM ** -0.5


@pytest.fixture(scope="module")
def cpu_kernels() -> None:
    assert load_cpu_kernels(), "the C++ host kernels (kernels/csrc) did not build: see the warning logged above"


def _case(seq_lens: list[int], query_len: int, dtype: str, seed: int = 0):
    """q [B*Q, H, D], caches [slots, Hkv, D] (fp8: e4m3 codes of N(0, 1) / 16 with scales 1/16), scattered block
    tables [B, nb] int32 padded with block 0, seq_lens [B] int32, and the caches' KVQuant (fp8) or None."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(seq_lens) // BLOCK)
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, s in enumerate(seq_lens):
        tables[b, : -(-s // BLOCK)] = torch.tensor([ids.pop() for _ in range(-(-s // BLOCK))], dtype=torch.int32)
    k = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(len(seq_lens) * query_len, HEADS, HEAD_DIM, generator=gen)
    quant = None
    if dtype == "fp8":
        quant = KVQuant(1 / 16, 1 / 16)
        k, v = ((x * 16).to(torch.float8_e4m3fn).view(torch.uint8) for x in (k, v))
    elif dtype == "bf16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    return q, k, v, tables, torch.tensor(seq_lens, dtype=torch.int32), quant


def _fp32_reference(q, k, v, tables, lens, query_len, quant) -> torch.Tensor:
    """The torch form (gather + SDPA) in fp32 over the caches' values (fp8 codes dequantized, bf16 widened)."""
    if quant is not None:
        k, v = (x.view(torch.float8_e4m3fn).float() * s for x, s in ((k, quant.k_scale), (v, quant.v_scale)))
    return paged_decode_attention(q.float(), k.float(), v.float(), tables, lens, query_len, BLOCK, SCALE)


# Contexts of 16 and 20 parts plus a few keys (the last part short), next to a short request in the same call; two
# queries a request at long context (the second sees one key more). bf16: q, caches and output in bf16, so the
# output's rounding (2^-9 relative, outputs within ~0.1 at these contexts) bounds the gap.
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 2e-3), ("fp8", 1e-5)])
@pytest.mark.parametrize("seq_lens,query_len", [([16384 + 7, 300], 1), ([20480 + 1], 1), ([9000, 4100], 2)])
def test_long_contexts_match_the_torch_form(dtype, tol, seq_lens, query_len, cpu_kernels):
    q, k, v, tables, lens, quant = _case(seq_lens, query_len, dtype)
    got = paged_decode_attention(q, k, v, tables, lens, query_len, BLOCK, SCALE, cpu_kernel=True, kv_quant=quant)
    want = _fp32_reference(q, k, v, tables, lens, query_len, quant)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert (got.float() - want).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_long_contexts_give_the_same_bits_on_one_and_two_threads(dtype, cpu_kernels):
    q, k, v, tables, lens, quant = _case([16384 + 5, 33, 5000], 1, dtype, seed=1)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(paged_decode_attention(q, k, v, tables, lens, 1, BLOCK, SCALE, cpu_kernel=True,
                                                  kv_quant=quant))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


# One key whose score exceeds every other by 50 or more (the rest weigh < 1e-17 together): the output is its value,
# whichever end of a 16k context it sits at, so the merge gives earlier parts' sums the right (vanishing) weight
# and never lets a part whose maximum is far below the request's turn into NaN or a wrong weight.
@pytest.mark.parametrize("position", [0, 700, 8191, 16384 + 2])
def test_one_dominant_key_anywhere_in_a_long_context_gives_its_value(position, cpu_kernels):
    seq_len = 16384 + 3
    q, k, v, tables, lens, _ = _case([seq_len], 1, "fp32", seed=2)
    k *= 0.01  # every other score ~0.01
    slot = int(tables[0, position // BLOCK]) * BLOCK + position % BLOCK
    k[slot] = q.view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).sum(1) * (100 / SCALE / q.pow(2).sum(-1).min())
    got = paged_decode_attention(q, k, v, tables, lens, 1, BLOCK, SCALE, cpu_kernel=True)
    want = v[slot].repeat_interleave(HEADS // KV_HEADS, dim=0)  # [H, D]
    assert torch.isfinite(got).all()
    assert (got[0] - want).abs().max().item() <= 1e-5
