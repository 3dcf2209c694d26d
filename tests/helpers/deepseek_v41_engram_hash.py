"""The V4.1 oracle's Engram hash (tests/helpers/deepseek_v41_reference.py): transformers main's
``DeepseekV41NgramHashState`` and ``EngramLayout`` (commit 0a2080b4) re-written for one sequence, independent of the
engine's ``backend_lib/models/deepseek_v41/engram.py``."""
from __future__ import annotations

from pathlib import Path

import torch


class EngramHash:
    """Token ids -> each Engram layer's table rows at every position [``DeepseekV41NgramHashState``]."""

    def __init__(self, text: dict, tokenizer_file: Path) -> None:
        import numpy as np
        from sympy import isprime
        from tokenizers import Regex, Tokenizer, normalizers

        tok = Tokenizer.from_file(str(tokenizer_file))
        norm = normalizers.Sequence([
            normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), "\ue000"),
            normalizers.Strip(), normalizers.Replace("\ue000", " ")])
        keys: dict[str, int] = {}
        lookup = []
        for i in range(tok.get_vocab_size(with_added_tokens=True)):
            t = tok.decode([i], skip_special_tokens=False)
            key = tok.id_to_token(i) if "\ufffd" in t else (norm.normalize_str(t) or t)
            lookup.append(keys.setdefault(key, len(keys)))
        assert len(keys) == text["engram_compressed_vocab_size"], (len(keys), text["engram_compressed_vocab_size"])
        self.layers = list(text["engram_layer_ids"])
        self.n, heads = text["engram_max_ngram_size"], text["engram_n_heads"]
        self.lookup, self.pad = torch.tensor(lookup), lookup[text["engram_pad_id"]]
        seen: set[int] = set()
        self.primes = []  # [L][order][head]
        for _ in self.layers:
            orders = []
            for _ in range(self.n - 1):
                heads_p, c = [], text["engram_vocab_size"] - 1
                for _ in range(heads):
                    c += 1
                    while not isprime(c) or c in seen:
                        c += 1
                    seen.add(c)
                    heads_p.append(c)
                orders.append(heads_p)
            self.primes.append(orders)
        bound = max(1, (np.iinfo(np.int64).max // len(keys)) // 2)
        self.mult = [torch.tensor(np.random.default_rng(10007 * layer).integers(0, bound, size=(self.n,),
                                                                                dtype=np.int64) * 2 + 1)
                     for layer in self.layers]

    def __call__(self, ids: list[int], dead_id: int | None = None) -> torch.Tensor:  # [S, L_e, cols]
        """``dead_id``: image tokens, DEAD as released (vLLM ``common/engram.py``): slot k of token t is padding
        once any of the k tokens before t is one."""
        c = self.lookup[torch.tensor(ids)]
        s = c.shape[0]
        grams = torch.stack([torch.cat([torch.full((k,), self.pad), c[:s - k]]) for k in range(self.n)], -1)
        if dead_id is not None:
            dead = torch.tensor(ids) == dead_id
            for k in range(1, self.n):
                before = torch.stack([torch.cat([torch.zeros(j, dtype=torch.bool), dead[:s - j]])
                                      for j in range(1, k + 1)]).any(0)
                grams[:, k] = torch.where(before, torch.full_like(grams[:, k], self.pad), grams[:, k])
        out = []
        for layer, orders in enumerate(self.primes):
            prod = grams * self.mult[layer]
            rolling, cols, offset = prod[:, 0], [], 0
            for i in range(1, self.n):
                rolling = rolling ^ prod[:, i]
                for prime in orders[i - 1]:
                    cols.append(rolling % prime + offset)
                    offset += prime
            out.append(torch.stack(cols, -1))
        return torch.stack(out, 1)
