"""DeepSeek-V4.1 vs DeepSeek-V4.0 decode step on tiny random models of similar size, and what each request holds.

Models (fp32, make-tiny): the V4.0 of ``deepseek_v4_decode.py`` (sliding / CSA / HCA / CSA / HCA / CSA, window 128,
CSA rate 4 with a top-64 indexer, HCA rate 128) and a V4.1 of the same widths (``V41_OVERRIDES``: window / ratio-2
source / ratio-2 reuse / ratio-1 source and candidate source / reindex / reuse, window 128, top-64, candidate pool of
64 blocks of 8). For each batch in --batches: that many requests with --context tokens of prompt each (different
ids, prefix caching off), prefilled, then the median engine step time over --steps decode steps (eager: V4.1 has no
compiled regions yet), and the paged cache bytes one more token of context costs (the model's own
``hybrid_cache_shapes``, two pool sizes apart). Writes benchmarks/results/deepseek_v41_decode.md and .png.
Run: `python benchmarks/deepseek_v41_decode.py --threads 1`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from backend_lib.tools.tiny import make_tiny  # noqa: E402
from benchmarks.deepseek_decode import load_average  # noqa: E402
from benchmarks.deepseek_v4_decode import MODEL_OVERRIDES as V4_OVERRIDES  # noqa: E402
from benchmarks.machine import describe  # noqa: E402

V41_OVERRIDES = dict(
    hidden_size=512, moe_intermediate_size=256, num_hidden_layers=6, num_attention_heads=8, head_dim=128,
    qk_rope_head_dim=32, q_lora_rank=256, o_groups=4, o_lora_rank=128, n_routed_experts=16, num_experts_per_tok=4,
    index_n_heads=8, index_head_dim=64, index_topk=64, sliding_window=128, compress_ratios=[0, 2, 2, 1, 1, 1],
    kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 4], candidate_source_layer_id=3,
    candidate_topk_blocks=64, candidate_block_size=8, max_position_embeddings=8192, swiglu_limit=10.0,
)
BLOCK_SIZE = 16
MODELS = {"DeepSeek-V4.0": ("deepseek_v4", V4_OVERRIDES), "DeepSeek-V4.1": ("deepseek_v41", V41_OVERRIDES)}


def paged_bytes_per_token(model) -> float:
    """Paged cache bytes one more token of context costs (the fixed per-request rings excluded)."""
    def total(blocks: int) -> int:
        paged, _ = model.hybrid_cache_shapes(blocks, BLOCK_SIZE, 1)
        return sum(torch.Size(s).numel() for s in paged) * 4  # fp32
    return (total(2048) - total(1024)) / (1024 * BLOCK_SIZE)


def decode_step_ms(model_dir: Path, batch: int, context: int, steps: int) -> tuple[float, int]:
    """(median decode step ms, steps timed) for ``batch`` requests of ``context`` tokens each."""
    longest = context + steps + 1
    llm = LLM(str(model_dir), max_num_seqs=batch, max_model_len=longest, max_num_batched_tokens=2048,
              block_size=BLOCK_SIZE, num_blocks=batch * (-(-longest // BLOCK_SIZE) + 1) + 4,
              enable_prefix_caching=False)
    core = llm.engine
    gen = torch.Generator().manual_seed(batch)
    for r in range(batch):
        core.add_request(f"r{r}", torch.randint(3, 300, (context,), generator=gen).tolist(),
                         SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    started = set()
    while len(started) < batch:  # prefill chunks until every request has its first token
        started |= {out.request_id for out in core.step() if out.new_token_ids}
    times = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    times = times[1:]  # the first decode step after the prefill also pays first-use costs
    return 1000 * statistics.median(times), len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch default")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from backend_lib.models.loading.loader import load_model
    machine, load_before = describe().line(), load_average()
    rows = []
    for name, (arch, overrides) in MODELS.items():
        model_dir = make_tiny(arch, tempfile.mkdtemp(prefix=f"{arch}-bench-"), overrides=overrides)
        model = load_model(str(model_dir), torch.float32, progress=False)
        params = sum(t.numel() for t in model.state_dict().values())  # experts are buffers
        per_token = paged_bytes_per_token(model)
        for batch in (int(b) for b in args.batches.split(",")):
            ms, n = decode_step_ms(model_dir, batch, args.context, args.steps)
            print(f"{name} batch {batch}, context {args.context}: {ms:.1f} ms per decode step (median of {n})",
                  flush=True)
            rows.append((name, params, per_token, batch, ms))
            # after every row: a long run cut short still leaves what it measured
            write_report(rows, args, machine, load_before, load_average(), Path(args.out))


def write_report(rows: list, args: argparse.Namespace, machine: str, load_before: str, load_after: str,
                 out: Path) -> None:
    lines = [
        "# DeepSeek-V4.1 vs V4.0: decode step at a long context",
        "",
        "Tiny random models (fp32, eager; `benchmarks/deepseek_v41_decode.py`): V4.0 layers sliding / CSA / HCA / "
        f"CSA / HCA / CSA, V4.1 ratios `{V41_OVERRIDES['compress_ratios']}` (KV sources "
        f"{V41_OVERRIDES['kv_source_layer_ids']}, index sources {V41_OVERRIDES['index_source_layer_ids']}, "
        "candidate source "
        f"{V41_OVERRIDES['candidate_source_layer_id']}); both hidden 512, 6 layers, 8 heads of 128, 16 experts top "
        f"4, window 128, top-64. Each batch: requests of {args.context} prompt tokens, prefilled, then the median "
        f"engine step over {args.steps - 1} decode steps (the first after the prefill dropped). The paged bytes are "
        "the tiny schedules': this V4.1's ratio-1 source keeps one entry per token, so it holds more than this V4.0 "
        "does; at the released dimensions V4.1 holds about half of V4.0 (docs/MODELS.md).",
        "",
        f"Machine: {machine}. **Loaded**: 2 cores shared with other jobs (load average 1/5/15 min before "
        f"{load_before}, after {load_after}); compare within the table, not with other runs.",
        "",
        "| model | parameters | paged cache bytes / token (fp32) | batch | decode step (ms) | ms / request |",
        "|---|---|---|---|---|---|",
    ]
    for name, params, per_token, batch, ms in rows:
        lines.append(f"| {name} | {params / 1e6:.1f} M | {per_token:.0f} | {batch} | {ms:.1f} | {ms / batch:.1f} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "deepseek_v41_decode.md").write_text(text)
    plot(rows, args.context, out)


def plot(rows: list, context: int, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r[3] for r in rows})
    names = [n for n in MODELS if any(r[0] == n for r in rows)]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ms = {r[3]: r[4] for r in rows if r[0] == name}
        bars = ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(batches))],
                      [ms.get(b, 0.0) for b in batches], width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel(f"decode step, ms ({context} tokens of context)")
    ax.set_title("DeepSeek-V4.1 vs V4.0, tiny random, fp32, eager (loaded machine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "deepseek_v41_decode.png", dpi=120)


if __name__ == "__main__":
    main()
