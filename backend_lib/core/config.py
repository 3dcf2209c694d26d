"""Validated configuration dataclasses shared by every layer of the engine.

Each field is checked in ``__post_init__`` so a bad value fails at construction with a message that
names the field and the allowed range (the Triton model turns these into load errors).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from backend_lib.structured_output.constraints import StructuredOutputLimits

_DTYPES = ("float32", "bfloat16", "float16")
_SPEC_METHODS = ("none", "ngram", "mtp", "dspark", "dflash")
# Block drafters read a drafter directory (speculative_model) and may let the confidence schedule pick the length.
BLOCK_DRAFT_METHODS = ("dspark", "dflash")
SPEC_SCHEDULES = ("fixed", "confidence")
_HOST_GEMMS = ("auto", "gemv", "onednn", "mkl")
WEIGHT_FORMATS = ("auto", "dequantize", "packed")
_COMPILE_BACKENDS = ("none", "auto", "inductor", "aot_eager", "neuron")
SCHEDULING_POLICIES = ("fcfs", "priority")
# KV cache element types: "auto" = the model dtype; "fp8_e4m3" = e4m3 codes with per-layer scales (kernels/kv_fp8.py).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
_KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
# Admission defaults per running slot: a burst of 8 batches' worth waits (the last one about 8 batch lifetimes),
# more is refused at once; sessions hold history (and KV until evicted), so more of them may stay open.
WAITING_PER_SEQ = 8
SESSIONS_PER_SEQ = 32


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """Which checkpoint to load and how."""

    model: str = ""  # GGUF file or Hugging Face directory; "" = the bundled SmolLM2-135M-Instruct GGUF
    dtype: str = "float32"
    max_model_len: int = 2048  # prompt + output tokens of one request (or session) at most
    device: str = "cpu"
    # Host GEMMs on weights packed at load: "auto" keeps two layouts, the blocked few-row kernel (kernels/gemv.py,
    # near memory bandwidth at decode row counts; fp32 and bf16) for <= GemvPolicy.max_rows rows and oneDNN's
    # packed GEMM (fp32; F.linear for other dtypes) above; "gemv" the blocked kernel alone at every row count (one
    # layout less); "onednn" oneDNN alone (about 2x MKL's sgemm at decode batch sizes); "mkl" torch's default
    # F.linear (the kernel transformers uses).
    host_gemm: str = "auto"
    # Host fp32 decode attention: "cpp" is the C++ kernel in kernels/csrc (built on first use; each KV row read
    # once), "torch" the block gather + SDPA (eager) / fused torch form (compiled) that Neuron runs.
    host_attention: str = "cpp"
    # Greedy steps on the host take the head's argmax from a cheap copy of the head plus the exact kernel on the few
    # columns the copy's error bound leaves: up to 4 rows (bf16) or 6 (fp32) an int8 copy (kernels/int8_head_screen.py,
    # 28 MB for SmolLM2), more rows of an fp32 head a bf16 copy (kernels/head_screen.py, 56 MB). The same tokens,
    # the head's time at one row 0.3-0.6x. Off: every logit is computed.
    greedy_head_screen: bool = True
    # Quantized checkpoints: "dequantize" widens the weights to ``dtype`` at load; "packed" keeps them in the
    # checkpoint's blocks in memory (GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K: ~0.6 bytes a weight for Q4_1, not 4) and runs
    # the host GEMMs on those bytes (kernels/packed_gemm.py), and DeepSeek-V3 / V4 fp8 projections likewise. Host
    # (cpu) only. "auto": packed for quantized checkpoints where it can run, else dequantize, chosen at load
    # (models/loading/weight_format.py).
    weight_format: str = "auto"
    # weight_format=packed's GEMM path (kernels/packed_gemm.py): "auto" = "int8" for GGUF (each activation row
    # rounded to int8 per 32 inputs as llama.cpp does, integer dot products: ~1.7x faster, within a documented
    # bound of dequantize) and "fp32" for fp8 / fp4; "fp32" widens the weights in registers: dequantize's function
    # up to summation order.
    packed_gemm_path: str = "auto"

    def __post_init__(self) -> None:
        _require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.weight_format in WEIGHT_FORMATS,
                 f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        _require(self.packed_gemm_path in ("auto", "fp32", "int8"),
                 f"packed_gemm_path must be 'auto', 'fp32' or 'int8', got {self.packed_gemm_path!r}")
        # The packed GEMMs are host C++ kernels: Neuron (and CUDA) have none.
        _require(self.weight_format != "packed" or self.device == "cpu",
                 f"weight_format=packed runs on the host only (device 'cpu'), not device {self.device!r}")
        _require(self.weight_format != "packed" or self.dtype in ("float32", "bfloat16"),
                 f"weight_format=packed takes float32 or bfloat16 activations, not dtype {self.dtype!r}")
        _require(self.host_gemm in _HOST_GEMMS, f"host_gemm must be one of {_HOST_GEMMS}, got {self.host_gemm!r}")
        _require(self.host_attention in ("cpp", "torch"),
                 f"host_attention must be 'cpp' or 'torch', got {self.host_attention!r}")
        _require(self.max_model_len >= 16, f"max_model_len must be >= 16, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """Paged KV cache geometry."""

    block_size: int = 16
    num_blocks: int = 0  # 0 = derive from kv_cache_memory_gb, or from the free memory (backend_lib/worker/kv_sizing.py)
    kv_cache_memory_gb: float = 0.0  # 0 = auto: kv_cache_memory_fraction of the memory free after loading weights
    kv_cache_memory_fraction: float = 0.5  # like vLLM's gpu_memory_utilization, of what is free, not of the total
    enable_prefix_caching: bool = True
    # "auto": K/V in the model dtype; "fp8_e4m3" (alias "fp8"): one byte per value with per-layer scales, so the
    # same memory holds 2x the tokens of bf16 (4x fp32). Models and paths that cannot store it refuse it at load.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.kv_cache_dtype = _KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (or the alias 'fp8'), got {self.kv_cache_dtype!r}")
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
                 f"block_size must be a power of two in [1, 128], got {self.block_size}")
        _require(self.num_blocks >= 0, f"num_blocks must be >= 0 (0 = auto), got {self.num_blocks}")
        _require(self.kv_cache_memory_gb >= 0,
                 f"kv_cache_memory_gb must be >= 0 (0 = auto), got {self.kv_cache_memory_gb}")
        _require(0 < self.kv_cache_memory_fraction <= 0.95,
                 f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}")


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 32  # running requests at once
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True
    # "fcfs": admission in arrival order, the newest running request preempted first. "priority" (vLLM's
    # --scheduling-policy priority): the lowest request priority value first, the highest preempted first
    # (core/priority.py), each request's value lowered by one per priority_aging_s seconds since it arrived.
    scheduling_policy: str = "fcfs"
    priority_aging_s: float = 10.0
    # Zero-overhead scheduling (engine/overlap.py): step t+1 is scheduled and its inputs prepared while step t's
    # forward runs; off by default: on the 2-core host the overlap alone was within noise
    # (benchmarks/results/async_scheduling.md).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _require(1 <= self.max_num_seqs <= 1024, f"max_num_seqs must be in [1, 1024], got {self.max_num_seqs}")
        _require(self.scheduling_policy in SCHEDULING_POLICIES,
                 f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        _require(self.priority_aging_s > 0, f"priority_aging_s must be > 0 (seconds), got {self.priority_aging_s}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class SpecConfig:
    """Speculative decoding (drafts verified by the rejection sampler)."""

    method: str = "none"
    num_speculative_tokens: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    # dspark / dflash: the drafter directory (DeepSpec's layout: config.json + safetensors), as vLLM names it
    speculative_model: str = ""
    # dspark / dflash: "fixed" verifies num_speculative_tokens drafts a step; "confidence" picks 0..k per step from
    # the drafts' predicted survival and the cost of verifying them at the step's batch
    spec_schedule: str = "confidence"
    # dspark: a request's drafts end before the first whose confidence falls below this (DeepSpec's eval); 0 = off
    dspark_confidence_threshold: float = 0.0

    def __post_init__(self) -> None:
        _require(self.method in _SPEC_METHODS, f"spec method must be one of {_SPEC_METHODS}, got {self.method!r}")
        _require(0 <= self.num_speculative_tokens <= 16,
                 f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        _require(self.method == "none" or self.num_speculative_tokens >= 1,
                 f"spec method {self.method!r} needs num_speculative_tokens in [1, 16], "
                 f"got {self.num_speculative_tokens}")
        _require(1 <= self.ngram_min <= self.ngram_max,
                 f"ngram range must satisfy 1 <= ngram_min <= ngram_max, got [{self.ngram_min}, {self.ngram_max}]")
        _require(self.method not in BLOCK_DRAFT_METHODS or bool(self.speculative_model),
                 f"spec method {self.method!r} needs speculative_model (a DSpark / DFlash drafter directory)")
        _require(self.spec_schedule in SPEC_SCHEDULES,
                 f"spec_schedule must be one of {SPEC_SCHEDULES}, got {self.spec_schedule!r}")
        _require(0.0 <= self.dspark_confidence_threshold < 1.0,
                 f"dspark_confidence_threshold must be in [0, 1), got {self.dspark_confidence_threshold}")


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    """Bucket lists arrive as tuples/lists (Python) or comma-separated strings (Triton parameters, CLI flags)."""
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    elif isinstance(value, int):
        value = [value]
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of ints (or 'a,b,c'), got {value!r}") from None
    _require(all(v >= 1 for v in out) and list(out) == sorted(set(out)),
             f"{name} must be strictly increasing ints >= 1, got {out}")
    return out


@dataclass
class CompileConfig:
    """Compiled regions (backend_lib/worker/compile): static-shape graphs per bucket; "none" keeps the engine eager."""

    compile_backend: str = "none"  # "auto" = neuron on Trainium, inductor on the host
    batch_buckets: tuple[int, ...] = ()  # () = powers of two up to max_num_seqs
    width_buckets: tuple[int, ...] = ()  # block-table widths; () = powers of two from 8 up to max_model_len's blocks
    prefill_buckets: tuple[int, ...] = ()  # single-chunk prefill lengths; () = prefill stays eager
    compile_progress: bool = True  # progress bar while the graphs compile at engine start
    # Persistent compile caches (inductor's FX-graph / AOTAutograd caches, neuronx-cc's NEFF cache) live here, so
    # a second start loads the graphs instead of compiling them; "" = TORCHINDUCTOR_CACHE_DIR /
    # NEURON_COMPILE_CACHE_URL when the environment sets them, else ~/.cache/deepinfer/compile (XDG_CACHE_HOME).
    compile_cache_dir: str = ""
    # Sampler graphs compiled at start: "greedy" (the argmax graph per batch bucket; a batch that samples compiles
    # its variant the first time one comes, from the cache when it is warm) or "all" (every variant up front).
    compile_sampler_variants: str = "greedy"
    # "model": one graph per bucket over all layers; "layer": one graph per bucket and layer kind, shared by every
    # layer of that kind (much less to trace and compile; what the Neuron port prescribes).
    compile_scope: str = "model"

    def __post_init__(self) -> None:
        _require(self.compile_backend in _COMPILE_BACKENDS,
                 f"compile_backend must be one of {_COMPILE_BACKENDS}, got {self.compile_backend!r}")
        _require(self.compile_sampler_variants in ("greedy", "all"),
                 f"compile_sampler_variants must be 'greedy' or 'all', got {self.compile_sampler_variants!r}")
        _require(self.compile_scope in ("model", "layer"),
                 f"compile_scope must be 'model' or 'layer', got {self.compile_scope!r}")
        _require(isinstance(self.compile_cache_dir, str) and "\0" not in self.compile_cache_dir,
                 f"compile_cache_dir must be a directory path (or \"\" for the default), got "
                 f"{self.compile_cache_dir!r}")
        self.batch_buckets = _int_tuple("batch_buckets", self.batch_buckets)
        self.width_buckets = _int_tuple("width_buckets", self.width_buckets)
        self.prefill_buckets = _int_tuple("prefill_buckets", self.prefill_buckets)


@dataclass
class ParallelConfig:
    """Tensor / expert / context parallelism over torch.distributed (names as vLLM uses them).

    Ranks = tensor_parallel_size x context_parallel_size; global rank ``cp * tensor_parallel_size + tp``. Rank 0 is
    the driver (where the engine lives), the rest worker processes. Context parallelism (worker/context_share.py):
    each context-parallel group holds a share of every request's KV blocks, attends it and merges the partial results
    by log-sum-exp; a step of at least ``context_parallel_min_tokens`` tokens also splits its rows across the group."""

    tensor_parallel_size: int = 1  # ranks that shard the weights (heads, intermediate units, vocabulary)
    enable_expert_parallel: bool = False  # MoE experts partitioned across the ranks instead of each one sharded
    context_parallel_size: int = 1  # groups that split the KV (and long steps' rows) by sequence position
    context_parallel_min_tokens: int = 256  # a step with fewer tokens runs every row on every context rank
    nnodes: int = 1  # machines; ranks on nodes 1.. are started there by `deepinfer worker`
    master_addr: str = "127.0.0.1"  # where the driver's rendezvous store listens (node 0's address)
    master_port: int = 0  # 0 = a free port (one machine only)
    distributed_timeout_s: float = 60.0  # a collective (or a worker joining) slower than this is a rank failure

    def __post_init__(self) -> None:
        _require(1 <= self.tensor_parallel_size <= 1024,
                 f"tensor_parallel_size must be in [1, 1024], got {self.tensor_parallel_size}")
        # Context ranks each hold a full copy of their tensor-parallel shard: CP multiplies the ranks, not the split.
        _require(1 <= self.context_parallel_size <= 64,
                 f"context_parallel_size must be in [1, 64], got {self.context_parallel_size}")
        _require(self.context_parallel_min_tokens >= 1,
                 f"context_parallel_min_tokens must be >= 1, got {self.context_parallel_min_tokens}")
        _require(1 <= self.nnodes <= self.world_size and self.world_size % self.nnodes == 0,
                 f"nnodes must divide tensor_parallel_size x context_parallel_size={self.world_size}, "
                 f"got {self.nnodes}")
        _require(self.nnodes == 1 or self.master_port > 0,
                 f"nnodes={self.nnodes} needs an explicit master_port (the workers on other nodes dial it)")
        _require(0 <= self.master_port <= 65535, f"master_port must be in [0, 65535], got {self.master_port}")
        _require(self.distributed_timeout_s > 0,
                 f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass
class EplbConfig:
    """Expert-parallel load balancing (names as vLLM's): each MoE layer's experts in physical slots, the heaviest
    with ``num_redundant_experts`` extra copies, re-placed from the measured loads while serving (core/eplb.py)."""

    enable_eplb: bool = False
    num_redundant_experts: int = 0  # extra slots over the ranks (experts + these must divide over the EP ranks)
    eplb_window_steps: int = 1000  # the loads a new placement balances: the router's counts of the last steps
    eplb_interval_steps: int = 3000  # steps between two re-placements (and weight moves)

    def __post_init__(self) -> None:
        _require(self.num_redundant_experts >= 0,
                 f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        _require(self.enable_eplb or self.num_redundant_experts == 0,
                 f"num_redundant_experts={self.num_redundant_experts} needs enable_eplb")
        _require(self.eplb_window_steps >= 1, f"eplb_window_steps must be >= 1, got {self.eplb_window_steps}")
        _require(self.eplb_interval_steps >= 1, f"eplb_interval_steps must be >= 1, got {self.eplb_interval_steps}")

    def check_parallel(self, parallel: ParallelConfig, compile_backend: str) -> None:
        """EPLB places whole experts on expert-parallel ranks; the model checks its own MoE at load (a top-k
        routed one whose experts + redundant slots divide over the ranks)."""
        if not self.enable_eplb:
            return
        _require(parallel.enable_expert_parallel and parallel.tensor_parallel_size >= 2,
                 "enable_eplb needs expert parallelism: enable_expert_parallel with tensor_parallel_size >= 2 "
                 f"(got enable_expert_parallel={parallel.enable_expert_parallel}, "
                 f"tensor_parallel_size={parallel.tensor_parallel_size})")
        # The driver counts the loads from its own router output: context groups would each see other rows.
        _require(parallel.context_parallel_size == 1,
                 f"enable_eplb does not run with context_parallel_size={parallel.context_parallel_size} (set 1)")
        # Placements change buffers in place between steps; compiled regions are not yet checked against that.
        _require(compile_backend == "none",
                 f"enable_eplb runs eager steps: set compile_backend 'none' (got {compile_backend!r})")


@dataclass
class RequestLimits:
    """Caps on what one request can make the server hold; beyond one, the request is refused with a RequestError
    (INVALID_ARG) naming the field and the limit. Each bounds memory or per-token work that grows with the
    request, not the model: the context itself is bounded by max_model_len."""

    max_prompt_chars: int = 1_048_576  # text_input characters (tokenized on the caller's thread)
    max_input_ids: int = 0  # input_ids length; 0 = what max_model_len allows (a longer prompt can never run)
    max_messages: int = 1024  # chat messages in one request
    max_messages_chars: int = 1_048_576  # characters of every message's keys and values together
    max_stop_strings: int = 16  # each is matched against every new token's text
    max_stop_string_chars: int = 256  # per stop string
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024  # logit_bias entries (each step scatters them into a [rows, vocab] bias)
    max_logprobs: int = 20  # top-n alternatives per token (vLLM's default max_logprobs)
    # Images (a model with a vision tower): images in one request, encoded bytes of one, its decoded width x height
    # (checked from the header, before the pixels are decoded)
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 32 * 1024 * 1024
    # Structured output (structured_outputs / guided_*; StructuredOutputLimits says what each bounds): characters of
    # a schema, regex or grammar (or of all choices), a schema's JSON nesting, strings in a choice list, and the
    # seconds a grammar may take to compile.
    max_schema_chars: int = StructuredOutputLimits.max_schema_chars
    max_schema_depth: int = StructuredOutputLimits.max_schema_depth
    max_choices: int = StructuredOutputLimits.max_choices
    compile_timeout_s: float = StructuredOutputLimits.compile_timeout_s

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "compile_timeout_s":
                continue  # StructuredOutputLimits checks it (a number > 0)
            value = getattr(self, f.name)
            lowest = 0 if f.name in ("max_input_ids", "max_logprobs") else 1
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= lowest,
                     f"{f.name} must be an integer >= {lowest}, got {value!r}")
        self.structured_output_limits()

    def structured_output_limits(self) -> StructuredOutputLimits:
        return StructuredOutputLimits(max_schema_chars=self.max_schema_chars, max_schema_depth=self.max_schema_depth,
                                      max_choices=self.max_choices, compile_timeout_s=self.compile_timeout_s)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    session_idle_timeout_s: float = 600.0
    seed: int = 0  # seeds the per-request seeds of unseeded sampled requests
    num_threads: int = 0  # torch intra-op threads; 0 = all cores
    # Admission control (AsyncEngine): requests waiting for a slot (inbox + scheduler queue) and open sessions.
    # Beyond either, a request is refused at once (a busy RequestError -> UNAVAILABLE) instead of queueing without
    # bound. 0 = derived from max_num_seqs (set in __post_init__, so the config holds the value in force).
    max_waiting_requests: int = 0
    max_sessions: int = 0

    def __post_init__(self) -> None:
        _require(self.session_idle_timeout_s > 0,
                 f"session_idle_timeout_s must be > 0, got {self.session_idle_timeout_s}")
        _require(self.num_threads >= 0, f"num_threads must be >= 0, got {self.num_threads}")
        _require(self.max_waiting_requests >= 0,
                 f"max_waiting_requests must be >= 0 (0 = {WAITING_PER_SEQ} x max_num_seqs), "
                 f"got {self.max_waiting_requests}")
        _require(self.max_sessions >= 0,
                 f"max_sessions must be >= 0 (0 = {SESSIONS_PER_SEQ} x max_num_seqs), got {self.max_sessions}")
        _require(self.model.weight_format != "packed" or self.compile.compile_backend != "neuron",
                 "weight_format=packed cannot run with compile_backend=neuron (its GEMMs are host C++ kernels)")
        context_parallel = self.parallel.context_parallel_size > 1
        _require(not context_parallel or self.compile.compile_backend == "none",
                 f"context_parallel_size={self.parallel.context_parallel_size} runs eager steps: set compile_backend "
                 f"'none' (got {self.compile.compile_backend!r})")
        self.eplb.check_parallel(self.parallel, self.compile.compile_backend)
        self.max_waiting_requests = self.max_waiting_requests or WAITING_PER_SEQ * self.scheduler.max_num_seqs
        self.max_sessions = self.max_sessions or SESSIONS_PER_SEQ * self.scheduler.max_num_seqs

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's element type as the load log and /metrics name it (the model dtype for "auto")."""
        return self.model.dtype if self.cache.kv_cache_dtype == "auto" else self.cache.kv_cache_dtype

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> "EngineConfig":
        """Build from flat ``name -> value`` pairs (Triton parameters, CLI flags); unknown names are errors."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig,
                    "compile": CompileConfig, "parallel": ParallelConfig, "limits": RequestLimits, "eplb": EplbConfig}
        owner = {f.name: section for section, klass in sections.items() for f in fields(klass)}
        top = {f.name for f in fields(cls)} - set(sections)
        grouped: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top_values: dict[str, Any] = {}
        for name, value in values.items():
            if name in owner:
                grouped[owner[name]][name] = value
            elif name in top:
                top_values[name] = value
            else:
                raise ValueError(f"unknown engine setting {name!r}")
        return cls(**{name: sections[name](**kw) for name, kw in grouped.items()}, **top_values)


def config_to_flat(config: EngineConfig) -> dict[str, Any]:
    """The inverse of ``EngineConfig.from_flat`` (what the driver hands its worker ranks)."""
    flat: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if hasattr(value, "__dataclass_fields__"):
            flat.update({g.name: getattr(value, g.name) for g in fields(value)})
        else:
            flat[f.name] = value
    return flat
