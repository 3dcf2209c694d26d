"""Several Triton requests for one OpenAI call (``n`` choices, a batch of prompts): awaited together, or their
streams merged as their responses arrive. A failure of any ends the call and cancels the others, so a refused
choice never leaves its siblings generating (and holding KV blocks) for a client that got an error.
"""
from __future__ import annotations

import asyncio
from typing import AsyncGenerator, AsyncIterator, Awaitable, TypeVar

T = TypeVar("T")


async def _cancel(futures: list[asyncio.Future]) -> None:
    for future in futures:
        future.cancel()
    await asyncio.gather(*futures, return_exceptions=True)


async def gather_all(works: list[Awaitable[T]]) -> list[T]:
    """Every result, in order. The first failure (by index, among those that failed at once) is raised after the
    others are cancelled; cancelling this cancels them all."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((task for task in tasks if task.done() and task.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [task.result() for task in tasks]
    finally:
        await _cancel([task for task in tasks if not task.done()])


async def merged(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) as the items arrive (those that arrive together in index order). A stream's failure
    is raised; closing this (or a failure) cancels what is still pending and closes every stream."""
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        # A stream's own pending step must end before it can be closed (aclose refuses a running generator).
        await _cancel(list(pending))
        for stream in streams:
            await stream.aclose()
