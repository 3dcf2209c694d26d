"""What every rank builds, the driver and the workers alike: its shard of the model, the host kernels, its KV cache
and a model runner. One function, so that every rank makes the same decisions (the collectives inside the model
pair up only if every rank runs the same code)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend_lib.core.config import EngineConfig
from backend_lib.models.interfaces import capabilities_of
from backend_lib.models.layers import HostGemmPlan
from backend_lib.core.model_path import resolve_model_path
from backend_lib.models.loading.loader import load_model
from backend_lib.models.parallel import ParallelContext
from backend_lib.neuron.platform import Platform, detect_platform
from backend_lib.neuron.regions import resolve_backend
from backend_lib.worker.kv_dtype import kv_storage_dtype
from backend_lib.worker.kv_sizing import kv_cache_num_blocks
from backend_lib.worker.kv_sizing import is_hybrid, kv_bytes_per_block, state_bytes_per_slot
from backend_lib.worker.model_runner import ModelRunner, max_drafts
from backend_lib.worker.step_channel import StepChannel
from backend_lib.worker.step_messages import StepLink
from kernels.cpu_kernels import cpu_kernels_supported, load_cpu_kernels
from kernels.gemv import GemvPolicy, gemv_available
from kernels.host_memory import move_buffers_to_huge_pages
from kernels.onednn_gemm import onednn_gemm_available

log = logging.getLogger("deepinfer.rank")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RankState:
    model: torch.nn.Module
    runner: ModelRunner
    num_blocks: int  # the scheduler's: this rank's pool times the context-parallel ranks (each holds its share)
    num_state_slots: int = 0  # fixed per-request state slots (hybrid-cache models; 0 otherwise)
    channel: StepChannel | None = None  # the step messages between the ranks (None: one rank)
    link: StepLink | None = None  # the driver's sending side of it


def num_state_slots(config: EngineConfig, model: torch.nn.Module) -> int:
    """A hybrid-cache model's fixed state slots: one per running request and one per session kept between turns
    (every rank derives the same count from the configuration)."""
    return config.scheduler.max_num_seqs + config.max_sessions if is_hybrid(model) else 0


def kv_cache_blocks(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype, world_size: int = 1,
                    kv_dtype: torch.dtype | None = None, device: torch.device = torch.device("cpu")) -> int:
    """Blocks of the KV pool for this rank's shard (backend_lib/worker/kv_sizing.py: ``num_blocks``,
    ``kv_cache_memory_gb``, or a fraction of the free memory, which the ranks of one host share); a hybrid model's
    state slots (and the scratch slot) come off the budget first. ``kv_dtype``: the paged cache's element type (uint8
    for fp8 records; default ``dtype``); the state slots keep the model ``dtype``."""
    drafts, block_size = max_drafts(config.spec), config.cache.block_size
    per_block = kv_bytes_per_block(model, block_size, kv_dtype or dtype, drafts)
    slots = num_state_slots(config, model)
    fixed = (slots + 1) * state_bytes_per_slot(model, block_size, dtype, drafts) if slots else 0
    return kv_cache_num_blocks(config, per_block, device, share=world_size,
                               fixed_bytes=fixed, fixed_what=f"{slots} state slots (max_num_seqs + max_sessions)",
                               kv_dtype=config.kv_dtype_name)


def _agree_on_blocks(num_blocks: int, world_size: int) -> int:
    """Every rank's pool must have the driver's block count (the scheduler's block ids index them all). The
    driver's shard holds the most KV heads (shares are uneven only in the first ranks' favour), so its count fits
    every rank's memory budget; context ranks hold the driver's shard's sizes."""
    if world_size == 1:
        return num_blocks
    count = torch.tensor([num_blocks], dtype=torch.int64)
    dist.broadcast(count, src=0)
    return int(count.item())


def host_gemm_plan(host_gemm: str, device: torch.device, dtype: torch.dtype,
                   greedy_head_screen: bool = True) -> HostGemmPlan:
    """``ModelConfig.host_gemm`` -> the layouts to pack, as far as this device and dtype have the kernels."""
    onednn = host_gemm in ("auto", "onednn") and onednn_gemm_available(device, dtype)
    blocked = host_gemm in ("auto", "gemv") and gemv_available(device, dtype)
    policy = GemvPolicy(max_rows=None) if host_gemm == "gemv" else GemvPolicy.for_host(dtype)
    return HostGemmPlan(onednn=onednn, blocked=blocked, policy=policy, screen_head=greedy_head_screen)


def build_rank(config: EngineConfig, par: ParallelContext,
               detect: Callable[..., Platform] = detect_platform) -> RankState:
    """``detect``: how the platform is found (once, here; everything below is handed this one)."""
    platform = detect(device=config.model.device)
    device, dtype = platform.torch_device, DTYPES[config.model.dtype]
    model = load_model(resolve_model_path(config.model.model), dtype=dtype, progress=par.is_driver,
                       par=par, weight_format=config.model.weight_format,
                       packed_gemm_path=config.model.packed_gemm_path,
                       host_steps=resolve_backend(config.compile, platform) != "neuron",
                       device=platform.device_type).to(device).eval()
    capabilities = capabilities_of(model)
    if capabilities.rope_extension and model.cover_positions(config.model.max_model_len) and par.is_driver:
        log.warning("max_model_len %d is past the checkpoint's max_position_embeddings %d: RoPE extrapolates there",
                    config.model.max_model_len, model.arch.max_position_embeddings)
    # Before the runner: compiled regions trace the packed GEMMs (opaque custom ops) that eager steps call. Before
    # the KV cache's sizing: the packed and blocked copies and the screened heads take memory the cache must not.
    plan = host_gemm_plan(config.model.host_gemm, device, dtype, config.model.greedy_head_screen)
    if capabilities.host_packing and (plan.onednn or plan.blocked):
        model.pack_for_cpu(plan)
        if plan.blocked:  # the layouts every decode step streams, in the model's order, on huge pages
            move_buffers_to_huge_pages([(module, name) for module in model.modules()
                                        for name, buffer in module.named_buffers(recurse=False)
                                        if "blocked" in name and buffer is not None])
    quantized = [(module, "quantized_data") for module in model.modules()
                 if getattr(module, "quantized", None) is not None]
    if quantized:  # weight_format=packed: the packed bytes every decode step streams, in model order, likewise
        move_buffers_to_huge_pages(quantized)
        for module, _ in quantized:
            module.rebind_quantized()
    kv_dtype = kv_storage_dtype(config, model, dtype, platform)  # refuses fp8 where the model cannot store it
    parallel = config.parallel
    num_blocks = _agree_on_blocks(kv_cache_blocks(config, model, dtype, parallel.ranks_per_node, kv_dtype, device),
                                  parallel.world_size)
    if (config.model.host_attention == "cpp" and capabilities.cpu_attention
            and cpu_kernels_supported(device, dtype) and load_cpu_kernels()):
        model.use_cpu_attention()
    global_rank = par.context.rank * par.world_size + par.rank
    channel = StepChannel(global_rank, parallel.world_size) if parallel.world_size > 1 else None
    link = StepLink(channel) if channel is not None and channel.is_driver else None
    slots = num_state_slots(config, model)
    runner = ModelRunner(model, num_blocks, config.cache.block_size, model.arch.vocab_size, platform, dtype,
                         spec=config.spec, compile_config=config.compile,
                         max_num_seqs=config.scheduler.max_num_seqs, max_model_len=config.model.max_model_len,
                         link=link, is_driver=global_rank == 0, num_state_slots=slots, kv_dtype=kv_dtype,
                         context=par.context, context_min_tokens=parallel.context_parallel_min_tokens)
    return RankState(model, runner, num_blocks * parallel.context_parallel_size, slots, channel, link)
