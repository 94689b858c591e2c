"""``python -m sangam.serve`` / ``sangam serve``: parse flags, load the engine, run uvicorn.

SIGINT/SIGTERM stop the server gracefully: it stops accepting connections, lets in-flight
requests finish for ``--shutdown-grace`` seconds, aborts the rest, shuts the engine down (the
app's lifespan) and exits 0. If the engine loop fails, the server stops the same way and exits
1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from fastapi import FastAPI

from sangam.config import EngineConfig
from sangam.engine.async_engine import AsyncEngine
from sangam.serve.app import build_app
from sangam.serve.config import ServerConfig

logger = logging.getLogger("sangam.serve")

SHUTDOWN_BACKSTOP_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn, with Sangam's shutdown: in-flight requests get ``grace`` seconds, then are
    aborted (their clients get a complete response ending in finish_reason "abort")."""

    def __init__(self, config: uvicorn.Config, abort_all: Callable[[], Awaitable[None]],
                 grace: float):
        super().__init__(config)
        self._abort_all = abort_all
        self._grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        aborts: list[asyncio.Task] = []  # holds the task: the loop keeps only a weak reference
        deadline = loop.call_later(self._grace,
                                   lambda: aborts.append(loop.create_task(self._abort_all())))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the caught signal once shut down, so the process dies of it
        # (exit status 143 for SIGTERM). A requested, completed shutdown exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be caught in the main thread (e.g. a server in a test)
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


# vLLM command lines for LLaDA and Dream carry it (their HF modeling code is remote code).
TRUST_REMOTE_CODE_HELP = ("Accepted so that vLLM command lines run; changes nothing: Sangam "
                          "implements LLaDA and Dream itself and never runs a checkpoint's code")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field and every ServerConfig field, one flag each (grouped so that
    --help reads as two lists: what runs the model, what serves it)."""
    EngineConfig.add_cli_args(parser.add_argument_group(
        "engine", "the model, its KV pool, the scheduler and the workers (LLM(...) keywords)"))
    server = parser.add_argument_group("server", "HTTP, the API and its request defaults")
    ServerConfig.add_cli_args(server)
    server.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)


def uvicorn_server(app: FastAPI, config: ServerConfig) -> uvicorn.Server:
    # uvicorn's own timeout is the backstop for connections that outlive the abort (a client
    # that stopped reading): it cancels them.
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, lifespan="on",
        timeout_graceful_shutdown=config.shutdown_grace + SHUTDOWN_BACKSTOP_S,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs)
    return _Server(uv_config, app.state.engine_requests.abort_all, config.shutdown_grace)


def run(args: argparse.Namespace) -> int:
    try:
        engine_config = EngineConfig.from_cli_args(args)
        server_config = ServerConfig.from_cli_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server_config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = AsyncEngine(engine_config)
    except (OSError, ValueError) as e:
        logger.error("cannot start the engine: %s", e)
        return 1
    logger.info("serving %s", engine.describe())
    app = build_app(engine, server_config)
    server = uvicorn_server(app, server_config)
    # A failed engine loop is final: stop serving (health has failed meanwhile) and exit
    # non-zero, so that a supervisor restarts the server, as vLLM's does.
    engine.on_death(lambda e: setattr(server, "should_exit", True))
    server.run()
    if engine.dead is not None:
        logger.error("exiting: the engine loop failed: %r", engine.dead)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sangam.serve",
        description="OpenAI-compatible HTTP server for diffusion LLMs (LLaDA, Dream).")
    add_cli_args(parser)
    return run(parser.parse_args(argv))
