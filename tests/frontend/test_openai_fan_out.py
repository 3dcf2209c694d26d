"""fan_out.py on plain asyncio streams: results in order, merged streams tagged, and a failure (or the caller
going away) ends every sibling, as a choice's gRPC call must end when its call is refused or abandoned."""
from __future__ import annotations

import asyncio

import pytest

from backend_lib.frontend.openai.fan_out import gather_all, merged


class Refused(Exception):
    pass


def _stream(name: str, items: int, delay: float, ended: list[str], fail_at: int | None = None):
    async def stream():
        try:
            for i in range(items):
                await asyncio.sleep(delay)
                if i == fail_at:
                    raise Refused(name)
                yield f"{name}{i}"
        finally:  # what generate()'s finally does: cancel its gRPC call
            ended.append(name)
    return stream()


async def _collect(stream) -> list[str]:
    return [item async for item in stream]


def test_gather_all_keeps_the_order_and_a_failure_cancels_the_rest():
    async def scenario():
        ended: list[str] = []
        done = await gather_all([_collect(_stream("a", 3, 0.02, ended)), _collect(_stream("b", 1, 0.0, ended))])
        assert done == [["a0", "a1", "a2"], ["b0"]]
        ended.clear()
        slow = _stream("slow", 100, 0.05, ended)
        with pytest.raises(Refused, match="bad"):
            await gather_all([_collect(slow), _collect(_stream("bad", 3, 0.01, ended, fail_at=1))])
        assert sorted(ended) == ["bad", "slow"]  # the slow sibling did not run on

        ended.clear()  # the caller cancels (the HTTP client went away): every stream ends
        task = asyncio.ensure_future(gather_all([_collect(_stream(n, 100, 0.05, ended)) for n in "xy"]))
        await asyncio.sleep(0.12)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(ended) == ["x", "y"]
    asyncio.run(scenario())


def test_merged_tags_items_as_they_come_and_closing_it_closes_every_stream():
    async def scenario():
        ended: list[str] = []
        items = await _collect(merged([_stream("a", 2, 0.03, ended), _stream("b", 3, 0.01, ended)]))
        assert sorted(items) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1"), (1, "b2")]
        assert items[0] == (1, "b0") and [i for i in items if i[0] == 1] == [(1, "b0"), (1, "b1"), (1, "b2")]

        ended.clear()
        both = merged([_stream("a", 100, 0.01, ended), _stream("b", 100, 0.02, ended)])
        assert (await anext(both))[0] in (0, 1)
        await both.aclose()  # the client disconnected mid-stream
        assert sorted(ended) == ["a", "b"]

        ended.clear()
        failing = merged([_stream("a", 100, 0.02, ended), _stream("bad", 5, 0.01, ended, fail_at=2)])
        with pytest.raises(Refused):
            await _collect(failing)
        assert sorted(ended) == ["a", "bad"]
    asyncio.run(scenario())
