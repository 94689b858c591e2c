"""The demo server as the load scripts run it: a subprocess on a free port, up when /health
says so, stopped on the way out."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


@contextlib.contextmanager
def demo_server(flags: list[str], log: Path, timeout: float = 300.0
                ) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m sangam.serve`` with ``flags``, its output in ``log``; yields the process and
    its URL once healthy (raises if it exits or takes longer than ``timeout``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "sangam.serve", "--port", str(port),
                                   "--log-level", "warning", *flags],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the demo server did not start (see {log})")
            time.sleep(0.3)
        yield server, url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
