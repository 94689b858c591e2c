"""Blocking work - tokenizing, chat templates, serializing large responses - on a thread of its
own, so that the event loop keeps serving meanwhile."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# One thread: a tokenizer holds the GIL for long stretches (its Rust encode does not release it,
# its Python wrapper rarely pauses), and with several of them the loop's thread waits behind
# each in turn.
TOKENIZER_THREADS = 1


class Offloader:
    """The server's tokenizer thread: ``run(fn, *args)`` is ``fn(*args)`` there, awaited."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="sangam-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
