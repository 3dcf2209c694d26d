"""Which part of an e4m3 KV cache costs SmolLM2-135M its greedy agreement, and whether a cheap transform wins it back.

A simulation, labelled as one: the fp32 engine keeps its fp32 cache, and every K / V row is rounded on its way in
(through kernels/kv_fp8.py's codes and back, optionally after a scale, a mean shift or a rotation, undone on the
read side where the maths needs it). Attention reads the cache for every key, the new ones included, so this is
the arithmetic of an fp8 cache up to summation order. Variants:

- K and V e4m3 at scale 1.0 (what ``kv_cache_dtype=fp8_e4m3`` stores for a checkpoint without scales);
- the same with per-layer power-of-two scales from the run's own amax (the calibrated scale vLLM can compute);
- V only / K only in e4m3 (the other exact), and K only / V only rounded to bf16 (the model's sensitivity floor);
- K e4m3 after subtracting its per-layer, per-KV-head channel mean (exact in exact arithmetic: q.(k - m) moves every
  score of a query by the same q.m), and after a 64-point Hadamard rotation of K (q.k = Hq.Hk; spreads outlier
  channels).
Greedy agreement with the unrounded run over the shared workload's first 32 new tokens, and the mean index of the
first differing token. Writes benchmarks/results/kv_fp8_ablation.md. Any machine load is fine (no timings).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import backend_lib.models.llama.model as llama_module  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.offline_throughput import load_workload  # noqa: E402
from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402
from kernels.kv_fp8 import FP8_E4M3_MAX, e4m3_codes, e4m3_values  # noqa: E402

TOKENS = 32


def e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # [...] -> [...] rounded through e4m3 codes
    return e4m3_values(e4m3_codes(x / scale)) * scale


def pow2_scale(amax: float) -> float:
    return 2.0 ** math.ceil(math.log2(amax / FP8_E4M3_MAX))


def hadamard(n: int) -> torch.Tensor:  # [n, n] orthonormal (Sylvester), n a power of two
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@dataclass
class LayerStats:
    """One cache tensor's rows over the reference run: amax, and K's per-head channel mean."""

    amax: float = 0.0
    total: torch.Tensor | None = None  # [Hkv, D] sum of rows
    rows: int = 0
    rotated_amax: float = 0.0

    def add(self, x: torch.Tensor, rotation: torch.Tensor) -> None:  # x [T, Hkv, D]
        self.amax = max(self.amax, float(x.abs().max()))
        self.rotated_amax = max(self.rotated_amax, float((x @ rotation).abs().max()))
        total = x.sum(0)
        self.total = total if self.total is None else self.total + total
        self.rows += x.shape[0]

    @property
    def mean(self) -> torch.Tensor:  # [Hkv, D]
        return self.total / self.rows


@dataclass
class Rounding:
    """The write_kv stand-in: which cache tensor a call writes (first-seen order: K0, V0, K1, ...), its stats."""

    stats: dict[int, LayerStats] = field(default_factory=dict)
    order: dict[int, int] = field(default_factory=dict)  # cache data_ptr -> index in first-seen order
    variant: Callable[[torch.Tensor, bool, LayerStats], torch.Tensor] | None = None

    def install(self, rotation: torch.Tensor) -> None:
        write = llama_module.write_kv

        def rounded_write(cache, x, slots, *rest):
            index = self.order.setdefault(cache.data_ptr(), len(self.order))
            x32 = x.float()
            if self.variant is None:
                self.stats.setdefault(index, LayerStats()).add(x32, rotation)
                return write(cache, x, slots, *rest)
            return write(cache, self.variant(x32, index % 2 == 1, self.stats[index]).to(x.dtype), slots, *rest)
        llama_module.write_kv = rounded_write


def variants(rotation: torch.Tensor) -> dict[str, Callable[[torch.Tensor, bool, LayerStats], torch.Tensor]]:
    def rotated_k(x, is_v, s):
        return x if is_v else e4m3(x @ rotation, pow2_scale(s.rotated_amax)) @ rotation.T
    return {
        "K and V e4m3, scale 1.0 (the engine's fp8_e4m3)": lambda x, is_v, s: e4m3(x),
        "K and V e4m3, per-layer pow2 scales from amax": lambda x, is_v, s: e4m3(x, pow2_scale(s.amax)),
        "V e4m3 only (scaled), K exact": lambda x, is_v, s: e4m3(x, pow2_scale(s.amax)) if is_v else x,
        "K e4m3 only (scaled), V exact": lambda x, is_v, s: x if is_v else e4m3(x, pow2_scale(s.amax)),
        "K e4m3 only, channel mean subtracted": lambda x, is_v, s: x if is_v else e4m3(
            x - s.mean, pow2_scale(float((x - s.mean).abs().max()) or 1.0)),
        "K e4m3 only, Hadamard-rotated": rotated_k,
        "K bf16 only, V exact": lambda x, is_v, s: x if is_v else x.to(torch.bfloat16).float(),
        "V bf16 only, K exact": lambda x, is_v, s: x.to(torch.bfloat16).float() if is_v else x,
    }


def compare(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """(identical continuations, mean index of the first differing token; TOKENS where none differs)."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), TOKENS) for x, y in zip(reference, other)]
    return sum(f == TOKENS for f in first), statistics.fmean(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_fp8_ablation.md"))
    args = parser.parse_args()
    prompts, _ = load_workload(Path(args.workload))
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    rotation = hadamard(64)
    rounding = Rounding()
    lines = ["# fp8 KV ablation: which rounding costs SmolLM2-135M (fp32) its greedy agreement (simulated)", "",
             f"Machine: {describe().line()}", "", f"Shared workload, {len(prompts)} prompts, first {TOKENS} new "
             "tokens, against the same engine with no rounding (prefix caching off, eager module path).", "",
             "| rounding on the way into the cache | identical continuations | mean first differing token |",
             "|---|---|---|"]
    config = EngineConfig.from_flat({**FLOAT_WEIGHTS, "dtype": "float32", "max_num_seqs": 32, "enable_prefix_caching": False})
    with LLM(config=config) as llm:
        model = llm.engine.model
        model.host_fused = False  # the module path, where every K / V row goes through write_kv
        for layer in model.layers:
            layer.host_fused = layer.self_attn.host_fused = False
        rounding.install(rotation)  # after the load: the warm-up's dummy rows stay out of the stats
        reference = [r.token_ids for r in llm.generate(prompts, params)]
        for name, variant in variants(rotation).items():
            rounding.variant = variant
            same, first = compare(reference, [r.token_ids for r in llm.generate(prompts, params)])
            lines.append(f"| {name} | {same} / {len(prompts)} | {first:.1f} |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
