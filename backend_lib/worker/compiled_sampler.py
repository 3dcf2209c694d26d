"""The compiled sampler region and the runner's wrapping of model and sampler in compiled regions.

``CompiledSampler`` runs the worker's one sampling core (``sampler.py: masked_sample``) as a static-shape graph per
(batch bucket, variant); ``build_regions`` builds it beside the model regions of ``backend_lib/neuron/regions.py``
(the Neuron layer knows compiled regions, not the sampler) and warms both inside the persistent compile cache.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from tqdm import tqdm

from backend_lib.core.config import CompileConfig
from backend_lib.neuron.buckets import BucketSpec
from backend_lib.neuron.compile_cache import compile_cache_scope, count_cache_use
from backend_lib.neuron.platform import Platform
from backend_lib.neuron.regions import CompiledModel, RegionStats, compile_region, raise_dynamo_cache_limits, \
    resolve_backend
from backend_lib.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, masked_sample

# Sampler variants that get a graph: (all_greedy, any_top_k, any_top_p). logit_bias, penalties, min-p, min_tokens
# and logprobs need [B, V] host-built side inputs and stay eager. Each variant has a second graph with the grammar
# bitmask ([batch bucket, ceil(V/32)] int32, a graph input like the others), compiled for its first constrained batch.
GREEDY_VARIANT = (True, False, False)
SAMPLER_VARIANTS = (GREEDY_VARIANT, (False, False, False), (False, True, False), (False, False, True),
                    (False, True, True))



def warm_up_meta(rows: int, vocab_size: int, device: torch.device, all_greedy: bool, any_top_k: bool,
                 any_top_p: bool, masked: bool = False) -> SamplingMetadata:
    """A batch of one sampler variant, for compiling (and linting) its graph. Distinct tensors per field: dynamo
    guards on aliasing between inputs."""
    def longs(value: int) -> torch.Tensor:
        return torch.full((rows,), value, dtype=torch.int64, device=device)

    width = -(-vocab_size // 32)
    return SamplingMetadata(
        temperature=torch.full((rows,), 0.7, device=device), is_greedy=torch.full((rows,), all_greedy, device=device),
        top_k=longs(vocab_size) if any_top_k else None, top_p=torch.ones(rows, device=device) if any_top_p else None,
        min_p=None, seeds=longs(0), positions=longs(0), repetition_penalty=None, presence_penalty=None,
        frequency_penalty=None, prompt_mask=None, output_counts=None, blocked=None, logit_bias=None,
        num_logprobs=[None] * rows, all_greedy=all_greedy, any_top_k=any_top_k, any_top_p=any_top_p,
        any_min_p=False, any_penalty=False, any_min_tokens=False, max_num_logprobs=None,
        bitmask=torch.full((rows, width), -1, dtype=torch.int32, device=device) if masked else None,
        masked_rows=tuple(range(rows)) if masked else ())


class CompiledSampler(torch.nn.Module):
    """The Sampler's contract; batches without logit_bias, penalties, min-p, min_tokens or logprobs run as a graph per
    (batch bucket, variant in SAMPLER_VARIANTS, grammar bitmask or not), the rest through the eager Sampler. Both
    run the one sampling core (worker/sampler.py: ``masked_sample``), so they give the same tokens."""

    def __init__(self, buckets: BucketSpec, backend: str, vocab_size: int, sampler: Sampler | None = None,
                 warm_variants: tuple[tuple[bool, bool, bool], ...] = SAMPLER_VARIANTS,
                 cache_scope: Callable[[], AbstractContextManager] = nullcontext) -> None:
        super().__init__()
        self.sampler = sampler or Sampler()
        self.buckets = buckets
        self.vocab_size = vocab_size
        self.warm_variants = warm_variants  # compiled by warm_up; the others on their first batch
        self.cache_scope = cache_scope  # the persistent compile cache, entered for a variant's first batch
        self.stats = RegionStats()
        raise_dynamo_cache_limits(len(buckets.batch_sizes) * len(SAMPLER_VARIANTS) * 2)
        self._core = compile_region(masked_sample, backend)

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return self.sampler.process_logits(logits, meta)

    def filtered_logits(self, processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        return self.sampler.filtered_logits(processed, meta)

    @staticmethod
    def in_graph(meta: SamplingMetadata) -> bool:
        return not (meta.processes_logits or meta.any_min_p or meta.max_num_logprobs is not None)

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:  # logits [B, V]
        rows = self.buckets.batch_bucket(meta.batch_size)
        if rows is None or not self.in_graph(meta):
            self.stats.eager_steps += 1
            return self.sampler(logits, meta)
        self.stats.compiled_steps += 1
        key = ("sampler", rows, meta.all_greedy, meta.any_top_k, meta.any_top_p)
        if meta.bitmask is not None:
            key += ("masked",)
        first = key not in self.stats.compiled_keys
        self.stats.compiled_keys.add(key)
        b = meta.batch_size
        logits = logits.to(torch.float32)
        padded = torch.cat([logits, logits.new_zeros((rows - b, logits.shape[1]))]) if rows > b else logits
        with self.cache_scope() if first else nullcontext():
            token_ids = self._core(padded, meta.padded(rows))
        return SamplerOutput(token_ids=token_ids[:b], logprobs=None, top_ids=None, top_logprobs=None)

    @torch.inference_mode()
    def warm_up(self, device: torch.device, progress: bool = True) -> float:
        start = time.perf_counter()
        keys = [(rows, variant) for rows in self.buckets.batch_sizes for variant in self.warm_variants]
        for rows, (all_greedy, any_top_k, any_top_p) in tqdm(keys, desc="compiling sampler graphs",
                                                              disable=not progress):
            self._core(torch.zeros(rows, self.vocab_size, device=device),
                       warm_up_meta(rows, self.vocab_size, device, all_greedy, any_top_k, any_top_p))
            self.stats.compiled_keys.add(("sampler", rows, all_greedy, any_top_k, any_top_p))
        self.stats.compile_seconds += time.perf_counter() - start
        return self.stats.compile_seconds


def build_regions(model: torch.nn.Module, sampler: Sampler | None, kv_caches: list[torch.Tensor], num_blocks: int,
                  block_size: int, vocab_size: int, platform: Platform, config: CompileConfig | None = None,
                  max_num_seqs: int = 32, max_model_len: int | None = None,
                  ) -> tuple[torch.nn.Module, Sampler | CompiledSampler | None]:
    """The runner's model and sampler, wrapped in compiled regions (and warmed up) when compiling is on;
    unchanged otherwise. A worker rank has no sampler (the driver samples): None stays None. Bucket defaults: powers
    of two up to ``max_num_seqs`` rows and up to the blocks of ``max_model_len`` (default: the pool) from 8."""
    backend = resolve_backend(config, platform)
    if backend is None:
        return model, sampler
    config = config or CompileConfig()
    max_len = max_model_len or num_blocks * block_size
    buckets = BucketSpec.build(max_num_seqs, max_len, block_size, config.batch_buckets or None,
                               config.width_buckets or None, config.prefill_buckets or None)
    compiled_model = CompiledModel(model, buckets, backend, scratch_block=num_blocks, scope=config.compile_scope)
    warm_variants = SAMPLER_VARIANTS if config.compile_sampler_variants == "all" else (GREEDY_VARIANT,)
    def cache_scope() -> AbstractContextManager:
        return compile_cache_scope(config.compile_cache_dir, platform, backend)

    compiled_sampler = (CompiledSampler(buckets, backend, vocab_size, sampler, warm_variants, cache_scope)
                        if sampler is not None else None)
    with cache_scope() as cache, count_cache_use() as use:
        model_s = compiled_model.warm_up(kv_caches, progress=config.compile_progress)
        sampler_s = (compiled_sampler.warm_up(kv_caches[0].device, progress=config.compile_progress)
                     if compiled_sampler is not None else 0.0)
    compiled_model.stats.cache = use[0]
    if config.compile_progress:
        sampler_graphs = len(compiled_sampler.stats.compiled_keys) if compiled_sampler is not None else 0
        where = "" if cache is None else f"; {cache.describe()}: {use[0].describe()}"
        print(f"deepinfer: compiled {len(compiled_model.stats.compiled_keys)} model and "
              f"{sampler_graphs} sampler graphs with {backend} in "
              f"{model_s:.1f} s + {sampler_s:.1f} s{where}", file=sys.stderr)
    return compiled_model, compiled_sampler
