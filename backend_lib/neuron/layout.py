"""What one rank holds and sends when a model is split ``tensor_parallel_size`` ways, read off the engine's own
sharding code: the model is built on the meta device with a rank-0 context of that size (no process group is
joined; nothing is loaded), and every projection reports the shard shape it would load.

``python -m backend_lib.neuron.layout --tp 64 [--ep] [--context 8192]`` prints weights, KV cache per token and the
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

FP8_BYTES, BF16_BYTES, FP32_BYTES = 1, 2, 4


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


def _linear_bytes(module: nn.Module) -> tuple[int, bool]:
    """(bytes, replicated) of a BlockLinear by its shard shape: fp8 with one fp32 scale per 128x128 block."""
    out, inp = module.out_features, module.in_features
    scales = math.ceil(out / module.block_size[0]) * math.ceil(inp / module.block_size[1]) * FP32_BYTES
    return out * inp * FP8_BYTES + scales, module.shard is None


def deepseek_v3_layout(tp: int, expert_parallel: bool, args=None) -> RankLayout:
    from backend_lib.models.deepseek_layers import BlockLinear, RMSNorm, RoutedExperts, Router
    from backend_lib.models.deepseek_v3 import DeepseekV3Args, DeepseekV3ForCausalLM

    args = args or DeepseekV3Args()  # the released DeepSeek-V3 dimensions
    par = ParallelContext(rank=0, world_size=tp, expert_parallel=expert_parallel,
                          group=None if tp == 1 else "layout only: no collective runs")
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(args, dtype=torch.bfloat16, par=par)
    total = replicated = 0
    for name, module in model.named_modules():
        if name.startswith("mtp"):
            continue
        if isinstance(module, BlockLinear):
            nbytes, whole = _linear_bytes(module)
            if name == "lm_head":
                nbytes, whole = module.out_features * module.in_features * BF16_BYTES, False  # bf16 as released
        elif isinstance(module, RoutedExperts):
            per_expert = sum(math.prod(shape) for shape in module.shapes.values())
            nbytes, whole = module.num_experts * (per_expert * FP8_BYTES + per_expert // (128 * 128) * FP32_BYTES), False
        elif isinstance(module, Router):
            nbytes, whole = module.weight.numel() * FP32_BYTES, True
        elif isinstance(module, RMSNorm):
            nbytes, whole = module.weight.numel() * BF16_BYTES, True
        elif isinstance(module, nn.Embedding):
            nbytes, whole = module.weight.numel() * BF16_BYTES, tp == 1
        else:
            continue
        total += nbytes
        replicated += nbytes if whole else 0
    layers = args.num_hidden_layers
    return RankLayout(
        tp=tp, expert_parallel=expert_parallel, weight_bytes=total, replicated_bytes=replicated,
        # MLA's latent is shared by all heads: every rank caches the whole latent of its requests.
        kv_bytes_per_token=layers * args.latent_dim * BF16_BYTES,
        allreduces_per_step=0 if tp == 1 else 2 * layers + 1,
        allreduce_bytes_per_token=args.hidden_size * BF16_BYTES,
        gather_bytes_per_token=model.vocab_rows.size * FP32_BYTES)


def describe(layout: RankLayout, hbm_gib: float, context: int) -> str:
    gib = 2 ** 30
    free = hbm_gib * gib - layout.weight_bytes
    head = (f"TP={layout.tp}{' + EP' if layout.expert_parallel else ''}: weights {layout.weight_bytes / gib:.2f} GiB "
            f"per rank ({layout.replicated_bytes / gib:.2f} GiB of it replicated on every rank); KV "
            f"{layout.kv_bytes_per_token / 1024:.1f} KiB per token of context")
    if free <= 0:
        return f"{head}; does not fit {hbm_gib:.0f} GiB"
    tokens = free / layout.kv_bytes_per_token
    return (f"{head}; the {free / gib:.1f} GiB left of {hbm_gib:.0f} GiB hold {tokens:,.0f} tokens "
            f"({tokens / context:,.0f} requests of {context:,} tokens, before activations); a decode step of B "
            f"tokens makes {layout.allreduces_per_step} all-reduces of B x {layout.allreduce_bytes_per_token:,} "
            f"bytes and one all-gather of B x {layout.gather_bytes_per_token:,} bytes from each rank")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=64)
    parser.add_argument("--ep", action="store_true", help="experts partitioned (enable_expert_parallel)")
    parser.add_argument("--hbm-gib", type=float, default=24.0, help="device memory of one rank (trn2 core: 24)")
    parser.add_argument("--context", type=int, default=8192)
    args = parser.parse_args(argv)
    print(describe(deepseek_v3_layout(args.tp, args.ep), args.hbm_gib, args.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
