"""DeepSeek-V4 kernels against transformers' modules and plain loops: mHC mixes (Sinkhorn) and the hyper head,
interleaved tail RoPE, window pooling (HCA and the overlapping CSA series), the indexer's top-k, attention with
sinks, page slots and fp4 (e2m1) dequantization."""
from __future__ import annotations

import types

import pytest
import torch

from kernels.compressed_attention import (
    TokenPages, indexer_select, top_k_in_order, pool_heavily_compressed, pool_overlapping, sink_attention,
)
from kernels.fp4 import dequantize_fp4, quantize_fp4
from kernels.hyper_connections import HyperConnectionSpec, hc_collapse, hc_expand, hc_head_collapse, hc_mixes
from kernels.interleaved_rope import apply_tail_rope, rope_cos_sin


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hf_config(**kw):
    from transformers import DeepseekV4Config
    return DeepseekV4Config(vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                            num_attention_heads=2, head_dim=16, q_lora_rank=8, n_routed_experts=4,
                            num_experts_per_tok=2, o_groups=2, o_lora_rank=4, index_n_heads=2, index_head_dim=16,
                            **kw)


def test_hyper_connection_mixes_and_head_match_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead
    config = _hf_config(hc_mult=4, hc_sinkhorn_iters=7)
    hc, head = DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)
    with torch.no_grad():
        for p in [*hc.parameters(), *head.parameters()]:
            p.copy_(torch.randn(p.shape, generator=_gen(p.numel())))
    streams = torch.randn(5, 4, 16, generator=_gen(1))
    spec = HyperConnectionSpec(4, 7, config.hc_eps, config.rms_norm_eps)
    post_ref, comb_ref, collapsed_ref = hc(streams[None])
    pre, post, comb = hc_mixes(streams, hc.fn.data, hc.base.data, hc.scale.data, spec)
    assert torch.allclose(post, post_ref[0], atol=1e-6) and torch.allclose(comb, comb_ref[0], atol=1e-6)
    assert torch.allclose(hc_collapse(streams, pre), collapsed_ref[0], atol=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-4)  # Sinkhorn: columns sum to one
    out = torch.randn(5, 16, generator=_gen(2))
    expected = post_ref[0][..., None] * out[:, None] + torch.matmul(comb_ref[0].transpose(-1, -2), streams)
    assert torch.allclose(hc_expand(out, streams, post, comb), expected, atol=1e-6)
    got = hc_head_collapse(streams, head.hc_fn.data, head.hc_base.data, head.hc_scale.data, spec)
    assert torch.allclose(got, head(streams[None])[0], atol=1e-6)


def test_tail_rope_matches_transformers_and_its_conjugate_undoes_it():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
    x = torch.randn(6, 3, 16, generator=_gen(3))  # [T, H, D], rope on the last 8 channels
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(6) * 5, 1.0, torch.float32)
    ours = apply_tail_rope(x, cos, sin)
    theirs = apply_rotary_pos_emb(x.transpose(0, 1)[None], cos[None], sin[None]).transpose(1, 2)[0]
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[..., :8], x[..., :8])
    assert torch.allclose(apply_tail_rope(ours, cos, -sin), x, atol=1e-6)


def _pool_reference(kv: list[torch.Tensor], gate: list[torch.Tensor]) -> torch.Tensor:  # lists of [D] -> [D]
    weights = torch.softmax(torch.stack(gate), dim=0)
    return (torch.stack(kv) * weights).sum(0)


def test_window_pooling_matches_a_per_window_loop():
    rate, dim = 3, 4
    tokens = torch.randn(12, 4 * dim, generator=_gen(4))  # per token [kv_a | kv_b | gate_a | gate_b]
    bias = torch.randn(rate, 2 * dim, generator=_gen(5))
    for w in range(4):  # CSA: entry w pools series A of window w - 1 with series B of window w
        lo = w * rate
        pos = torch.arange(lo - rate, lo + rate)
        window = tokens[pos.clamp(min=0)][None]
        got = pool_overlapping(window, (pos >= 0)[None], bias)[0]
        kv = [tokens[lo + i, dim:2 * dim] for i in range(rate)]
        gate = [tokens[lo + i, 3 * dim:] + bias[i, dim:] for i in range(rate)]
        if w:
            kv = [tokens[lo - rate + i, :dim] for i in range(rate)] + kv
            gate = [tokens[lo - rate + i, 2 * dim:3 * dim] + bias[i, :dim] for i in range(rate)] + gate
        assert torch.allclose(got, _pool_reference(kv, gate), atol=1e-6), w
    hca = tokens[:rate, :2 * dim]  # HCA: [kv | gate] of one window
    got = pool_heavily_compressed(hca[None], bias[:, :dim])[0]
    reference = _pool_reference([hca[i, :dim] for i in range(rate)],
                                [hca[i, dim:] + bias[i, :dim] for i in range(rate)])
    assert torch.allclose(got, reference, atol=1e-6)


def test_page_slots_windows_and_visible_entries():
    tables = torch.tensor([[5, 2, 7, 9], [1, 0, 3, 3]])
    pages = TokenPages(torch.tensor([6, 1]), tables, block_size=4)
    pos, exists = pages.recent(3)
    assert pos.tolist() == [[4, 5, 6], [-1, 0, 1]] and exists.tolist() == [[True] * 3, [False, True, True]]
    assert pages.slots(pos).tolist() == [[8, 9, 10], [4, 4, 5]]
    entry_pos, visible = pages.entries(rate=3)  # windows close at positions 2, 5, 8, 11, 14
    assert entry_pos[0].tolist() == [2, 5, 8, 11, 14]
    assert visible.tolist() == [[True, True, False, False, False], [False] * 5]


def test_indexer_picks_the_best_visible_entries():
    q = torch.randn(3, 2, 8, generator=_gen(6))
    keys = torch.randn(3, 6, 8, generator=_gen(7))
    weights = torch.randn(3, 2, generator=_gen(8))
    visible = torch.tensor([[True] * 6, [True] * 3 + [False] * 3, [True] + [False] * 5])
    picked = indexer_select(q, keys, weights, visible, top_k=2)
    for t in range(3):
        scores = [sum(float(weights[t, h]) * max(float(q[t, h] @ keys[t, e]), 0.0) for h in range(2))
                  for e in range(6) if visible[t, e]]
        best = sorted(range(len(scores)), key=lambda e: -scores[e])[:2]
        assert picked[t].nonzero().flatten().tolist() == sorted(best), t


def test_top_k_in_order_takes_ties_left_to_right_whatever_the_row_length():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [3.0, -1.0, -1.0, -1.0, float("-inf"), float("-inf")]])
    assert top_k_in_order(scores, 3).tolist() == [[True, True, False, False, True, False],
                                                  [True, True, True, False, False, False],
                                                  [True, True, True, False, False, False]]
    # masked (future) columns added, as a prefill row has them and a decode row not: the same picks
    wide = torch.cat([scores, torch.full((3, 5), float("-inf"))], dim=1)
    assert top_k_in_order(wide, 3)[:, :6].tolist() == top_k_in_order(scores, 3).tolist()
    # fewer finite scores than k: all finite ones, plus -inf fill that the caller masks with `visible`
    assert top_k_in_order(scores[2:], 5)[0, :4].all()


def test_top_k_in_order_equals_a_stable_sort_on_random_ties():
    gen = _gen(21)
    for _ in range(50):
        scores = torch.randint(0, 3, (4, 17), generator=gen).float()  # few values: many ties
        scores[torch.rand(4, 17, generator=gen) < 0.2] = float("-inf")
        k = int(torch.randint(1, 17, (1,), generator=gen))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        expected = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order, True)
        assert torch.equal(top_k_in_order(scores, k), expected)


def test_sink_attention_matches_transformers_eager_attention():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward
    q = torch.randn(4, 3, 8, generator=_gen(9))  # [T, H, D]
    keys = torch.randn(4, 5, 8, generator=_gen(10))  # [T, K, D] per query
    allowed = torch.rand(4, 5, generator=_gen(11)) > 0.4
    allowed[:, 0] = True
    sinks = torch.randn(3, generator=_gen(12))
    ours = sink_attention(q, keys, allowed, sinks, 8 ** -0.5)
    module = types.SimpleNamespace(num_key_value_groups=3, sinks=sinks, training=False)
    for t in range(4):
        mask = torch.where(allowed[t], 0.0, float("-inf"))[None, None, None, :]
        ref, _ = eager_attention_forward(module, q[t][None, :, None, :], keys[t][None, None], keys[t][None, None],
                                         mask, 8 ** -0.5)
        assert torch.allclose(ours[t], ref[0, 0], atol=1e-6), t


def test_fp4_round_trip_and_transformers_dequantization():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    weight = torch.randn(6, 64, generator=_gen(13))
    packed, scale = quantize_fp4(weight)
    assert packed.dtype == torch.int8 and packed.shape == (6, 32) and scale.shape == (6, 2)
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # ue8m0: powers of two
    dense = dequantize_fp4(packed, scale)
    assert torch.equal(dense, Fp8Dequantize(None)._dequantize_one(packed, scale, torch.float32))
    # e2m1 steps are at most 2 (between 4 and 6): every value is within one scale of the original
    assert ((dense - weight).abs() <= scale.repeat_interleave(32, dim=-1) * 1.0 + 1e-6).all()


def test_cpp_hc_mixes_match_the_torch_form():
    from dataclasses import replace

    from kernels.cpu_kernels import load_cpu_kernels
    assert load_cpu_kernels(), "the C++ kernels did not build"
    hc, dim = 4, 8
    streams = torch.randn(6, hc, dim, generator=_gen(2))
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=_gen(3))
    base, scale = torch.randn((2 + hc) * hc, generator=_gen(4)), torch.rand(3, generator=_gen(5)) + 0.5
    spec = HyperConnectionSpec(hc, 20, 1e-6, 1e-6)
    ref = hc_mixes(streams, fn, base, scale, spec)
    got = hc_mixes(streams, fn, base, scale, replace(spec, cpp_mixes=True))
    for a, b in zip(got, ref):  # other summation orders (norm, mix logits): not bit-equal
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert torch.allclose(got[2].sum(dim=-2), torch.ones(6, hc), atol=1e-5)  # columns sum to one


def test_cpp_sink_attention_matches_the_torch_form_over_concatenated_keys():
    from kernels.compressed_attention import cpu_sink_attention
    from kernels.cpu_kernels import load_cpu_kernels
    assert load_cpu_kernels(), "the C++ kernels did not build"
    tokens, heads, dim = 5, 3, 40  # dim not a multiple of 16: the dot products' scalar tail runs too
    q = torch.randn(tokens, heads, dim, generator=_gen(6))
    window, entries = torch.randn(tokens, 7, dim, generator=_gen(7)), torch.randn(tokens, 4, dim, generator=_gen(8))
    allowed, visible = torch.rand(tokens, 7, generator=_gen(9)) > 0.3, torch.rand(tokens, 4, generator=_gen(10)) > 0.5
    allowed[1], visible[1] = False, False  # a token with no key at all: the sink takes all the mass, output 0
    sinks = torch.randn(heads, generator=_gen(11))
    for shared in (False, True):  # per-token keys, or one key set shared by a chunk's queries
        w, e = (window[:1], entries[:1]) if shared else (window, entries)
        ref = sink_attention(q, torch.cat([w, e], dim=1), torch.cat([allowed, visible], dim=1), sinks, 0.3)
        got = cpu_sink_attention(q, w, allowed, e, visible, sinks, 0.3)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[1], torch.zeros(heads, dim))
    no_entries = cpu_sink_attention(q, window, allowed, entries[:, :0], visible[:, :0], sinks, 0.3)
    torch.testing.assert_close(no_entries, sink_attention(q, window, allowed, sinks, 0.3), atol=1e-5, rtol=1e-5)


def test_cpp_tail_rope_matches_the_torch_form():
    from kernels.cpu_kernels import load_cpu_kernels
    assert load_cpu_kernels(), "the C++ kernels did not build"
    cos, sin = rope_cos_sin(torch.rand(4, generator=_gen(12)), torch.arange(3, 8), 1.1, torch.float32)
    for x in (torch.randn(5, 2, 20, generator=_gen(13)), torch.randn(5, 8, generator=_gen(14))):  # heads or not
        for s in (sin, -sin):  # the output's conjugate rotation too
            torch.testing.assert_close(apply_tail_rope(x, cos, s, cpp=True), apply_tail_rope(x, cos, s),
                                       atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_hc_pre_and_post_match_the_torch_forms(dtype):
    from dataclasses import replace

    from kernels.cpu_kernels import load_cpu_kernels
    from kernels.hyper_connections import hc_post, hc_pre
    assert load_cpu_kernels(), "the C++ kernels did not build"
    hc, dim, tokens = 4, 32, 19  # hc * dim a multiple of 16 (the vector path); 19 tokens: groups of 4 and a remainder
    streams = torch.randn(tokens, hc, dim, generator=_gen(21)).to(dtype)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=_gen(22)) / 8
    base, scale = torch.randn((2 + hc) * hc, generator=_gen(23)), torch.rand(3, generator=_gen(24)) + 0.5
    spec = HyperConnectionSpec(hc, 20, 1e-6, 1e-6)
    cpp = replace(spec, cpp_mixes=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    ref, got = hc_pre(streams, fn, base, scale, spec), hc_pre(streams, fn, base, scale, cpp)
    assert got[0].dtype == dtype and got[0].shape == (tokens, dim)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)
    # the multi-row dot products sum each row in the single dot's order: the mixes op agrees to the bit
    pre_ref = hc_mixes(streams, fn, base, scale, cpp)[0]
    torch.testing.assert_close(got[0], hc_collapse(streams, pre_ref), **tol)
    block_out = torch.randn(tokens, dim, generator=_gen(25)).to(dtype)
    post, comb = ref[1], ref[2]
    expected = hc_expand(block_out, streams, post, comb)
    out = hc_post(block_out, streams, post, comb, cpp)
    assert out.dtype == dtype and out.shape == streams.shape
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(hc_post(block_out, streams, post, comb, spec), expected, atol=0, rtol=0)


def test_cpp_ring_sink_attention_matches_the_gathered_window():
    from kernels.attention_metadata import StateRows
    from kernels.compressed_attention import cpu_ring_sink_attention, cpu_sink_attention
    from kernels.cpu_kernels import load_cpu_kernels
    from kernels.state_ring import recent_rows
    assert load_cpu_kernels(), "the C++ kernels did not build"
    heads, dim, window, capacity = 3, 32, 6, 8  # capacity = window + 2 draft positions
    ring = torch.randn(5, capacity, dim, generator=_gen(31))  # 4 state slots + the scratch slot
    # a 3-token prefill chunk (positions 0..2, slot 1), then decode rows: 1 + 1 draft each (slots 0, 2) and a padded
    # row (slot -1, the scratch slot); positions below the window length leave masked keys
    positions = torch.tensor([0, 1, 2, 40, 41, 3, 4, 7, 8])
    slots = torch.tensor([1, 1, 1, 0, 0, 2, 2, -1, -1])
    starts = torch.tensor([0, 0, 0, 40, 40, 3, 3, 7, 7])
    rows = StateRows(slots, starts, starts + 2)
    fresh = torch.randn(positions.shape[0], dim, generator=_gen(32))
    q = torch.randn(positions.shape[0], heads, dim, generator=_gen(33))
    entries = torch.randn(6, 4, dim, generator=_gen(34))
    visible = torch.rand(6, 4, generator=_gen(35)) > 0.4
    sinks = torch.randn(heads, generator=_gen(36))
    first, count = 3, 6
    keys, allowed = recent_rows(ring, fresh, rows, positions, window, first, count, longest_chunk=2)
    for extra, extra_allowed in ((entries, visible), (entries[:1, :0], visible[:, :0])):
        ref = cpu_sink_attention(q[first:], keys, allowed, extra, extra_allowed, sinks, 0.2)
        got = cpu_ring_sink_attention(q[first:], ring, fresh, rows, positions, first, window, extra, extra_allowed,
                                      sinks, 0.2)
        assert torch.equal(got, ref)  # the same keys in the same order: the same bits
    torch.testing.assert_close(
        cpu_sink_attention(q[first:], keys, allowed, entries, visible, sinks, 0.2),
        sink_attention(q[first:], torch.cat([keys, entries], dim=1), torch.cat([allowed, visible], dim=1), sinks,
                       0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_rms_norm_matches_the_torch_forms(dtype):
    from backend_lib.models.deepseek_v3.layers import RMSNorm
    from kernels.cpu_kernels import load_cpu_kernels
    from kernels.hyper_connections import unweighted_rms_norm
    assert load_cpu_kernels(), "the C++ kernels did not build"
    x = (torch.randn(5, 3, 40, generator=_gen(41)) * 3).to(dtype)  # 40: not a multiple of 16 (the scalar tail)
    norm = RMSNorm(40, 1e-6)
    norm.weight.data = torch.randn(40, generator=_gen(42))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    ref = norm(x)
    norm.cpp = True
    got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(unweighted_rms_norm(x, 1e-6, cpp=True), unweighted_rms_norm(x, 1e-6), **tol)
