"""DeepSeek-V4.1 vision: the encoder's time per image, and the time to first token of a prompt with 1 / 4 images
against a text-only prompt of the same length, on a tiny vision V4.1 (``make-tiny --arch deepseek_v41 --vision``,
fp32, one request at a time); and the release tower's cost per layer, measured on one block of the release's
dimensions (width 1024, 16 heads, intermediate 2816) at a small grid and scaled to a full 1,024-token image
(the projections grow with the patches, the attention with their square; the scale is stated, not measured).

Time to first token counts the request's preparation (decode, preprocessing, the encoder: ``prepare_request``) and
every step until its first token; the text-only prompt has as many tokens as the image prompt (its spans' positions
given text ids). Writes benchmarks/results/vision.md.
Run: `python benchmarks/vision.py` on a quiet machine (nothing else running).
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.llm_engine import LLMEngine  # noqa: E402
from backend_lib.models.deepseek_v41.vision.config import VisionArgs  # noqa: E402
from backend_lib.models.deepseek_v41.vision.preprocess import ImageLimits, preprocess  # noqa: E402
from backend_lib.models.deepseek_v41.vision.tower import VisionBlock, rope_2d  # noqa: E402
from backend_lib.tools.tiny import make_tiny  # noqa: E402
from benchmarks.machine import describe  # noqa: E402

RELEASE_PATCHES = 93 * 96  # the ViT grid of a square image whose span fills max_image_tokens 1024 (31 x 32 + 2)


def _png(width: int, height: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ttft(engine: LLMEngine, prompt: list[int], images: list[bytes] | None, rid: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_prepared(engine.prepare_request(rid, engine.take_in(prompt, params, images=images)))
    while engine.has_unfinished_requests():
        if any(out.new_token_ids for out in engine.step()):
            break
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def release_layer_seconds(dtype: torch.dtype, side: int, repeats: int) -> tuple[float, float, float]:
    """(seconds at side x side patches, the same scaled to RELEASE_PATCHES, the attention's share at side^2)."""
    args = VisionArgs()
    block = VisionBlock(args).to(dtype).eval()
    for norm in (block.norm1, block.norm2):
        norm.weight.data = norm.weight.data.float()
    n = side * side
    x = torch.randn(n, args.hidden_size, dtype=dtype)
    cos, sin = rope_2d(side, side, args.head_dim, args.rope_theta, x.device)
    with torch.no_grad():
        seconds = _median(lambda: block(x, cos, sin), repeats)
    # FLOPs at n patches: projections 2 n d (3d + d + 3 i) per layer, attention 4 n^2 d
    d, i = args.hidden_size, args.intermediate_size
    linear, attention = 2 * n * d * (4 * d + 3 * i), 4 * n * n * d
    big = RELEASE_PATCHES
    scale = (2 * big * d * (4 * d + 3 * i) + 4 * big * big * d) / (linear + attention)
    return seconds, seconds * scale, attention / (linear + attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--side", type=int, default=24, help="patch grid side of the release-layer measurement")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vision.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny("deepseek_v41", tmp, seed=1, vision=True)
        engine = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 512, "block_size": 16,
                                                   "max_num_seqs": 4, "max_num_batched_tokens": 512}))
        encoder, image_id = engine.model.image_encoder, engine.model.config.image_token_id
        images = [_png(120 + 7 * k, 90 + 5 * k, k) for k in range(4)]
        pre = [preprocess(data, "image", encoder.args, ImageLimits(1 << 24, 1 << 24)) for data in images]
        encode = _median(lambda: [encoder.encode(p) for p in pre[:1]], args.repeats)
        preprocess_s = _median(lambda: preprocess(images[0], "image", encoder.args, ImageLimits(1 << 24, 1 << 24)),
                               args.repeats)
        rows = []
        for count in (1, 4):
            prompt = [5, 9, 11] + [image_id, 17, 23] * count
            spans = sum(p.num_tokens for p in pre[:count])
            text = [5 + (k % 200) for k in range(len(prompt) - count + spans)]
            with_images = statistics.median(_ttft(engine, prompt, images[:count], f"i{count}-{r}")
                                            for r in range(args.repeats))
            text_only = statistics.median(_ttft(engine, text, None, f"t{count}-{r}") for r in range(args.repeats))
            rows.append((count, len(text), with_images, text_only))
    lines = ["# DeepSeek-V4.1 vision (benchmarks/vision.py)", "", describe().line(), "",
             f"Tiny vision V4.1 (make-tiny --vision: tower 2 x 32 wide, text 64 wide, 8 layers), fp32, "
             f"median of {args.repeats}:", "",
             f"- preprocessing one 120x90 PNG (decode, resize / pad, patches): {preprocess_s * 1e3:.2f} ms",
             f"- encoder, one image ({pre[0].n_vit_h}x{pre[0].n_vit_w} patches, {pre[0].num_tokens}-token span): "
             f"{encode * 1e3:.2f} ms", "",
             "| images | prompt tokens | time to first token | text-only, same length | ratio |",
             "|---|---|---|---|---|"]
    lines += [f"| {c} | {n} | {w * 1e3:.1f} ms | {t * 1e3:.1f} ms | {w / t:.2f}x |" for c, n, w, t in rows]
    lines += ["", f"Release tower, one block (width 1024, 16 heads, intermediate 2816), median of {args.repeats}:", "",
              "| dtype | measured at | per layer | scaled to 93x96 patches (1,024-token span) | x 32 layers | "
              "attention's FLOP share measured |", "|---|---|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16):
        seconds, scaled, share = release_layer_seconds(dtype, args.side, args.repeats)
        name = str(dtype).removeprefix("torch.")
        lines.append(f"| {name} | {args.side}x{args.side} patches | {seconds * 1e3:.1f} ms | {scaled:.2f} s | "
                     f"{32 * scaled:.1f} s | {share:.0%} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
