"""KV cache sizing (backend_lib/worker/kv_sizing.py): every rule, and a cache that cannot fit fails with the numbers."""
from __future__ import annotations

import pytest

from backend_lib.core.config import CacheConfig
from backend_lib.worker.kv_sizing import MIN_AUTO_BLOCKS, host_available_bytes, plan_kv_cache

GIB = 2**30
MIB = 2**20


def _plan(available: int | None, max_model_len: int = 256, max_num_seqs: int = 4, **cache):
    return plan_kv_cache(CacheConfig(block_size=16, **cache), MIB, available, max_model_len, max_num_seqs)


def test_default_is_auto():
    cache = CacheConfig()
    assert cache.num_blocks == 0 and cache.kv_cache_memory_gb == 0 and cache.kv_cache_memory_fraction == 0.5


def test_explicit_num_blocks_wins():
    plan = _plan(10 * GIB, num_blocks=7, kv_cache_memory_gb=1.0)
    assert plan.num_blocks == 7 and plan.rule == "num_blocks"


def test_explicit_gib():
    assert _plan(10 * GIB, kv_cache_memory_gb=0.5).num_blocks == 512


def test_auto_takes_the_fraction_of_free_memory():
    # 64 MiB free, half of it = 32 blocks of 1 MiB; the cap (4 x 16 blocks) is above that.
    plan = _plan(64 * MIB)
    assert plan.num_blocks == 32
    assert plan.available_bytes == 64 * MIB
    assert "kv_cache_memory_fraction=0.5" in plan.describe()
    assert _plan(64 * MIB, kv_cache_memory_fraction=0.25).num_blocks == 16


def test_auto_is_capped_at_what_running_requests_can_use():
    plan = _plan(100 * GIB, max_model_len=256, max_num_seqs=4)
    assert plan.num_blocks == 4 * 256 // 16
    assert "capped" in plan.rule


def test_auto_floor_serves_one_full_length_request():
    # 40 MiB free -> 20 blocks by the fraction; max_model_len 512 needs 32: the load fails with the numbers.
    with pytest.raises(ValueError, match=r"at least 32 blocks .*max_model_len=512.* 0\.039 GiB free"):
        _plan(40 * MIB, max_model_len=512)
    # The floor is also at least MIN_AUTO_BLOCKS for short contexts.
    with pytest.raises(ValueError, match=f"at least {MIN_AUTO_BLOCKS} blocks"):
        _plan(2 * MIB, max_model_len=16)


@pytest.mark.parametrize("cache", [{"num_blocks": 2048}, {"kv_cache_memory_gb": 2.0}])
def test_explicit_size_that_does_not_fit_fails_with_needed_and_available(cache):
    with pytest.raises(ValueError, match=r"2\.000 GiB needed .* only 1\.000 GiB is free after loading the weights"):
        _plan(1 * GIB, **cache)


def test_unknown_free_memory():
    assert _plan(None, num_blocks=9).num_blocks == 9  # explicit sizes need no measurement
    with pytest.raises(ValueError, match="set num_blocks or kv_cache_memory_gb"):
        _plan(None)


@pytest.mark.parametrize("field, value", [("kv_cache_memory_fraction", 0.0), ("kv_cache_memory_fraction", 1.5),
                                          ("kv_cache_memory_gb", -1.0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_host_available_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   2000000 kB\n")
    assert host_available_bytes(str(meminfo)) == 2000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert host_available_bytes(str(meminfo)) is None
    assert host_available_bytes() > 0  # this machine's /proc/meminfo


def test_fixed_state_slots_come_off_the_budget_first():
    """A hybrid-cache model's state slots (fixed bytes) are allocated besides the blocks: the auto rule gives the
    blocks what the fraction leaves after them, and a plan that cannot hold both names the slots."""
    plan = plan_kv_cache(CacheConfig(block_size=16), MIB, 64 * MIB, max_model_len=256, max_num_seqs=4, fixed_bytes=8 * MIB)
    assert plan.num_blocks == 32 - 8 and plan.fixed_bytes == 8 * MIB and "state slots" in plan.describe()
    with pytest.raises(ValueError, match=r"40 state slots \(max_num_seqs \+ max_sessions\) 0.0[0-9]+ GiB"):
        plan_kv_cache(CacheConfig(num_blocks=60), MIB, 64 * MIB, max_model_len=256, max_num_seqs=4,
                      fixed_bytes=8 * MIB, fixed_what="40 state slots (max_num_seqs + max_sessions)")
    with pytest.raises(ValueError, match="after the state slots"):
        plan_kv_cache(CacheConfig(block_size=16), MIB, 64 * MIB, max_model_len=256, max_num_seqs=4, fixed_bytes=30 * MIB)


def test_the_cache_is_sized_after_the_host_layouts_take_their_memory(smollm2_path, monkeypatch):
    """The blocked and packed weight copies and the screened heads are built before the free memory is measured, so
    the auto size never counts memory they then take."""
    from backend_lib.core.config import EngineConfig
    from backend_lib.models.parallel import ParallelContext
    import backend_lib.worker.executor.rank as rank

    seen = []
    measure = rank.kv_cache_blocks

    def sizing(config, model, *rest):
        seen.append(model.blocked_head is not None)
        return measure(config, model, *rest)

    monkeypatch.setattr(rank, "kv_cache_blocks", sizing)
    # dequantize: the fp32 head's blocked copy is what this checks (the packed default keeps the head in Q8_0 blocks)
    flat = {"model": smollm2_path, "weight_format": "dequantize", "max_num_seqs": 2, "max_model_len": 256}
    state = rank.build_rank(EngineConfig.from_flat(flat), ParallelContext())
    assert state.model.blocked_head is not None and seen == [True]
