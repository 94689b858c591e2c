"""``--distributed-executor-backend ray``: worker processes as Ray actors, placed on the nodes of
an existing Ray cluster (``RAY_ADDRESS``, or the cluster this process already joined; else
``ray.init`` starts a local one), instead of forked here and by a node process on each host.

Each worker is one placement group of ``--tensor-parallel-size`` bundles (one GPU each on GPU,
one CPU each on CPU), packed on one node (``STRICT_PACK``: a group's collectives stay on its
fast links), one actor per rank. An actor runs the same worker process entry point as a forked
one: it connects to the front's ZeroMQ socket, joins the torch.distributed store (the data
plane is torch.distributed, never Ray), and binds its data plane to the interface that routes
to the front (``network.local_address``). The front watches each actor through Ray: an actor
that dies (killed, or its node lost) is a dead worker, found within a poll.

RL frameworks (verl, OpenRLHF) run their rollout engines inside Ray this way; the front may
itself run inside an actor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from sangam.config import EngineConfig
from sangam.engine.multi.launcher import WorkerSpec
from sangam.engine.multi.network import local_address

PLACEMENT_TIMEOUT_S = 120.0  # the cluster has the resources, or says why not meanwhile
CHECK_S = 0.1  # how often the front asks Ray whether an actor lives (step() runs far oftener)


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend ray needs Ray: pip install ray"
                         ) from None
    return ray


def connect() -> str:
    """Join the Ray cluster (as above) and return the IP address of this process's Ray node,
    which the workers reach the front at."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    here = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == here)


def device_type(config: EngineConfig) -> str:
    """The workers' device type: as --device says, else cuda when the cluster has GPUs."""
    if config.device:
        return config.device.split(":")[0]
    return "cuda" if _ray().cluster_resources().get("GPU", 0) > 0 else "cpu"


class RayWorkerHandle:
    """A rank's actor as the front's process handle (``launcher.ProcessHandle``'s methods)."""

    def __init__(self, actor, done, group, node_id: str):
        self.actor = actor
        self.done = done  # the actor's run() call: ready when the process has ended
        self.group = group  # its worker's placement group
        self.node_id = node_id  # the Ray node it was placed on
        self._alive = (True, 0.0)  # (answer, when): Ray is asked at most every CHECK_S

    def is_alive(self) -> bool:
        alive, at = self._alive
        if alive and time.monotonic() - at > CHECK_S:
            ready, _ = _ray().wait([self.done], timeout=0)
            self._alive = (not ready, time.monotonic())
        return self._alive[0]

    def join(self, timeout: float) -> None:
        if self._alive[0]:
            _ray().wait([self.done], timeout=max(0.0, timeout))
            self._alive = (True, 0.0)  # ask again

    def kill(self) -> None:
        if self.is_alive():
            _ray().kill(self.actor, no_restart=True)
            self._alive = (False, time.monotonic())

    def close(self) -> None:
        pass


class _WorkerActor:
    """One rank of one worker, in the process Ray gave it."""

    def run(self, spec: WorkerSpec, front_ip: str) -> None:
        from sangam.engine.multi.worker import run_worker

        address = local_address(spec.config, spec.device.split(":")[0], front_ip,
                                "the front's Ray node")
        # The raylet is its parent: the worker exits if it goes (as a forked one with its node
        # process); Ray kills it when the front's driver goes.
        run_worker(dataclasses.replace(spec, address=address), os.getppid())


def make_specs(config: EngineConfig, roles: list[str], device: str, front_addr: str,
               store_addr: tuple[str, int] | None) -> list[WorkerSpec]:
    """Every worker's ranks, in order; each actor has one device (Ray sets which GPU it
    sees) or one CPU."""
    device = "cuda:0" if device == "cuda" else device
    return [WorkerSpec(w, tuple(roles), config, device, front_addr, store_addr, 1, t)
            for w in range(len(roles)) for t in range(config.tensor_parallel_size)]


def start_ray_workers(specs: list[WorkerSpec], front_ip: str) -> list[RayWorkerHandle]:
    """One placement group per worker and one actor per rank (``specs``); returns a handle
    per spec. Raises when the cluster cannot place a group within ``PLACEMENT_TIMEOUT_S``."""
    ray = _ray()
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = specs[0].device.startswith("cuda")
    bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
    tp = specs[0].config.tensor_parallel_size
    actor_cls = ray.remote(_WorkerActor)
    groups = {}
    for w in sorted({s.worker for s in specs}):
        pg = placement_group([dict(bundle)] * tp, strategy="STRICT_PACK")
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            for g in [*groups.values(), pg]:
                ray.util.remove_placement_group(g)
            raise RuntimeError(
                f"the Ray cluster could not place worker {w}: {tp} bundle(s) of {bundle} on one "
                f"node within {PLACEMENT_TIMEOUT_S:g}s (it has {ray.available_resources()})")
        groups[w] = pg
    handles = []
    for spec in specs:
        pg = groups[spec.worker]
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.tp_rank)
        actor = actor_cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                  scheduling_strategy=strategy, max_restarts=0).remote()
        node = placement_group_table(pg)["bundles_to_node_id"][spec.tp_rank]
        handles.append(RayWorkerHandle(actor, actor.run.remote(spec, front_ip), pg, node))
    return handles


def release(handles: list[RayWorkerHandle]) -> None:
    """Give the placement groups back (once their actors ended)."""
    ray = _ray()
    for group in {id(h.group): h.group for h in handles}.values():
        with contextlib.suppress(Exception):  # already gone with the cluster
            ray.util.remove_placement_group(group)
