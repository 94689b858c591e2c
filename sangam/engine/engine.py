"""``Engine``: the in-process engine, a front (``front.py``: requests, placement, outputs) over
one worker in this process (``worker.py``: the engine core's iteration over the KV pool, the
batch builder and the model runner).

``Engine.step()`` is one iteration: place what waits to be placed, run the worker's iteration,
take in its reports, and return an output for every request that completed a block. The front
hands the worker its own ``DecodeState`` objects, so nothing is copied between the two.
"""

from __future__ import annotations

from sangam.config import EngineConfig
from sangam.engine import messages as msg
from sangam.engine.front import ControlRefused, Front
from sangam.engine.interface import Gauge
from sangam.engine.loaded_model import LoadedModel, use_device
from sangam.engine.model_runner import ModelRunner
from sangam.engine.worker import Worker, build_worker_parts, worker_control
from sangam.sampling_params import RequestOutput
from sangam.sched.batch_builder import BatchBuilder


class Engine(Front):
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        if config.tensor_parallel_size > 1:  # its ranks are processes: make_engine starts them
            raise ValueError("a tensor-parallel worker runs in worker processes: build the "
                             "engine with sangam.engine.multi.make_engine (LLM and the "
                             "server do)")
        loaded = loaded or LoadedModel.load(config)
        pool, builder, runner = build_worker_parts(config, loaded)
        super().__init__(config, loaded, [pool.num_pages])
        self.pool = pool
        self.worker = Worker(0, builder, runner,
                             control=worker_control(config, loaded, pool, runner, builder))

    @property
    def builder(self) -> BatchBuilder:
        return self.worker.builder

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    def _send(self, worker: int, message: object) -> None:
        self.worker.handle(message)  # in process: the message object itself, nothing copied

    def _run_control(self, m: msg.Control) -> None:
        error = self.worker.run_control(m)
        if error is not None:
            raise ControlRefused(error)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that completed a block."""
        use_device(self.loaded.device)  # whichever thread steps (an AsyncEngine's, a user's)
        self._place()
        w = self.worker
        if w.iterate():
            events, w.events = w.events, []
            iterations, w.iterations = w.iterations, []
            self._on_report(0, events, iterations)
        return self._take_outputs()

    def watch(self) -> None:
        """Nothing to watch: the one worker is this process."""

    def shutdown(self) -> None:
        """Nothing to stop in process (the multi-worker engine stops its workers here)."""

    # What a caller may ask of any engine.
    profilable = True  # its forwards run in this process: torch.profiler sees them

    def _describe_workers(self) -> list[str]:
        pool = self.pool
        spans = ", ".join(str(g.span) for g in self.runner.graphs)
        rings = pool.rings
        return [f"KV pool {pool.num_pages} pages x {pool.page_size} = "
                f"{pool.num_pages * pool.page_size} tokens"
                + (f"; sliding-window rings of {rings.shape.pages} pages, "
                   f"{rings.allocator.num_pages} pages" if rings is not None else ""),
                f"{self.loaded.model.attention_backend.name} attention, CUDA graphs "
                f"{f'for block length {spans}' if spans else 'off'}"]

    def gauges(self) -> list[Gauge]:
        """(name, help, value) of every live gauge: the scheduler's queue and the KV pool."""
        b, alloc = self.builder, self.pool.allocator
        return [
            ("sangam_requests_in_flight", "Requests accepted and not finished",
             self.num_requests),
            ("sangam_requests_waiting", "Requests waiting for a prefill (queue depth)",
             b.num_waiting),
            ("sangam_requests_seated", "Seated decodes (requests in their cached steps)",
             b.num_seated),
            ("sangam_deficit_tokens", "Carried prefill token budget (deficit)", b.deficit),
            ("sangam_kv_pool_usage_ratio", "Fraction of KV pages in use", self.pool.usage),
            ("sangam_kv_pool_pages_used", "KV pages in use", alloc.num_used),
            ("sangam_kv_pool_pages", "KV pages in the pool", alloc.num_pages),
        ]
