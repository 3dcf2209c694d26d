"""DeepSeek-V3 multi-token prediction (MTP) drafts, from the checkpoint's first MTP module (``model.mtp[0]``).

One MTP step at position ``p`` (transformers' ``MtpLayer`` / ``MtpModel.forward_layer``, which we match):
    h' = eh_proj([enorm(embed(t_p)); hnorm(h_{p-1})]) -> the MTP decoder block -> shared_head.norm
and its logits come from the *main* model's lm_head (the shared head; like transformers we use the main embedding
and head, not the checkpoint's copies). ``h_{p-1}`` is the main model's final-norm hidden state at ``p - 1``; the
argmax of the logits drafts the token at ``p + 1``. More drafts reuse the same module on its own (normed) output, as
transformers chains its MTP layers (vLLM chains the pre-norm state instead).

KV: the MTP block attends over its own latent cache ``[num_slots, R + P]`` addressed by the main model's block
tables. The entry of MTP position ``p`` lives at the slot of main position ``p - 1`` (so a request's MTP context is
its positions ``1..p``, exactly transformers' MTP cache); rope uses ``p``. Invariant: every slot below the
request's ``num_computed_tokens`` holds a verified entry; slots at or above it are scratch, always rewritten before
they are read (each pass writes a contiguous range starting at ``num_computed_tokens``). The draft chain writes up to
``k - 1`` slots past the verified tokens: the scheduler reserves them as lookahead slots.

Two passes per step, both on device with no host sync:
  1. first pass: every token the main model ran this step, shifted by one (token at ``p + 1`` with hidden at ``p``),
     under the main step's own attention metadata - rows past a rejection hold garbage that later passes overwrite;
  2. chain: from the row of the last verified token, ``k - 1`` single-token decode steps.
Limitation: a prefix-cache hit reuses another request's blocks; the MTP entry in the last slot of a shared block was
computed with that request's next token, which may differ. That only affects draft quality, never the output.
"""
from __future__ import annotations

from typing import Callable

import torch

from backend_lib.models.deepseek_v3.layers import rope_cos_sin
from kernels.attention_metadata import AttentionMetadata


class MTPProposer:
    def __init__(self, model: torch.nn.Module, num_slots: int, num_speculative_tokens: int,
                 device: torch.device, dtype: torch.dtype,
                 share: Callable[[AttentionMetadata, torch.Tensor], AttentionMetadata] | None = None) -> None:
        if not model.has_mtp_weights:
            raise ValueError("spec method 'mtp' needs a DeepSeek-V3 checkpoint with MTP weights "
                             "(num_nextn_predict_layers >= 1); this model has none")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 for mtp, got {num_speculative_tokens}")
        self.model = model
        self.layer = model.mtp[0]
        self.k = num_speculative_tokens
        # Context parallelism: the chain's metadata (global block ids) as this context rank runs it
        # (worker/context_share.py: meta, query positions -> meta); None with one context rank.
        self.share = share
        # dtype: the main cache's (uint8 for fp8 latent records, whose width latent_width gives)
        self.cache = torch.zeros(num_slots, model.latent_width, dtype=dtype, device=device)

    @property
    def num_lookahead_slots(self) -> int:
        return self.k - 1

    def step(self, token_ids: torch.Tensor,  # [T] int64: the token at each MTP position
             hidden: torch.Tensor,  # [T, H]: the previous position's hidden (main final-norm, or MTP normed)
             positions: torch.Tensor,  # [T] int64: MTP positions (rope)
             meta: AttentionMetadata) -> torch.Tensor:  # [T, H] shared_head-normed MTP hidden
        layer, share = self.layer, meta.context
        cos, sin = rope_cos_sin(self.model.rope, positions, hidden.dtype)
        if share is not None:  # context parallelism: this rank's rows through the block, every row at the end
            token_ids, hidden = token_ids[share.rows], hidden[share.rows]
        embeds = layer.enorm(self.model.embed(token_ids))
        x = layer.eh_proj(torch.cat([embeds, layer.hnorm(hidden)], dim=-1))
        x = layer.shared_head.norm(layer(x, cos, sin, self.cache, meta))
        return x if share is None else self.model.par.context.gather_rows(x, share.row_counts)

    def first_pass(self, next_token_ids: torch.Tensor,  # [T] int64: the token after each main row
                   hidden: torch.Tensor,  # [T, H] main final-norm hidden
                   positions: torch.Tensor,  # [T] int64 main positions (MTP positions are one past them)
                   meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        return self.step(next_token_ids, hidden, positions + 1, meta)

    def _draft(self, normed: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S] int64
        return torch.argmax(self.model.compute_logits(normed), dim=-1)

    def propose(self, hidden: torch.Tensor,  # [T, H] main final-norm hidden of this step's tokens
                next_token_ids: torch.Tensor,  # [T] int64: the token after each row (verified or garbage)
                positions: torch.Tensor,  # [T] int64: main positions of the rows
                meta: AttentionMetadata,  # the main step's metadata (same slots)
                select_rows: torch.Tensor,  # [S] int64: row of each sampling request's last verified token
                block_tables: torch.Tensor,  # [S, W] int32: those requests' block tables (lookahead included)
                ) -> torch.Tensor:  # [S, k] int64 drafts
        normed = self.first_pass(next_token_ids, hidden, positions, meta)[select_rows]
        drafts = [self._draft(normed)]
        if self.k == 1:
            return drafts[0][:, None]
        bs = meta.block_size
        new_positions = positions[select_rows] + 1  # where each request's newest (verified) token sits
        empty = torch.zeros((0, 1), dtype=torch.int32, device=hidden.device)
        for j in range(1, self.k):
            mtp_positions = new_positions + j  # draft j's position; its cache entry sits one slot lower
            index = mtp_positions - 1
            blocks = block_tables.gather(1, (index // bs)[:, None]).squeeze(1).to(torch.int64)
            chain_meta = AttentionMetadata(
                block_size=bs, slot_mapping=blocks * bs + index % bs, num_decodes=int(select_rows.shape[0]),
                decode_query_len=1, decode_block_tables=block_tables, decode_seq_lens=(index + 1).to(torch.int32),
                num_prefills=0, prefill_query_lens=[], prefill_seq_lens=[], prefill_block_tables=empty)
            if self.share is not None:
                chain_meta = self.share(chain_meta, index)
            normed = self.step(drafts[-1], normed, mtp_positions, chain_meta)
            drafts.append(self._draft(normed))
        return torch.stack(drafts, dim=1)
