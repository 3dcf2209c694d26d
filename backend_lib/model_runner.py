"""Host-side input preparation, the model run, and sampling: one SchedulerOutput in, one RunnerOutput out.

Preparation turns the scheduler's chunks into one tensor per input (one host->device copy each); the model
forward and the sampler consume only tensors, so the same step can later run as compiled regions with static
shapes. The step syncs with the host once, when it reads the sampled ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backend_lib.outputs import RunnerOutput, ScheduledChunk, SchedulerOutput, TokenLogprob
from backend_lib.sampler import Sampler, SamplingMetadata, SamplingRow
from kernels.attention_metadata import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the last token of every chunk that samples
    order: list[int]  # chunk indices in token order (decode-like chunks first)
    sampling_chunks: list[int]  # chunk indices that sample, aligned with logits_indices


def chunk_token_ids(chunk: ScheduledChunk) -> list[int]:
    """The chunk's tokens without concatenating the whole history (decodes read one token)."""
    request = chunk.request
    num_prompt = request.num_prompt_tokens
    start, end = chunk.start, chunk.start + chunk.num_tokens
    if start >= num_prompt:
        return request.output_token_ids[start - num_prompt:end - num_prompt]
    if end <= num_prompt:
        return request.prompt_token_ids[start:end]
    return request.prompt_token_ids[start:] + request.output_token_ids[:end - num_prompt]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, vocab_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks  # one block past the pool: padded rows write here
        self.vocab_size = vocab_size
        self.device = device
        num_slots = (num_blocks + 1) * block_size
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for shape in model.kv_cache_shapes(num_slots)]
        self.sampler = Sampler()

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        per_slot = sum(math.prod(shape) for shape in model.kv_cache_shapes(1))
        return per_slot * block_size * torch.empty((), dtype=dtype).element_size()

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        padded = [r + [self.scratch_block] * (width - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(rows), width).to(self.device)

    def prepare(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        chunks = scheduler_output.chunks
        decodes = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
        prefills = [i for i, c in enumerate(chunks) if c.num_tokens != 1]
        order = decodes + prefills
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampling_chunks: list[int] = []
        for i in order:
            chunk = chunks[i]
            blocks = chunk.block_ids
            span = range(chunk.start, chunk.start + chunk.num_tokens)
            input_ids += chunk_token_ids(chunk)
            positions += span
            slots += [blocks[p // bs] * bs + p % bs for p in span]
            if chunk.samples:
                logits_indices.append(len(input_ids) - 1)
                sampling_chunks.append(i)

        def needed_blocks(chunk: ScheduledChunk) -> list[int]:
            return chunk.block_ids[:-(-(chunk.start + chunk.num_tokens) // bs)]

        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decodes=len(decodes),
            decode_query_len=1,
            decode_block_tables=self._block_table([needed_blocks(chunks[i]) for i in decodes]),
            decode_seq_lens=torch.tensor([chunks[i].start + 1 for i in decodes], dtype=torch.int32,
                                         device=self.device),
            num_prefills=len(prefills),
            prefill_query_lens=[chunks[i].num_tokens for i in prefills],
            prefill_seq_lens=[chunks[i].start + chunks[i].num_tokens for i in prefills],
            prefill_block_tables=self._block_table([needed_blocks(chunks[i]) for i in prefills]),
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            order=order,
            sampling_chunks=sampling_chunks,
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        chunks = scheduler_output.chunks
        inputs = self.prepare(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        sampled: list[list[int]] = [[] for _ in chunks]
        if not inputs.sampling_chunks:
            return RunnerOutput(sampled_token_ids=sampled)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        rows = [SamplingRow(params=r.sampling_params, seed=r.seed, output_position=r.num_output_tokens,
                            prompt_token_ids=r.prompt_token_ids, output_token_ids=r.output_token_ids,
                            eos_token_ids=r.eos_token_ids)
                for r in (chunks[i].request for i in inputs.sampling_chunks)]
        out = self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, self.device))
        # The one host sync of the step.
        token_ids = out.token_ids.tolist()
        for row, i in enumerate(inputs.sampling_chunks):
            sampled[i] = [token_ids[row]]
        if out.logprobs is None:
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
