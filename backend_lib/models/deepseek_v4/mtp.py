"""DeepSeek-V4 multi-token prediction: one nextn depth (checkpoint prefix ``mtp.{k}.``).

Release layout (as the public V4 ports read it): the block's own tensors sit directly under the prefix, named as a
decoder layer's (``attn.*``, ``ffn.*``, ``attn_norm``, ``ffn_norm``, ``hc_attn_*``, ``hc_ffn_*``), plus the glue
``enorm`` / ``hnorm`` (RMSNorms), ``e_proj`` / ``h_proj`` (hidden -> hidden each, not V3's concatenated
``eh_proj``), its own hyper head ``hc_head_{fn,base,scale}`` and final ``norm``. The block's attention is
sliding-window only (compress ratio 0: no compressor, no indexer) and its MoE routes top-k with ``gate.bias``.

One MTP row for main position ``p``: the streams ``h_p`` the main model leaves before its ``hc_head`` ([hc, D]) and
the token ``t_{p+1}``:
    x = h_proj(hnorm(h_p)) + e_proj(enorm(embed(t_{p+1})))   (the embedding broadcast over the hc streams)
    s = block(x)                      -> streams [hc, D], fed back as ``h`` for the next chained draft
    logits = head(norm(hc_head(s)))   (the main model's shared head) -> the draft for ``t_{p+2}``
The row sits at position ``p`` (rope and its sliding-window ring slot), so its context is the request's own rows
``0..p`` and the first pass of a step shares the main step's attention context.
"""
from __future__ import annotations

import torch
from torch import nn

from backend_lib.models.deepseek_v3.layers import BlockLinear, RMSNorm
from backend_lib.models.deepseek_v4.attention import LayerCache, StepContext, V4Attention
from backend_lib.models.deepseek_v4.layers import V4DecoderLayer, V4MoE
from kernels.hyper_connections import HyperConnectionSpec, hc_head_collapse


class V4MTPLayer(V4DecoderLayer):
    """A V4 decoder block (sliding attention, top-k MoE) plus the MTP glue and its own hyper head."""

    def __init__(self, attn: V4Attention, ffn: V4MoE, hidden: int, eps: float, hc: HyperConnectionSpec) -> None:
        super().__init__(attn, ffn, hidden, eps, hc)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.e_proj = BlockLinear(hidden, hidden)
        self.h_proj = BlockLinear(hidden, hidden)
        self.norm = RMSNorm(hidden, eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc.hc_mult, hc.hc_mult * hidden), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.zeros(hc.hc_mult), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def draft(self, embeds: torch.Tensor,  # [T, D] embedding of each row's next token
              token_ids: torch.Tensor,  # [T] int64 those tokens
              streams: torch.Tensor,  # [T, hc, D] pre-hc_head streams (main model's, or the previous draft's)
              ctx: StepContext, window: torch.Tensor,  # ring [S + 1, sliding_window + drafts, D]
              ) -> torch.Tensor:  # [T, hc, D] this depth's pre-hc_head streams
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(1)
        return self(x, token_ids, ctx, LayerCache(window))

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:  # [N, hc, D] -> [N, D] for the shared head
        return self.norm(hc_head_collapse(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.hc))
