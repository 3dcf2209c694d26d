"""DeepSeek-V4.1's DSpark / DFlash drafter: the checkpoint's ``mtp.{0,1,2}`` (design note ``DEEPSEEK_V41.md``
section 3; NeMo AutoModel ``deepseek_v41/dspark.py``; the oracle is tests/helpers/dspark_v41_reference.py).

Each ``mtp.j`` is a V4.1 decoder layer (models/deepseek_v41/layers.py, imported: single-pass mHC, ``attn_norm`` /
``ffn_norm``, the V4.1 router over ``dspark_n_routed_experts`` experts) whose attention is window-only MLA over
two kinds of keys (K = V, one latent head):
- context: ``rope(kv_norm(wkv(main_x)))`` at each context position, ``main_x = main_norm(main_proj(features))``
  with ``features`` the target's hc-mean streams entering ``dspark_target_layer_ids`` (the target keeps them:
  ``capture_layer_ids``); the engine stores them in the drafter's cache, a query block reads the ``sliding_window``
  positions before its anchor;
- the block's own ``rope(kv_norm(wkv(x)))`` of every slot (non-causal inside the block), never stored.
Positions (the oracle's docstring): the anchor ``t_p`` at ``p``, context ``< p``, slot ``i`` at ``p + i`` drafting
the token at ``p + i + 1``. After the last block the streams collapse with its FFN ``pre`` into the pre-norm ``h``;
the target's ``head`` reads ``norm(h)``. DSpark's heads: the Markov bias ``head(embed(prev))`` (vanilla, rank
``dspark_markov_rank``) and the confidence ``sigmoid(proj([h ; embed(prev)]))`` (fp32, no bias). No fake
quantization (the reference drafter has none).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from backend_lib.models.deepseek_v3.layers import BlockLinear, RMSNorm
from backend_lib.models.deepseek_v41.attention import V41Attention
from backend_lib.models.deepseek_v41.config import WINDOW, LayerRole
from backend_lib.models.deepseek_v41.layers import V41DecoderLayer, V41MoE
from backend_lib.models.dspark.v41_config import V41DSparkArgs
from backend_lib.models.parallel import Shard, vocab_parallel_embedding
from kernels.compressed_attention import sink_attention
from kernels.interleaved_rope import apply_tail_rope

if TYPE_CHECKING:
    from backend_lib.models.deepseek_v41.model import DeepseekV41ForCausalLM


@dataclass(frozen=True)
class DraftStep:
    """One draft forward's shared inputs (what ``V41DecoderLayer`` hands its attention as ``step``)."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin of the block positions [S * B, P / 2]
    ctx_valid: torch.Tensor  # [S, C] bool: the context rows each block reads
    num_blocks: int
    block_size: int


class V41DraftAttention(V41Attention):
    """A draft block's window-only MLA: the V4.1 layer's weights, queries from the block, keys from the context
    cache and the whole block."""

    def context_kv(self, main_x: torch.Tensor,  # [T, hidden]
                   rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # [T, head_dim]
        return apply_tail_rope(self.kv_norm(self.wkv(main_x)), *rope)

    def forward(self, x: torch.Tensor,  # [S * B, hidden] the block's normed input
                step: DraftStep, cache: torch.Tensor) -> torch.Tensor:  # cache [S, C, D] context keys -> [S B, H]
        d, (cos, sin) = self.d, step.rope
        S, B, C = step.num_blocks, step.block_size, cache.shape[1]
        q = apply_tail_rope(self.wq_b(self.q_norm(self.wq_a(x))).view(-1, self.num_heads, d.head_dim), cos, sin)
        own = self.context_kv(x, step.rope).view(S, 1, B, -1).expand(S, B, B, -1)
        keys = torch.cat([cache.to(own.dtype)[:, None].expand(S, B, C, -1), own], dim=2).reshape(S * B, C + B, -1)
        allowed = torch.cat([step.ctx_valid[:, None, :].expand(S, B, C),
                             torch.ones(S, B, B, dtype=torch.bool, device=x.device)], dim=2).reshape(S * B, C + B)
        out = sink_attention(q, keys.to(q.dtype), allowed, self.attn_sink, self.scale)
        return self.project_output(out, cos, sin)


class V41MarkovHead(nn.Module):
    """``markov_head.{embed, head}``: a rank-``r`` bias on slot ``i``'s logits from the token before it."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class V41ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=False)

    def forward(self, hidden: torch.Tensor,  # [..., H] pre-norm block states
                prev_embed: torch.Tensor) -> torch.Tensor:  # [..., rank] -> [...] fp32 confidence in (0, 1)
        features = torch.cat([hidden.float(), prev_embed.float()], dim=-1)
        return torch.sigmoid(nn.functional.linear(features, self.proj.weight.float()).squeeze(-1))


class V41DSparkDrafter(nn.Module):
    def __init__(self, target: "DeepseekV41ForCausalLM", d: V41DSparkArgs) -> None:
        super().__init__()
        d.check_target(target.args)
        a, par = target.args, target.par
        self.d, self.args, self.par, self.dtype = d, a, par, target.dtype
        self.main_rope = target.main_rope
        attn_dims, moe_dims = target.layers[0].attn.d, target.layers[0].ffn.d
        moe_dims = replace(moe_dims, num_experts=d.num_experts, top_k=d.experts_per_token)
        n = a.num_hidden_layers
        self.mtp = nn.ModuleList(
            V41DecoderLayer(V41DraftAttention(attn_dims, LayerRole(n + j, 0, WINDOW, None, None), target.main_rope,
                                              target.compress_rope, par),
                            V41MoE(moe_dims, par, attn_dims.block_size, a.gate_temp, a.norm_topk_prob,
                                   packed_fp4=target.packed_fp4),
                            a.hidden_size, a.rms_norm_eps, target.hc)
            for j in range(d.num_layers))
        first, last = self.mtp[0], self.mtp[-1]
        first.main_proj = BlockLinear(len(d.target_layer_ids) * a.hidden_size, a.hidden_size,
                                      block_size=attn_dims.block_size)
        first.main_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        last.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.markov = self.confidence = None
        if d.markov_rank:
            last.markov_head = self.markov = V41MarkovHead(a.vocab_size, d.markov_rank)
            last.confidence_head = self.confidence = V41ConfidenceHead(a.hidden_size + d.markov_rank)
        self.to(target.dtype)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.is_floating_point() and (name.split(".")[2].startswith("hc_") or "attn_sink" in name
                                               or ".gate." in name or "confidence_head" in name
                                               or name.endswith("norm.weight")):
                tensor.data = tensor.data.float()

    # ---- the forward, in the proposer's three parts --------------------------------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:  # [T, n * H] -> main_x [T, H]
        first = self.mtp[0]
        return first.main_norm(first.main_proj(features.to(self.dtype)))

    def context_kv(self, main_x: torch.Tensor,  # [T, H]
                   positions: torch.Tensor) -> list[torch.Tensor]:  # [T] int64 -> per layer [T, D]
        rope = self.main_rope.at(positions, main_x.dtype)
        return [layer.attn.context_kv(main_x, rope) for layer in self.mtp]

    def block_hidden(self, target: "DeepseekV41ForCausalLM",
                     block_ids: torch.Tensor,  # [S, B] int64 [anchor, noise, ...]
                     block_positions: torch.Tensor,  # [S, B] int64
                     context: list[torch.Tensor],  # per layer [S, C, D] context keys
                     ctx_valid: torch.Tensor,  # [S, C] bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # pre-norm h [S, B, H], norm(h) [S, B, H]
        S, B = block_ids.shape
        ids = block_ids.flatten()
        x = vocab_parallel_embedding(ids, target.embed.weight, target.vocab_start, target.par)
        hc = self.args.hc_mult
        streams = x.unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre = torch.zeros(x.shape[0], hc, device=x.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0, as the target's layer 0
        step = DraftStep(self.main_rope.at(block_positions.flatten(), x.dtype), ctx_valid, S, B)
        for layer, keys in zip(self.mtp, context):
            streams, pre = layer(streams, pre, ids, step, keys)
        h = (pre.to(streams.dtype).unsqueeze(-1) * streams).sum(1)
        return h.view(S, B, -1), self.mtp[-1].norm(h).view(S, B, -1)

    def draft(self, base: torch.Tensor,  # [S, B, V] float32 the target head's logits of norm(h)
              hidden: torch.Tensor,  # [S, B, H] pre-norm h
              anchors: torch.Tensor,  # [S] int64
              heads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # greedy drafts [S, B], confidence
        """Greedy drafts slot by slot through the Markov bias (``heads``: DSpark; off: DFlash, plain argmax), with
        each slot's confidence given the token before it."""
        if not heads or self.markov is None:
            return base.argmax(dim=-1), None
        prev, drafts, conf = anchors, [], []
        for i in range(base.shape[1]):
            e = self.markov.embed(prev)
            conf.append(self.confidence(hidden[:, i], e))
            prev = (base[:, i] + self.markov.head(e).float()).argmax(dim=-1)
            drafts.append(prev)
        return torch.stack(drafts, dim=1), torch.stack(conf, dim=1)

    # ---- weights -------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's ``mtp.*`` tensors (other names skipped); fp8 projections with their ``.scale``, fp4 /
        fp8 routed experts as the target loads them. Every drafter tensor must arrive."""
        shards = {f"{prefix}.{key}" if prefix else key: shard for prefix, module in self.named_modules()
                  for key, shard in getattr(module, "shards", {}).items()}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if not name.startswith("mtp."):
                continue
            base, _, leaf = name.rpartition(".")
            if leaf == "scale" or (leaf == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.int8,
                                                                          torch.uint8)):
                pending.setdefault(base, {})[leaf] = tensor
                if len(pending[base]) == 2:
                    entry = pending.pop(base)
                    self._set(base + ".weight", entry["weight"], entry["scale"], shards)
                    loaded.add(base + ".weight")
                continue
            self._set(name, tensor, None, shards)
            loaded.add(name)
        if pending:
            raise ValueError(f"speculative_model: quantized mtp.* weights without their scale: {sorted(pending)}")
        missing = sorted(self._expected_names() - loaded)
        if missing:
            raise ValueError(f"speculative_model: the checkpoint lacks DSpark drafter tensors {missing[:8]}")

    def _set(self, name: str, tensor: torch.Tensor, scale: torch.Tensor | None, shards: dict[str, Shard]) -> None:
        parts = name.split(".")
        if len(parts) == 7 and parts[2:4] == ["ffn", "experts"]:  # mtp.j.ffn.experts.e.wK.weight
            moe = self.mtp[int(parts[1])].ffn
            for local in moe.local_slots(int(parts[4])):
                moe.set_expert(local, parts[5], tensor, scale)
            return
        owner, _, leaf = name.rpartition(".")
        try:
            target = self.get_submodule(owner)
        except AttributeError as err:
            raise ValueError(f"speculative_model: unexpected DSpark tensor {name!r}") from err
        shard = shards.get(name)
        if isinstance(target, BlockLinear) and leaf == "weight":
            if shard is not None:
                block = target.block_size[shard.dim]
                tensor = shard.take(tensor)
                if scale is not None:
                    scale = Shard(shard.dim, shard.start // block, -(-shard.size // block)).take(scale)
            target.set_weight(tensor, None if scale is None else scale.float(), self.dtype, False)
            return
        current = getattr(target, leaf, None)
        if not isinstance(current, torch.Tensor) or scale is not None:
            raise ValueError(f"speculative_model: unexpected DSpark tensor {name!r}")
        value = shard.take(tensor) if shard is not None else tensor
        if tuple(current.shape) != tuple(value.shape):
            raise ValueError(f"speculative_model: {name}: shape {tuple(value.shape)} != expected "
                             f"{tuple(current.shape)}")
        with torch.no_grad():
            current.copy_(value.to(current.dtype))

    def _expected_names(self) -> set[str]:
        names = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, BlockLinear)}
        names |= {n for n, _ in self.named_parameters()}
        names |= {n for n, _ in self.named_buffers() if n.endswith(("gate.bias", "gate.bias_vl"))}
        for j, layer in enumerate(self.mtp):
            names |= {f"mtp.{j}.ffn.experts.{e}.{w}.weight" for e in layer.ffn.held_experts()
                      for w in ("w1", "w2", "w3")}
        return names


def load_v41_drafter(target: "DeepseekV41ForCausalLM", directory: str) -> V41DSparkDrafter:
    """The drafter in a V4.1 checkpoint directory (its config.json's ``dspark_*`` fields, its ``mtp.*`` tensors),
    on the target's ranks and dtype."""
    from safetensors import safe_open

    from backend_lib.models.loading.loader import safetensors_files

    drafter = V41DSparkDrafter(target, V41DSparkArgs.from_directory(directory))

    def tensors():
        for path in safetensors_files(directory):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name.startswith("mtp."):
                        yield name, f.get_tensor(name)

    drafter.load_weights(tensors())
    return drafter.eval()
