"""DeepSeek-V4.1 MoE (the V4.1 router over V4's experts) and the decoder layer with single-pass mHC.

Router (transformers main ``DeepseekV41TopKRouter``; vLLM ``dsv4_topk``): ``s = sqrt(softplus(logits / gate_temp))``,
experts chosen by the top-k of ``s + bias`` (``bias_vl`` for image tokens: every image-span position carries
``image_token_id``, vLLM ``vl_model.py``'s ``requires_raw_input_tokens``; exact ties to the lower expert id, our
rule: no implementation defines one), weights the unbiased ``s`` of the chosen experts normalised by their sum +
1e-20 and scaled by ``routed_scaling_factor``; no hash-routed layers. The experts and the shared expert are V4's
(clamped SwiGLU).

Single-pass mHC (``DeepseekV41DecoderLayer.forward``; NeMo ``DeepseekV41Block.forward``): each site computes its
(pre, post, comb) from its own input streams as V4 does, but collapses its input with the *previous* site's ``pre``:
attention with the previous layer's FFN ``pre`` (a one-hot stream-0 mix before layer 0), the FFN with this layer's
attention ``pre``. The layer returns its FFN ``pre`` for the next one; after the last layer it collapses the streams
(no learned ``hc_head``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.models.deepseek_v3.layers import RMSNorm
from backend_lib.models.deepseek_v41.attention import V41Attention, V41Step
from backend_lib.models.deepseek_v4.attention import LayerCache
from backend_lib.models.deepseek_v4.layers import V4MoE, V4MoEDims, expert_scores
from backend_lib.models.parallel import ParallelContext
from kernels.compressed_attention import top_k_in_order
from kernels.hyper_connections import HyperConnectionSpec, hc_collapse, hc_mixes, hc_post


class V41MoE(V4MoE):
    """V4's experts behind the V4.1 router (``ffn.gate.{weight, bias, bias_vl}``)."""

    def __init__(self, d: V4MoEDims, par: ParallelContext, block_size: tuple[int, int], gate_temp: float,
                 norm_topk_prob: bool, impl: str = "dynamic", packed_fp4: bool = False,
                 image_token_id: int = -1) -> None:
        super().__init__(d, par, block_size, impl=impl, packed_fp4=packed_fp4)
        self.gate_temp, self.norm_topk_prob, self.image_token_id = gate_temp, norm_topk_prob, image_token_id
        self.gate.register_buffer("bias_vl", torch.zeros(d.num_experts))

    def route(self, x: torch.Tensor,  # [T, hidden]
              input_ids: torch.Tensor,  # [T] int64 (image_token_id: an image-span position, biased by bias_vl)
              ) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k] int64
        logits = F.linear(x.float(), self.gate.weight.float()) / self.gate_temp
        scores = expert_scores(logits, self.d.scoring_func)
        image = (input_ids == self.image_token_id).unsqueeze(-1)
        bias = torch.where(image, self.gate.bias_vl.float(), self.gate.bias.float())
        # exact ties (the fp32 sum s + bias can tie: a tiny checkpoint met one) go to the lower expert id, so the
        # choice depends on the values alone (torch.topk's order among equals is unspecified); ids ascending
        chosen = top_k_in_order(scores + bias, self.d.top_k)  # [T, E] bool, k a row
        ids = torch.arange(chosen.shape[-1], device=x.device).expand_as(chosen)[chosen].view(-1, self.d.top_k)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob and self.d.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.d.routed_scaling_factor, ids


class V41DecoderLayer(nn.Module):
    def __init__(self, attn: V41Attention, ffn: V41MoE, hidden: int, eps: float, hc: HyperConnectionSpec) -> None:
        super().__init__()
        self.attn, self.ffn, self.hc = attn, ffn, hc
        self.engram: nn.Module | None = None  # a V41Engram on the layers of engram_layer_ids
        self.attn_norm = RMSNorm(hidden, eps)
        self.ffn_norm = RMSNorm(hidden, eps)
        mixes = (2 + hc.hc_mult) * hc.hc_mult
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros(mixes, hc.hc_mult * hidden), requires_grad=False))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mixes), requires_grad=False))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3), requires_grad=False))

    def forward(self, streams: torch.Tensor,  # [T, hc, hidden]
                pre_mix: torch.Tensor,  # [T, hc] float32: the previous site's pre
                input_ids: torch.Tensor,  # [T] int64
                step: V41Step, cache: LayerCache,
                hash_ids: torch.Tensor | None = None,  # [T, cols] this layer's Engram rows
                ) -> tuple[torch.Tensor, torch.Tensor]:  # streams, this FFN's pre
        if self.engram is not None:  # on the streams the previous layer left, before this layer's coefficients
            streams = self.engram(streams, hash_ids, input_ids)
        attn_pre, post, comb = hc_mixes(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.hc)
        x = hc_collapse(streams, pre_mix)
        streams = hc_post(self.attn(self.attn_norm(x), step, cache), streams, post, comb, self.hc)
        ffn_pre, post, comb = hc_mixes(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.hc)
        x = hc_collapse(streams, attn_pre)
        return hc_post(self.ffn(self.ffn_norm(x), input_ids), streams, post, comb, self.hc), ffn_pre
