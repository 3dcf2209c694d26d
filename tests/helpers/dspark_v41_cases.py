"""Tiny DeepSeek-V4.1 checkpoints with a DSpark drafter that drafts *some* tokens right, for lossless tests: a random
drafter accepts nothing, so nothing would be rolled back after a partial acceptance. ``plant_bigrams`` rewrites
the checkpoint's Markov head (``markov_head.embed`` / ``head``) so that its bias is ``scale`` on ``next`` after
``prev`` for up to ``rank`` (prev, next) pairs taken from the target's own greedy output, and zero elsewhere: the
drafts follow those bigrams (the random backbone's logits are small next to ``scale``), accepted where the target
repeats them and rejected where it does not."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def plant_bigrams(path: str | Path, sequences: list[list[int]], scale: float = 1000.0) -> int:
    """In place; returns the number of planted pairs. Each ``prev`` keeps its most frequent ``next``."""
    pairs = Counter((a, b) for seq in sequences for a, b in zip(seq, seq[1:]))
    best: dict[int, tuple[int, int]] = {}
    for (a, b), n in pairs.most_common():
        best.setdefault(a, (b, n))
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors = load_file(str(file))
        embed_name = next((n for n in tensors if n.endswith("markov_head.embed.weight")), None)
        if embed_name is None:
            continue
        embed = torch.zeros_like(tensors[embed_name])
        head_name = embed_name.replace("embed.weight", "head.weight")
        head = torch.zeros_like(tensors[head_name])
        chosen = sorted(best.items(), key=lambda kv: -kv[1][1])[:embed.shape[1]]
        for k, (prev, (nxt, _)) in enumerate(chosen):
            embed[prev, k], head[nxt, k] = scale, 1.0
        tensors[embed_name], tensors[head_name] = embed, head
        save_file(tensors, str(file))
        return len(chosen)
    raise ValueError(f"{path}: no markov_head tensors")
