"""A test oracle for Engram: DeepSeek's reference (``deepseek-ai/Engram``, ``engram_demo_v1.py``) re-written plainly,
inserted into the V4 oracle (``tests/helpers/v4_reference.py``) in front of the layers of ``engram.layer_ids``.

As in the reference: the compressed tokenizer is built with transformers' ``AutoTokenizer`` (its ``decode`` and
``convert_ids_to_tokens``) and the ``tokenizers`` normalizers; the hash is numpy int64 over the whole sequence
(``np.pad`` with the compressed pad id, XOR of products, ``%`` by each head's prime); the ShortConv is
``nn.Conv1d``'s math (``F.conv1d`` with padding ``(kernel - 1) * dilation``, cut to the sequence) over every value
so far; norm1 / norm2 are RMSNorms without an eps (``F.rms_norm(eps=None)``: the dtype's machine epsilon). Decoding
keeps the whole history of ids and values and recomputes over it: slow and obviously right.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sympy import isprime
from tokenizers import Regex, normalizers

from tests.helpers.v4_reference import ReferenceV4


def reference_lookup(path: str | Path) -> np.ndarray:  # ``CompressedTokenizer._build_lookup_table``
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    sentinel = "\uE000"
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    key2new: dict[str, int] = {}
    lookup = np.empty(len(tokenizer), dtype=np.int64)
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.convert_ids_to_tokens(tid)
        else:
            norm = normalizer.normalize_str(text)
            key = norm if norm else text
        lookup[tid] = key2new.setdefault(key, len(key2new))
    return lookup


class ReferenceHash:  # ``NgramHashMapping``
    def __init__(self, cfg: dict, lookup: np.ndarray) -> None:
        self.cfg, self.lookup = cfg, lookup
        self.vocab = int(lookup.max()) + 1
        self.pad = int(lookup[cfg["pad_id"]])
        half_bound = max(1, int(np.iinfo(np.int64).max // self.vocab) // 2)
        self.multipliers = {}
        for layer in cfg["layer_ids"]:
            g = np.random.default_rng(int(cfg["seed"] + 10007 * int(layer)))
            self.multipliers[layer] = g.integers(0, half_bound, size=(cfg["max_ngram_size"],), dtype=np.int64) * 2 + 1
        seen: set[int] = set()
        self.sizes: dict[int, list[list[int]]] = {}
        for layer in cfg["layer_ids"]:
            per_order = []
            for n in range(2, cfg["max_ngram_size"] + 1):
                heads, start = [], cfg["engram_vocab_size"][n - 2] - 1
                for _ in range(cfg["n_head_per_ngram"]):
                    candidate = start + 1
                    while not (isprime(candidate) and candidate not in seen):
                        candidate += 1
                    seen.add(candidate)
                    heads.append(candidate)
                    start = candidate
                per_order.append(heads)
            self.sizes[layer] = per_order

    def __call__(self, ids: np.ndarray, layer: int) -> np.ndarray:  # [B, T] raw ids -> [B, T, heads]
        x = np.where(ids >= 0, self.lookup[np.maximum(ids, 0)], ids).astype(np.int64)
        _, length = x.shape
        shifts = [x if k == 0 else np.pad(x, ((0, 0), (k, 0)), constant_values=self.pad)[:, :length]
                  for k in range(self.cfg["max_ngram_size"])]
        m, out = self.multipliers[layer], []
        for n in range(2, self.cfg["max_ngram_size"] + 1):
            mix = shifts[0] * m[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * m[k])
            out += [mix % int(p) for p in self.sizes[layer][n - 2]]
        return np.stack(out, axis=2)


class ReferenceEngram:  # ``Engram.forward`` over the whole history
    def __init__(self, w: dict[str, torch.Tensor], layer: int, cfg: dict, hashing: ReferenceHash, hc: int) -> None:
        p = f"layers.{layer}.engram."
        self.w = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}
        self.layer, self.cfg, self.hashing, self.hc = layer, cfg, hashing, hc
        flat = [s for order in hashing.sizes[layer] for s in order]
        self.offsets = np.cumsum([0] + flat[:-1])
        self.ids: list[int] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [S, hc, D], [S] -> [S, hc, D]
        w, s = self.w, h.shape[0]
        self.ids += ids.tolist()
        rows = self.hashing(np.asarray([self.ids]), self.layer)[0, -s:] + self.offsets
        e = w["multi_head_embedding.embedding.weight"][torch.from_numpy(rows)].flatten(-2)
        dim = h.shape[-1]
        gates = []
        for i in range(self.hc):
            key = F.linear(e, w[f"key_projs.{i}.weight"], w[f"key_projs.{i}.bias"])
            g = (F.rms_norm(key, (dim,), w[f"norm1.{i}.weight"]) * F.rms_norm(h[:, i], (dim,), w[f"norm2.{i}.weight"]))
            g = g.sum(-1) / math.sqrt(dim)
            gates.append((g.abs().clamp_min(1e-6).sqrt() * g.sign()).sigmoid()[:, None])
        value = torch.stack(gates, dim=1) * F.linear(e, w["value_proj.weight"], w["value_proj.bias"])[:, None]
        self.values.append(value)
        history = torch.cat(self.values)  # [L, hc, D]
        length, kernel, dilation = history.shape[0], self.cfg["kernel_size"], self.cfg["max_ngram_size"]
        normed = torch.cat([F.rms_norm(history[:, i], (dim,), w[f"short_conv.norms.{i}.weight"], 1e-5)
                            for i in range(self.hc)], dim=-1)
        y = F.conv1d(normed.t()[None], w["short_conv.conv.weight"], padding=(kernel - 1) * dilation,
                     dilation=dilation, groups=normed.shape[-1])[..., :length]
        y = F.silu(y)[0].t().reshape(length, self.hc, dim)
        return value + y[-s:]


class _EngramBlock:
    def __init__(self, block, engram: ReferenceEngram) -> None:
        self.block, self.engram, self.attn = block, engram, block.attn

    def __call__(self, h: torch.Tensor, start: int, ids: torch.Tensor) -> torch.Tensor:
        return self.block(h + self.engram(h, ids), start, ids)


class EngramReferenceV4(ReferenceV4):
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.engram_cfg = json.loads((path / "config.json").read_text())["engram"]
        self.hashing = ReferenceHash(self.engram_cfg, reference_lookup(path))
        super().__init__(path)

    def reset(self) -> None:
        super().reset()
        for layer in self.engram_cfg["layer_ids"]:
            engram = ReferenceEngram(self.weights, layer, self.engram_cfg, self.hashing, self.args.hc)
            self.layers[layer] = _EngramBlock(self.layers[layer], engram)


class EngramTransformersV3:
    """DeepSeek-V3 with Engram: transformers' own V3 (the repository's V3 oracle) with the reference Engram added to
    the hidden states entering each layer of ``engram.layer_ids`` (a forward pre-hook); every call recomputes the
    whole sequence (no cache), so the Engram history is the sequence itself."""

    def __init__(self, path: str | Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        path = Path(path)
        self.model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
        self.cfg = json.loads((path / "config.json").read_text())["engram"]
        self.hashing = ReferenceHash(self.cfg, reference_lookup(path))
        self.weights = {k: v.float() for k, v in load_file(str(path / "model-engram.safetensors")).items()}
        self._ids = torch.zeros(0, dtype=torch.long)
        for layer in self.cfg["layer_ids"]:
            self.model.model.layers[layer].register_forward_pre_hook(self._hook(layer), with_kwargs=True)

    def _hook(self, layer: int):
        def add_engram(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            engram = ReferenceEngram(self.weights, layer, self.cfg, self.hashing, hc=1)
            hidden = hidden + engram(hidden[0][:, None], self._ids)[:, 0][None]
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": hidden}
            return (hidden, *args[1:]), kwargs
        return add_engram

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
        self._ids = torch.tensor(ids)
        return self.model(input_ids=self._ids[None], use_cache=False).logits[0].float()

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(new_tokens):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):]
