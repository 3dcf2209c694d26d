"""KV bytes per token of context: DeepSeek-V4's hybrid cache against V3's MLA latent cache and a plain GQA cache.

Measured, not assumed: for each tiny random model (make-tiny) the engine's own ``ModelRunner`` allocates its cache at
two pool sizes, and the difference per block / ``block_size`` is the bytes one more token of context costs (a V4
state slot likewise, from two slot counts). Each measurement must equal the formula below at the tiny dimensions;
the formulas then give the released dimensions (bf16). Writes benchmarks/results/kv_bytes.md.

Formulas (values per token of context; L layers, D head_dim, Di index_head_dim, W sliding_window, k draft tokens):
- V4 hybrid, paged: ``n_csa * (D + Di) / r_csa + n_hca * D / r_hca`` (``block_size`` a multiple of both rates);
  plus a fixed slot per request: ``L * (W + k) * D + n_csa * (2 r_csa + k) * 4 (D + Di) + n_hca * (r_hca + k) * 2D``
- V4 first version (per-token state): ``L * D + n_csa * 5 (D + Di) + n_hca * 3D``
- V3 MLA: ``L * (kv_lora_rank + qk_rope_head_dim)``;  GQA: ``2 * L * num_kv_heads * head_dim``
Run: ``python benchmarks/kv_bytes_per_token.py``.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.models.loading.loader import load_model  # noqa: E402
from backend_lib.neuron.platform import detect_platform  # noqa: E402
from backend_lib.tools.tiny import make_tiny  # noqa: E402
from backend_lib.worker.model_runner import ModelRunner  # noqa: E402

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
BF16 = 2


@dataclass(frozen=True)
class V4Dims:
    layers: int
    n_csa: int
    n_hca: int
    d: int = 512
    di: int = 128
    window: int = 128
    r_csa: int = 4
    r_hca: int = 128

    def paged(self) -> float:
        return self.n_csa * (self.d + self.di) / self.r_csa + self.n_hca * self.d / self.r_hca

    def state(self, drafts: int = 0) -> int:
        return (self.layers * (self.window + drafts) * self.d + self.n_csa * (2 * self.r_csa + drafts) * 4
                * (self.d + self.di) + self.n_hca * (self.r_hca + drafts) * 2 * self.d)

    def first_version(self) -> int:
        return self.layers * self.d + self.n_csa * 5 * (self.d + self.di) + self.n_hca * 3 * self.d


def transformers_schedule(layers: int) -> tuple[int, int]:
    """(n_csa, n_hca) of transformers' default layer_types: two HCA layers, then CSA / HCA interleaved."""
    n_csa = sum(1 for i in range(max(layers - 2, 0)) if i % 2)
    return n_csa, layers - n_csa


def _values(runner_args: dict, model: torch.nn.Module, **kw) -> int:
    runner = ModelRunner(model, platform=detect_platform(device="cpu"), dtype=torch.float32,
                         vocab_size=model.arch.vocab_size,
                         **runner_args, **kw)
    return sum(t.numel() for t in runner.kv_caches)


def measure(model: torch.nn.Module, block_size: int) -> tuple[float, int]:
    """(values per token of context, values per state slot) of the engine's allocation."""
    def alloc(blocks: int, slots: int) -> int:
        return _values({"num_blocks": blocks, "block_size": block_size, "num_state_slots": slots}, model)
    per_token = (alloc(9, 2) - alloc(1, 2)) / (8 * block_size)
    return per_token, alloc(1, 3) - alloc(1, 2)


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        v4 = load_model(str(make_tiny("deepseek_v4", f"{tmp}/v4", seed=0)), torch.float32, progress=False)
        a = v4.args
        tiny = V4Dims(a.num_hidden_layers, a.count(CSA), a.count(HCA), a.head_dim, a.index_head_dim,
                      a.sliding_window, a.rate(CSA), a.rate(HCA))
        per_token, per_slot = measure(v4, block_size=8)  # both tiny rates (4, 8) divide 8
        assert per_token == tiny.paged() and per_slot == tiny.state(), (per_token, per_slot, tiny)
        v3 = load_model(str(make_tiny("deepseek_v3", f"{tmp}/v3", seed=0)), torch.float32, progress=False)
        v3_token, _ = measure(v3, block_size=4)
        assert v3_token == v3.arch.num_hidden_layers * (v3.arch.kv_lora_rank + v3.arch.qk_rope_head_dim)
        llama = load_model(str(make_tiny("llama", f"{tmp}/llama", seed=0)), torch.float32, progress=False)
        gqa_token, _ = measure(llama, block_size=4)
        cfg = llama.arch
        assert gqa_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim, gqa_token
    flash, pro = V4Dims(43, *transformers_schedule(43)), V4Dims(61, *transformers_schedule(61))
    for name, dims in (("DeepSeek-V4-Flash", flash), ("DeepSeek-V4-Pro", pro)):
        rows.append((f"{name} hybrid: paged entries (L={dims.layers}, {dims.n_csa} CSA / {dims.n_hca} HCA)",
                     dims.paged(), dims.state()))
        rows.append((f"{name}, first version (per-token state)", dims.first_version(), 0))
    rows.append(("DeepSeek-V3 MLA latent (61 layers, 512 + 64)", 61 * (512 + 64), 0))
    rows.append(("plain GQA, Llama-3.1-70B (80 layers, 8 KV heads of 128)", 2 * 80 * 8 * 128, 0))
    lines = ["| cache | values / token | bf16 bytes / token | 1M-token context | fixed per request |",
             "|---|---|---|---|---|"]
    for name, values, state in rows:
        per_token = values * BF16
        fixed = f"{state * BF16 / 2**20:.1f} MiB" if state else "-"
        lines.append(f"| {name} | {values:,.0f} | {per_token / 1024:.1f} KiB | {per_token * 2**20 / 2**30:.1f} GiB "
                     f"| {fixed} |")
    table = "\n".join(lines)
    out = ROOT / "benchmarks" / "results" / "kv_bytes.md"
    out.write_text(f"# KV bytes per token of context\n\n{__doc__.split('Run:')[0].strip()}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
