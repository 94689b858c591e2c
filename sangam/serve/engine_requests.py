"""A request's engine requests: opened all or nothing (a refusal is an error status before any
response byte is sent), their outcomes counted in the metrics (and logged, with
--enable-log-requests) however they end, and all of them abortable at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from sangam.engine.async_engine import AsyncEngine, RequestFailed
from sangam.engine.front import QueueFull, RequestRejected
from sangam.sampling_params import RequestOutput, SamplingParams
from sangam.serve.errors import ApiError
from sangam.serve.intake import overloaded
from sangam.serve.metrics import ServerMetrics
from sangam.serve.streams import Stream, close_all

logger = logging.getLogger(__name__)

LOGGED_PARAMS_CHARS = 500  # --enable-log-requests: stop strings can make parameters long


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class EngineRequests:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, log: bool):
        self.engine = engine
        self.metrics = metrics
        self.log = log  # --enable-log-requests
        self.in_flight: set[str] = set()  # engine request ids of open generators

    async def open(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                   suffix: list[int] = ()) -> list[Stream]:
        """Submit ``params.n`` requests per prompt (choice ``i * n + j`` is prompt i's j-th;
        each infills before ``suffix`` if given) and wait for each one's first output, so that
        a refusal becomes an error status before any response byte is sent. All or nothing."""
        if self.engine.dead is not None:
            raise ApiError(503, f"the engine failed: {self.engine.dead!r}", "server_error",
                           code="engine_dead")
        # Choices differ through their noise seeds (reproducibly when the request gives one).
        work = [(ids, params.for_sample(j)) for ids in prompts for j in range(params.n)]
        ids_of = [request_id if len(work) == 1 else f"{request_id}-{i}" for i in range(len(work))]
        started: set[str] = set()
        gens = [self._generate(ids, p, rid, list(suffix), started)
                for rid, (ids, p) in zip(ids_of, work)]
        try:
            # return_exceptions: gather returns (or raises CancelledError) only once every
            # generator is idle again, so each can be closed.
            firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
        except BaseException:  # the client left (or we are shutting down) meanwhile
            await close_all(gens)
            self.metrics.requests_aborted.inc(len(set(ids_of) - started))  # never ran
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if not errors:
            return list(zip(gens, firsts))
        await close_all(gens)
        e = errors[0]
        if isinstance(e, QueueFull):
            raise overloaded(str(e))
        if isinstance(e, ValueError):  # bad ids, too long for the context or the KV pool
            raise ApiError(400, str(e))
        raise e

    async def _generate(self, ids: list[int], params: SamplingParams, request_id: str,
                        suffix: list[int], started: set[str]
                        ) -> AsyncGenerator[RequestOutput, None]:
        """``engine.generate`` plus outcome counters (and log lines, with
        --enable-log-requests); closing this closes (aborts) that. Its id joins ``started``
        once it runs (one closed before that counts as aborted where it was opened)."""
        m = self.metrics
        log = self.log
        done = rejected = False
        started.add(request_id)
        self.in_flight.add(request_id)
        if log:
            start = time.monotonic()
            logger.info("Received request %s: %d prompt tokens, %s", request_id, len(ids),
                        _clip(repr(params), LOGGED_PARAMS_CHARS))
        sent: int | None = None  # response tokens counted; None before the first output
        try:
            async with contextlib.aclosing(
                    self.engine.generate(ids, params, request_id, suffix)) as outs:
                async for out in outs:
                    if sent is None:  # accepted
                        m.prompt_tokens.inc(len(out.prompt_token_ids))
                        if out.num_cached_tokens is not None:
                            m.prefix_cache_queries.inc(len(out.prompt_token_ids))
                            m.prefix_cache_hits.inc(out.num_cached_tokens)
                        sent = 0
                    m.generation_tokens.inc(max(0, len(out.token_ids) - sent))
                    sent = max(sent, len(out.token_ids))
                    if out.finished:
                        done = True
                        if out.finish_reason == "abort":
                            m.requests_aborted.inc()
                        else:
                            m.requests_finished.labels(out.finish_reason).inc()
                            if "tokens_per_forward" in out.metrics:
                                m.tokens_per_forward.observe(out.metrics["tokens_per_forward"])
                        if log:
                            logger.info("Finished request %s: %s, %d tokens, %d forwards, "
                                        "%.3f s", request_id, out.finish_reason,
                                        len(out.token_ids), out.num_forwards,
                                        time.monotonic() - start)
                    yield out
        except ValueError as e:  # refused at submission: counted, then mapped to a status
            rejected = True
            reason = ("queue_full" if isinstance(e, QueueFull) else
                      "kv_pool" if isinstance(e, RequestRejected) else "invalid")
            m.requests_rejected.labels(reason).inc()
            if log:
                logger.info("Refused request %s (%s): %s", request_id, reason, e)
            raise
        except RequestFailed as e:  # it failed in the engine: ended, counted as such
            done = True
            m.requests_finished.labels("error").inc()
            if log:
                logger.info("Failed request %s: %s", request_id, e)
            raise
        finally:
            self.in_flight.discard(request_id)
            if not done and not rejected:
                m.requests_aborted.inc()
                if log:
                    logger.info("Aborted request %s before it finished", request_id)

    async def abort_all(self) -> None:
        """End every request in flight now: each finishes with finish_reason "abort", so its
        client still gets a complete response."""
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)
