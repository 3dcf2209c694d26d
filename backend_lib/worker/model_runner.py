"""Host-side input preparation, the model run, and sampling: one SchedulerOutput in, one RunnerOutput out.

Preparation turns the scheduler's chunks into one tensor per input (one host->device copy each); the model
forward and the sampler consume only tensors, so the same step can later run as compiled regions with static
shapes. The step syncs with the host once, when it reads the sampled ids.

Speculative decoding (``SpecConfig.method`` ngram | mtp | dspark | dflash): a decode chunk carries its drafts. The
decode group runs with ``decode_query_len = 1 + max drafts`` of the step; a request with fewer drafts is padded with
rows that write into the scratch block and whose logits are never read, so padding cannot change its output (its
real queries see exactly its own positions). ``_execute_spec`` verifies every sampling chunk's drafts with the rejection sampler
(a chunk without drafts is plain sampling: the same seeded draw) and proposes the next drafts: n-gram on the host
after the one sync, MTP and the DSpark / DFlash block drafters on device before it (the block drafters' lengths are
then chosen on the host: worker/spec_decode/verify_schedule.py).

Structured output: before sampling, the driver's ``StepBitmask`` (worker/grammar_bitmask.py) takes each constrained
request's mask from its matcher (a verification's rows: the masks after each of its drafts) into
``SamplingMetadata.bitmask``; the sampling core applies it, or, for greedy rows, the screened greedy head does
(each row's argmax over the tokens its mask allows, without the logits).

Tensor / context parallelism: the driver (rank 0) prepares the inputs and sends them through its ``StepLink``
(worker/step_messages.py); every other rank's loop (executor/worker.py) receives them and calls ``follow_step``: the
same forward (the collectives inside the model pair up rank by rank), the same head calls, and for MTP the same
draft passes once the driver's verified tokens arrive. Only the driver samples. With context ranks, every rank
first turns the global step into its share (worker/context_share.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from backend_lib.core.config import CompileConfig, SpecConfig
from backend_lib.core.outputs import RunnerOutput, ScheduledChunk, SchedulerOutput, TokenLogprob
from backend_lib.core.request import Request
from backend_lib.models.interfaces import capabilities_of
from backend_lib.models.parallel import ContextGroup
from backend_lib.neuron.platform import Platform
from backend_lib.neuron.regions import resolve_backend
from backend_lib.worker.compiled_sampler import build_regions
from backend_lib.worker.context_share import share_step
from backend_lib.worker.kv_sizing import is_hybrid
from backend_lib.worker.grammar_bitmask import StepBitmask
from backend_lib.worker.image_rows import image_rows
from backend_lib.worker.model_inputs import ModelInputs, StepOverlap
from backend_lib.worker.prompt_logprobs import head_slices, prompt_rows
from backend_lib.worker.prompt_logprobs import compute as compute_prompt_logprobs
from backend_lib.worker.sampler import Sampler, SamplingMetadata, SamplingRow
from backend_lib.worker.spec_decode import make_block_drafter, make_mtp_proposer
from backend_lib.worker.spec_decode.dspark import BlockPlan
from backend_lib.worker.spec_decode.ngram import NgramProposer
from backend_lib.worker.spec_decode.rejection import DraftLayout, greedy_verify, num_accepted, rejection_sample
from backend_lib.worker.step_messages import StepLink
from backend_lib.worker.token_history import chunk_history, padding_history, step_history
from kernels import sampling as sampling_ops
from kernels.attention_metadata import AttentionMetadata, StateRows


def max_drafts(spec: SpecConfig | None) -> int:
    """Draft positions a verification may roll back (hybrid rings keep that many extra positions)."""
    return spec.num_speculative_tokens if spec is not None and spec.method != "none" else 0


def _matcher(request: Request):
    """The request's grammar matcher while it runs (structured output), else None."""
    return request.grammar.matcher if request.grammar is not None else None


def chunk_token_ids(chunk: ScheduledChunk) -> list[int]:
    """The chunk's tokens (drafts last) without concatenating the whole history (decodes read one token)."""
    request = chunk.request
    num_prompt = request.num_prompt_tokens
    start, end = chunk.start, chunk.start + chunk.num_tokens - chunk.num_draft_tokens
    if start >= num_prompt:
        tokens = request.output_token_ids[start - num_prompt:end - num_prompt]
    elif end <= num_prompt:
        tokens = request.prompt_token_ids[start:end]
    else:
        tokens = request.prompt_token_ids[start:] + request.output_token_ids[:end - num_prompt]
    return tokens + chunk.draft_token_ids if chunk.draft_token_ids else tokens


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, vocab_size: int,
                 platform: Platform, dtype: torch.dtype, spec: SpecConfig | None = None,
                 compile_config: CompileConfig | None = None, max_num_seqs: int = 32,
                 max_model_len: int | None = None, link: StepLink | None = None, is_driver: bool = True,
                 num_state_slots: int = 0, kv_dtype: torch.dtype | None = None,
                 context: ContextGroup = ContextGroup(), context_min_tokens: int = 1) -> None:
        capabilities = capabilities_of(model)
        if context.size > 1 and not (capabilities.context_parallel and model.supports_context_parallel):
            raise ValueError(f"context_parallel_size={context.size}: {type(model).__name__} has no context-parallel "
                             f"attention here (Llama, DeepSeek-V3 without Engram and DeepSeek-V4 have)")
        self.model = model
        self.context = context
        # Models whose every layer needs every row (DeepSeek-V4: its compressors and rings) split only the KV.
        self.context_min_tokens = (context_min_tokens if capabilities.splits_context_rows
                                   else torch.iinfo(torch.int64).max)
        self.token_history = model.token_history if capabilities.engram else 0  # ids before each token (Engram)
        self.link = link  # the driver's messages to its worker ranks (None: one rank, or this is a worker)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One block past the pool: padded rows write here. The step's block ids are global (the scheduler's pool is
        # every context rank's blocks together; worker/context_share.py maps them onto this rank's).
        self.scratch_block = num_blocks * context.size
        self.vocab_size = vocab_size
        self.platform = platform  # the rank's, built once (worker/executor/rank.py)
        self.device = device = platform.torch_device
        num_slots = (num_blocks + 1) * block_size
        self.num_state_slots = num_state_slots if is_hybrid(model) else 0
        # kv_dtype: the paged cache's element type (default the model's; uint8 for kv_cache_dtype=fp8_e4m3); a
        # hybrid model's fixed state (rings) keeps the model dtype.
        if is_hybrid(model):  # paged blocks + the scratch block, state slots + the scratch slot
            paged, state = model.hybrid_cache_shapes(num_blocks + 1, block_size, num_state_slots + 1,
                                                     max_drafts(spec))
            shapes = [(shape, kv_dtype or dtype) for shape in paged] + [(shape, dtype) for shape in state]
        else:
            shapes = [(shape, kv_dtype or dtype) for shape in model.kv_cache_shapes(num_slots)]
        self.kv_caches = [torch.zeros(shape, dtype=kind, device=device) for shape, kind in shapes]
        self.sampler = Sampler() if is_driver else None  # only the driver samples
        self.bitmask = StepBitmask(vocab_size)  # structured output's masks (filled on the driver only)
        self.last_sampled: torch.Tensor | None = None  # [S] int64 the last plain step's tokens (the driver's)
        spec = spec or SpecConfig()
        k = spec.num_speculative_tokens
        self.spec_method = spec.method if k > 0 else "none"
        self.ngram = NgramProposer(spec.ngram_min, spec.ngram_max, k) if self.spec_method == "ngram" else None
        self.mtp = (make_mtp_proposer(model, self.kv_caches, num_slots, k, device, kv_dtype or dtype,
                                      self._share_meta if context.size > 1 else None)
                    if self.spec_method == "mtp" else None)
        self.block_drafter = (make_block_drafter(model, spec, num_slots, max_model_len or num_slots, device, dtype)
                              if self.spec_method in ("dspark", "dflash") else None)
        if context.size > 1 and self.block_drafter is not None:
            raise ValueError(f"spec_method {self.spec_method!r} runs without context parallelism: set "
                             f"context_parallel_size 1")
        eager_drafter = self.mtp if self.mtp is not None else self.block_drafter
        if getattr(eager_drafter, "needs_eager_model", False) and resolve_backend(compile_config, platform):
            raise ValueError(f"spec_method {self.spec_method!r} drafts for this model need the eager forward (it "
                             "keeps intermediate hidden states): set compile_backend 'none' (and no "
                             "DEEPINFER_COMPILE_BACKEND) or DEEPINFER_ENFORCE_EAGER=1")
        # Compiled regions (backend_lib/neuron/regions.py): same contracts, eager unless compile_config or
        # DEEPINFER_COMPILE_BACKEND ask for graphs; DEEPINFER_ENFORCE_EAGER=1 keeps everything eager.
        self.model, self.sampler = build_regions(model, self.sampler, self.kv_caches, num_blocks, block_size,
                                                 vocab_size, platform, compile_config, max_num_seqs,
                                                 max_model_len)
        # The compiled regions run the full head: only the eager model screens it.
        self.greedy_screen = (model.greedy_token_ids if capabilities.greedy_head_screen and self.model is model
                              else None)

    @property
    def num_lookahead_slots(self) -> int:
        """Slots past a step's tokens that the proposer writes (the scheduler reserves them)."""
        return self.mtp.num_lookahead_slots if self.mtp is not None else 0

    def _block_table(self, rows: list[list[int]], min_width: int = 0) -> torch.Tensor:
        width = max(max((len(r) for r in rows), default=0), min_width)
        padded = [r + [self.scratch_block] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(rows), width).to(self.device)

    def prepare(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        chunks = scheduler_output.chunks
        decodes = [i for i, c in enumerate(chunks) if c.num_tokens - c.num_draft_tokens == 1]
        prefills = [i for i, c in enumerate(chunks) if c.num_tokens - c.num_draft_tokens != 1]
        order = decodes + prefills
        decode_len = 1 + max((chunks[i].num_draft_tokens for i in decodes), default=0)
        bs = self.block_size
        scratch_slot = self.scratch_block * bs
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampling_chunks: list[int] = []
        row_starts = [0] * len(chunks)
        state: tuple[list[int], list[int], list[int]] = ([], [], [])  # slot, chunk start, chunk end per token
        history: list = []  # per chunk (and padding), the ids before each token: models with token_history only
        for rank, i in enumerate(order):
            chunk = chunks[i]
            blocks = chunk.block_ids
            span = range(chunk.start, chunk.start + chunk.num_tokens)
            row_starts[i] = len(input_ids)
            tokens = chunk_token_ids(chunk)
            input_ids += tokens
            positions += span
            if self.token_history:
                history.append(chunk_history(chunk, tokens, self.token_history))
            slots += [blocks[p // bs] * bs + p % bs for p in span]
            if self.num_state_slots:
                if chunk.state_slot is None:
                    raise ValueError(f"request {chunk.request.request_id!r} has no state slot: a hybrid-cache model "
                                     f"needs a scheduler built with num_state_slots")
                end = chunk.start + chunk.num_tokens
                for column, value in zip(state, (chunk.state_slot, chunk.start, end)):
                    column += [value] * chunk.num_tokens
            if chunk.samples:
                last = len(input_ids) - 1
                logits_indices += range(last - chunk.num_draft_tokens, last + 1)
                sampling_chunks.append(i)
            pad = decode_len - chunk.num_tokens if rank < len(decodes) else 0
            if pad:  # rows nobody reads: KV goes to the scratch block
                input_ids += [0] * pad
                if self.token_history:
                    history.append(padding_history(pad, self.token_history))
                positions += range(chunk.start + chunk.num_tokens, chunk.start + chunk.num_tokens + pad)
                slots += [scratch_slot] * pad
                if self.num_state_slots:
                    for column, value in zip(state, (-1, 0, 0)):
                        column += [value] * pad

        def needed_blocks(chunk: ScheduledChunk) -> list[int]:
            return chunk.block_ids[:-(-(chunk.start + chunk.num_tokens) // bs)]

        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decodes=len(decodes),
            decode_query_len=decode_len,
            decode_block_tables=self._block_table(
                [needed_blocks(chunks[i]) for i in decodes],
                max((-(-(chunks[i].start + decode_len) // bs) for i in decodes), default=0)),
            decode_seq_lens=torch.tensor([chunks[i].start + decode_len for i in decodes], dtype=torch.int32,
                                         device=self.device),
            num_prefills=len(prefills),
            prefill_query_lens=[chunks[i].num_tokens for i in prefills],
            prefill_seq_lens=[chunks[i].start + chunks[i].num_tokens for i in prefills],
            prefill_block_tables=self._block_table([needed_blocks(chunks[i]) for i in prefills]),
            state=StateRows(*(torch.tensor(c, dtype=torch.int64, device=self.device) for c in state))
            if self.num_state_slots else None,
            token_history=step_history(history, self.device) if self.token_history else None,
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            order=order,
            sampling_chunks=sampling_chunks,
            row_starts=row_starts,
            prompt_rows=prompt_rows(chunks, row_starts),
            embed_rows=image_rows(chunks, row_starts, self.device),
        )

    @torch.inference_mode()
    def follow_step(self, inputs: ModelInputs, extra: dict[str, torch.Tensor],
                    next_verified: Callable[[], torch.Tensor]) -> None:
        """A worker rank's step, mirroring the driver's ``execute`` (the collectives inside pair up rank by rank):
        the same forward, the head calls the driver makes, and MTP's passes (``next_verified``: the driver's
        verified tokens, which it sends after sampling)."""
        self._share(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, **inputs.forward_kwargs())
        if self.block_drafter is not None:
            self.block_drafter.write_context(inputs.positions, inputs.meta.slot_mapping)
        # Context ranks past the first: their tensor-parallel group does not compute the sampled logits (the first
        # one's does), but runs the MTP passes (their attention spans every context rank).
        if inputs.logits_indices.numel() and not self.context.rank:
            self.model.compute_logits(hidden[inputs.logits_indices])  # the driver samples from the gathered rows
        if "mtp_first_rows" in extra:
            self._mtp_drafts(hidden, inputs, extra["mtp_next_ids"], extra["mtp_first_rows"], extra["mtp_tables"],
                             next_verified())
        elif "mtp_next_ids" in extra:
            self.mtp.first_pass(extra["mtp_next_ids"], hidden, inputs.positions, inputs.meta)
        if "block_last" in extra:  # the driver's block draft pass (its collectives pair with ours)
            plan = BlockPlan(extra["block_last"], int(extra["block_bound"][0]))
            self.block_drafter.draft(next_verified(), plan, extra["block_tables"], self.block_size)
        if "prompt_logits_indices" in extra and not self.context.rank:  # the driver's prompt logprobs' head calls
            for _ in head_slices(self.model, hidden, extra["prompt_logits_indices"]):
                pass

    def _share(self, inputs: ModelInputs) -> None:
        """Context parallelism: the global step becomes this rank's share (after the driver published it)."""
        if self.context.size > 1:
            self._share_meta(inputs.meta, inputs.positions)

    def _share_meta(self, meta: AttentionMetadata,
                    positions: torch.Tensor) -> AttentionMetadata:  # positions [T] int64 of the queries
        return share_step(meta, positions, self.context, self.num_blocks, self.context_min_tokens)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput, inputs: ModelInputs | None = None,
                overlap: StepOverlap | None = None) -> RunnerOutput:
        """One step. Zero-overhead scheduling (engine/overlap.py) passes the ``inputs`` it prepared while the
        previous step ran and its ``overlap``: the rows whose token that step sampled (filled in here, on the
        device, before the inputs go to the other ranks) and the sampling metadata, built once that step's tokens
        were committed (penalties and grammar masks need them)."""
        chunks = scheduler_output.chunks
        inputs = self.prepare(scheduler_output) if inputs is None else inputs
        if overlap is not None and overlap.dst_rows.numel():
            if self.last_sampled is None:
                raise RuntimeError("a step continues the previous one, but that step sampled nothing here")
            inputs.input_ids.index_copy_(0, overlap.dst_rows, self.last_sampled[overlap.src_rows])
        mtp_host = self._mtp_host_inputs(chunks, inputs)
        block_plan = self._block_plan(chunks, inputs, mtp_host)
        if self.link is not None:
            self.link.send_step(inputs, mtp_host)
        self._share(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, **inputs.forward_kwargs())
        if self.block_drafter is not None:
            self.block_drafter.write_context(inputs.positions, inputs.meta.slot_mapping)
        if self.spec_method != "none" or any(c.draft_token_ids for c in chunks):
            output = self._execute_spec(chunks, inputs, hidden, mtp_host, block_plan)
        else:
            output = self._execute_plain(chunks, inputs, hidden, None if overlap is None else overlap.sampling)
        if inputs.prompt_rows is not None:
            output.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, inputs.prompt_rows)
        return output

    def sampling_metadata(self, chunks: list[ScheduledChunk], inputs: ModelInputs) -> SamplingMetadata | None:
        """A plain step's sampling rows and grammar masks (None: it samples nothing). Reads each request's output
        and matcher, so it runs on the engine's thread once the previous step's tokens are in."""
        if not inputs.sampling_chunks:
            return None
        requests = [chunks[i].request for i in inputs.sampling_chunks]
        rows = [SamplingRow(params=r.sampling_params, seed=r.seed, output_position=r.num_output_tokens,
                            prompt_token_ids=r.prompt_token_ids, output_token_ids=r.output_token_ids,
                            eos_token_ids=r.eos_token_ids)
                for r in requests]
        bitmask, masked = self.bitmask.fill([(_matcher(r), ()) for r in requests])
        return SamplingMetadata.build(rows, self.vocab_size, self.device, bitmask, masked)

    def _execute_plain(self, chunks: list[ScheduledChunk], inputs: ModelInputs, hidden: torch.Tensor,  # [T, hidden]
                       sampling: Callable[[], SamplingMetadata | None] | None = None) -> RunnerOutput:
        sampled: list[list[int]] = [[] for _ in chunks]
        if not inputs.sampling_chunks:
            return RunnerOutput(sampled_token_ids=sampled)
        meta = sampling() if sampling is not None else self.sampling_metadata(chunks, inputs)
        head_input = hidden[inputs.logits_indices]
        greedy = self._screened_greedy(head_input, meta)
        out = self.sampler(self.model.compute_logits(head_input), meta) if greedy is None else None
        self.last_sampled = out.token_ids if out is not None else greedy  # [S] the next step may continue from it
        # The one host sync of the step.
        token_ids = self.last_sampled.tolist()
        for row, i in enumerate(inputs.sampling_chunks):
            sampled[i] = [token_ids[row]]
        if out is None or out.logprobs is None:
            return RunnerOutput(sampled_token_ids=sampled)
        token_logprobs = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_logprobs = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        logprobs: list[list[TokenLogprob]] = [[] for _ in chunks]
        for row, i in enumerate(inputs.sampling_chunks):
            wanted = chunks[i].request.sampling_params.logprobs
            if wanted is None:
                continue
            top = list(zip(top_ids[row][:wanted], top_logprobs[row][:wanted])) if top_ids and wanted else []
            logprobs[i] = [TokenLogprob(token_ids[row], token_logprobs[row], top)]
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _screened_greedy(self, head_input: torch.Tensor,  # [N, hidden]
                         meta: SamplingMetadata) -> torch.Tensor | None:  # [N] int64
        """Plain greedy rows' tokens without the logits, where the model screens its head
        (kernels/int8_head_screen.py, kernels/head_screen.py), under their grammar masks when some row is
        constrained (kernels/masked_head_screen.py); None: compute the logits."""
        screen = self.greedy_screen
        if screen is None:
            return None
        if meta.plain_greedy:
            return screen(head_input)
        return screen(head_input, meta.bitmask) if meta.masked_greedy else None

    # ---- speculative decoding -------------------------------------------------------------------------
    def _verify_rows(self, chunks: list[ScheduledChunk], inputs: ModelInputs) -> list[SamplingRow]:
        """One sampling row per verified position: row j of a chunk sees the chunk's first j drafts as output
        (so penalties and min_tokens treat them as if they had been sampled)."""
        rows = []
        for i in inputs.sampling_chunks:
            chunk, r = chunks[i], chunks[i].request
            for j in range(chunk.num_draft_tokens + 1):
                output = r.output_token_ids + chunk.draft_token_ids[:j] if j else r.output_token_ids
                rows.append(SamplingRow(params=r.sampling_params, seed=r.seed, output_position=r.num_output_tokens + j,
                                        prompt_token_ids=r.prompt_token_ids, output_token_ids=output,
                                        eos_token_ids=r.eos_token_ids))
        return rows

    def _execute_spec(self, chunks: list[ScheduledChunk], inputs: ModelInputs, hidden: torch.Tensor,
                      mtp_host: dict[str, torch.Tensor], block_plan: BlockPlan | None = None) -> RunnerOutput:
        sampled: list[list[int]] = [[] for _ in chunks]
        proposals: list[list[int]] = [[] for _ in chunks]
        sampling = inputs.sampling_chunks
        if not sampling:
            if self.mtp is not None:  # keep the MTP cache complete for the prefill tokens
                self.mtp.first_pass(mtp_host["mtp_next_ids"], hidden, inputs.positions, inputs.meta)
            return RunnerOutput(sampled_token_ids=sampled, draft_token_ids=proposals)
        bitmask, masked = self.bitmask.fill([(_matcher(chunks[i].request), chunks[i].draft_token_ids)
                                             for i in sampling])
        meta = SamplingMetadata.build(self._verify_rows(chunks, inputs), self.vocab_size, self.device, bitmask,
                                      masked)
        layout = DraftLayout.build([chunks[i].draft_token_ids for i in sampling], self.device)
        head_input = hidden[inputs.logits_indices]
        greedy = self._screened_greedy(head_input, meta)
        logits = self.model.compute_logits(head_input) if greedy is None else None
        verified = (greedy_verify(greedy, layout) if greedy is not None
                    else rejection_sample(logits, layout, meta, sampler=self.sampler))
        to_read = [verified.token_ids.flatten()]
        if self.mtp is not None:
            if self.link is not None:
                self.link.send_verified(verified.token_ids)
            drafts = self._mtp_drafts(hidden, inputs, mtp_host["mtp_next_ids"], mtp_host["mtp_first_rows"],
                                      mtp_host["mtp_tables"], verified.token_ids)
            to_read.append(drafts.flatten())
        block = None
        if block_plan is not None:
            if self.link is not None:  # the other tensor-parallel ranks run the same draft pass
                self.link.send_verified(verified.token_ids)
            block = self.block_drafter.draft(verified.token_ids, block_plan, mtp_host["block_tables"],
                                             self.block_size)
        if block is not None:
            to_read.append(block.token_ids.flatten())
        # The one host sync of the step: verified tokens (and MTP drafts) together.
        flat = torch.cat(to_read).tolist()
        width = verified.token_ids.shape[1]
        row_offsets, offset = [], 0
        for b, i in enumerate(sampling):
            sampled[i] = [t for t in flat[b * width:(b + 1) * width] if t >= 0]
            row_offsets.append(offset)
            offset += chunks[i].num_draft_tokens + 1
        drafts_at = len(sampling) * width
        # n-gram drafts per request: the next step's verification rows stay within what the few-row GEMM reads
        # the weights once for (NgramProposer.batch_limit).
        ngram_limit = self.ngram.batch_limit(len(sampling)) if self.ngram is not None else 0
        if self.block_drafter is not None:
            block_proposals = self.block_drafter.proposals([chunks[i] for i in sampling],
                                                           [sampled[i] for i in sampling], block, flat[drafts_at:])
        for b, i in enumerate(sampling):
            request = chunks[i].request
            if not request.sampling_params.speculative:
                continue
            if self.mtp is not None:
                proposals[i] = flat[drafts_at + b * self.mtp.k:drafts_at + (b + 1) * self.mtp.k]
            elif self.block_drafter is not None:
                proposals[i] = block_proposals[b]
            elif ngram_limit:
                proposals[i] = self.ngram.propose(request.all_token_ids + sampled[i], ngram_limit)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = self._spec_logprobs(chunks, sampling, logits, verified.row_token_ids, meta, sampled,
                                           row_offsets)
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, draft_token_ids=proposals)

    def _spec_logprobs(self, chunks: list[ScheduledChunk], sampling: list[int], logits: torch.Tensor,
                       row_tokens: torch.Tensor, meta: SamplingMetadata, sampled: list[list[int]],
                       row_offsets: list[int]) -> list[list[TokenLogprob]]:
        """Logprobs of each emitted token under its row's raw distribution (as the plain sampler reports)."""
        lp, top_ids, top_lp = sampling_ops.compute_logprobs(logits, row_tokens, meta.max_num_logprobs)
        lp = lp.tolist()
        top_ids = top_ids.tolist() if top_ids is not None else None
        top_lp = top_lp.tolist() if top_lp is not None else None
        out: list[list[TokenLogprob]] = [[] for _ in chunks]
        for b, i in enumerate(sampling):
            wanted = chunks[i].request.sampling_params.logprobs
            if wanted is None:
                continue
            for j, token in enumerate(sampled[i]):
                row = row_offsets[b] + j
                top = list(zip(top_ids[row][:wanted], top_lp[row][:wanted])) if top_ids and wanted else []
                out[i].append(TokenLogprob(token, lp[row], top))
        return out

    def _next_token_ids(self, chunks: list[ScheduledChunk], inputs: ModelInputs) -> list[int]:
        """Host part of the MTP input: for every row, the token at the next position when already known
        (prompt tokens); 0 where the verifier decides (scattered in on device) and on padding rows."""
        next_ids = [0] * int(inputs.input_ids.shape[0])
        for i, chunk in enumerate(chunks):
            end = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
            known_end = end - 1 if chunk.samples else end  # a sampling chunk's last next token is being sampled
            if known_end <= chunk.start:
                continue
            tokens = chunk.request.all_token_ids
            row = inputs.row_starts[i]
            next_ids[row:row + known_end - chunk.start] = tokens[chunk.start + 1:known_end + 1]
        return next_ids

    def _block_plan(self, chunks: list[ScheduledChunk], inputs: ModelInputs,
                    host: dict[str, torch.Tensor]) -> BlockPlan | None:
        """The block drafter's pass of this step, fixed before it runs, and its inputs added to ``host`` (what the
        driver sends the other ranks)."""
        sampling = inputs.sampling_chunks
        if self.block_drafter is None or not sampling:
            return None
        plan = self.block_drafter.plan([chunks[i] for i in sampling], self.device)
        if plan is not None:
            host["block_last"] = plan.last_positions
            host["block_bound"] = torch.tensor([plan.context_bound], dtype=torch.int64, device=self.device)
            host["block_tables"] = self._block_table([chunks[i].block_ids for i in sampling])
        return plan

    def _mtp_host_inputs(self, chunks: list[ScheduledChunk], inputs: ModelInputs) -> dict[str, torch.Tensor]:
        """What the MTP passes need from the host: the known next token of every row and, when the step
        samples, the row of each sampling chunk's last token before its drafts and the chunks' block tables."""
        if self.mtp is None:
            return {}
        host = {"mtp_next_ids": torch.tensor(self._next_token_ids(chunks, inputs), dtype=torch.int64,
                                             device=self.device)}
        sampling = inputs.sampling_chunks
        if sampling:
            first_rows = [inputs.row_starts[i] + chunks[i].num_tokens - chunks[i].num_draft_tokens - 1
                          for i in sampling]
            host["mtp_first_rows"] = torch.tensor(first_rows, dtype=torch.int64, device=self.device)
            host["mtp_tables"] = self._block_table([chunks[i].block_ids for i in sampling])
        return host

    def _mtp_drafts(self, hidden: torch.Tensor,  # [T, H] this step's final-norm hidden
                    inputs: ModelInputs,
                    next_ids: torch.Tensor,  # [T] int64 known next tokens (0 where the verifier decides)
                    first_rows: torch.Tensor,  # [S] int64
                    tables: torch.Tensor,  # [S, W'] int32
                    verified: torch.Tensor,  # [S, W] rejection output
                    ) -> torch.Tensor:  # [S, k]
        # One spare element at the end takes the writes of padding columns (never read).
        next_ids = torch.cat([next_ids, next_ids.new_zeros(1)])
        spare = int(next_ids.shape[0]) - 1
        width = verified.shape[1]
        targets = first_rows[:, None] + torch.arange(width, dtype=torch.int64, device=self.device)[None, :]
        targets = torch.where(verified >= 0, targets, torch.full_like(targets, spare))
        next_ids = next_ids.index_put((targets.flatten(),), verified.flatten())[:spare]
        select = first_rows + num_accepted(verified)
        return self.mtp.propose(hidden, next_ids, inputs.positions, inputs.meta, select, tables)
