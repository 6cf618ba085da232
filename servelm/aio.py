"""Running several async streams or tasks as one: what the services use to serve n prompts of one request together.
Nothing here knows servelm."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_all(coros: list[Awaitable[T]]) -> list[T]:
    """Run them concurrently; the first failure (or a cancellation) cancels the rest, which abort."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """Interleave several streams' items as they come. The first failure ends the merged stream with that
    error; closing it (a client gone) cancels every stream still running."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as it:
                async for item in it:
                    queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

