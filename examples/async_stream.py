"""Embed the engine in an asyncio program: stream several requests at once from the demo model,
one output per committed block, with a stop string and per-token log-probabilities.
Run: python examples/async_stream.py"""

import asyncio
import math

from sangam import SamplingParams
from sangam.engine.async_engine import AsyncEngine


async def stream(engine: AsyncEngine, task: str, params: SamplingParams) -> None:
    ids = engine.engine.loaded.text.encode_chat([{"role": "user", "content": task}])
    async for out in engine.generate(ids, params, request_id=task):
        probs = " ".join(f"{math.exp(lp):.2f}" for lp in out.logprobs)
        state = out.finish_reason if out.finished else "..."
        print(f"{task!r:>22} -> {out.text!r:12} p=[{probs}] {state}")


async def main() -> None:
    engine = AsyncEngine(device="cpu")  # no model: the embedded demo model
    params = engine.engine.loaded.default_params(block_length=4, logprobs=0, stop=["z"])
    try:
        await asyncio.gather(*(stream(engine, task, params) for task in
                               ("Reverse: sangam", "Sort: dcba", "Repeat: hazel")))
    finally:
        engine.shutdown()


asyncio.run(main())
