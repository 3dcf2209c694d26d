"""DeepSeek decode with quantized weights kept packed: ``weight_format=packed`` vs ``dequantize`` on a random
DeepSeek-V3 (fp8 128x128 block-scaled projections and experts) and a random DeepSeek-V4 (fp8 projections, fp4 e2m1
routed experts), decode steps at batch 1 / 8 / 32 (issue 37's DeepSeek rows).

Models are sized so that the weights dominate a step (wide experts, short contexts: a 32-token prompt): V3 hidden
1024, 4 layers (1 dense), 16 experts of 1024 x 512, top-4; V4 the 6-layer hidden-512 model of deepseek_v4_decode.py
with 16 experts of 512 x 256. fp32 activations. Each engine's median decode step over ``--steps`` steps after the
prefill, the two engines alternating, each batch size's best of ``--rounds``. Target (issue 37): packed at batch 1 at
least 2x dequantize. Writes benchmarks/results/quantized_deepseek.md. Run on a quiet machine.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.engine.llm_engine import LLMEngine  # noqa: E402
from backend_lib.tools.tiny import make_tiny  # noqa: E402
from benchmarks.deepseek_v4_decode import MODEL_OVERRIDES as V4_OVERRIDES  # noqa: E402
from benchmarks.engram import PROMPT, decode_step_ms  # noqa: E402
from benchmarks.machine import describe  # noqa: E402

V3_OVERRIDES = dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
                    n_group=2, topk_group=2, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=64,
                    qk_nope_head_dim=64, v_head_dim=64)
MODELS = {"DeepSeek-V3 fp8": ("deepseek_v3", V3_OVERRIDES, False),
          "DeepSeek-V4 fp8 + fp4 experts": ("deepseek_v4", V4_OVERRIDES, True)}
FORMATS = ("dequantize", "packed")


def _engine(path: Path, batch: int, weight_format: str) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 512, "block_size": 16,
                                             "max_num_seqs": batch, "max_num_batched_tokens": batch * PROMPT,
                                             "num_blocks": batch * 8 + 8, "weight_format": weight_format}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="v3,v4", help="which of v3, v4 to measure (comma-separated)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized_deepseek.md"))
    args = parser.parse_args()
    machine = describe()
    print(machine.line())
    work = Path(tempfile.mkdtemp(prefix="quantized-deepseek-"))
    lines = ["# DeepSeek decode: weight_format=packed vs dequantize", "", f"Machine: {machine.line()}.", "",
             "| model | batch | dequantize, ms | packed, ms | packed speed-up |", "|---|---|---|---|---|"]
    chosen = {f"deepseek_{m.strip()}" for m in args.models.split(",")}
    for label, (arch, overrides, fp4) in MODELS.items():
        if arch not in chosen:
            continue
        path = make_tiny(arch, work / arch, seed=5, initializer_range=0.05, overrides=overrides, fp8=True,
                         fp4_experts=fp4)
        for batch in [int(b) for b in args.batches.split(",")]:
            engines = {f: _engine(path, batch, f) for f in FORMATS}
            for engine in engines.values():
                decode_step_ms(engine, batch, 4)  # warm-up
            best = {f: float("inf") for f in FORMATS}
            for _ in range(args.rounds):
                for f, engine in engines.items():
                    best[f] = min(best[f], decode_step_ms(engine, batch, args.steps))
            for engine in engines.values():
                engine.close()
            line = (f"| {label} | {batch} | {best['dequantize']:.2f} | {best['packed']:.2f} | "
                    f"{best['dequantize'] / best['packed']:.2f}x |")
            print(line, flush=True)
            lines.append(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
