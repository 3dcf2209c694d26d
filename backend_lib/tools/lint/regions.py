"""The catalogue of compiled regions that ``deepinfer lint-graphs`` checks, built on tiny random models.

Regions: decode at each batch bucket, each prefill bucket, the lm_head, every sampler variant and the draft
verification (greedy and sampled rows; with and without the structured-output grammar bitmask), for a tiny Llama, a
tiny DeepSeek-V3 (fp8 weights, static MoE) and a tiny DeepSeek-V4 (fp32, static MoE); ``llama_fp8``,
``deepseek_v3_fp8`` and ``deepseek_v4_fp8`` are the same with an fp8 KV cache (e4m3 K/V codes, MLA latent records,
V4 entry and indexer-key records) stored and read at Neuron's 224.
"""
from __future__ import annotations

import tempfile
from collections.abc import Iterator

import torch

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.models.loading.loader import load_model
from backend_lib.models.interfaces import keeps_hybrid_state
from backend_lib.models.parallel import ParallelContext
from backend_lib.neuron.graph_lint import GraphLintError, lint_region
from backend_lib.tools.tiny import make_tiny
from backend_lib.neuron.buckets import BucketSpec
from backend_lib.neuron.regions import CompiledModel, layer_views
from backend_lib.worker.compiled_sampler import SAMPLER_VARIANTS, warm_up_meta
from backend_lib.neuron.platform import KV_FP8_MAX_NEURON
from backend_lib.worker.sampler import SamplingMetadata, SamplingRow, masked_sample
from backend_lib.worker.spec_decode.rejection import DraftLayout, rejection_sample

BLOCK_SIZE = 4
NUM_BLOCKS = 16
NUM_STATE_SLOTS = 4  # hybrid-cache models (DeepSeek-V4): fixed per-request state slots
# Batch 1 (the one-row special cases) and 4 (the general case): the graphs differ only in shape past that.
LINT_BUCKETS = BucketSpec(batch_sizes=(1, 4), block_table_widths=(4,), prefill_lengths=(8,),
                          block_size=BLOCK_SIZE)


def _tiny_model(arch: str, directory: str, par: ParallelContext | None = None) -> torch.nn.Module:
    fp8_kv = arch.endswith("_fp8")
    arch = arch.removesuffix("_fp8")
    # V4: one layer of each attention kind (window, CSA, HCA) and of each MoE kind (hash, routed): the ops of
    # the 4-layer tiny model, a quarter less to trace
    small_v4 = dict(num_hidden_layers=3, mlp_layer_types=["hash_moe", "moe", "moe"],
                    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    path = make_tiny(arch, directory, fp8=arch == "deepseek_v3", seed=0,
                     overrides=small_v4 if arch == "deepseek_v4" else None)
    model = load_model(str(path), torch.float32, progress=False, par=par).eval()
    if fp8_kv:
        model.use_fp8_kv(KV_FP8_MAX_NEURON)
    if arch in ("deepseek_v3", "deepseek_v4"):
        model.set_moe_impl("static")
    return model


def _model_regions(arch: str, model: torch.nn.Module) -> Iterator[tuple[str, object]]:
    if keeps_hybrid_state(model):
        paged, state = model.hybrid_cache_shapes(NUM_BLOCKS + 1, BLOCK_SIZE, NUM_STATE_SLOTS + 1)
        paged_dtype = torch.uint8 if getattr(model, "records", None) is not None else torch.float32  # fp8 records
        caches = [torch.zeros(s, dtype=paged_dtype) for s in paged] + [torch.zeros(s) for s in state]
    else:
        fp8 = getattr(model, "kv_fp8", False) or getattr(model, "record", None) is not None
        kv_dtype = torch.uint8 if fp8 else torch.float32  # e4m3 codes / latent records
        caches = [torch.zeros(s, dtype=kv_dtype) for s in model.kv_cache_shapes((NUM_BLOCKS + 1) * BLOCK_SIZE)]
    wrapper = CompiledModel(model, LINT_BUCKETS, "eager", scratch_block=NUM_BLOCKS)
    keys = ([("decode", b, 1, w) for b, w in LINT_BUCKETS.decode_keys()]
            + [("prefill", 1, n, w) for n, w in LINT_BUCKETS.prefill_keys()])
    for kind, rows, queries, width in keys:
        step = wrapper._dummy_step(rows, queries, width, torch.device("cpu"))
        name = f"{arch} {kind} tokens={rows * queries} width={width}"
        yield name, lambda step=step, name=name: lint_region(
            wrapper._run, step.input_ids, step.positions, layer_views(caches), step.meta, region=name)
    hidden = torch.zeros(2, model.arch.hidden_size)
    yield f"{arch} lm_head rows=2", lambda: lint_region(model.compute_logits, hidden, region=f"{arch} lm_head")


def _sampler_regions(vocab: int) -> Iterator[tuple[str, object]]:
    rows = 4
    for (all_greedy, top_k, top_p), masked in [(variant, False) for variant in SAMPLER_VARIANTS] + [
            (SAMPLER_VARIANTS[0], True), (SAMPLER_VARIANTS[-1], True)]:
        name = f"sampler greedy={all_greedy} top_k={top_k} top_p={top_p}" + (" masked" if masked else "")
        meta = warm_up_meta(rows, vocab, torch.device("cpu"), all_greedy, top_k, top_p, masked)
        yield name, lambda meta=meta, name=name: lint_region(masked_sample, torch.randn(rows, vocab), meta,
                                                            region=name)


def _verification_regions(vocab: int) -> Iterator[tuple[str, object]]:
    drafts = [[3, 4], [], [5]]
    layout = DraftLayout.build(drafts, "cpu")
    n = sum(len(d) + 1 for d in drafts)
    for greedy, masked in ((True, False), (False, False), (True, True), (False, True)):
        rows = [SamplingRow(params=SamplingParams(temperature=0.0 if greedy else 0.8, top_k=-1 if greedy else 20),
                            seed=7, output_position=i, prompt_token_ids=[1], output_token_ids=[])
                for i in range(n)]
        # A structured-output verification: the grammar bitmask of every row is a graph input.
        bitmask = torch.randint(-2**31, 2**31 - 1, (n, -(-vocab // 32)), dtype=torch.int32) if masked else None
        meta = SamplingMetadata.build(rows, vocab, "cpu", bitmask, tuple(range(n)) if masked else ())
        name = f"verification greedy={greedy}" + (" masked" if masked else "")

        def verify(logits, layout=layout, meta=meta):
            return rejection_sample(logits, layout, meta).token_ids

        yield name, lambda verify=verify, name=name: lint_region(verify, torch.randn(n, vocab), region=name)


def lint_all_regions(archs: list[str], par: ParallelContext | None = None,
                     ) -> Iterator[tuple[str, GraphLintError | None]]:
    """(region name, the lint error or None) for every region of every arch, then the sampler regions. With a
    tensor-parallel ``par`` every rank lints its own shard's regions (their collectives run, so all ranks walk the
    same regions in the same order); only the driver has sampler regions."""
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        vocab = 0
        for arch in archs:
            model = _tiny_model(arch, f"{tmp}/{arch}", par)
            vocab = model.arch.vocab_size
            for name, run in _model_regions(arch, model):
                yield name, _run(run)
        if par is None or par.is_driver:
            for name, run in [*_sampler_regions(vocab), *_verification_regions(vocab)]:
                yield name, _run(run)


def _run(run) -> GraphLintError | None:
    try:
        run()
    except GraphLintError as error:  # reported by the caller, region by region
        return error
    return None
