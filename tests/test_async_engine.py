"""AsyncEngine: block streaming, many concurrent callers, aborts, bad requests."""

import asyncio
import json
from pathlib import Path

import pytest

from sangam import LLM, SamplingParams
from sangam.config import EngineConfig
from sangam.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(dream_path):
    eng = AsyncEngine(EngineConfig(model=dream_path, device="cpu", dtype="float64",
                                   page_size=4, num_pages=200))
    yield eng
    eng.shutdown()


def _params(i):
    return SamplingParams(max_tokens=16, block_length=4, cache=["dual", "prefix", "none"][i % 3],
                          stop_at_eos=False, seed=i, temperature=1.5 if i % 2 else 0.0)


async def _collect(engine, prompt, params, rid):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


def test_streams_one_output_per_block_and_matches_llm(engine, dream_path):
    prompts = [[5 + i] * (1 + 3 * i) for i in range(12)]

    async def main():
        return await asyncio.gather(*(_collect(engine, p, _params(i), f"s{i}")
                                      for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    assert asyncio.run(engine.get_tokenizer()) is engine.tokenizer  # vLLM's name
    llm = LLM(dream_path, device="cpu", dtype="float64")
    expected = llm.generate(prompt_token_ids=prompts,
                            sampling_params=[_params(i) for i in range(12)])
    for outs, exp in zip(streams, expected):
        assert len(outs) == 4  # 16 tokens / block 4, one output per committed block
        assert [len(o.token_ids) for o in outs] == [4, 8, 12, 16]
        assert [o.finished for o in outs] == [False, False, False, True]
        assert outs[-1].token_ids == exp.token_ids
        assert outs[-1].num_forwards == exp.num_forwards
        assert outs[-1].metrics["e2e_latency"] > 0


def test_abort_and_early_exit_free_pages(engine):
    async def main():
        gen = engine.generate([3] * 10, SamplingParams(max_tokens=64, block_length=4,
                                                       stop_at_eos=False), "early")
        first = await gen.__anext__()
        await gen.aclose()  # the caller walks away: the request is aborted

        async def aborted():
            outs = await _collect(engine, [4] * 10, SamplingParams(
                max_tokens=512, block_length=4, stop_at_eos=False), "victim")
            return outs[-1]

        task = asyncio.create_task(aborted())
        await asyncio.sleep(0.05)
        await engine.abort("victim")
        last = await task
        return first, last

    first, last = asyncio.run(main())
    assert not first.finished
    assert last.finished and last.finish_reason == "abort"
    for _ in range(100):
        if engine.engine.pool.allocator.num_free == engine.engine.pool.num_pages:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert engine.engine.pool.allocator.num_free == engine.engine.pool.num_pages


def test_bad_request_is_refused_and_others_continue(engine):
    async def main():
        good = asyncio.create_task(_collect(engine, [7] * 5, _params(0), "good"))
        with pytest.raises(ValueError, match="empty"):
            await _collect(engine, [], _params(1), "bad")
        with pytest.raises(ValueError, match="beyond the model's context"):
            await _collect(engine, [1], SamplingParams(max_tokens=100_000), "huge")
        return await good

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].token_ids) == 16


def test_shutdown_ends_open_streams(dream_path):
    eng = AsyncEngine(EngineConfig(model=dream_path, device="cpu", dtype="float32",
                                   page_size=4, num_pages=200))

    async def main():
        task = asyncio.create_task(_collect(eng, [3] * 4, SamplingParams(
            max_tokens=512, block_length=4, stop_at_eos=False), "open"))
        await asyncio.sleep(0.1)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        return await asyncio.wait_for(task, timeout=10)

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"

    async def after():  # a request after shutdown is refused at once, never left waiting
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(_collect(eng, [3], SamplingParams(max_tokens=4), "late"), 5)
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(eng.start_profile("unused"), 5)

    asyncio.run(after())


def test_profile_traces_the_engine_loop(engine, tmp_path):
    """start_profile / stop_profile (vLLM's): a Chrome trace of the forwards between them."""

    async def main():
        with pytest.raises(ValueError, match="no profile is running"):
            await engine.stop_profile()
        await engine.start_profile(tmp_path / "traces")
        with pytest.raises(ValueError, match="already running"):
            await engine.start_profile(tmp_path / "traces")
        await _collect(engine, [5, 6, 7], _params(0), "profiled")
        return await engine.stop_profile()

    path = Path(asyncio.run(main()))
    assert path.parent == tmp_path / "traces" and path.name.startswith("sangam-trace-")
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert any(str(n).startswith("aten::") for n in names)  # the model's ops were recorded


def test_each_thread_that_steps_runs_on_the_models_device(dream_path, monkeypatch):
    """CUDA's current device is per thread and Triton launches on it: building the engine (which
    captures its graphs) and every step make the model's device current on the thread that
    does them (a model on cuda:1 would otherwise be run from cuda:0)."""
    import threading

    import torch

    from sangam.engine import engine as engine_module
    from sangam.engine import loaded_model
    from sangam.engine import worker as worker_module

    current = []  # (thread, device) of each set_device
    monkeypatch.setattr(loaded_model.torch.cuda, "set_device",
                        lambda d: current.append((threading.current_thread().name, d)))
    loaded_model.use_device(torch.device("cpu"))
    loaded_model.use_device(torch.device("cuda"))  # no index: nothing to choose
    loaded_model.use_device(torch.device("cuda:1"))
    assert current == [("MainThread", torch.device("cuda:1"))]
    seen = set()
    for module in (engine_module, worker_module):  # stepping, and building the worker's parts
        monkeypatch.setattr(module, "use_device",
                            lambda d: seen.add((threading.current_thread().name, d)))
    eng = AsyncEngine(EngineConfig(model=dream_path, device="cpu", dtype="float32",
                                   page_size=4, num_pages=64))
    try:
        asyncio.run(_collect(eng, [3] * 4, SamplingParams(max_tokens=4, block_length=4), "d"))
    finally:
        eng.shutdown()
    device = eng.engine.loaded.device
    assert seen == {("MainThread", device), ("sangam-engine", device)}
