"""The driver's step traffic to its worker ranks, over the step channel: what a step's inputs look like as a
message and back, the verified tokens MTP's passes need mid-step, and the end. The runner only sees a ``StepLink``
(the driver's sending side); the workers' loop (executor/worker.py) receives and hands the runner its inputs."""
from __future__ import annotations

import torch

from backend_lib.models.interfaces import InputEmbeddingRows
from backend_lib.worker.model_inputs import ModelInputs
from backend_lib.worker.step_channel import StepChannel, StepOp
from kernels.attention_metadata import AttentionMetadata, StateRows


def step_tensors(inputs: ModelInputs, extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step's inputs (and the runner's extra inputs, e.g. MTP's) as the message's named tensors."""
    meta = inputs.meta
    return {
        "input_ids": inputs.input_ids, "positions": inputs.positions, "slot_mapping": meta.slot_mapping,
        "decode_block_tables": meta.decode_block_tables, "decode_seq_lens": meta.decode_seq_lens,
        "prefill_block_tables": meta.prefill_block_tables,
        "prefill_query_lens": torch.tensor(meta.prefill_query_lens, dtype=torch.int64),
        "prefill_seq_lens": torch.tensor(meta.prefill_seq_lens, dtype=torch.int64),
        "logits_indices": inputs.logits_indices,
        "scalars": torch.tensor([meta.num_decodes, meta.decode_query_len], dtype=torch.int64), **extra,
        **({} if inputs.prompt_rows is None else
           {"prompt_logits_indices": torch.tensor(inputs.prompt_rows.indices, dtype=torch.int64)}),
        **({} if meta.state is None else {"state_slots": meta.state.slots, "chunk_starts": meta.state.chunk_starts,
                                          "chunk_ends": meta.state.chunk_ends}),
        **({} if meta.token_history is None else {"token_history": meta.token_history}),
        # image spans' input embeddings: fp32 bits as int32 (the channel carries integers; bf16 widens exactly)
        **({} if inputs.embed_rows is None else
           {"embed_rows": inputs.embed_rows.rows,
            "embed_values": inputs.embed_rows.embeddings.float().contiguous().view(torch.int32)})}


def received_inputs(t: dict[str, torch.Tensor], block_size: int) -> ModelInputs:
    """A worker's ModelInputs from the driver's message (rows only: the host bookkeeping stays on the driver)."""
    num_decodes, decode_query_len = t["scalars"].tolist()
    prefill_query_lens = t["prefill_query_lens"].tolist()
    meta = AttentionMetadata(
        block_size=block_size, slot_mapping=t["slot_mapping"], num_decodes=num_decodes,
        decode_query_len=decode_query_len, decode_block_tables=t["decode_block_tables"],
        decode_seq_lens=t["decode_seq_lens"], num_prefills=len(prefill_query_lens),
        prefill_query_lens=prefill_query_lens, prefill_seq_lens=t["prefill_seq_lens"].tolist(),
        prefill_block_tables=t["prefill_block_tables"],
        state=StateRows(t["state_slots"], t["chunk_starts"], t["chunk_ends"]) if "state_slots" in t else None,
        token_history=t.get("token_history"))
    embed_rows = (InputEmbeddingRows(t["embed_rows"], t["embed_values"].view(torch.float32))
                  if "embed_rows" in t else None)
    return ModelInputs(input_ids=t["input_ids"], positions=t["positions"], meta=meta,
                       logits_indices=t["logits_indices"], order=[], sampling_chunks=[], row_starts=[],
                       embed_rows=embed_rows)


class StepLink:
    """The driver's side: every message goes to every worker rank, in the order the workers receive them."""

    def __init__(self, channel: StepChannel) -> None:
        self.channel = channel

    def send_step(self, inputs: ModelInputs, extra: dict[str, torch.Tensor]) -> None:
        self.channel.publish(StepOp.STEP, step_tensors(inputs, extra))

    def send_verified(self, verified: torch.Tensor) -> None:  # [S, W] int64 the rejection sampler's tokens
        self.channel.publish(StepOp.RESULT, {"verified": verified})

    def send_placements(self, table: torch.Tensor) -> None:  # [layers, slots] int64 EPLB's new slot -> expert
        self.channel.publish(StepOp.REBALANCE, {"placement": table})

    def shutdown(self) -> None:
        self.channel.publish(StepOp.SHUTDOWN)
