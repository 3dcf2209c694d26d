"""DSpark / DFlash block drafts for Llama-family targets (the drafter: backend_lib/models/dspark/).

Per step, on device before the step's one host sync (as MTP):
  1. ``write_context``: every row the target ran writes the drafter's context K / V at the row's own slot, from the
     target's hidden states at the drafter's layers (the target keeps them: ``capture_layer_ids``). Prefill chunks
     that do not sample write too, so a request's context is complete when it first drafts.
  2. ``draft``: after verification, each sampling request's anchor is the token it emitted last (the bonus or
     recovered token) at position ``p``; the block ``[anchor, mask x (B - 1)]`` attends to the cache at positions
     ``< p`` through the request's block table and drafts ``B`` tokens (the first ``k`` are used), with the
     confidence head's per-slot confidence (DSpark).
Rollback: the cache is keyed by the target's slots. Rows of rejected drafts write positions at or past the new
anchor, which no block reads (it reads ``< p``) and the next step's rows rewrite before any does; the block's own
K / V are never stored. So after a rejection the read part of the cache is exactly what a run without the rejected
drafts would hold (tests/worker/test_spec_dspark.py checks it), and a prefix-cache hit shares the entries of the
same tokens at the same positions.

Host part (``proposals``): the verify schedule (verify_schedule.py) picks the next step's length, each request's
drafts are cut to it (and before the first confidence under ``dspark_confidence_threshold``), and the lengths the
last step verified calibrate the schedule. Eager, one rank: the target keeps its layers' outputs only on the
layer-by-layer path, and the drafter has no sharded form yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.core.config import SpecConfig
from backend_lib.core.outputs import ScheduledChunk
from backend_lib.models.dspark.heads import confidence_logits, draft_sequentially
from backend_lib.models.dspark.model import load_drafter
from backend_lib.models.interfaces import capabilities_of
from backend_lib.worker.spec_decode.block_stats import SurvivalCalibration
from backend_lib.worker.spec_decode.rejection import num_accepted
from backend_lib.worker.spec_decode.verify_schedule import VerifyLengthSchedule


@dataclass(frozen=True)
class BlockPlan:
    """What a step's draft pass reads from the host, fixed before the step runs (the driver sends it to the other
    tensor-parallel ranks, which run the same pass)."""

    last_positions: torch.Tensor  # [S] int64 per sampling chunk: the position of its last token before its drafts
    context_bound: int  # host bound on every anchor position (the longest context read)


@dataclass
class BlockDrafts:
    token_ids: torch.Tensor  # [S, B] int64
    confidence: torch.Tensor | None  # [S, B] float32 per-slot confidence (DSpark), None for DFlash


class BlockDraftProposer:
    needs_eager_model = True
    num_lookahead_slots = 0  # the block's K / V are never written

    def __init__(self, model: torch.nn.Module, spec: SpecConfig, num_slots: int, max_model_len: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        method = spec.method
        if not capabilities_of(model).captures_hidden:
            raise ValueError(f"spec_method {method!r} drafts for Llama-family targets here; "
                             f"{type(model).__name__} keeps no layer outputs for a drafter")
        if model.par.world_size > 1:
            raise ValueError(f"spec_method {method!r} runs on one rank: set tensor_parallel_size 1")
        drafter = load_drafter(spec.speculative_model, max_model_len, dtype)
        config = drafter.config
        config.check_target(model.arch)
        if method == "dspark" and not config.has_heads:
            raise ValueError(f"spec_method 'dspark': the drafter at speculative_model {spec.speculative_model!r} has "
                             f"no Markov or confidence head (a DFlash drafter): use spec_method 'dflash'")
        self.model, self.drafter = model, drafter.to(device)
        # DFlash is the same backbone without the heads (a DSpark drafter with its heads off is DFlash's baseline)
        self.markov = drafter.markov_head if method == "dspark" else None
        self.confidence = drafter.confidence_head if method == "dspark" else None
        self._init_schedule(spec, config.block_size)
        arch = config.arch
        shape = (arch.num_layers, num_slots, arch.num_kv_heads, arch.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        model.capture_layer_ids = config.target_layer_ids

    def _init_schedule(self, spec: SpecConfig, block_size: int) -> None:
        """What ``plan`` / ``proposals`` read, the same for every drafter family."""
        self.k, self.block_size = spec.num_speculative_tokens, block_size
        self.fixed_length = spec.spec_schedule == "fixed"
        self.threshold = spec.dspark_confidence_threshold
        self.schedule = VerifyLengthSchedule(self.k, self.block_size)
        self.last_survival: dict[str, list[float]] = {}  # request id -> survival of the drafts it proposed
        self.calibration = SurvivalCalibration(self.k)  # /metrics: DSpark's predicted against observed survival
        self.head_survival = False  # whether last_survival came from a confidence head (DFlash: none, all 1.0)

    def write_context(self, positions: torch.Tensor,  # [T] int64: the rows the target ran this step
                      slot_mapping: torch.Tensor) -> None:  # [T] int64: their slots (padding rows: the scratch block)
        main_x = self.drafter.project_context(self.model.captured_hidden)
        for layer, (k, v) in enumerate(self.drafter.context_kv(main_x, positions)):
            self.k_cache[layer].index_copy_(0, slot_mapping, k.to(self.k_cache.dtype))
            self.v_cache[layer].index_copy_(0, slot_mapping, v.to(self.v_cache.dtype))

    def draft(self, verified: torch.Tensor,  # [S, W] rejection output (-1 padded)
              plan: BlockPlan,
              block_tables: torch.Tensor,  # [S, Wb] int32
              block_size: int) -> BlockDrafts:
        accepted = num_accepted(verified)
        anchors = verified.gather(1, accepted[:, None]).squeeze(1)
        device = verified.device
        anchor_pos = plan.last_positions + accepted + 1
        context_bound = plan.context_bound
        positions = torch.arange(context_bound, dtype=torch.int64, device=device)
        valid = positions[None, :] < anchor_pos[:, None]
        column = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
        slots = block_tables.to(torch.int64)[:, column] * block_size + positions % block_size  # [S, C]
        context = [(self.k_cache[layer][slots], self.v_cache[layer][slots])
                   for layer in range(self.k_cache.shape[0])]
        B = self.block_size
        ids = torch.full((anchors.shape[0], B), self.drafter.config.mask_token_id, dtype=torch.int64, device=device)
        ids[:, 0] = anchors
        embeds = self.model.embed_tokens(ids.flatten()).reshape(*ids.shape, -1)
        block_positions = anchor_pos[:, None] + torch.arange(B, device=device)[None, :]
        hidden = self.drafter.block_hidden(embeds, block_positions, context, valid).to(self.model.dtype)
        S, _, H = hidden.shape
        base = self.model.compute_logits(hidden.reshape(S * B, H)).reshape(S, B, -1)
        drafts = draft_sequentially(base, anchors, hidden, self.markov)
        confidence = None
        if self.confidence is not None:
            prev = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)
            with_markov = self.drafter.config.confidence_head_with_markov
            confidence = torch.sigmoid(confidence_logits(self.confidence, self.markov, with_markov, hidden, prev))
        return BlockDrafts(drafts, confidence)

    def plan(self, chunks: list[ScheduledChunk],  # the step's sampling chunks, in order
             device: torch.device) -> BlockPlan | None:
        """Before the step (once: it advances the schedule): whether the drafter runs after verification, and
        from where; None while the schedule keeps drafting off."""
        speculating = sum(c.request.sampling_params.speculative for c in chunks)
        if not (self.fixed_length or self.schedule.wants_drafts(len(chunks), speculating)):
            return None
        last = [c.start + c.num_tokens - c.num_draft_tokens - 1 for c in chunks]
        bound = max(p + c.num_draft_tokens + 1 for p, c in zip(last, chunks))
        return BlockPlan(torch.tensor(last, dtype=torch.int64, device=device), bound)

    def proposals(self, chunks: list[ScheduledChunk],  # the step's sampling chunks, in order
                  emitted: list[list[int]],  # the tokens each emitted this step
                  block: BlockDrafts | None,  # draft's (None: the drafter did not run)
                  flat_drafts: list[int],  # block.token_ids as read with the step's one sync
                  ) -> list[list[int]]:  # each request's drafts for the next step
        for chunk, tokens in zip(chunks, emitted):  # calibrate on what this step verified
            predicted = self.last_survival.get(chunk.request.request_id)
            if predicted is not None and chunk.num_draft_tokens:
                self.schedule.calibration.observe(predicted[:chunk.num_draft_tokens], len(tokens) - 1)
                if self.head_survival:
                    self.calibration.observe(predicted[:chunk.num_draft_tokens], len(tokens) - 1)
        self.last_survival = {}
        if block is None:
            return [[] for _ in chunks]
        width = block.token_ids.shape[1]
        drafts = [flat_drafts[b * width:(b + 1) * width] for b in range(len(chunks))]
        # read after the sync (the tensor is already computed): a copy, no second wait
        confidence = block.confidence.tolist() if block.confidence is not None else None
        speculating = [b for b, c in enumerate(chunks) if c.request.sampling_params.speculative]
        survival = None
        if confidence is not None:
            survival = [_running_product(row[:self.k]) for row in confidence]
        self.head_survival = survival is not None
        if self.fixed_length:
            length = self.k
        else:
            mean = None
            if survival is not None and speculating:
                mean = [sum(survival[b][j] for b in speculating) / len(speculating) for j in range(self.k)]
            length = self.schedule.choose(len(chunks), len(speculating), mean)
        out: list[list[int]] = [[] for _ in chunks]
        for b in speculating:
            n = length
            if self.threshold and confidence is not None:
                n = min(n, next((j for j, c in enumerate(confidence[b][:n]) if c < self.threshold), n))
            out[b] = drafts[b][:n]
            self.last_survival[chunks[b].request.request_id] = (survival[b][:n] if survival is not None
                                                                 else [1.0] * n)
        return out


def _running_product(values: list[float]) -> list[float]:
    out, acc = [], 1.0
    for v in values:
        acc *= v
        out.append(acc)
    return out
