"""Prometheus metrics of one server: the scheduler's live state, per-iteration and per-request
histograms, and request outcome counters (``GET /metrics``, text exposition format)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from sangam.engine.async_engine import AsyncEngine
from sangam.engine.interface import EngineClient

logger = logging.getLogger(__name__)

INGEST_PERIOD_S = 1.0
_TOKEN_BUCKETS = tuple(float(2**k) for k in range(15))  # 1 .. 16384 tokens
_ITERATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_PARALLELISM_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineGauges:
    """Read at scrape time, so the values are current: whatever the engine reports (the
    in-process engine its scheduler and pool, a multi-worker front its workers' pools)."""

    def __init__(self, engine: EngineClient):
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in self.values():
            yield GaugeMetricFamily(name, doc, value=float(value))

    def values(self) -> list[tuple[str, str, float]]:
        """(name, help, value) of every gauge, now."""
        return self._engine.gauges()


def _total(counter: Counter) -> float:
    """A counter's value, summed over its label values."""
    return sum(s.value for family in counter.collect() for s in family.samples
               if s.name.endswith("_total"))


def _snapshot(items: deque) -> list:
    # The engine thread appends while we copy; a copy that raced an append is simply retried.
    while True:
        try:
            return list(items)
        except RuntimeError:
            continue


def _since(items: list, last: Any) -> list:
    """The entries after ``last`` (compared by identity); all of them if ``last`` rolled out."""
    for i in range(len(items) - 1, -1, -1):
        if items[i] is last:
            return items[i + 1:]
    return items


class ServerMetrics:
    """Histograms are fed from the engine's bounded stats deques by ``ingest()``; call it often
    enough that the deques (10,000 entries) do not roll over in between."""

    def __init__(self, engine: AsyncEngine):
        self._stats = engine.engine.stats
        self._last_iteration: Any = None
        self._last_finished: Any = None
        self._gauges = _EngineGauges(engine)
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(self._gauges)
        self.requests_finished = Counter(
            "sangam_requests_finished", "Requests that ended, by finish reason (error: it "
            "failed in the engine)",
            ["finish_reason"], registry=r)
        self.requests_aborted = Counter(
            "sangam_requests_aborted", "Requests aborted (client gone, server shutting down)",
            registry=r)
        self.requests_rejected = Counter(
            "sangam_requests_rejected", "Requests refused at submission, by reason",
            ["reason"], registry=r)
        # Tokens in and out, as vLLM's prompt/generation counters (the prefill and decode
        # counters below are the work the forwards did, which re-prefills make larger).
        self.prompt_tokens = Counter("sangam_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter("sangam_generation_tokens",
                                         "Response tokens sent (committed blocks)", registry=r)
        # vLLM's prefix cache counters, in prompt tokens (block-causal models only).
        self.prefix_cache_queries = Counter(
            "sangam_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
            registry=r)
        self.prefix_cache_hits = Counter(
            "sangam_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.tokens_per_forward = Histogram(
            "sangam_request_tokens_per_forward",
            "Tokens a finished request committed per forward it took (diffusion parallelism)",
            buckets=_PARALLELISM_BUCKETS, registry=r)
        self._iter_prefill = Counter("sangam_prefill_tokens", "Prefill (refresh) tokens run",
                                     registry=r)
        self._iter_decode = Counter("sangam_decode_tokens", "Cached-step tokens run", registry=r)
        self._iter_tokens = Histogram("sangam_iteration_tokens", "Tokens in one forward",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self._iter_batch = Histogram("sangam_iteration_batch_size", "Requests in one forward",
                                     buckets=_TOKEN_BUCKETS, registry=r)
        self._iter_seconds = Histogram("sangam_iteration_seconds", "Time of one iteration",
                                       buckets=_ITERATION_BUCKETS, registry=r)
        self._latency = Histogram("sangam_request_latency_seconds",
                                  "End-to-end latency of finished requests",
                                  buckets=_REQUEST_BUCKETS, registry=r)
        self._queueing = Histogram("sangam_request_queueing_seconds",
                                   "Time a finished request waited for its prefills, in total",
                                   buckets=_REQUEST_BUCKETS, registry=r)
        self._first_block = Histogram("sangam_time_to_first_block_seconds",
                                      "Arrival to first committed block (streaming TTFT)",
                                      buckets=_REQUEST_BUCKETS, registry=r)
        self._logged = (time.monotonic(), self._totals())  # when, and the counters, last logged

    def ingest(self) -> None:
        iterations = _since(_snapshot(self._stats.iterations), self._last_iteration)
        for it in iterations:
            self._iter_prefill.inc(it.prefill_tokens)
            self._iter_decode.inc(it.decode_tokens)
            self._iter_tokens.observe(it.prefill_tokens + it.decode_tokens)
            self._iter_batch.observe(it.batch_size)
            self._iter_seconds.observe(it.seconds)
        if iterations:
            self._last_iteration = iterations[-1]
        finished = _since(_snapshot(self._stats.finished), self._last_finished)
        for m in finished:
            if m.e2e_latency is not None:
                self._latency.observe(m.e2e_latency)
            if m.time_to_first_block is not None:
                self._first_block.observe(m.time_to_first_block)
            self._queueing.observe(m.queueing_time)
        if finished:
            self._last_finished = finished[-1]

    def stats_line(self) -> str | None:
        """One log line of what happened since the last call (throughput, queue, KV use), as
        vLLM logs periodically; None when the server was and is idle."""
        self.ingest()
        now, totals = time.monotonic(), self._totals()
        then, before = self._logged
        self._logged = (now, totals)
        rate = {k: (totals[k] - before[k]) / max(now - then, 1e-9) for k in totals}
        gauges = {name: value for name, _, value in self._gauges.values()}
        in_flight = int(gauges["sangam_requests_in_flight"])
        if totals == before and in_flight == 0:
            return None
        queue = (f" ({int(gauges['sangam_requests_waiting'])} waiting, "
                 f"{int(gauges['sangam_requests_seated'])} seated)"
                 if "sangam_requests_waiting" in gauges else "")
        return (f"generation {rate['generation']:.1f} tok/s (forwards: prefill "
                f"{rate['prefill']:.1f} tok/s, decode {rate['decode']:.1f} tok/s), "
                f"{rate['finished']:.2f} req/s finished; {in_flight} in flight{queue}; "
                f"KV pool {100 * gauges['sangam_kv_pool_usage_ratio']:.1f}% used")

    def _totals(self) -> dict[str, float]:
        """The counters the log line reports as rates."""
        return {"prefill": _total(self._iter_prefill), "decode": _total(self._iter_decode),
                "generation": _total(self.generation_tokens),
                "finished": _total(self.requests_finished)}

    def render(self) -> bytes:
        self.ingest()
        return generate_latest(self.registry)


async def ingest_forever(metrics: ServerMetrics, log_interval: float) -> None:
    """Feed ``metrics`` from the engine's stats every INGEST_PERIOD_S (so its deques never
    roll over unread), and log its stats line every ``log_interval`` seconds (0: never)."""
    loop = asyncio.get_running_loop()
    next_log = loop.time() + log_interval
    while True:
        await asyncio.sleep(INGEST_PERIOD_S)
        metrics.ingest()
        now = loop.time()
        if log_interval and now >= next_log:
            next_log = now + log_interval
            line = metrics.stats_line()
            if line:
                logger.info("engine: %s", line)
