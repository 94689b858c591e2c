"""Request lifetimes in the HTTP layer: however a response ends (it completed, the client went
away, a sibling request was refused, the server is shutting down), every engine generator it
opened is closed, and closing one aborts its request and frees its KV pages."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sangam.sampling_params import RequestOutput

T = TypeVar("T")
Stream = tuple[AsyncGenerator[RequestOutput, None], RequestOutput]  # (generator, first output)


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class EventStream(StreamingResponse):
    """Server-sent events that always close their generators, whether the stream ended, the
    client went away or the server is shutting down: closing them aborts unfinished requests.
    (Starlette only cancels the sending task: a generator suspended at ``yield`` would stay
    open until garbage-collected.)"""

    def __init__(self, events: AsyncGenerator[str, None], streams: list[Stream],
                 headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **headers})
        self._events = events
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await close_all([gen for gen, _ in self._streams])  # if events never started


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (which closes its generators) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # no-op when done; else the client left, or we are being cancelled
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def merge(streams: list[Stream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) of every stream as it comes: the first outputs, then the rest;
    each stream's outputs stay in order."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks: list[asyncio.Task] = []
    try:
        for i, (_, first) in enumerate(streams):
            yield i, first
        tasks = [asyncio.create_task(pump(i, gen)) for i, (gen, _) in enumerate(streams)]
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        # A generator must be idle before it is closed, so wait for the pumps, even through
        # repeated cancellation (anyio re-delivers it until its cancelled scope is left).
        while not all(task.done() for task in tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(tasks)
        await close_all([gen for gen, _ in streams])


async def close_all(gens: list[AsyncGenerator[RequestOutput, None]]) -> None:
    for gen in gens:
        await gen.aclose()


async def collect(streams: list[Stream]) -> list[RequestOutput]:
    last = [first for _, first in streams]
    async with contextlib.aclosing(merge(streams)) as merged:
        async for i, out in merged:
            last[i] = out
    return last
