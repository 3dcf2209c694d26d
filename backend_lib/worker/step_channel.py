"""The driver's per-step messages to the worker ranks, as tensors over the process group (no pickling).

A message is an op code and named integer tensors. It travels as two broadcasts from rank 0: a fixed-size int64
header (op, then per tensor its field index, dtype code, rank and shape) and one int64 payload with every tensor
flattened end to end. Workers rebuild the tensors with the header's shapes and dtypes. The messages go to every
rank of the world (tensor- and context-parallel alike).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist



class StepOp(IntEnum):
    STEP = 1  # run the model over the message's inputs
    RESULT = 2  # a device result of the driver's (verified tokens for the MTP drafts)
    SHUTDOWN = 3  # leave the loop
    REBALANCE = 4  # EPLB: move the experts to the message's placement (worker/eplb.py), between two steps


# Every name a message may carry (the header sends the index, not the name).
FIELDS = ("input_ids", "positions", "slot_mapping", "decode_block_tables", "decode_seq_lens", "prefill_block_tables",
          "prefill_query_lens", "prefill_seq_lens", "logits_indices", "scalars", "mtp_next_ids", "mtp_first_rows",
          "mtp_tables", "verified", "state_slots", "chunk_starts", "chunk_ends", "prompt_logits_indices",
          "token_history", "placement", "block_last", "block_bound", "block_tables", "embed_rows", "embed_values")
_DTYPES = (torch.int64, torch.int32, torch.bool)
_HEADER_LEN = 128
_MAX_DIMS = 2


@dataclass
class StepMessage:
    op: StepOp
    tensors: dict[str, torch.Tensor]


class StepChannel:
    """Driver: ``publish``; workers: ``receive`` (every rank calls its side once per message, in the same order)."""

    def __init__(self, rank: int, world_size: int) -> None:  # global: every tensor- and context-parallel rank
        if world_size < 2:
            raise ValueError("a step channel needs at least two ranks")
        self.rank, self.world_size = rank, world_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def publish(self, op: StepOp, tensors: dict[str, torch.Tensor] | None = None) -> None:
        tensors = tensors or {}
        header = [int(op), len(tensors)]
        for name, tensor in tensors.items():
            if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
                raise ValueError(f"step field {name}: {tensor.dtype} with {tensor.dim()} dims cannot be sent")
            dims = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
            header += [FIELDS.index(name), _DTYPES.index(tensor.dtype), tensor.dim(), *dims]
        if len(header) > _HEADER_LEN:
            raise ValueError(f"a step message of {len(tensors)} tensors does not fit the header")
        header_tensor = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header_tensor[:len(header)] = torch.tensor(header, dtype=torch.int64)
        dist.broadcast(header_tensor, src=0)
        if tensors:
            payload = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors.values()])
            dist.broadcast(payload, src=0)

    def receive(self) -> StepMessage:
        header_tensor = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header_tensor, src=0)
        header = header_tensor.tolist()
        op, count = StepOp(header[0]), header[1]
        specs = []
        at = 2
        for _ in range(count):
            field, dtype, ndim = header[at:at + 3]
            shape = header[at + 3:at + 3 + ndim]
            specs.append((FIELDS[field], _DTYPES[dtype], shape))
            at += 3 + _MAX_DIMS
        tensors: dict[str, torch.Tensor] = {}
        if specs:
            sizes = [int(torch.Size(shape).numel()) for _, _, shape in specs]
            payload = torch.empty(sum(sizes), dtype=torch.int64)
            dist.broadcast(payload, src=0)
            for (name, dtype, shape), part in zip(specs, payload.split(sizes)):
                tensors[name] = part.view(shape).to(dtype)
        return StepMessage(op, tensors)
