"""``--distributed-executor-backend ray``: workers as actors on a Ray cluster of several nodes
(``ray.cluster_utils.Cluster``: a head and two raylets on this machine, on loopback), with the
one-process engine's tokens in float64, and a killed actor taken for a dead worker."""

from __future__ import annotations

import os
import random

import pytest

from sangam import LLM
from sangam.config import EngineConfig
from sangam.engine.multi import make_engine
from sangam.sampling_params import SamplingParams

# Read when Ray is imported: every Ray process of this machine's cluster on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    # The head holds no CPU: every actor lands on one of the two other "nodes", one CPU each.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address)
    head = ray.get_runtime_context().get_node_id()  # this driver's
    try:
        yield c, sorted(n["NodeID"] for n in ray.nodes() if n["NodeID"] != head)
    finally:
        ray.shutdown()
        c.shutdown()


def _requests(n: int, seed: int):
    rng = random.Random(seed)
    return [(f"r{seed}-{i}", [rng.randrange(2, 150) for _ in range(rng.choice([5, 17, 30]))],
             SamplingParams(max_tokens=rng.choice([16, 24]), block_length=rng.choice([4, 8]),
                            temperature=rng.choice([0.0, 2.0]), seed=i,
                            unmasking="threshold", threshold=rng.choice([0.9, 0.5])))
            for i in range(n)]


def _reference(path, reqs) -> dict[str, list[int]]:
    llm = LLM(model=path, device="cpu", dtype="float64")
    outs = llm.generate([{"prompt_token_ids": p} for _, p, _ in reqs], [s for *_, s in reqs])
    return {rid: o.token_ids for (rid, *_), o in zip(reqs, outs)}


def _run(engine, reqs, on_step=None) -> dict[str, list[int]]:
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
        if on_step is not None:
            on_step(steps, done)
    return done


@pytest.mark.parametrize("layout", [
    dict(num_workers=2),
    dict(mode="disaggregated", prefill_workers=1, decode_workers=1),
])
def test_workers_as_ray_actors_on_two_nodes(cluster, llada_path, layout):
    """Each worker is placed on its own Ray node (one CPU each), the tokens are the one-process
    engine's; then one worker's actor is killed mid-run and the other finishes everything."""
    engine = make_engine(EngineConfig(model=llada_path, device="cpu", dtype="float64",
                                      page_size=4, num_pages=64,
                                      distributed_executor_backend="ray", **layout))
    try:
        handles = engine._ray_handles
        assert sorted(h.node_id for h in handles) == cluster[1]  # one per node
        reqs = _requests(10, seed=1)
        assert _run(engine, reqs) == _reference(llada_path, reqs)
        if "num_workers" not in layout:
            assert engine.counters.kv_transfers > 0  # K/V moved between the nodes' actors
        victim = handles[-1]

        def kill(steps, done):
            if len(done) >= 2 and victim.is_alive():
                ray.kill(victim.actor)

        reqs = _requests(12, seed=2)
        assert _run(engine, reqs, kill) == _reference(llada_path, reqs)
        assert engine.dead_workers == [len(handles) - 1]
        assert not engine.worker_states()[-1].alive
    finally:
        engine.shutdown()
    assert all(not h.is_alive() for h in handles)


def test_a_cluster_without_room_is_refused(cluster, llada_path, monkeypatch):
    from sangam.engine.multi import ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(RuntimeError, match="could not place worker 0: 2 bundle"):
        make_engine(EngineConfig(model=llada_path, device="cpu", dtype="float64",
                                 tensor_parallel_size=2, distributed_executor_backend="ray"))


def test_a_tensor_parallel_worker_is_one_placement_group_on_one_node(cluster, llada_path):
    """A worker of two ranks: one placement group of two bundles, packed on the one node that
    has two CPUs (a third, added here), its ranks' collectives over gloo; the tokens are the
    one-process engine's."""
    c, _ = cluster
    node = c.add_node(num_cpus=2)
    try:
        c.wait_for_nodes()
        big = next(n["NodeID"] for n in ray.nodes()
                   if n["Alive"] and n["Resources"].get("CPU") == 2)
        engine = make_engine(EngineConfig(model=llada_path, device="cpu", dtype="float64",
                                          page_size=4, num_pages=64, tensor_parallel_size=2,
                                          distributed_executor_backend="ray"))
        try:
            assert [h.node_id for h in engine._ray_handles] == [big, big]
            reqs = _requests(8, seed=3)
            assert _run(engine, reqs) == _reference(llada_path, reqs)
        finally:
            engine.shutdown()
    finally:
        c.remove_node(node)
