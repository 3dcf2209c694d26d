"""The model runner's job done by hand for model-level tests: our forward over shuffled cache blocks with
hand-built AttentionMetadata (PagedRunner), and the same over a hybrid cache's paged blocks plus state slots
(HybridPagedRunner, DeepSeek-V4)."""
from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata, StateRows


class PagedRunner:
    """Drives our forward with hand-built AttentionMetadata over shuffled cache blocks (the model runner's job)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64, block_size: int = 4) -> None:
        self.model, self.bs, self.scratch = model, block_size, num_blocks
        self.caches = [torch.zeros(s) for s in model.kv_cache_shapes((num_blocks + 1) * block_size)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def _place(self, rid: str, n: int) -> tuple[list[int], list[int]]:
        start = self.computed.get(rid, 0)
        blocks = self.blocks.setdefault(rid, [])
        while len(blocks) * self.bs < start + n:
            blocks.append(self.free.pop())
        positions = list(range(start, start + n))
        self.computed[rid] = start + n
        return positions, [blocks[p // self.bs] * self.bs + p % self.bs for p in positions]

    def share_prefix(self, src: str, dst: str, num_blocks: int) -> None:
        """Prefix caching: ``dst`` starts with ``src``'s first full blocks, already computed."""
        self.blocks[dst] = list(self.blocks[src][:num_blocks])
        self.computed[dst] = num_blocks * self.bs

    def _meta_hook(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta  # subclasses add what their model needs beyond the paged metadata

    def _table(self, rids: list[str], width: int) -> torch.Tensor:
        rows = [self.blocks[r] + [self.scratch] * (width - len(self.blocks[r])) for r in rids]
        return torch.tensor(rows, dtype=torch.int32).view(len(rids), width)

    def step(self, decodes: list[tuple[str, list[int]]], prefills: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Logits [T, vocab] for decodes (same query length each) then prefill chunks."""
        ids, pos, slots = [], [], []
        for rid, toks in decodes + prefills:
            p, s = self._place(rid, len(toks))
            ids += toks
            pos += p
            slots += s
        width = max(len(self.blocks[r]) for r, _ in decodes + prefills)
        meta = AttentionMetadata(
            block_size=self.bs, slot_mapping=torch.tensor(slots), num_decodes=len(decodes),
            decode_query_len=len(decodes[0][1]) if decodes else 1,
            decode_block_tables=self._table([r for r, _ in decodes], width),
            decode_seq_lens=torch.tensor([self.computed[r] for r, _ in decodes], dtype=torch.int32),
            num_prefills=len(prefills), prefill_query_lens=[len(t) for _, t in prefills],
            prefill_seq_lens=[self.computed[r] for r, _ in prefills],
            prefill_block_tables=self._table([r for r, _ in prefills], width))
        meta = self._meta_hook(meta)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
            return self.model.compute_logits(hidden)


class HybridPagedRunner(PagedRunner):
    """The V3 harness over V4's hybrid cache: paged entry blocks (shuffled) plus one fixed state slot per request,
    handed out in reverse so slot ids and request order differ."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4, num_state_slots: int = 6) -> None:
        self.model, self.bs, self.scratch = model, block_size, num_blocks
        paged, state = model.hybrid_cache_shapes(num_blocks + 1, block_size, num_state_slots + 1)
        self.caches = [torch.zeros(s) for s in paged + state]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.free_slots = list(range(num_state_slots))
        self.slots: dict[str, int] = {}

    def share_prefix(self, src: str, dst: str, num_blocks: int) -> None:
        raise NotImplementedError("the hybrid cache keeps no per-position state to share (prefix caching is off)")

    def step(self, decodes: list[tuple[str, list[int]]], prefills: list[tuple[str, list[int]]]) -> torch.Tensor:
        slots, starts, ends = [], [], []
        for rid, toks in decodes + prefills:
            if rid not in self.slots:
                self.slots[rid] = self.free_slots.pop()
            start = self.computed.get(rid, 0)
            slots += [self.slots[rid]] * len(toks)
            starts += [start] * len(toks)
            ends += [start + len(toks)] * len(toks)
        self.state = StateRows(torch.tensor(slots), torch.tensor(starts), torch.tensor(ends))
        return super().step(decodes, prefills)

    def _meta_hook(self, meta):
        meta.state = self.state
        return meta
