"""What one rank holds and sends when a model is split ``tensor_parallel_size`` ways, read off the engine's own
sharding code: the model is built on the meta device with a rank-0 context of that size (no process group is
joined; nothing is loaded), and every projection reports the shard shape it would load.

``python -m backend_lib.tools.layout --tp 64 [--ep] [--context 8192]`` prints weights, KV cache per token and the
collectives of one decode step for DeepSeek-V3 at its released dimensions (fp8 block weights as released, bf16
everything else, as Neuron runs them).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import nn

from backend_lib.models.parallel import ParallelContext
from backend_lib.models.interfaces import keeps_hybrid_state

FP8_BYTES, BF16_BYTES, FP32_BYTES = 1, 2, 4
HYBRID_BLOCK = 128  # a block size every V4 compress rate divides: the paged entries have no unused rows


@dataclass
class RankLayout:
    tp: int
    expert_parallel: bool
    weight_bytes: int  # this rank's weights
    replicated_bytes: int  # of which every rank holds a full copy
    kv_bytes_per_token: int  # this rank's cache per token of context (one request)
    allreduces_per_step: int  # of [tokens, hidden] partial sums (attention, MLP / MoE, embedding)
    allreduce_bytes_per_token: int  # bytes one decode token contributes to one all-reduce
    gather_bytes_per_token: int  # this rank's logits shard per sampled token (all-gather)
    state_bytes_per_request: int = 0  # hybrid cache (DeepSeek-V4): the fixed state slot of one request


def _linear_bytes(module: nn.Module) -> int:
    """A BlockLinear by its shard shape: fp8 with one fp32 scale per 128x128 block, as the releases store them."""
    out, inp = module.out_features, module.in_features
    return out * inp * FP8_BYTES + math.ceil(out / 128) * math.ceil(inp / 128) * FP32_BYTES


def _tensor_bytes(name: str, tensor: torch.Tensor) -> int:
    """Packed integer codes at their size, routers and scales in fp32, every other float tensor in bf16."""
    if not tensor.dtype.is_floating_point:
        return tensor.numel() * tensor.element_size()
    fp32 = name.endswith(("gate.weight", "scale", "e_score_correction_bias", "gate.bias"))
    return tensor.numel() * (FP32_BYTES if fp32 else BF16_BYTES)


def _weight_bytes(model: nn.Module) -> int:
    """This rank's weights: BlockLinears by shard shape, every other parameter / buffer by its (shard) tensor."""
    from backend_lib.models.deepseek_v3.layers import BlockLinear
    from backend_lib.models.deepseek_v3.moe import RoutedExperts

    total = 0
    for name, module in model.named_modules():
        if name.startswith("mtp"):
            continue
        if isinstance(module, BlockLinear):
            total += _linear_bytes(module)
        elif isinstance(module, RoutedExperts):  # V3's stacked experts: allocated at load, sized by their shapes
            per_expert = sum(math.prod(shape) for shape in module.shapes.values())
            total += module.num_experts * (per_expert * FP8_BYTES + per_expert // (128 * 128) * FP32_BYTES)
        for leaf, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is None or isinstance(module, BlockLinear) or leaf.startswith(("cos", "sin", "inv_freq")):
                continue
            total += _tensor_bytes(f"{name}.{leaf}", tensor)
    return total


def _layout(model: nn.Module, whole: nn.Module, tp: int, expert_parallel: bool, num_layers: int, hidden: int,
            vocab_local: int) -> RankLayout:
    total, unsplit = _weight_bytes(model), _weight_bytes(whole)
    # total = replicated + sharded / tp and unsplit = replicated + sharded
    replicated = 0 if tp == 1 else max(0, (tp * total - unsplit) // (tp - 1))
    state = 0
    if keeps_hybrid_state(model):  # paged entries per block of HYBRID_BLOCK positions, one state slot
        paged, fixed = model.hybrid_cache_shapes(1, HYBRID_BLOCK, 1)
        per_token = sum(math.prod(shape) for shape in paged) * BF16_BYTES // HYBRID_BLOCK
        state = sum(math.prod(shape) for shape in fixed) * BF16_BYTES
    else:
        per_token = sum(math.prod(shape) for shape in model.kv_cache_shapes(1)) * BF16_BYTES
    return RankLayout(
        tp=tp, expert_parallel=expert_parallel, weight_bytes=total, replicated_bytes=replicated,
        kv_bytes_per_token=per_token, state_bytes_per_request=state,
        # one after attention and one after the MLP / MoE in every layer, one after the embedding
        allreduces_per_step=0 if tp == 1 else 2 * num_layers + 1,
        allreduce_bytes_per_token=hidden * BF16_BYTES, gather_bytes_per_token=vocab_local * FP32_BYTES)


def _context(tp: int, expert_parallel: bool) -> ParallelContext:
    return ParallelContext(rank=0, world_size=tp, expert_parallel=expert_parallel,
                           group=None if tp == 1 else "layout only: no collective runs")


def deepseek_v3_layout(tp: int, expert_parallel: bool, args=None) -> RankLayout:
    from backend_lib.models.deepseek_v3.model import DeepseekV3Args, DeepseekV3ForCausalLM

    args = args or DeepseekV3Args()  # the released DeepSeek-V3 dimensions
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(args, dtype=torch.bfloat16, par=_context(tp, expert_parallel))
        whole = DeepseekV3ForCausalLM(args, dtype=torch.bfloat16)
    return _layout(model, whole, tp, expert_parallel, args.num_hidden_layers, args.hidden_size,
                   model.vocab_rows.size)


def deepseek_v4_layout(tp: int, expert_parallel: bool) -> RankLayout:
    """DeepSeek-V4-Flash's dimensions (transformers' DeepseekV4Config defaults), fp8 weights and fp4 experts."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    from backend_lib.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from backend_lib.models.deepseek_v4.args import DeepseekV4Args

    config = DeepseekV4Config().to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    args = DeepseekV4Args.from_hf_config(config)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(args, dtype=torch.bfloat16, par=_context(tp, expert_parallel))
        whole = DeepseekV4ForCausalLM(args, dtype=torch.bfloat16)
    return _layout(model, whole, tp, expert_parallel, args.num_hidden_layers, args.hidden_size,
                   args.vocab_size // tp)


def describe(layout: RankLayout, hbm_gib: float, context: int) -> str:
    gib = 2 ** 30
    free = hbm_gib * gib - layout.weight_bytes
    head = (f"TP={layout.tp}{' + EP' if layout.expert_parallel else ''}: weights {layout.weight_bytes / gib:.2f} GiB "
            f"per rank ({layout.replicated_bytes / gib:.2f} GiB of it replicated on every rank); KV "
            f"{layout.kv_bytes_per_token / 1024:.1f} KiB per token of context")
    if free <= 0:
        return f"{head}; does not fit {hbm_gib:.0f} GiB"
    tokens = free / layout.kv_bytes_per_token
    requests = free / (context * layout.kv_bytes_per_token + layout.state_bytes_per_request)
    state = (f", plus {layout.state_bytes_per_request / 2**20:.1f} MiB of fixed state per request"
             if layout.state_bytes_per_request else "")
    return (f"{head}{state}; the {free / gib:.1f} GiB left of {hbm_gib:.0f} GiB hold {tokens:,.0f} tokens "
            f"({requests:,.0f} requests of {context:,} tokens, before activations); a decode step of B "
            f"tokens makes {layout.allreduces_per_step} all-reduces of B x {layout.allreduce_bytes_per_token:,} "
            f"bytes and one all-gather of B x {layout.gather_bytes_per_token:,} bytes from each rank")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=64)
    parser.add_argument("--ep", action="store_true", help="experts partitioned (enable_expert_parallel)")
    parser.add_argument("--hbm-gib", type=float, default=24.0, help="device memory of one rank (trn2 core: 24)")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--arch", choices=["deepseek_v3", "deepseek_v4"], default="deepseek_v3")
    args = parser.parse_args(argv)
    layout = deepseek_v3_layout if args.arch == "deepseek_v3" else deepseek_v4_layout
    print(describe(layout(args.tp, args.ep), args.hbm_gib, args.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
