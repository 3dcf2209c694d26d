"""DeepSeek-V4.1's released Engram (transformers main ``DeepseekV41Engram`` / ``DeepseekV41NgramHashState``; vLLM
``common/engram.py``, "port of the reference inference/engram.py"), which differs from ``engram_demo_v1``
(``backend_lib/models/engram/``):

- n-grams of orders 2 .. ``engram_max_ngram_size`` (4), each over ``engram_n_heads`` heads: ``n_hash_cols`` =
  ``(N - 1) * heads`` rows a token; one ``engram_vocab_size`` for every order (each (layer, order) searches primes
  upward from it, no prime reused anywhere); a layer's rows are addressed from its own table start (the primes'
  exclusive prefix sum);
- the hash: compressed ids (the checkpoint's own tokenizer, raw decode: ``engram.ngram_hash.compressed_vocabulary``),
  ``XOR_k id_k * mult_k`` rolled one look-back at a time, ``% prime + offset``; a look-back before the start is the
  compressed ``engram_pad_id``; multipliers from ``default_rng(10007 * layer)``, odd, below
  ``(int64 max // V') // 2``; hashed once per step for every Engram layer;
- the module: the ``n_hash_cols`` rows (``engram.embed.weight``, fp32 / bf16, or fp8 with ``engram.embed.scale``:
  one ue8m0 factor per 32 channels of a row) through one bias-free ``engram.wkv`` into a key per stream and one
  value; the gate of stream s is ``sigmoid(signed sqrt(<h_s, w_s * key_s> * rstd(h_s) * rstd(key_s) / sqrt(D)))``
  with ``w = q_weight * k_weight``; the output is ``h + gate * value`` (no ShortConv), on the 4-stream residual
  before the layer's attention mHC coefficients.
Image tokens (``image_token_id``) are DEAD: from a look-back slot holding one, it and every older slot are padding,
and an image token's gate is zero. Not here yet: tables sharded over ranks or in host memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sympy import isprime  # torch's own dependency
from torch import nn

from backend_lib.models.deepseek_v3.layers import BlockLinear
from backend_lib.models.deepseek_v41.config import DeepseekV41TextArgs
from backend_lib.models.engram.ngram_hash import compressed_vocabulary

FP8_BLOCK = 32  # channels per ue8m0 scale of an fp8 table row


def engram_primes(a: DeepseekV41TextArgs) -> list[list[int]]:
    """Per Engram layer, its (order, head) table sizes in flat order: primes searched upward from
    ``engram_vocab_size`` for every (layer, order), never reused."""
    taken: set[int] = set()
    out = []
    for _ in a.engram_layer_ids:
        flat = []
        for _ in range(a.engram_max_ngram_size - 1):
            candidate = a.engram_vocab_size - 1
            for _ in range(a.engram_n_heads):
                candidate += 1
                while not isprime(candidate) or candidate in taken:
                    candidate += 1
                taken.add(candidate)
                flat.append(candidate)
        out.append(flat)
    return out


@dataclass(frozen=True)
class V41EngramHash:
    token_map: torch.Tensor  # [vocab] int64 compressed ids
    pad_id: int  # compressed
    multipliers: torch.Tensor  # [L, N] int64
    primes: torch.Tensor  # [L, N - 1, heads] int64
    offsets: torch.Tensor  # [L, cols] int64
    dead_id: int = -1  # image_token_id: a DEAD look-back

    @classmethod
    def build(cls, a: DeepseekV41TextArgs, tokenizer_file: str | Path, dead_id: int = -1) -> "V41EngramHash":
        lookup = compressed_vocabulary(tokenizer_file)
        size = int(lookup.max()) + 1
        if size != a.engram_compressed_vocab_size:
            raise ValueError(f"text_config.engram_compressed_vocab_size is {a.engram_compressed_vocab_size} but the "
                             f"checkpoint's tokenizer compresses to {size} ids: every hash would change")
        if not 0 <= a.engram_pad_id < len(lookup):
            raise ValueError(f"text_config.engram_pad_id {a.engram_pad_id} is not a token id ({len(lookup)} ids)")
        primes = engram_primes(a)
        for k, (layer, rows) in enumerate(zip(a.engram_layer_ids, a.engram_num_embeddings)):
            if rows < sum(primes[k]):
                raise ValueError(f"text_config.engram_num_embeddings[{k}] ({rows} rows, layer {layer}) is below the "
                                 f"sum of its primes ({sum(primes[k])})")
        bound = max(1, int(np.iinfo(np.int64).max // size) // 2)
        mult = [np.random.default_rng(10007 * layer).integers(0, bound, size=(a.engram_max_ngram_size,),
                                                              dtype=np.int64) * 2 + 1
                for layer in a.engram_layer_ids]
        offsets = [np.concatenate([[0], np.cumsum(p[:-1])]) for p in primes]
        return cls(torch.from_numpy(lookup), int(lookup[a.engram_pad_id]), torch.from_numpy(np.stack(mult)),
                   torch.tensor(primes).view(len(primes), a.engram_max_ngram_size - 1, a.engram_n_heads),
                   torch.from_numpy(np.stack(offsets).astype(np.int64)), dead_id)

    def __call__(self, input_ids: torch.Tensor,  # [T] int64
                 history: torch.Tensor,  # [T, N - 1] int64 the ids before each token, oldest first, -1: none
                 ) -> torch.Tensor:  # [T, L, cols] int64 table rows of each Engram layer
        ids = torch.cat([input_ids[:, None], history.flip(-1)], dim=1)  # slot k: k tokens back
        compressed = self.token_map.to(ids.device)[ids.clamp(min=0)]
        # once a look-back is before the start or DEAD, it and every older slot are padding
        blocked = torch.cumsum(((ids < 0) | (ids == self.dead_id)).long(), dim=1) > 0
        tokens = torch.where(blocked, torch.full_like(compressed, self.pad_id), compressed)
        products = tokens[:, None, :] * self.multipliers[None]  # [T, L, N]
        rolling, hashes = products[..., 0], []
        for i in range(1, products.shape[-1]):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            hashes.append(rolling[..., None] % self.primes[None, :, i - 1])
        return torch.cat(hashes, dim=-1) + self.offsets[None]


class V41Engram(nn.Module):
    """``layers.{i}.engram.{embed.weight, embed.scale, wkv.weight, q_weight, k_weight}``."""

    def __init__(self, a: DeepseekV41TextArgs, rows: int, block_size: tuple[int, int], dead_id: int = -1) -> None:
        super().__init__()
        self.hidden, self.hc, self.eps, self.dead_id = a.hidden_size, a.hc_mult, a.rms_norm_eps, dead_id
        cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads
        self.embed = nn.Module()
        self.embed.register_buffer("weight", torch.zeros(rows, a.engram_head_dim))
        self.embed.register_buffer("scale", None)  # fp8 tables: [rows, head_dim / 32] factors
        self.wkv = BlockLinear(cols * a.engram_head_dim, (a.hc_mult + 1) * a.hidden_size, block_size=block_size)
        self.q_weight = nn.Parameter(torch.ones(a.hc_mult, a.hidden_size), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(a.hc_mult, a.hidden_size), requires_grad=False)

    def rows(self, hash_ids: torch.Tensor) -> torch.Tensor:  # [T, cols] -> [T, cols * head_dim]
        values = self.embed.weight[hash_ids]
        if self.embed.scale is not None:  # fp8 rows, dequantized as they are gathered
            scales = self.embed.scale[hash_ids].float()
            values = (values.float().unflatten(-1, (-1, FP8_BLOCK)) * scales[..., None]).flatten(-2)
        return values.flatten(1)

    def forward(self, streams: torch.Tensor,  # [T, hc, D]
                hash_ids: torch.Tensor,  # [T, cols]
                input_ids: torch.Tensor | None = None) -> torch.Tensor:  # [T] int64 -> [T, hc, D]
        kv = self.wkv(self.rows(hash_ids).to(streams.dtype))
        key = kv[:, :self.hc * self.hidden].float().view(-1, self.hc, self.hidden)
        value = kv[:, self.hc * self.hidden:].float()
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.hidden ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # [T, hc]
        if input_ids is not None:  # image tokens are DEAD: no memory added
            gate = gate * (input_ids != self.dead_id).unsqueeze(-1)
        return (h + gate[..., None] * value[:, None, :]).to(streams.dtype)
