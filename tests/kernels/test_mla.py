"""MLA kernels: absorbed decode == expanded decode (<= 1e-5 fp32), prefill vs a dense reference, cache layout."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.mla import (gather_context, mla_decode_absorbed, mla_decode_expanded, mla_prefill, split_kv_b,
                         write_latent_cache)

H, DN, DP, DV, R, BS = 4, 16, 8, 12, 32, 4


def _filled_cache(num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn((num_blocks + 1) * BS, R + DP, generator=gen)


@pytest.mark.parametrize("query_len", [1, 3])
def test_absorbed_decode_equals_expanded(query_len):
    gen = torch.Generator().manual_seed(query_len)
    num_blocks, batch, max_blocks = 12, 3, 4
    cache = _filled_cache(num_blocks, gen)
    blocks = cache.view(-1, BS, R + DP)
    tables = torch.tensor([[3, 7, 1, num_blocks], [0, 2, 5, 9], [11, num_blocks, num_blocks, num_blocks]],
                          dtype=torch.int32)  # padded with the scratch block
    seq_lens = torch.tensor([10, 16, 3], dtype=torch.int32)
    q_nope = torch.randn(batch, query_len, H, DN, generator=gen)
    q_rope = torch.randn(batch, query_len, H, DP, generator=gen)
    kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    w_uk, w_uv = split_kv_b(kv_b, H, DN)
    scale = 1 / math.sqrt(DN + DP)
    absorbed = mla_decode_absorbed(q_nope, q_rope, blocks, tables, seq_lens, w_uk, w_uv, scale)
    expanded = mla_decode_expanded(q_nope, q_rope, blocks, tables, seq_lens, kv_b, scale)
    assert absorbed.shape == (batch, query_len, H, DV)
    assert (absorbed - expanded).abs().max() <= 1e-5
    # scratch rows must not leak in: poisoning everything past each context changes nothing
    poisoned = blocks.clone()
    poisoned[num_blocks] = 1e4
    again = mla_decode_absorbed(q_nope, q_rope, poisoned, tables, seq_lens, w_uk, w_uv, scale)
    assert torch.equal(again, absorbed)


def test_prefill_chunk_matches_dense_causal_attention():
    gen = torch.Generator().manual_seed(7)
    seq_len, chunk = 11, 5  # a chunk continuing a 6-token cached prefix
    latent, k_rope = torch.randn(seq_len, R, generator=gen), torch.randn(seq_len, DP, generator=gen)
    cache = torch.zeros(9 * BS, R + DP)
    table = torch.tensor([6, 2, 4, 8], dtype=torch.int32)
    slots = (table.long()[torch.arange(seq_len) // BS] * BS + torch.arange(seq_len) % BS)
    write_latent_cache(cache, slots, latent, k_rope)
    ctx = gather_context(cache.view(-1, BS, R + DP), table[None])[0, :seq_len]
    assert torch.equal(ctx, torch.cat([latent, k_rope], -1))
    q_nope, q_rope = torch.randn(chunk, H, DN, generator=gen), torch.randn(chunk, H, DP, generator=gen)
    kv_b = torch.randn(H * (DN + DV), R, generator=gen) * 0.3
    out = mla_prefill(q_nope, q_rope, cache.view(-1, BS, R + DP), table, seq_len, kv_b, 0.2)
    kv = (latent @ kv_b.T).view(seq_len, H, DN + DV)
    k = torch.cat([kv[..., :DN], k_rope[:, None].expand(-1, H, -1)], -1)
    q = torch.cat([q_nope, q_rope], -1)
    mask = torch.ones(chunk, seq_len, dtype=torch.bool).tril(seq_len - chunk)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), kv[..., DN:].transpose(0, 1), attn_mask=mask, scale=0.2)
    assert (out - ref.transpose(0, 1)).abs().max() <= 1e-5


def test_latent_cache_holds_rank_plus_rope_values_per_token_per_layer():
    from backend_lib.models.deepseek_v3.model import DeepseekV3Args, DeepseekV3ForCausalLM
    args = DeepseekV3Args(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, kv_lora_rank=24,
                          q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=1,
                          topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1)
    model = DeepseekV3ForCausalLM(args)
    assert model.kv_cache_shapes(40) == [(2, 40, 24 + 8)]
    real = DeepseekV3Args()  # DeepSeek-V3's own dimensions
    latent = real.kv_lora_rank + real.qk_rope_head_dim
    expanded = real.num_attention_heads * (real.qk_nope_head_dim + real.qk_rope_head_dim + real.v_head_dim)
    assert (latent, expanded) == (576, 40960)  # the README's 71x saving per token per layer
