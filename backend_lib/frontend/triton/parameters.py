"""config.pbtxt ``parameters`` -> the engine's ``EngineConfig`` and the Triton model's ``ServingOptions``, and the
factory that builds the engine from them (``build_engine``). Load-time only: a bad parameter is the model's load
error, naming it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from backend_lib.core.config import EngineConfig
from backend_lib.engine.intake import parse_bool

if TYPE_CHECKING:
    from backend_lib.engine.async_engine import AsyncEngine

# Engine settings accepted as config.pbtxt parameters: name -> (EngineConfig flat name, converter name).
_ENGINE_PARAMETERS: dict[str, tuple[str, type]] = {
    "model": ("model", str),
    "dtype": ("dtype", str),
    "device": ("device", str),
    "host_gemm": ("host_gemm", str),
    "host_attention": ("host_attention", str),
    "greedy_head_screen": ("greedy_head_screen", bool),
    "max_num_seqs": ("max_num_seqs", int),
    "max_model_len": ("max_model_len", int),
    "block_size": ("block_size", int),
    "num_blocks": ("num_blocks", int),
    "kv_cache_memory_gb": ("kv_cache_memory_gb", float),
    "kv_cache_memory_fraction": ("kv_cache_memory_fraction", float),
    "enable_prefix_caching": ("enable_prefix_caching", bool),
    "kv_cache_dtype": ("kv_cache_dtype", str),
    "weight_format": ("weight_format", str),
    "packed_gemm_path": ("packed_gemm_path", str),
    "max_num_batched_tokens": ("max_num_batched_tokens", int),
    "enable_chunked_prefill": ("enable_chunked_prefill", bool),
    "scheduling_policy": ("scheduling_policy", str),
    "priority_aging_s": ("priority_aging_s", float),
    "async_scheduling": ("async_scheduling", bool),
    "session_idle_timeout_s": ("session_idle_timeout_s", float),
    "spec_method": ("method", str),
    "num_speculative_tokens": ("num_speculative_tokens", int),
    "ngram_min": ("ngram_min", int),
    "ngram_max": ("ngram_max", int),
    "speculative_model": ("speculative_model", str),
    "spec_schedule": ("spec_schedule", str),
    "dspark_confidence_threshold": ("dspark_confidence_threshold", float),
    "compile_backend": ("compile_backend", str),
    # Bucket lists stay strings ("1,2,4,8"): CompileConfig parses and validates them.
    "batch_buckets": ("batch_buckets", str),
    "width_buckets": ("width_buckets", str),
    "prefill_buckets": ("prefill_buckets", str),
    "compile_cache_dir": ("compile_cache_dir", str),
    "compile_sampler_variants": ("compile_sampler_variants", str),
    "compile_scope": ("compile_scope", str),
    "seed": ("seed", int),
    "num_threads": ("num_threads", int),
    "tensor_parallel_size": ("tensor_parallel_size", int),
    "enable_expert_parallel": ("enable_expert_parallel", bool),
    "context_parallel_size": ("context_parallel_size", int),
    "context_parallel_min_tokens": ("context_parallel_min_tokens", int),
    "nnodes": ("nnodes", int),
    "master_addr": ("master_addr", str),
    "master_port": ("master_port", int),
    "distributed_timeout_s": ("distributed_timeout_s", float),
    "enable_eplb": ("enable_eplb", bool),
    "num_redundant_experts": ("num_redundant_experts", int),
    "eplb_window_steps": ("eplb_window_steps", int),
    "eplb_interval_steps": ("eplb_interval_steps", int),
    "max_waiting_requests": ("max_waiting_requests", int),
    "max_sessions": ("max_sessions", int),
    "max_prompt_chars": ("max_prompt_chars", int),
    "max_input_ids": ("max_input_ids", int),
    "max_messages": ("max_messages", int),
    "max_messages_chars": ("max_messages_chars", int),
    "max_stop_strings": ("max_stop_strings", int),
    "max_stop_string_chars": ("max_stop_string_chars", int),
    "max_stop_token_ids": ("max_stop_token_ids", int),
    "max_logit_bias": ("max_logit_bias", int),
    "max_logprobs": ("max_logprobs", int),
    "max_images_per_request": ("max_images_per_request", int),
    "max_image_bytes": ("max_image_bytes", int),
    "max_image_pixels": ("max_image_pixels", int),
    "max_schema_chars": ("max_schema_chars", int),
    "max_schema_depth": ("max_schema_depth", int),
    "max_choices": ("max_choices", int),
    "compile_timeout_s": ("compile_timeout_s", float),
}
ENGINE_PARAMETER_NAMES = tuple(_ENGINE_PARAMETERS)
# Parameters of the Triton model itself, not the engine.
SERVING_PARAMETER_NAMES = ("stream_interval",)
MAX_STREAM_INTERVAL = 1024


def engine_config_from_parameters(parameters: Mapping[str, str]) -> EngineConfig:
    """config.pbtxt ``parameters`` (all strings) -> a validated EngineConfig.

    An empty string means "not set" (the EngineConfig default). A bad name or value raises ValueError
    naming the parameter, which Triton reports as the model's load error.
    """
    flat: dict[str, Any] = {}
    for name, text in parameters.items():
        if name in SERVING_PARAMETER_NAMES:
            continue
        if name not in _ENGINE_PARAMETERS:
            allowed = ", ".join(ENGINE_PARAMETER_NAMES + SERVING_PARAMETER_NAMES)
            raise ValueError(f"unknown model parameter {name!r} (allowed: {allowed})")
        if text == "":
            continue
        target, kind = _ENGINE_PARAMETERS[name]
        if kind is bool:
            value: Any = parse_bool(f"model parameter {name}", text)
        elif kind is str:
            value = text
        else:
            try:
                value = kind(text.strip())
            except ValueError:
                raise ValueError(f"model parameter {name} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {text!r}") from None
        flat[target] = value
    try:
        return EngineConfig.from_flat(flat)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid model parameters: {exc}") from exc


@dataclass
class ServingOptions:
    """How the Triton model streams (config.pbtxt parameters that are not engine settings)."""

    # Tokens per streamed response after the first: 1 = one response per token; n > 1 sends every n tokens
    # (the first token and the final response always go at once), for fewer responses under load.
    stream_interval: int = 1


def serving_options_from_parameters(parameters: Mapping[str, str]) -> ServingOptions:
    text = parameters.get("stream_interval", "").strip()
    if not text:
        return ServingOptions()
    if not text.isdigit() or not 1 <= int(text) <= MAX_STREAM_INTERVAL:
        raise ValueError(f"model parameter stream_interval must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                         f"got {text!r}")
    return ServingOptions(stream_interval=int(text))


def build_engine(parameters: Mapping[str, str]) -> "AsyncEngine":
    """The one factory the Triton model uses: parameters -> running AsyncEngine."""
    from backend_lib.engine.async_engine import AsyncEngine  # deferred: torch and the model load only here

    return AsyncEngine(engine_config_from_parameters(parameters))
