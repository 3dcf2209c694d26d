"""dtype=bfloat16 on the host: the bf16 decode kernel and packed GEMM against fp32 math on the same bf16 values, and
the engine in bf16 against transformers in bf16 (tiny Llama, tiny DeepSeek-V3) and against itself on two ranks.

Two correct bf16 implementations round differently, so greedy ids are compared with the near-tie rule of
tests/helpers/greedy_agreement.py: where a continuation differs, the reference's top two logits must be within a few
bf16 ulps there."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.models.layers import Linear
from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from kernels.attention import paged_attention, reference_attention, write_kv
from kernels.cpu_kernels import load_cpu_kernels
from kernels.onednn_gemm import PackedWeight, onednn_gemm_available, packed_linear
from tests.helpers.greedy_agreement import first_divergence, hf_greedy_with_logits, near_tie_bound
from tests.helpers.attention_batches import mixed_batch
from tests.helpers.paged_runner import HybridPagedRunner, PagedRunner

BF16 = torch.bfloat16
NEW_TOKENS = 24
# bf16 keeps 8 significant bits: one final rounding is at most half an ulp, 2^-9 of the value (2^-8 leaves room
# for the fp32 sums' order).
BF16_RELATIVE = 2.0 ** -8


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=gen).tolist() for length in (5, 19, 11, 2, 33, 7)[:n]]


@pytest.mark.parametrize("heads,kv_heads,decode_seq_lens,decode_q,head_dim", [
    (9, 3, [4, 40, 23, 8], 1, 64),  # SmolLM2's head layout, the vectorized widening
    (6, 2, [9, 33], 3, 16),  # GQA, Q=3 (drafts)
    (4, 4, [5, 17, 1], 1, 8),  # head_dim 8: the scalar loops
])
def test_bf16_decode_kernel_is_fp32_math_on_bf16_values(heads, kv_heads, decode_seq_lens, decode_q, head_dim):
    assert load_cpu_kernels(), "the C++ host kernels (kernels/csrc) did not build: see the warning logged above"
    block_size, num_blocks = 4, 64
    meta, num_tokens = mixed_batch(decode_seq_lens, decode_q, [], block_size, num_blocks)
    gen = torch.Generator().manual_seed(2)
    num_slots = (num_blocks + 1) * block_size
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(BF16)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(BF16)
    write_kv(k_cache, torch.randn(num_tokens, kv_heads, head_dim, generator=gen), meta.slot_mapping)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(BF16)
    scale = head_dim ** -0.5
    want = reference_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = paged_attention(q, k_cache, v_cache, meta, scale, cpu_kernel=True)
    assert got.dtype == BF16 and got.shape == q.shape
    assert ((got.float() - want).abs() <= BF16_RELATIVE * want.abs() + 1e-6).all()
    # The torch form (SDPA in bf16: probabilities rounded to bf16 before the values) stays close too.
    torch_form = paged_attention(q, k_cache, v_cache, meta, scale, cpu_kernel=False)
    assert torch_form.dtype == BF16 and (torch_form.float() - want).abs().max().item() <= 2e-2


@pytest.mark.skipif(not onednn_gemm_available(torch.device("cpu"), BF16), reason="oneDNN has no bf16 GEMM here")
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_bf16_packed_gemm_is_fp32_accumulation_rounded_once(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(200, 96, generator=gen) * 0.1).to(BF16)  # [out, in]
    bias = torch.randn(200, generator=gen).to(BF16)
    x = torch.randn(rows, 96, generator=gen).to(BF16)
    got = packed_linear(x, weight, bias, PackedWeight(weight))
    want = F.linear(x.float(), weight.float(), bias.float())
    assert got.dtype == BF16
    assert ((got.float() - want).abs() <= BF16_RELATIVE * want.abs() + 1e-6).all()


def _assert_near_ties(ours: list[list[int]], hf_model, prompts: list[list[int]], logprobs,
                      logprob_tolerance: float) -> None:
    """Every divergence from transformers' greedy continuation starts at a near-tie; our log-probabilities of
    the tokens before it stay within ``logprob_tolerance`` (bf16 noise) of transformers'. How many diverge
    depends on the CPU's GEMM kernels (AMX, AVX512-BF16 or emulated), so only the rule is asserted."""
    for prompt, tokens, our_logprobs in zip(prompts, ours, logprobs):
        theirs, their_logits = hf_greedy_with_logits(hf_model, prompt, NEW_TOKENS)
        divergence = first_divergence(tokens, theirs, their_logits)
        assert divergence is None or divergence.near_tie, f"prompt of {len(prompt)} tokens: {divergence}"
        for step in range(divergence.index if divergence else NEW_TOKENS):
            theirs_lp = torch.log_softmax(their_logits[step], dim=-1)[theirs[step]].item()
            assert abs(our_logprobs[step].logprob - theirs_lp) <= logprob_tolerance, f"step {step}"


def _engine_bf16(path, prompts: list[list[int]], **settings):
    with LLM(str(path), dtype="bfloat16", num_blocks=128, max_num_batched_tokens=16, **settings) as llm:
        model, runner = llm.engine.model, llm.engine.runner
        assert all(cache.dtype == BF16 for cache in runner.kv_caches)
        assert next(model.parameters()).dtype == BF16
        results = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                                       logprobs=5))
    return model, results


def test_engine_bf16_llama_matches_transformers_bf16(tmp_path):
    """Host kernels on (packed bf16 GEMM where oneDNN has one, the bf16 C++ decode attention), chunked prefill."""
    from transformers import AutoModelForCausalLM
    path = make_tiny("llama", tmp_path, seed=3)
    prompts = _prompts(6)
    model, results = _engine_bf16(path, prompts)
    assert model.layers[0].self_attn.cpu_decode_kernel
    # An untied lm_head is packed once, as the model's head (Llama.pack_for_cpu), not as a Linear.
    packed = [m.packed is not None for m in model.modules()
              if isinstance(m, Linear) and m is not getattr(model, "lm_head", None)]
    assert all(packed) if onednn_gemm_available(torch.device("cpu"), BF16) else not any(packed)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=BF16).eval()
    _assert_near_ties([r.token_ids for r in results], hf, prompts, [r.logprobs for r in results], 0.1)


def test_engine_bf16_deepseek_v3_mla_matches_transformers_bf16(tmp_path):
    """Dense layers only: MoE routing in bf16 flips experts at router near-ties (see the next test). This tiny
    model amplifies rounding (transformers' own bf16 logits sit 0.4-0.9 from its fp32 ones), hence the looser
    log-probability tolerance."""
    from transformers import AutoModelForCausalLM
    path = make_tiny("deepseek_v3", tmp_path, seed=3, overrides={"first_k_dense_replace": 3})
    prompts = _prompts(4)
    _, results = _engine_bf16(path, prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=BF16).eval()
    _assert_near_ties([r.token_ids for r in results], hf, prompts, [r.logprobs for r in results], 0.25)


def test_bf16_deepseek_v3_moe_is_as_close_to_fp32_as_transformers_bf16(tmp_path):
    """With MoE layers a bf16 rounding can flip a routing choice at a router near-tie and move that position's
    logits by whole units, in transformers as here; so per position, typically (the median), our bf16 logits
    are within bf16 noise of transformers' and as close to the fp32 model as transformers' bf16 logits are."""
    from transformers import AutoModelForCausalLM
    path = make_tiny("deepseek_v3", tmp_path, seed=3)
    ids = _prompts(5)[4] + _prompts(5, seed=1)[1]
    with torch.inference_mode():
        truth = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0]
        theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=BF16).eval()(
            torch.tensor([ids])).logits[0].float()
    runner = PagedRunner(load_model(str(path), BF16, progress=False))
    runner.caches = [cache.to(BF16) for cache in runner.caches]
    ours = runner.step([], [("r", ids)])
    assert ours.dtype == torch.float32
    median = lambda diff: diff.abs().amax(-1).median().item()  # noqa: E731
    assert median(ours - theirs) <= 0.25
    assert median(ours - truth) <= 1.25 * median(theirs - truth) + 0.02


def test_bf16_deepseek_v4_is_as_close_to_fp32_as_transformers_bf16(tmp_path):
    """V4 in bf16 over a prompt that crosses the window and several compress windows (indexer top-k, hash and
    top-k routing can flip at near-ties, as in V3): per position, typically, our bf16 logits are within bf16 noise
    of transformers' and as close to the fp32 model. Like transformers, the norm, mHC, sink, position-bias and
    router weights stay fp32 (with the norm weights in bf16 our median distance to fp32 was 1.2-1.3x theirs)."""
    from transformers import AutoModelForCausalLM
    path = make_tiny("deepseek_v4", tmp_path, seed=5)
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.inference_mode():
        truth = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0]
        theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=BF16).eval()(
            torch.tensor([ids])).logits[0].float()
    model = load_model(str(path), BF16, progress=False)
    assert model.layers[0].attn_norm.weight.dtype == torch.float32 and model.embed.weight.dtype == BF16
    runner = HybridPagedRunner(model)
    runner.caches = [cache.to(BF16) if cache.is_floating_point() else cache for cache in runner.caches]
    ours = runner.step([], [("r", ids)]).float()
    median = lambda diff: diff.abs().amax(-1).median().item()  # noqa: E731
    assert median(ours - theirs) <= 0.25
    assert median(ours - truth) <= 1.25 * median(theirs - truth) + 0.02


@pytest.mark.slow
def test_two_ranks_bf16_match_one(tmp_path):
    """The shared-memory all-reduce sums bf16 partials in fp32 and rounds once, but each rank's partial is
    already rounded: two ranks equal one up to near-ties, judged on one rank's top-5 log-probabilities, and each
    log-probability within the same bound (4 bf16 ulps of a logit in [4, 8), where the tiny Llama's top logits lie:
    a few rounding steps of the partials reach 0.057 in one step of these prompts)."""
    path = make_tiny("llama", tmp_path, seed=3)
    prompts = _prompts(4)
    _, one = _engine_bf16(path, prompts)
    _, two = _engine_bf16(path, prompts, tensor_parallel_size=2)
    for ref, got in zip(one, two):
        for step, (ref_lp, lp) in enumerate(zip(ref.logprobs, got.logprobs)):
            if ref.token_ids[step] != got.token_ids[step]:
                top = dict(ref_lp.top)
                assert got.token_ids[step] in top and top[ref.token_ids[step]] - top[got.token_ids[step]] <= near_tie_bound(4.0)
                break
            assert abs(ref_lp.logprob - lp.logprob) <= near_tie_bound(4.0)
