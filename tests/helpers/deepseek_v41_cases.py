"""Tiny DeepSeek-V4.1 schedules the V4.1 tests share (``make_tiny("deepseek_v41", overrides=...)``)."""
from __future__ import annotations

import torch

CONFIGS = {
    # tools/tiny_v41.py's default: window, a ratio-2 source with two reuse layers, a ratio-1 source that cuts the
    # pool (blocks of 2, 2 kept), reuse, reindex inside the pool, reuse; top-3
    "default": {},
    # compressed from layer 0, a window layer between two ratio-2 groups, a ratio-1 source with a pool of one
    # 4-entry block that is narrower than the top-6 of the index source right after it
    "two_groups": dict(num_hidden_layers=7, compress_ratios=[2, 2, 0, 2, 1, 1, 1], kv_source_layer_ids=[0, 3, 4],
                       index_source_layer_ids=[0, 3, 4, 5], candidate_source_layer_id=4, candidate_topk_blocks=1,
                       candidate_block_size=4, index_topk=6, sliding_window=5),
    # a reindex layer in a ratio-2 group, no candidate pool, 8 query heads in 4 output groups, two mHC streams
    "reindex_r2": dict(num_hidden_layers=6, compress_ratios=[2, 2, 2, 0, 1, 1], kv_source_layer_ids=[0, 4],
                       index_source_layer_ids=[0, 2, 4], candidate_source_layer_id=-1, index_topk=2,
                       num_attention_heads=8, o_groups=4, hc_mult=2, hc_sinkhorn_iters=5),
    # a top-k and a pool wider than every context tested: every visible entry is attended
    "wide": dict(index_topk=2048, candidate_topk_blocks=4096),
}


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
