"""V4.1's ViT (NeMo ``deepseek_v4/vision.py -> DeepseekV4VisionTransformer``, re-used by V4.1; vLLM
``deepseek_v4/common/vision.py -> DeepseekV4ViT``): a linear embedding of each flattened 14x14 RGB patch, pre-norm
blocks of bidirectional attention over one image with 2D RoPE and a fused SwiGLU MLP, a final RMSNorm. Tensor names
as the release stores them under ``vision.``: ``patch_embed.proj``, ``blocks.{i}.{norm1, attn.wqkv, attn.wo, norm2,
mlp.w1, mlp.w2}``, ``norm``.

2D RoPE: of the ``head_dim / 2`` angles of a patch at (row h, column w), the first half are ``h * f_j`` and the
second half ``w * f_j`` (``f_j = theta^(-2j / (head_dim / 2))``); they rotate channel c with channel
``c + head_dim / 2`` (rotate-half, not interleaved pairs), in fp32 whatever the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.models.deepseek_v41.vision.config import VisionArgs


class VisionRMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (the release keeps the tower's norms fp32), output in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, dim]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope_2d(n_h: int, n_w: int, head_dim: int, theta: float,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [n_h * n_w, 1, head_dim / 2] fp32
    half = head_dim // 2
    freqs = theta ** (-torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)  # [half / 2]
    rows = torch.arange(n_h, device=device, dtype=torch.float32).repeat_interleave(n_w)  # reading order
    cols = torch.arange(n_w, device=device, dtype=torch.float32).repeat(n_h)
    angles = torch.cat([torch.outer(rows, freqs), torch.outer(cols, freqs)], dim=-1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_half(x: torch.Tensor,  # [N, heads, head_dim]
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [N, 1, head_dim / 2] fp32
    a, b = x.float().split(x.shape[-1] // 2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.heads, self.head_dim = a.num_attention_heads, a.head_dim
        self.wqkv = nn.Linear(a.hidden_size, 3 * a.hidden_size, bias=True)
        self.wo = nn.Linear(a.hidden_size, a.hidden_size, bias=True)

    def forward(self, x: torch.Tensor,  # [N, dim] one image's patches
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [N, dim]
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        # every patch sees every patch of its image (no mask)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.inter = a.intermediate_size
        self.w1 = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)  # gate rows, then up rows
        self.w2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, dim]
        gate_up = self.w1(x)
        return self.w2(F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:])


class VisionBlock(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.norm1, self.norm2 = VisionRMSNorm(a.hidden_size, a.norm_eps), VisionRMSNorm(a.hidden_size, a.norm_eps)
        self.attn, self.mlp = VisionAttention(a), VisionMLP(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [N, dim]
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.proj = nn.Linear(a.patch_dim, a.hidden_size, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, 3, p, p] -> [N, dim]
        return self.proj(patches.reshape(patches.shape[0], -1).to(self.proj.weight.dtype))


class VisionTower(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.blocks = nn.ModuleList(VisionBlock(a) for _ in range(a.num_hidden_layers))
        self.norm = VisionRMSNorm(a.hidden_size, a.norm_eps)

    def forward(self, patches: torch.Tensor,  # [n_h * n_w, 3, p, p] one image, reading order
                n_h: int, n_w: int) -> torch.Tensor:  # [n_h * n_w, dim]
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"vision tower: {patches.shape[0]} patches for a {n_h}x{n_w} grid")
        x = self.patch_embed(patches)
        cos, sin = rope_2d(n_h, n_w, self.args.head_dim, self.args.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)
