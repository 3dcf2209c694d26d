"""Prefix caching keys an image span's blocks by the image (its digest and start), not only by the ids, which are
the same image token everywhere in a span: the same image at the same place shares blocks, another image never."""
from __future__ import annotations

from backend_lib.core.kv_cache import KVCacheManager
from backend_lib.core.request import PromptImage, Request
from backend_lib.core.sampling_params import SamplingParams

BS, IMG = 4, 99


def _request(rid: str, digest: str) -> Request:
    ids = [1, 2, IMG, IMG, IMG, IMG, IMG, IMG, 3, 4, 5, 6, 7]  # a 6-token span at 2: blocks 0 and 1
    return Request(request_id=rid, prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=2), seed=0,
                   images=(PromptImage(2, 6, digest, None),))


def _cached_tokens(manager: KVCacheManager, request: Request) -> int:
    blocks, cached = manager.get_computed_blocks(request)
    manager.allocate(request, request.num_tokens - cached, blocks)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return cached


def test_the_same_image_shares_blocks_and_another_never():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    assert _cached_tokens(manager, _request("a", "cat")) == 0
    assert _cached_tokens(manager, _request("b", "cat")) == 3 * BS  # every full block, the span's two included
    assert _cached_tokens(manager, _request("c", "dog")) == 0  # block 0 holds the span's start: no hit at all
