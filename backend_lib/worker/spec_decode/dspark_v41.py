"""DSpark / DFlash drafts for DeepSeek-V4.1 from the checkpoint's own drafter (``mtp.{0,1,2}``,
backend_lib/models/dspark/deepseek_v41.py); the schedule and the host part are BlockDraftProposer's (dspark.py).

``speculative_model`` names the checkpoint directory holding ``mtp.*`` (usually the target's own). The drafter's
context cache is one K = V latent per draft layer per paged slot (``[L, num_slots, head_dim]``, keyed by the target's
slot mapping as dspark.py's): every row the target runs writes ``rope(kv_norm(wkv(main_x)))`` at its slot, and a
block anchored at ``p`` reads the ``sliding_window`` positions ``p - W .. p - 1`` through the request's block table.
Rollback is dspark.py's argument: rejected rows wrote positions ``>= p``, which no block reads before the target's
next rows rewrite them, so the window a block reads is what a run without the rejected drafts holds (the target's own
window rings, compressor rings and Engram history roll back in the model, as for every drafter). Eager; under
tensor parallelism every rank runs the drafter on its share of the heads / experts, as the target (the driver sends
the plan and the verified tokens: model_runner.py).
"""
from __future__ import annotations

import torch

from backend_lib.core.config import SpecConfig
from backend_lib.models.dspark.deepseek_v41 import load_v41_drafter
from backend_lib.worker.spec_decode.dspark import BlockDraftProposer, BlockDrafts, BlockPlan
from backend_lib.worker.spec_decode.rejection import num_accepted


class V41BlockDraftProposer(BlockDraftProposer):
    def __init__(self, model: torch.nn.Module, spec: SpecConfig, num_slots: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        method = spec.method
        drafter = load_v41_drafter(model, spec.speculative_model)
        if method == "dspark" and drafter.markov is None:
            raise ValueError(f"spec_method 'dspark': the checkpoint at speculative_model {spec.speculative_model!r} "
                             f"has no Markov / confidence head (dspark_markov_rank 0): use spec_method 'dflash'")
        self.model, self.drafter = model, drafter.to(device)
        self.heads = method == "dspark"  # DFlash: the same blocks, plain argmax, no confidence
        self._init_schedule(spec, drafter.d.block_size)
        self.window = model.args.sliding_window
        self.cache = torch.zeros((drafter.d.num_layers, num_slots, model.args.head_dim), dtype=dtype, device=device)
        model.capture_layer_ids = drafter.d.target_layer_ids

    def write_context(self, positions: torch.Tensor,  # [T] int64: the rows the target ran this step
                      slot_mapping: torch.Tensor) -> None:  # [T] int64 (padding rows: the scratch block)
        main_x = self.drafter.project_context(self.model.captured_hidden)
        for layer, kv in enumerate(self.drafter.context_kv(main_x, positions)):
            self.cache[layer].index_copy_(0, slot_mapping, kv.to(self.cache.dtype))

    def draft(self, verified: torch.Tensor,  # [S, W] rejection output (-1 padded)
              plan: BlockPlan,  # its context_bound unused: a block reads its window, not the whole context
              block_tables: torch.Tensor,  # [S, Wb] int32
              block_size: int) -> BlockDrafts:
        accepted = num_accepted(verified)
        anchors = verified.gather(1, accepted[:, None]).squeeze(1)
        device = verified.device
        anchor_pos = plan.last_positions + accepted + 1
        positions = anchor_pos[:, None] - self.window + torch.arange(self.window, device=device)[None, :]  # [S, W]
        valid = positions >= 0
        positions = positions.clamp(min=0)
        column = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
        slots = block_tables.to(torch.int64).gather(1, column) * block_size + positions % block_size
        context = [self.cache[layer][slots] for layer in range(self.cache.shape[0])]  # each [S, W, D]
        B = self.block_size
        ids = torch.full((anchors.shape[0], B), self.drafter.d.noise_token_id, dtype=torch.int64, device=device)
        ids[:, 0] = anchors
        block_positions = anchor_pos[:, None] + torch.arange(B, device=device)[None, :]
        hidden, normed = self.drafter.block_hidden(self.model, ids, block_positions, context, valid)
        S, _, H = normed.shape
        base = self.model.compute_logits(normed.reshape(S * B, H)).reshape(S, B, -1)
        drafts, confidence = self.drafter.draft(base, hidden, anchors, self.heads)
        return BlockDrafts(drafts, confidence)
