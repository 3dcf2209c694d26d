"""Compiled regions: the decode step, single-chunk prefill, the lm_head and the sampler as static-shape graphs.

``CompiledModel`` keeps the model's contract (forward / compute_logits / kv_cache_shapes / arch) so the runner
does not change: a decode-only step (every request one token) is padded to a (rows, block-table width) bucket
and runs as one ``torch.compile(fullgraph=True, dynamic=False)`` graph over all layers and the final norm; a step
of exactly one prefill chunk runs as a (queries, width) prefill graph; anything else (mixed steps, shapes above
every bucket, draft verification rows) runs eagerly. ``CompiledSampler`` does the same for the sampler.

Why each layer's cache enters as its own graph input: the caches are layer-major roots ``[L, slots, ...]``. A
graph that slices ``root[i]`` and writes into that view makes functionalization rebuild the whole root per layer
(a full cache copy per step, measured ~60 ms on SmolLM2 with a small pool); the unbound per-layer views are
contiguous inputs that inductor updates in place, and the runner still owns one allocation per cache.

Scope: ``"model"`` (default) traces the whole model per bucket; ``"layer"`` traces one decoder layer per bucket and
layer kind and runs every layer of that kind through the same graph (the embedding, RoPE table gather and final
norm stay eager), as the Neuron port notes prescribe (one graph per class reused by every layer, every layer
reusing the loaded NEFF). On the host a layer graph compiled in 12.7 s cold / 2.3 s warm against 34 s / 5.4 s for
the 30-layer SmolLM2 graph, but a batch-32 step took 67 against 63 ms (30 compiled-region entries instead of one).

Graph count is bounded by the bucket lists (``BucketSpec.max_graphs`` + sampler variants); ``warm_up`` compiles
every model graph at engine start and the sampler's greedy graph per batch bucket (every variant with
``compile_sampler_variants="all"``; otherwise a sampled batch compiles its variant when the first one comes).
Shapes outside the buckets never compile: they run eagerly. ``build_regions`` compiles inside the engine's
persistent compile cache (compile_cache.py), so a second start loads the graphs instead.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from tqdm import tqdm

from backend_lib.core.config import CompileConfig
from backend_lib.neuron.buckets import BucketSpec, PaddedStep, pad_decode, pad_prefill
from backend_lib.neuron.compile_cache import CacheUse
from backend_lib.neuron.platform import Platform
from kernels.attention_metadata import AttentionMetadata, StateRows

def compile_region(fn: Callable, backend: str, module_guards: bool = False) -> Callable:
    """torch.compile with the Neuron rules: one graph (no breaks), static shapes.

    Where torch has them, each region keeps its own graph cache (isolate_recompiles: no other engine's model
    can match it) and, unless ``module_guards``, dynamo skips its guards on module state: the weights and module
    attributes are fixed once the engine is built, and checking them cost 0.4 ms a call (0.07 ms without), ~2.5%
    of a batch-32 SmolLM2 step on the host. A region that takes a module as an argument (a layer graph shared by
    many layers) keeps them: they are what tells a dense layer's graph from an MoE layer's. An older torch
    (torch-neuronx's) keeps the default guards."""
    kwargs: dict = {}
    if ("isolate_recompiles" in inspect.signature(torch.compile).parameters
            and hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")):
        kwargs = {"isolate_recompiles": True}
        if not module_guards:
            kwargs["options"] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, **kwargs)


def _call_layer(layer: torch.nn.Module, *args):
    """A layer's own forward (its instance ``forward`` points back here while a step runs per-layer graphs)."""
    return type(layer).forward(layer, *args)


def raise_dynamo_cache_limits(num_graphs: int) -> None:
    """Every bucket is a legitimate recompile of the same code object, and every wrapper instance (one per
    engine) adds its own graphs to that code object's cache: raise dynamo's limits by this wrapper's count
    instead of letting it fall back to eager (or fail under fullgraph) after its default 8 entries."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 8) + num_graphs
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 256) + num_graphs


def layer_views(kv_caches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Layer-major roots [L, slots, ...] -> per-layer contiguous views, one graph input each."""
    return [list(cache.unbind(0)) for cache in kv_caches]


@dataclass
class RegionStats:
    compiled_keys: set[tuple] = field(default_factory=set)
    compile_seconds: float = 0.0
    compiled_steps: int = 0
    eager_steps: int = 0
    cache: CacheUse | None = None  # the persistent compile cache during warm-up (build_regions sets it)


COMPILE_SCOPES = ("model", "layer")


class CompiledModel(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, buckets: BucketSpec, backend: str, scratch_block: int,
                 scope: str = "model") -> None:
        super().__init__()
        if scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {scope!r}")
        # The ServedModel interface (backend_lib/models/interfaces.py: that layer sits above this one, so no import).
        self.engram_history = model.token_history  # ids before each token (Engram)
        if model.capabilities.static_moe:
            # The grouped-dispatch MoE has data-dependent shapes; the eager fallback shares the module, and
            # switching per call would fail dynamo's guards, so the whole model takes the fixed-shape MoE.
            model.set_moe_impl("static")
        self.model = model
        self.buckets = buckets
        self.backend = backend
        self.scratch_block = scratch_block
        self.stats = RegionStats()
        self.scope = scope
        layers = len(model.layers) if scope == "layer" else 1  # a bound: layers of one kind share their graphs
        raise_dynamo_cache_limits(buckets.max_graphs * layers + len(buckets.batch_sizes))
        self._forward = compile_region(self._run, backend) if scope == "model" else self._run
        self._layer = compile_region(_call_layer, backend, module_guards=True) if scope == "layer" else None
        self._logits = compile_region(self._compute_logits, backend)

    # The model's contract ------------------------------------------------------------------------------------
    @property
    def arch(self):
        return self.model.arch

    def kv_cache_shapes(self, num_slots: int) -> list[tuple[int, ...]]:
        return self.model.kv_cache_shapes(num_slots)

    def forward(self,
                input_ids: torch.Tensor,  # [T] int64
                positions: torch.Tensor,  # [T] int64
                kv_caches: list[torch.Tensor],  # layer-major roots
                meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        if self.engram_history and meta.engram_rows is None:
            # host work before the graph: the int64 hash and the table lookup (the graph sees gathered rows)
            meta = replace(meta, engram_rows=self.model.engram_gather(input_ids, meta.token_history))
        padded = self.pad(input_ids, positions, meta)
        if padded is None:
            self.stats.eager_steps += 1
            return self.model(input_ids, positions, kv_caches, meta)
        self.stats.compiled_steps += 1
        with self._layer_graphs():
            hidden = self._forward(padded.input_ids, padded.positions, layer_views(kv_caches), padded.meta)
        return hidden[: padded.num_real]

    @contextmanager
    def _layer_graphs(self) -> Iterator[None]:
        """With scope "layer": every decoder layer runs through the shared layer region for one padded step
        (eager steps, whose shapes have no graph, keep the plain forward)."""
        if self._layer is None:
            yield
            return
        # A model whose eager host steps run all layers from one C++ op (Llama's host_fused) must call each
        # layer's forward here, the region, instead.
        fused = self.model.host_fused
        for layer in self.model.layers:
            layer.forward = partial(self._layer, layer)
        if fused:
            self.model.host_fused = False
        try:
            yield
        finally:
            for layer in self.model.layers:
                del layer.forward
            if fused:
                self.model.host_fused = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        rows = self.buckets.batch_bucket(hidden.shape[0])
        if rows is None:
            return self.model.compute_logits(hidden)
        pad = hidden.new_zeros((rows - hidden.shape[0], hidden.shape[1]))
        return self._logits(torch.cat([hidden, pad]) if pad.shape[0] else hidden)[: hidden.shape[0]]

    # Regions -------------------------------------------------------------------------------------------------
    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, views: list[list[torch.Tensor]],
             meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, views, meta)

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def pad(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> PaddedStep | None:
        """The step padded to its graph's bucket, or None when it runs eagerly."""
        spec = self.buckets
        if meta.num_prefills == 0 and meta.decode_query_len == 1:
            rows = spec.batch_bucket(meta.num_decodes)
            width = spec.width_bucket(meta.decode_block_tables.shape[1])
            if rows is None or width is None:
                return None
            return pad_decode(input_ids, positions, meta, rows, width, self.scratch_block)
        if meta.num_decodes == 0 and meta.num_prefills == 1:
            length = spec.prefill_bucket(meta.prefill_query_lens[0])
            if length is None:
                return None
            width = spec.prefill_width(length)
            if -(-meta.prefill_seq_lens[0] // meta.block_size) > width:
                return None  # a late chunk of a long prompt: its context is wider than this bucket's graph
            return pad_prefill(input_ids, positions, meta, length, width, self.scratch_block)
        return None

    def _dummy_step(self, rows: int, queries: int, width: int, device: torch.device) -> PaddedStep:
        """A step whose every token writes the scratch block: compiling it leaves the pool untouched."""
        bs = self.buckets.block_size
        tokens = rows * queries
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.full((tokens,), self.scratch_block * bs, dtype=torch.int64, device=device),
            num_decodes=rows, decode_query_len=queries,
            decode_block_tables=torch.full((rows, width), self.scratch_block, dtype=torch.int32, device=device),
            decode_seq_lens=torch.full((rows,), queries, dtype=torch.int32, device=device),
            num_prefills=0, prefill_query_lens=[], prefill_seq_lens=[],
            prefill_block_tables=torch.zeros((0, width), dtype=torch.int32, device=device),
        )
        zeros = torch.zeros(tokens, dtype=torch.int64, device=device)
        if self.model.has_hybrid_state:  # no state slot: every row writes the scratch slot
            meta.state = StateRows(torch.full_like(zeros, -1), zeros.clone(), zeros.clone())
        if self.engram_history:
            history = torch.full((tokens, self.engram_history), -1, dtype=torch.int64, device=device)
            meta.engram_rows = self.model.engram_gather(zeros, history)
        return PaddedStep(zeros, zeros.clone(), meta, tokens)

    @torch.inference_mode()
    def warm_up(self, kv_caches: list[torch.Tensor], progress: bool = True) -> float:
        """Compile every decode, prefill and lm_head graph; returns the seconds spent."""
        device = kv_caches[0].device
        keys = ([("decode", b, 1, w) for b, w in self.buckets.decode_keys()]
                + [("prefill", 1, n, w) for n, w in self.buckets.prefill_keys()])
        hidden_size = None
        start = time.perf_counter()
        for kind, rows, queries, width in tqdm(keys, desc="compiling model graphs", disable=not progress):
            step = self._dummy_step(rows, queries, width, device)
            with self._layer_graphs():
                hidden = self._forward(step.input_ids, step.positions, layer_views(kv_caches), step.meta)
            hidden_size = hidden.shape[-1]
            self.stats.compiled_keys.add((kind, rows * queries, width))
        for rows in self.buckets.batch_sizes:
            dtype = next(self.model.parameters()).dtype
            self._logits(torch.zeros(rows, hidden_size, dtype=dtype, device=device))
            self.stats.compiled_keys.add(("lm_head", rows))
        self.stats.compile_seconds += time.perf_counter() - start
        return self.stats.compile_seconds


def resolve_backend(config: CompileConfig | None, platform: Platform) -> str | None:
    """The torch.compile backend for the regions, or None for the eager engine.

    ``DEEPINFER_ENFORCE_EAGER=1`` always wins; without an explicit config, ``DEEPINFER_COMPILE_BACKEND`` (when set)
    turns the regions on; ``compile_backend="auto"`` takes the platform's backend (neuron / inductor)."""
    if platform.enforce_eager:
        return None
    if config is None or config.compile_backend == "none":
        on = platform.backend_from_env and platform.compile_backend != "eager"
        return platform.compile_backend if on else None
    backend = platform.compile_backend if config.compile_backend == "auto" else config.compile_backend
    return None if backend == "eager" else backend
