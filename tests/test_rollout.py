"""RL rollouts (docs/design.md §3.1): weight updates in place (from tensors, from disk, from a
trainer's broadcast) give the tokens of a fresh engine started from the new weights, in
process, over two workers and over a tensor-parallel pair; a bad update is refused and changes
nothing; requests in flight finish on the old weights (AsyncEngine), or are aborted by
pause_generation; the prefix cache is flushed; memory is released and resumed with the same
tokens after; trajectories' log-probabilities equal a trainer's recomputation; and n samples
of a prompt differ under temperature, agree when greedy."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from rollout_cases import PARAMS, PROMPTS, perturbed, state
from safetensors.torch import save as safetensors_save
from test_llada2 import LLADA2
from test_sdar import SDAR

from sangam import LLM, SamplingParams, WeightUpdateGroup
from sangam.demo.tokenizer import VOCAB_SIZE, write_tokenizer
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.front import ControlRefused
from sangam.testing import make_tiny_checkpoint

OPTIONS = dict(device="cpu", dtype="float64", page_size=4, num_pages=256)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """The LLaDA checkpoint a rollout starts from, the trainer's update of it, and the tokens
    fresh engines give on each."""
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("base"), arch="llada", seed=3,
                                vocab_size=VOCAB_SIZE)
    write_tokenizer(base)  # for the chat route
    new = perturbed(base, tmp_path_factory.mktemp("new"), seed=1)
    return {"base": base, "new": new}


@pytest.fixture(scope="module")
def fresh(ckpts) -> dict[str, list[list[int]]]:
    return {k: _tokens(LLM(path, **OPTIONS)) for k, path in ckpts.items()}


def test_updates_in_process_give_a_fresh_engines_tokens(ckpts, fresh):
    assert fresh["base"] != fresh["new"]  # the update changes what is generated
    llm = LLM(ckpts["base"], **OPTIONS)
    assert _tokens(llm) == fresh["base"] and llm.weights_version == 0
    assert llm.update_weights_from_tensor(state(ckpts["new"])) == 1
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    assert [o.token_ids for o in outs] == fresh["new"]
    assert {o.weight_version for o in outs} == {1}
    assert llm.update_weights_from_disk(ckpts["base"]) == 2
    assert _tokens(llm) == fresh["base"]
    # A partial update: only the tensors named change.
    new = state(ckpts["new"])
    llm.update_weights_from_tensor([(n, t) for n, t in new.items() if "blocks.0." in n])
    llm.update_weights_from_tensor({n: t for n, t in new.items() if "blocks.0." not in n})
    assert _tokens(llm) == fresh["new"] and llm.weights_version == 4


def _bad_updates(state: dict[str, torch.Tensor]) -> dict[str, tuple[list, str]]:
    name, t = next(iter(state.items()))
    nan = t.clone()
    nan.view(-1)[7] = float("nan")
    return {
        "unknown name": ([("model.nope.weight", t)], "has no tensor"),
        "wrong shape": ([(name, t[:-1])], "has shape"),
        "integer dtype": ([(name, t.to(torch.int32))], "dtype"),
        "duplicate": ([(name, t), (name, t)], "given twice"),
        "non-finite": ([(name, nan)], "non-finite"),
        "empty": ([], "at least one"),
    }


def test_bad_updates_change_nothing(ckpts, fresh, tmp_path):
    llm = LLM(ckpts["base"], **OPTIONS)
    for why, (named, fragment) in _bad_updates(state(ckpts["new"])).items():
        with pytest.raises(ValueError, match=fragment):
            llm.update_weights_from_tensor(named)
        assert llm.weights_version == 0, why
    with pytest.raises(ValueError, match="lacks"):  # another architecture's checkpoint
        llm.update_weights_from_disk(make_tiny_checkpoint(tmp_path / "dream", arch="dream"))
    with pytest.raises(ValueError, match="no .*safetensors"):
        llm.update_weights_from_disk(str(tmp_path))
    # Tensors of the same shapes under another config (here RoPE's base): refused by name.
    other = tmp_path / "other"
    other.mkdir()
    for f in Path(ckpts["new"]).iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="differs from the served model's in rope_theta"):
        llm.update_weights_from_disk(str(other))
    with pytest.raises(ValueError, match="differ in length"):
        llm.update_weights_from_distributed(["a"], [], [[1]])
    with pytest.raises(ValueError, match="dtype"):
        name, t = next(iter(state(ckpts["new"]).items()))
        llm.update_weights_from_distributed([name], ["int8"], [list(t.shape)])
    assert _tokens(llm) == fresh["base"] and llm.weights_version == 0


def test_an_update_waits_for_no_request(ckpts):
    """A stepped engine runs an update only between requests (AsyncEngine waits for them)."""
    llm = LLM(ckpts["base"], **OPTIONS)
    llm.engine.add_request("r", PROMPTS[0], PARAMS[0])
    with pytest.raises(RuntimeError, match="in flight"):
        llm.update_weights_from_disk(ckpts["new"])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.update_weights_from_disk(ckpts["new"]) == 1


def _trainer(port: int, world: int, named: list[tuple[str, torch.Tensor]],
             errors: list) -> threading.Thread:
    """The trainer's side of a distributed update: rank 0, broadcasting ``named`` in order."""
    def run() -> None:
        try:
            group = WeightUpdateGroup("127.0.0.1", port, 0, world, "rl")
            for _, t in named:
                group.broadcast(t.clone())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _distributed_update(llm: LLM, named: list[tuple[str, torch.Tensor]]) -> int:
    port, errors = _free_port(), []
    world = 1 + llm.engine.num_engine_ranks
    thread = _trainer(port, world, named, errors)
    llm.init_weights_update_group("127.0.0.1", port, 1, world, "rl", "gloo")
    try:
        return llm.update_weights_from_distributed(
            [n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named],
            [list(t.shape) for _, t in named])
    finally:
        thread.join(60)
        assert not errors, errors


@pytest.mark.parametrize("layout", [dict(), dict(num_workers=2),
                                    dict(tensor_parallel_size=2)],
                         ids=["in-process", "two-workers", "tp2"])
def test_updates_across_workers_and_ranks(ckpts, fresh, layout):
    """Every worker and every rank takes its slice: from tensors, from disk and from a
    trainer's broadcast (gloo); a refused update (non-finite values, found on the ranks for a
    broadcast) leaves every one as it was."""
    llm = LLM(ckpts["base"], **OPTIONS, **layout)
    try:
        new = state(ckpts["new"])
        assert llm.update_weights_from_tensor(new) == 1
        assert _tokens(llm) == fresh["new"]
        assert llm.update_weights_from_disk(ckpts["base"]) == 2
        assert _tokens(llm) == fresh["base"]
        named = list(new.items())
        assert _distributed_update(llm, named) == 3
        assert _tokens(llm) == fresh["new"]
        bad = [(n, t * float("inf")) if i == 2 else (n, t) for i, (n, t) in enumerate(
            state(ckpts["base"]).items())]
        with pytest.raises(ControlRefused, match="non-finite"):
            _distributed_update(llm, bad)
        assert llm.weights_version == 3 and _tokens(llm) == fresh["new"]
    finally:
        llm.shutdown()


def test_prefix_cache_is_flushed_by_an_update(tmp_path):
    """A block-causal model caches prompt K/V: after an update, a prompt seen before must not
    reuse K/V computed with the old weights."""
    base = make_tiny_checkpoint(tmp_path / "base", seed=5, **SDAR)
    new = perturbed(base, tmp_path / "new", seed=2)
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=8, block_length=4)
    expect = LLM(new, **OPTIONS).generate(prompt_token_ids=[prompt], sampling_params=params)
    llm = LLM(base, **OPTIONS)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0] \
        .num_cached_tokens > 0  # the prompt's blocks are cached
    llm.update_weights_from_disk(new)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == expect[0].token_ids
    assert out.token_ids != first.token_ids
    llm.flush_cache()  # also on its own
    assert llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0] \
        .num_cached_tokens == 0


def _storages(llm: LLM) -> list[int]:
    engine = llm.engine
    return [t.untyped_storage().nbytes() for t in
            [*engine.pool.kv.buffers, *engine.loaded.model.state_dict().values()]]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_release_and_resume_memory(ckpts, fresh, dtype):
    """float32 serves the checkpoint's own tensors (read from the file, storage that cannot
    be resized): they are given storage of their own first."""
    llm = LLM(ckpts["base"], **{**OPTIONS, "dtype": dtype})
    fresh = fresh if dtype == "float64" else {k: _tokens(LLM(p, **{**OPTIONS, "dtype": dtype}))
                                              for k, p in ckpts.items()}
    assert _tokens(llm) == fresh["base"]
    held = _storages(llm)
    llm.release_memory_occupation()
    assert set(_storages(llm)) == {0}  # the pool's and every weight's storage freed
    with pytest.raises(ValueError, match="released"):
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=PARAMS[0])
    with pytest.raises(ValueError, match="released"):
        llm.update_weights_from_disk(ckpts["new"])
    llm.resume_memory_occupation()
    assert _storages(llm) == held
    assert _tokens(llm) == fresh["base"]
    llm.release_memory_occupation(["kv_cache"])  # one tag: the weights stay
    assert _storages(llm)[0] == 0 and _storages(llm)[1:] == held[1:]
    llm.update_weights_from_disk(ckpts["new"])  # the weights may change meanwhile
    llm.resume_memory_occupation(["kv_cache"])
    assert _tokens(llm) == fresh["new"]
    with pytest.raises(ValueError, match="memory tags"):
        llm.release_memory_occupation(["gpu"])


def test_release_and_resume_across_workers(ckpts, fresh):
    llm = LLM(ckpts["base"], **OPTIONS, tensor_parallel_size=2)
    try:
        llm.release_memory_occupation()
        llm.resume_memory_occupation()
        assert _tokens(llm) == fresh["base"]
    finally:
        llm.shutdown()


def test_requests_in_flight_finish_on_the_old_weights(ckpts, fresh):
    """AsyncEngine: an update waits for the requests in flight (their tokens are the old
    weights', their version 0); a request submitted while it waits starts after it."""
    engine = AsyncEngine(model=ckpts["base"], **OPTIONS)
    new = state(ckpts["new"])

    async def one(i: int):
        async for out in engine.generate(PROMPTS[i], PARAMS[i]):
            last = out
        return last

    async def main():
        first = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
        await asyncio.sleep(0)  # submitted before the update
        while not engine.engine.requests:
            await asyncio.sleep(0.001)
        update = asyncio.create_task(engine.update_weights_from_tensor(new))
        await asyncio.sleep(0.01)
        later = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
        return await asyncio.gather(*first), await update, await asyncio.gather(*later)

    try:
        before, version, after = asyncio.run(main())
    finally:
        engine.shutdown()
    assert version == 1
    assert [o.token_ids for o in before] == fresh["base"]
    assert {o.weight_version for o in before} == {0}
    assert [o.token_ids for o in after] == fresh["new"]
    assert {o.weight_version for o in after} == {1}


def test_updates_under_load_never_mix_versions(ckpts, fresh):
    """Many clients while updates alternate the weights: every response is exactly the fresh
    engine's on the weights of the version it reports, and clients that leave while held
    behind an update (or mid-stream) take nothing down."""
    engine = AsyncEngine(model=ckpts["base"], **OPTIONS)
    weights = [state(ckpts["new"]), state(ckpts["base"])]

    async def one(i: int, leave: bool):
        async for out in engine.generate(PROMPTS[i % 4], PARAMS[i % 4]):
            if leave:
                return None
            last = out
        return i % 4, last

    async def main():
        tasks, versions = [], []
        for wave in range(6):
            tasks += [asyncio.create_task(one(i, leave=i % 7 == 3)) for i in range(16)]
            await asyncio.sleep(0.005 * wave)
            versions.append(asyncio.create_task(
                engine.update_weights_from_tensor(weights[wave % 2])))
        late = [asyncio.create_task(one(i, leave=False)) for i in range(8)]
        waiting = [asyncio.create_task(one(i, leave=False)) for i in range(8)]
        await asyncio.sleep(0)
        for t in waiting[::2]:
            t.cancel()  # left while held behind the updates
        results = await asyncio.gather(*tasks, *late, *waiting, return_exceptions=True)
        return results, await asyncio.gather(*versions)

    try:
        results, versions = asyncio.run(main())
    finally:
        engine.shutdown()
    assert versions == [1, 2, 3, 4, 5, 6]
    served = [r for r in results if isinstance(r, tuple)]
    assert len(served) >= 80 and all(isinstance(r, (tuple, type(None), asyncio.CancelledError))
                                     for r in results)
    for i, out in served:  # odd versions: the new weights; even: the base's
        assert out.token_ids == fresh["new" if out.weight_version % 2 else "base"][i]
    assert {out.weight_version for _, out in served} >= {0, 6}


def test_pause_aborts_in_flight_and_holds_new_requests(ckpts, fresh):
    engine = AsyncEngine(model=ckpts["base"], **OPTIONS)
    slow = SamplingParams(max_tokens=64, block_length=1, unmasking="topk", cache="none",
                          stop_at_eos=False)

    async def one(prompt, params):
        async for out in engine.generate(prompt, params):
            last = out
        return last

    async def main():
        running = asyncio.create_task(one(PROMPTS[0], slow))
        while not engine.engine.requests:
            await asyncio.sleep(0.001)
        aborted = await engine.pause_generation()
        held = asyncio.create_task(one(PROMPTS[1], PARAMS[1]))
        await asyncio.sleep(0.2)
        assert not held.done() and not engine.engine.requests  # waiting for the pause to end
        version = await engine.update_weights_from_disk(ckpts["new"])  # runs at once
        await engine.continue_generation()
        return aborted, await running, version, await held

    try:
        aborted, stopped, version, held = asyncio.run(main())
    finally:
        engine.shutdown()
    assert aborted == 1 and stopped.finish_reason == "abort" and version == 1
    assert held.token_ids == fresh["new"][1] and held.weight_version == 1


# Trajectories: each model family, with the cache its forwards see exactly (a bidirectional
# model's approximate cache would make the trainer's dense recomputation differ by design).
TRAJECTORY_MODELS = {
    "llada": (dict(arch="llada"), dict(cache="none")),
    "dream": (dict(arch="dream", num_heads=8, num_kv_heads=2), dict(cache="none")),
    "sdar": (SDAR, dict()),
    "llada2.1-editing": (LLADA2, dict(edit_threshold=0.3, max_post_steps=2)),
}


def _recompute(model, prompt: list[int], trajectory, mask: int, shift: int,
               block: int | None) -> list[float]:
    """The trainer's side: for every value in ``trajectory``, rebuild the input of the forward
    that wrote it (each response position as the forwards before had left it, else masked)
    and take the token's log-probability from a dense forward, as a policy-gradient step
    would."""
    p, n = len(prompt), len(trajectory)
    out = []
    for step in sorted({s for values in trajectory for s, _, _ in values}):
        canvas = [mask] * n
        for i, values in enumerate(trajectory):
            before = [t for s, t, _ in values if s < step]
            if before:
                canvas[i] = before[-1]
        ids = torch.tensor([prompt + canvas])
        logits = model.forward_dense(ids, block_size=block)[0].double()
        logits[:, mask] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        for i, values in enumerate(trajectory):
            for s, t, _ in values:
                if s == step:
                    out.append((i, s, float(logp[p + i - shift, t])))
    return [lp for _, _, lp in sorted(out)]


@pytest.mark.parametrize("name", list(TRAJECTORY_MODELS))
def test_trajectory_logprobs_equal_the_trainers_recomputation(tmp_path, name):
    arch, options = TRAJECTORY_MODELS[name]
    path = make_tiny_checkpoint(tmp_path, seed=7, **{"logit_scale": 3.0, **arch})
    llm = LLM(path, **OPTIONS)
    model, cfg = llm.engine.loaded.model, llm.engine.loaded.config
    block = cfg.causal_block_size if cfg.block_causal else None
    params = [SamplingParams(max_tokens=16, block_length=block or 4, seed=s, temperature=t,
                             return_trajectory=True, **options)
              for s, t in ((1, 0.0), (2, 0.9), (3, 1.5))]
    outs = llm.generate(prompt_token_ids=[[5, 9, 13, 2, 7]] * 3, sampling_params=params)
    # A stop id in its first block ends a fourth early: its trajectory still spans the canvas
    # the forwards saw (the stopped block's tail decoded, the blocks after it never).
    stop = dataclasses.replace(params[1], stop_token_ids=[outs[1].token_ids[1]])
    outs += llm.generate(prompt_token_ids=[[5, 9, 13, 2, 7]], sampling_params=stop)
    assert len(outs[-1].token_ids) <= 1 and outs[-1].finish_reason == "stop"
    assert not outs[-1].trajectory[-1]  # its last block was never decoded
    edited = 0
    for out in outs:
        traj = out.trajectory
        assert len(traj) >= 16  # the canvas (a block-causal one: to the block grid)
        assert [v[-1][1] for v in traj[:len(out.token_ids)]] == out.token_ids
        assert out.step_map == [v[-1][0] for v in traj[:len(out.token_ids)]]
        edited += sum(len(v) > 1 for v in traj)
        order = sorted((i, s) for i, v in enumerate(traj) for s, _, _ in v)
        got = [next(lp for s2, _, lp in traj[i] if s2 == s) for i, s in order]
        want = _recompute(model, out.prompt_token_ids, traj, cfg.mask_token_id,
                          int(cfg.shift_logits), block)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    if name == "llada2.1-editing":
        assert edited  # some position took several values
    # logprobs keep their meaning: each output token's at the step that committed it.
    plain = llm.generate(prompt_token_ids=[[5, 9, 13, 2, 7]], sampling_params=dataclasses.replace(
        params[1], return_trajectory=False, logprobs=0,
        edit_threshold=None if name.startswith("llada2.1") else params[1].edit_threshold))[0]
    if not name.startswith("llada2.1"):
        assert plain.token_ids == outs[1].token_ids
        np.testing.assert_allclose(plain.logprobs, outs[1].step_logprobs, atol=1e-12)


def test_samples_of_a_prompt_differ_under_temperature_and_agree_greedy(ckpts):
    llm = LLM(ckpts["base"], **OPTIONS)
    prompt = [[5, 9, 13, 2, 7]]
    hot = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=12, block_length=4, temperature=1.0, n=6))[0]
    samples = [o.token_ids for o in hot.outputs]
    assert len(samples) == 6 and len({tuple(s) for s in samples}) > 1
    seeded = SamplingParams(max_tokens=12, block_length=4, temperature=1.0, n=6, seed=40)
    a = [o.token_ids for o in llm.generate(prompt_token_ids=prompt, sampling_params=seeded)[0]
         .outputs]
    b = [o.token_ids for o in llm.generate(prompt_token_ids=prompt, sampling_params=seeded)[0]
         .outputs]
    assert a == b and len({tuple(s) for s in a}) > 1  # seeds seed + j: differ, reproduce
    cold = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=12, block_length=4, n=6))[0]
    assert len({tuple(o.token_ids) for o in cold.outputs}) == 1


def test_http_routes(ckpts, fresh, tmp_path):
    """The routes (behind the API key, with --enable-rollout-routes): an update from a
    safetensors body and from disk, the version in every choice, bad bodies refused with 400
    and nothing changed, trajectories in chat and completions, memory, pause."""
    import httpx
    from test_serve_openai import serve_subprocess

    args = [ckpts["base"], "--device", "cpu", "--dtype", "float64", "--api-key", "k",
            "--enable-rollout-routes", "--max-request-body-bytes", str(64 * 2**20),
            "--page-size", "4", "--num-pages", "256", "--log-level", "warning"]
    auth = {"Authorization": "Bearer k"}
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "block_length": 4, "seed": 1}
    with serve_subprocess(args, tmp_path / "server.log", entry=("-m", "sangam.cli", "serve")) \
            as (_, url), httpx.Client(base_url=url, headers=auth, timeout=120) as http:
        def completion(**extra) -> dict:
            r = http.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        assert httpx.post(f"{url}/flush_cache").status_code == 401
        assert completion()["token_ids"] == fresh["base"][0]
        assert http.get("/get_weight_version").json() == {"weight_version": 0}
        blob = base64.b64encode(safetensors_save(state(ckpts["new"]))).decode()
        r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": blob})
        assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
        choice = completion(return_trajectory=True)
        assert choice["token_ids"] == fresh["new"][0] and choice["weight_version"] == 1
        assert [v[-1][1] for v in choice["trajectory"]][:len(choice["token_ids"])] \
            == choice["token_ids"]
        for route, bad in [
                ("/update_weights_from_tensor", {"serialized_named_tensors": "bm90IGl0"}),
                ("/update_weights_from_tensor", {"serialized_named_tensors": "%%%"}),
                ("/update_weights_from_tensor", {"serialized_named_tensors": base64.b64encode(
                    safetensors_save({"x.weight": torch.zeros(2)})).decode()}),
                ("/update_weights_from_disk", {"model_path": str(tmp_path)}),
                ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                                      "shapes": [[1]]}),
                ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["int8"],
                                                      "shapes": [[1]]}),
                ("/init_weights_update_group", {"master_address": "127.0.0.1",
                                                "master_port": 70000, "rank_offset": 1,
                                                "world_size": 2}),
                ("/release_memory_occupation", {"tags": ["everything"]})]:
            r = http.post(route, json=bad)
            assert r.status_code == 400 and "error" in r.json(), (route, r.text)
        assert http.get("/get_weight_version").json() == {"weight_version": 1}
        r = http.post("/update_weights_from_disk", json={"model_path": ckpts["base"]})
        assert r.json()["weight_version"] == 2
        assert completion()["token_ids"] == fresh["base"][0]
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "return_trajectory": True})
        assert chat.status_code == 200 and chat.json()["choices"][0]["trajectory"], chat.text
        responses = http.post("/v1/responses", json={"input": "hi", "return_trajectory": True})
        assert responses.status_code == 400 and "return_trajectory" in responses.text
        assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).json()[
            "success"]
        assert http.post("/v1/completions", json=body).status_code == 400  # no pool meanwhile
        assert http.post("/resume_memory_occupation").json()["success"]
        assert http.post("/flush_cache").json()["success"]
        assert http.post("/pause_generation").json()["num_aborted"] == 0
        assert http.post("/continue_generation").json()["success"]
        assert completion()["token_ids"] == fresh["base"][0]


@pytest.mark.parametrize("layout", [dict(num_workers=2),
                                    dict(mode="disaggregated", prefill_workers=1,
                                         decode_workers=1)],
                         ids=["two-workers", "1P1D"])
def test_trajectories_across_processes(ckpts, layout):
    """A block's trajectory entries travel with its progress between processes (a 1P1D
    request's first step runs on the prefill worker): the same trajectories as in process."""
    params = [dataclasses.replace(p, return_trajectory=True) for p in PARAMS]
    want = LLM(ckpts["base"], **OPTIONS).generate(prompt_token_ids=PROMPTS,
                                                  sampling_params=params)
    llm = LLM(ckpts["base"], **OPTIONS, **layout)
    try:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    finally:
        llm.shutdown()
    for g, w in zip(got, want):  # the same steps and tokens; log-probs to float64 rounding
        # (a worker process sums in its own thread count's order)
        assert [[v[:2] for v in pos] for pos in g.trajectory] == \
            [[v[:2] for v in pos] for pos in w.trajectory]
        np.testing.assert_allclose([v[2] for pos in g.trajectory for v in pos],
                                   [v[2] for pos in w.trajectory for v in pos], atol=1e-12)
        assert g.step_map



def test_uniform_state_trajectories():
    """DiffusionGemma (uniform-state): each canvas position is committed once, at its canvas's
    last forward, with its log-probability under that step's tempered distribution; the same
    over two workers."""
    params = SamplingParams(return_trajectory=True, seed=3, max_tokens=40)
    llm = LLM(model="sangam-demo-gemma", device="cpu", dtype="float64")
    msgs = [[{"role": "user", "content": "Reverse: sangam"}], [{"role": "user",
                                                               "content": "Sort: diffusion"}]]
    outs = llm.chat(msgs, params)
    for out in outs:
        traj = out.trajectory
        assert [len(v) for v in traj[:len(out.token_ids)]] == [1] * len(out.token_ids)
        assert [v[0][1] for v in traj[:len(out.token_ids)]] == out.token_ids
        assert all(v[0][2] <= 0 for v in traj if v)
        canvas = llm.engine.loaded.config.gemma.canvas_length
        ends = {v[0][0] for v in traj[:canvas] if v}  # one canvas: one forward commits it
        assert len(ends) == 1 and max(out.step_map) < out.num_forwards
    two = LLM(model="sangam-demo-gemma", device="cpu", dtype="float64", num_workers=2)
    try:
        again = two.chat(msgs, params)
    finally:
        two.shutdown()
    for a, b in zip(again, outs):
        assert [[v[:2] for v in p] for p in a.trajectory] == \
            [[v[:2] for v in p] for p in b.trajectory]
