"""DeepSeek-V4 MTP drafts from the checkpoint's first nextn depth (``model.mtp[0]``, ``models/deepseek_v4_mtp.py``).

The runner contract is V3's ``MTPProposer`` (two passes per step, on device, no host sync): ``first_pass`` over every
row the main model ran this step, then in ``propose`` a chain of ``k - 1`` single-row steps from the row of each
request's last verified token. More drafts reuse ``mtp[0]`` on its own pre-hc_head output, as V3 chains its first
depth (a checkpoint's further depths are loaded but not used for drafting).

Where V4 differs from V3:
* the hidden the depth reads is the main model's pre-hc_head streams ``[T, hc, D]``; the model keeps them from the
  step's forward (``keep_streams`` / ``last_streams``), so the draft costs no second main forward;
* an MTP row for main position ``p`` (hidden ``h_p``, token ``t_{p+1}``) sits at position ``p``, so the first pass
  runs under the main step's own attention context (same state rows, chunks and rope); its K = V lives in one more
  sliding-window ring of the hybrid cache's state slots (``hybrid_cache_shapes``), sized like the main rings for
  the draft positions a verification rolls back. Rows past a rejection write positions the next step rewrites
  before any read (a ring never reads at or past a chunk's start), so only verified rows are ever attended;
* the depth's attention is sliding-only and writes nothing paged: no lookahead blocks.

Eager only: compiled regions would not keep the streams (the runner refuses the combination).
"""
from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata, StateRows


class V4MTPProposer:
    needs_eager_model = True

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], num_speculative_tokens: int) -> None:
        if not model.has_mtp_weights:
            raise ValueError("spec method 'mtp' needs a DeepSeek-V4 checkpoint with MTP weights (mtp.0.* tensors and "
                             "num_nextn_predict_layers >= 1); this model has none")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 for mtp, got {num_speculative_tokens}")
        self.model, self.layer, self.k = model, model.mtp[0], num_speculative_tokens
        self.window = model.mtp_window(kv_caches)
        model.keep_streams = True

    @property
    def num_lookahead_slots(self) -> int:
        return 0

    def _pass(self, token_ids: torch.Tensor,  # [T] int64: each row's next token
              streams: torch.Tensor,  # [T, hc, D] pre-hc_head streams at the rows' positions
              positions: torch.Tensor,  # [T] int64: the rows' (main) positions
              meta: AttentionMetadata) -> torch.Tensor:  # [T, hc, D]
        ctx = self.model.step_context(positions, meta, streams.dtype)
        return self.layer.draft(self.model.embed_tokens(token_ids), token_ids, streams, ctx, self.window)

    def _draft(self, streams: torch.Tensor) -> torch.Tensor:  # [S, hc, D] -> [S] int64
        return torch.argmax(self.model.compute_logits(self.layer.head_hidden(streams)), dim=-1)

    def first_pass(self, next_token_ids: torch.Tensor,  # [T] int64 (0 where unknown: rows the next step rewrites)
                   hidden: torch.Tensor,  # [T, H] main final-norm hidden (unused: V4 reads the kept streams)
                   positions: torch.Tensor,  # [T] int64 main positions
                   meta: AttentionMetadata) -> torch.Tensor:  # [T, hc, D]
        return self._pass(next_token_ids, self.model.last_streams, positions, meta)

    def propose(self, hidden: torch.Tensor,  # [T, H] main final-norm hidden (unused, see first_pass)
                next_token_ids: torch.Tensor,  # [T] int64: the token after each row (verified or garbage)
                positions: torch.Tensor,  # [T] int64: main positions of the rows
                meta: AttentionMetadata,  # the main step's metadata
                select_rows: torch.Tensor,  # [S] int64: row of each sampling request's last verified token
                block_tables: torch.Tensor,  # [S, W] int32: those requests' block tables
                ) -> torch.Tensor:  # [S, k] int64 drafts
        streams = self.first_pass(next_token_ids, hidden, positions, meta)[select_rows]
        drafts = [self._draft(streams)]
        slots, rows = meta.state.slots[select_rows], positions[select_rows]
        empty = torch.zeros((0, 1), dtype=torch.int32, device=positions.device)
        for j in range(1, self.k):
            at = rows + j  # draft j's row: hidden of the previous row, token draft j
            chain_meta = AttentionMetadata(
                block_size=meta.block_size, slot_mapping=meta.slot_mapping[select_rows],  # nothing paged is written
                num_decodes=int(select_rows.shape[0]), decode_query_len=1, decode_block_tables=block_tables,
                decode_seq_lens=(at + 1).to(torch.int32), num_prefills=0, prefill_query_lens=[],
                prefill_seq_lens=[], prefill_block_tables=empty, state=StateRows(slots, at, at + 1))
            streams = self._pass(drafts[-1], streams, at, chain_meta)
            drafts.append(self._draft(streams))
        return torch.stack(drafts, dim=1)
