"""Llama model + loaders against transformers: the real SmolLM2 GGUF and tiny random Llamas written by transformers,
run through the paged cache as mixed batches (decode after a cached prefix, chunked prefill, plain prefill)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend_lib.models.loading.gguf_loader import dequantize_tensor, open_gguf, unpermute_rows
from backend_lib.core.model_path import resolve_model_path
from backend_lib.models.loading.loader import load_model, safetensors_files
from kernels.attention_metadata import AttentionMetadata

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea, then explain why it works.",
    "List three prime numbers and one even number greater than ten.",
]


class PagedRun:
    """A hand-built paged cache for one model: allocates shuffled blocks per request and runs steps."""

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 96) -> None:
        self.model, self.block_size, self.scratch = model, block_size, num_blocks
        num_slots = (num_blocks + 1) * block_size
        self.caches = [torch.zeros(shape, dtype=model.dtype) for shape in model.kv_cache_shapes(num_slots)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[str, list[int]] = {}

    def _table(self, req: str, seq_len: int) -> list[int]:
        table = self.tables.setdefault(req, [])
        while len(table) * self.block_size < seq_len:
            table.append(self.free.pop())
        return table

    def step(self, decodes: list[tuple[str, list[int], int]], prefills: list[tuple[str, list[int], int, int]],
             decode_query_len: int = 1) -> list[torch.Tensor]:
        """decodes: (req, tokens, seq_len) running the last ``decode_query_len`` tokens before seq_len;
        prefills: (req, tokens, start, end). Returns each chunk's logits [n, vocab], decodes first."""
        chunks = [(r, t, s - decode_query_len, s) for r, t, s in decodes] + prefills
        ids, positions, slots, tables = [], [], [], []
        for req, tokens, start, end in chunks:
            table = self._table(req, end)
            tables.append(table)
            ids += tokens[start:end]
            positions += list(range(start, end))
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
        width = max(len(t) for t in tables)

        def pad(rows: list[list[int]]) -> torch.Tensor:
            return torch.tensor([r + [self.scratch] * (width - len(r)) for r in rows],
                                dtype=torch.int32).reshape(len(rows), width)

        nd = len(decodes)
        meta = AttentionMetadata(
            block_size=self.block_size, slot_mapping=torch.tensor(slots), num_decodes=nd,
            decode_query_len=decode_query_len, decode_block_tables=pad(tables[:nd]),
            decode_seq_lens=torch.tensor([s for _, _, s in decodes], dtype=torch.int32), num_prefills=len(prefills),
            prefill_query_lens=[e - s for _, _, s, e in prefills], prefill_seq_lens=[e for _, _, _, e in prefills],
            prefill_block_tables=pad(tables[nd:]))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([e - s for _, _, s, e in chunks]))


def paged_logits(model: torch.nn.Module, prompts: list[list[int]], decode_query_len: int = 1) -> list[torch.Tensor]:
    """Two steps: (1) prefill A's prefix and B's first chunk; (2) decode A's last Q tokens, B's second chunk and
    all of C, as one mixed batch. Returns per-prompt logits [len, vocab] at every position."""
    a, b, c = prompts
    run = PagedRun(model)
    cut_a, cut_b = len(a) - decode_query_len, len(b) // 2
    a1, b1 = run.step([], [("a", a, 0, cut_a), ("b", b, 0, cut_b)])
    a2, b2, c2 = run.step([("a", a, len(a))], [("b", b, cut_b, len(b)), ("c", c, 0, len(c))], decode_query_len)
    return [torch.cat([a1, a2]), torch.cat([b1, b2]), c2]


def hf_logits(model, ids: list[int]) -> torch.Tensor:  # [len, vocab] float32
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="session")
def smollm2_ours(smollm2_path):
    return load_model(smollm2_path, progress=False, weight_format="dequantize")  # the oracle: transformers' weights


@pytest.fixture(scope="session")
def smollm2_prompts(hf_smollm2) -> list[list[int]]:
    _, tokenizer = hf_smollm2
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]


def test_smollm2_gguf_config(smollm2_ours, hf_smollm2):
    arch, hf_config = smollm2_ours.arch, hf_smollm2[0].config
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.hidden_size, arch.vocab_size) == (30, 9, 3, 576,
                                                                                                        49152)
    assert arch.rope_theta == hf_config.rope_parameters["rope_theta"] == 100000.0
    assert arch.tie_word_embeddings and smollm2_ours.lm_head is None
    assert arch.eos_token_ids == (2,)


def test_smollm2_gguf_weights_equal_transformers(smollm2_ours, hf_smollm2):
    hf = hf_smollm2[0].state_dict()
    layer = smollm2_ours.layers[3]
    q, k, v = layer.self_attn.qkv_proj.weight.split([576, 192, 192])
    assert torch.equal(q, hf["model.layers.3.self_attn.q_proj.weight"])  # undone Q permutation
    assert torch.equal(k, hf["model.layers.3.self_attn.k_proj.weight"])  # undone K permutation (kv heads)
    assert torch.equal(v, hf["model.layers.3.self_attn.v_proj.weight"])
    assert torch.equal(smollm2_ours.embed_tokens.weight, hf["model.embed_tokens.weight"])  # Q8_0


def test_smollm2_mixed_batch_logits_match_transformers(smollm2_ours, hf_smollm2, smollm2_prompts):
    hf_model = hf_smollm2[0]
    ours = paged_logits(smollm2_ours, smollm2_prompts)
    for ids, got in zip(smollm2_prompts, ours):
        want = hf_logits(hf_model, ids)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def _write_tiny_llama(directory, tie: bool, rope_parameters: dict | None, shard: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie, initializer_range=0.2, rms_norm_eps=1e-5,
                         rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = HFLlama(config).to(torch.float32)
    model.save_pretrained(directory, max_shard_size="60KB" if shard else "10GB")


TINY_VARIANTS = {
    "tied": dict(tie=True, rope_parameters=None, shard=False),
    "untied_sharded": dict(tie=False, rope_parameters=None, shard=True),
    "llama3_rope": dict(tie=False, shard=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
}


@pytest.fixture(scope="session", params=sorted(TINY_VARIANTS))
def tiny_llama(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tiny_{request.param}")
    _write_tiny_llama(directory, **TINY_VARIANTS[request.param])
    return request.param, directory


def test_tiny_llama_loads_and_matches_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM
    variant, directory = tiny_llama
    if variant == "untied_sharded":
        assert len(safetensors_files(str(directory))) > 1
    ours = load_model(str(directory), progress=False)
    assert ours.arch.tie_word_embeddings == (variant == "tied")
    if variant == "llama3_rope":
        assert ours.arch.rope_scaling is not None and ours.arch.rope_scaling.rope_type == "llama3"
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (23, 40, 9)]
    for decode_query_len in (1, 3):  # 3: a decode step verifying drafts, causal among its queries
        for ids, got in zip(prompts, paged_logits(ours, prompts, decode_query_len)):
            want = hf_logits(hf, ids)
            assert (got - want).abs().max().item() <= 1e-4


def test_bf16_load_matches_transformers_bf16(tiny_llama):
    from transformers import AutoModelForCausalLM
    variant, directory = tiny_llama
    if variant != "tied":
        pytest.skip("one variant is enough")
    ours = load_model(str(directory), dtype=torch.bfloat16, progress=False)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    assert [c.dtype for c in PagedRun(ours).caches] == [torch.bfloat16, torch.bfloat16]
    ids = list(range(5, 30))
    got = paged_logits(ours, [ids, ids, ids])
    want = hf_logits(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval(), ids)
    assert got[2].dtype == torch.float32
    # The plain prefill runs the same ops on the same shapes as transformers, so bf16 rounding matches closely.
    # Chunked runs split the matmuls differently; a few bf16 ulps (0.0156 at |logit| ~ 3) may differ there.
    # For scale: this model's bf16 logits differ from its fp32 logits by ~0.33.
    assert (got[2] - want).abs().max().item() <= 2e-2
    for logits in got[:2]:
        assert (logits - want).abs().max().item() <= 0.15


def test_checkpoint_with_missing_or_unknown_weights_is_rejected(tmp_path):
    from safetensors.torch import load_file, save_file
    _write_tiny_llama(tmp_path, tie=True, rope_parameters=None, shard=False)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 weight"):
        load_model(str(tmp_path), progress=False)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    weights["model.layers.1.mlp.extra.weight"] = torch.zeros(3)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.1.mlp.extra.weight'"):
        load_model(str(tmp_path), progress=False)


def test_unsupported_gguf_tensor_type_is_rejected(tmp_path):
    import gguf
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", 8), ("block_count", 0), ("feed_forward_length", 16),
                       ("attention.head_count", 2), ("context_length", 32)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.int32))  # stored as I32
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'token_embd.weight' has unsupported type I32"):
        load_model(str(path), progress=False)
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has unsupported type IQ2_XXS"):
        dequantize_tensor("blk.0.attn_q.weight", np.zeros((1, 66), dtype=np.uint8),
                          gguf.GGMLQuantizationType.IQ2_XXS)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0"])
def test_gguf_dequantize_float_types(qtype):
    import gguf
    values = np.linspace(-2, 2, 4 * 64, dtype=np.float32).reshape(4, 64)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = values.astype(np.float16) if qtype == "F16" else gguf.quants.quantize(values, kind)
    got = dequantize_tensor("w", raw, kind)
    assert got.shape == (4, 64) and got.dtype == np.float32
    assert np.abs(got - values).max() <= (0.02 if qtype != "F16" else 1e-3)


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    hf = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf permute: [h, 2, D/2] -> [h, D/2, 2].
    gguf_rows = hf.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(hf.shape)
    assert torch.equal(unpermute_rows(gguf_rows, heads), hf)


def test_open_gguf_and_resolve_default(smollm2_path):
    assert resolve_model_path("") == smollm2_path
    checkpoint = open_gguf(smollm2_path)
    assert checkpoint.architecture == "LlamaForCausalLM" and checkpoint.num_tensors == 272
    assert json.dumps(checkpoint.config)  # plain JSON-able, like a config.json
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("/nonexistent/model.gguf")


def test_positions_past_max_position_embeddings_match_transformers(tmp_path):
    """max_model_len past the checkpoint's max_position_embeddings (256 here): the RoPE table is extended at load
    (transformers computes any position too), so a 300-token prompt's logits still match."""
    from transformers import AutoModelForCausalLM
    _write_tiny_llama(tmp_path, tie=False, rope_parameters=None, shard=False)
    ours = load_model(str(tmp_path), progress=False)
    assert not ours.cover_positions(200) and ours.cover_positions(320)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (300, 8, 40)]  # 96 blocks of 4 hold them
    for ids, got in zip(prompts, paged_logits(ours, prompts)):
        assert (got - hf_logits(hf, ids)).abs().max().item() <= 1e-4
