"""Distil a small DSpark drafter for the bundled SmolLM2 from the target's own greedy outputs (issue 48).

Data: prompts built from text that ships with the machine, disjoint from the benchmarks' shared workload: the
paragraphs of /usr/share/common-licenses and the docstrings of Python's standard library, asked as chat turns
("Summarize ...", "Explain ..."). The engine generates the target's greedy answers (batched); transformers then
runs the target over prompt + answer once for its hidden states (``hidden_states[id + 1]``: DeepSpec's capture of
the drafter's layers) and its final-normed states (the target's logits for the distillation terms). The answer
tokens are supervised.

Training: the engine's own drafter module, the target's embedding and head shared and frozen, DeepSpec's objective
(benchmarks/drafter_objective.py: cross-entropy + L1 of the probabilities (twice the total variation) to the target +
the confidence head's BCE on 1 - TV), AdamW with warmup and cosine decay, one sequence a step. Its layers start from
the target's last layers' weights (the same shapes: the drafter copies the target's architecture), which a short
CPU budget turns into drafts far sooner than a random start. Writes the drafter directory (config.json +
model.safetensors) under ~/.cache/deepinfer/drafters/ (XDG_CACHE_HOME respected) and prints each slot's held-out
greedy acceptance (a draft prefix equal to the target's argmax) and survival calibration.

    python benchmarks/train_drafter.py                     # ~30 min on 2 cores: 256 prompts, 96 tokens, 1500 steps
    python benchmarks/train_drafter.py --prompts 8 --new-tokens 16 --steps 20 --out /tmp/tiny-drafter  # ~a minute
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from backend_lib.models.dspark.model import DSparkDrafter, save_drafter  # noqa: E402
from backend_lib.tools.drafter import build_drafter, target_arch  # noqa: E402
from benchmarks.drafter_objective import Objective, TargetSequence, step_losses  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
STDLIB_MODULES = ("json", "os.path", "collections", "itertools", "functools", "textwrap", "string", "re", "random",
                  "math", "statistics", "datetime", "pathlib", "shutil", "heapq", "bisect", "csv", "argparse",
                  "logging", "fractions", "decimal", "difflib", "glob", "fnmatch", "tempfile", "zipfile", "base64")


def default_output_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "deepinfer" / "drafters" / "smollm2-135m-dspark"


def license_paragraphs() -> list[str]:
    out = []
    for path in sorted(LICENSES.glob("*")) if LICENSES.is_dir() else []:
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="ignore")
            out += [" ".join(p.split()) for p in text.split("\n\n") if 200 <= len(p) <= 900]
    return out


def stdlib_docstrings() -> list[str]:
    import importlib

    out = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            doc = inspect.getdoc(getattr(module, attr, None)) if not attr.startswith("_") else None
            if doc and 80 <= len(doc) <= 900:
                out.append(f"{name}.{attr}: {doc}")
    return out


def training_prompts(count: int, seed: int) -> list[list[dict]]:
    """Chat turns over the machine's own texts (disjoint from the shared workload's prompts)."""
    rng = random.Random(seed)
    licenses, docs = license_paragraphs(), stdlib_docstrings()
    rng.shuffle(licenses)
    rng.shuffle(docs)
    asks = [("Summarize this passage in plain words:", licenses), ("Explain what this Python API does:", docs),
            ("Rewrite this more simply:", licenses), ("Give an example of using this Python API:", docs)]
    prompts = []
    for i in range(count):
        ask, pool = asks[i % len(asks)]
        prompts.append([{"role": "user", "content": f"{ask}\n\n{pool[(i // len(asks)) % len(pool)]}"}])
    return prompts


def generate(model_path: str, prompts: list[list[dict]], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer) per prompt, from the engine (batched)."""
    llm = LLM(config=EngineConfig.from_flat({"model": model_path, "max_num_seqs": 16}))
    prompt_ids = [llm.engine.tokenizer.apply_chat_template(p) for p in prompts]
    results = llm.generate(prompt_ids, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    return [(ids, r.token_ids) for ids, r in zip(prompt_ids, results)]


@torch.no_grad()
def target_states(model_path: str, pairs: list[tuple[list[int], list[int]]], layer_ids: tuple[int, ...],
                  ) -> tuple[list[TargetSequence], torch.Tensor, torch.Tensor]:
    """Each sequence's hidden states from transformers (DeepSpec's capture), and the target's embedding and head."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(model_path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    sequences = []
    for prompt, answer in pairs:
        ids = torch.tensor(prompt + answer)
        states = hf(ids[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)
        mask = torch.zeros(ids.shape[0], dtype=torch.bool)
        mask[len(prompt):] = True
        sequences.append(TargetSequence(ids, features, states[-1][0], mask))
    return sequences, hf.get_input_embeddings().weight.detach().clone(), hf.get_output_embeddings().weight.detach().clone()


def start_from_target_layers(drafter: DSparkDrafter, model_path: str) -> None:
    """Copy the target's last layers into the drafter's (same names under ``model.layers.N``)."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(model_path)
    state = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).state_dict()
    total = drafter.config.num_target_layers
    own = drafter.state_dict()
    for i in range(len(drafter.layers)):
        source = total - len(drafter.layers) + i
        for key in [k for k in own if k.startswith(f"layers.{i}.")]:
            own[key] = state[f"model.layers.{source}." + key[len(f"layers.{i}."):]].clone()
    drafter.load_state_dict(own)


@torch.no_grad()
def held_out_acceptance(drafter: DSparkDrafter, embed: torch.Tensor, head: torch.Tensor,
                        sequences: list[TargetSequence], objective: Objective) -> list[float]:
    """Mean 1 - TV per slot on sequences the training never saw (what a sampled verification would accept)."""
    generator = torch.Generator().manual_seed(0)
    rows = [s.accept_by_slot for s in (step_losses(drafter, embed, head, seq, objective, generator)
                                       for seq in sequences) if s is not None]
    return [sum(r[i] for r in rows) / len(rows) for i in range(len(rows[0]))] if rows else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="the target (default: the bundled SmolLM2 GGUF)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=1, help="draft layers (1-2)")
    parser.add_argument("--block-size", type=int, default=5)
    parser.add_argument("--markov-rank", type=int, default=64)
    parser.add_argument("--target-layers", type=int, default=3, help="how many target layers the drafter reads")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--random-init", action="store_true", help="start from random layers (DeepSpec's start)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="drafter directory (default under ~/.cache/deepinfer/drafters)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model_path = args.model or default_model_path()
    out = Path(args.out) if args.out else default_output_dir()
    begin = time.perf_counter()

    drafter, config = build_drafter(target_arch(model_path), seed=args.seed, num_draft_layers=args.layers,
                                    block_size=args.block_size, markov_rank=args.markov_rank,
                                    num_target_layer_ids=args.target_layers)
    if not args.random_init:
        start_from_target_layers(drafter, model_path)
    pairs = generate(model_path, training_prompts(args.prompts, args.seed), args.new_tokens)
    print(f"generated {sum(len(a) for _, a in pairs)} answer tokens in {time.perf_counter() - begin:.0f} s",
          flush=True)
    sequences, embed, head = target_states(model_path, pairs, drafter.config.target_layer_ids)
    held = max(1, len(sequences) // 16)
    train, test = sequences[held:] or sequences, sequences[:held]
    objective = Objective()
    print(f"target states in {time.perf_counter() - begin:.0f} s; held-out acceptance before training: "
          f"{[round(a, 3) for a in held_out_acceptance(drafter, embed, head, test, objective)]}", flush=True)

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, int(0.04 * args.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    generator = torch.Generator().manual_seed(args.seed)
    drafter.train()
    for step in range(args.steps):
        losses = step_losses(drafter, embed, head, train[step % len(train)], objective, generator)
        if losses is None:
            continue
        optimizer.zero_grad(set_to_none=True)
        losses.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % max(1, args.steps // 20) == 0 or step == args.steps - 1:
            print(f"step {step}: loss {float(losses.loss):.3f} ce {losses.ce:.3f} l1 {losses.l1:.3f} "
                  f"conf {losses.confidence:.3f} accept {[round(a, 2) for a in losses.accept_by_slot]} "
                  f"({time.perf_counter() - begin:.0f} s)", flush=True)
    drafter.eval()
    print(f"held-out acceptance by slot: "
          f"{[round(a, 3) for a in held_out_acceptance(drafter, embed, head, test, objective)]}")
    save_drafter(drafter, str(out), config)
    print(f"wrote {out} in {time.perf_counter() - begin:.0f} s; serve it with spec_method=dspark "
          f"speculative_model={out} num_speculative_tokens={args.block_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
