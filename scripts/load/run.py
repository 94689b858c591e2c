"""Overload the demo server and check that it held.

The server holds ``--max-queue-len`` requests at once: that is its capacity. This starts the
demo server (``python -m sangam.serve``, default flags but the queue length), points twice as
many closed-loop locust clients at it for ``--duration`` seconds, then checks: the server is
alive and healthy, every request got a 200 or a fast 503 (no failure), /health answered
throughout (probed from this process, which the load leaves idle, every 50 ms), and once the
load stops nothing is left in flight and every KV page is free.
Prints the figures as a Markdown table; exits 1 if a check fails.

    .venv/bin/pip install locust && .venv/bin/python scripts/load/run.py
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from demo_server import demo_server

HERE = Path(__file__).resolve().parent


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=60, help="seconds of load")
    parser.add_argument("--max-queue-len", type=int, default=64,
                        help="the server's capacity (requests it holds); clients: twice that")
    parser.add_argument("--out", default=None, help="directory for locust's CSV files")
    args = parser.parse_args()
    users = 2 * args.max_queue_len
    out = Path(args.out or tempfile.mkdtemp(prefix="sangam-load-"))
    out.mkdir(parents=True, exist_ok=True)
    with demo_server(["--max-queue-len", str(args.max_queue_len)], out / "server.log") as (
            server, url):
        before = httpx.get(f"{url}/metrics").text
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
        stop = threading.Event()
        health: list[float] = []
        prober = threading.Thread(target=_probe, args=(url, stop, health))
        prober.start()
        locust = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless",
             "-u", str(users), "-r", str(users), "-t", f"{args.duration}s", "-H", url,
             "--csv", str(out / "run"), "--only-summary", "--stop-timeout", "30"],
            env=env, capture_output=True, text=True)
        stop.set()
        prober.join()
        settled_s = None
        start = time.monotonic()
        while time.monotonic() - start < 60:
            after = httpx.get(f"{url}/metrics").text
            if (_metric(after, "sangam_requests_in_flight") == 0
                    and _metric(after, "sangam_kv_pool_pages_used") == 0):
                settled_s = time.monotonic() - start
                break
            time.sleep(0.2)
        healthy = httpx.get(f"{url}/health").status_code == 200 and server.poll() is None
    rows = {r["Name"]: r for r in csv.DictReader(open(out / "run_stats.csv"))}

    def row(name: str) -> dict:
        return rows.get(name, {"Request Count": "0", "Failure Count": "0", "50%": "-",
                               "99%": "-", "Max Response Time": "-"})

    failures = int(rows["Aggregated"]["Failure Count"])
    finished = (_metric(after, 'sangam_requests_finished_total{finish_reason="stop"}')
                + _metric(after, 'sangam_requests_finished_total{finish_reason="length"}')
                - _metric(before, 'sangam_requests_finished_total{finish_reason="stop"}')
                - _metric(before, 'sangam_requests_finished_total{finish_reason="length"}'))
    print(f"{users} clients, server capacity {args.max_queue_len}, {args.duration} s "
          f"(locust CSV in {out})\n")
    print("| outcome | requests | failures | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for name in ("chat 200", "chat 503"):
        r = row(name)
        print(f"| {name} | {r['Request Count']} | {r['Failure Count']} | {r['50%']} | "
              f"{r['99%']} | {float(r['Max Response Time']):.0f} |")
    ms = sorted(1000 * t for t in health if t >= 0)
    down = sum(t < 0 for t in health)
    print(f"| /health | {len(health)} | {down} | {statistics.median(ms):.0f} | "
          f"{ms[int(0.99 * (len(ms) - 1))]:.0f} | {ms[-1]:.0f} |")
    settled = "NOT within 60 s" if settled_s is None else f"after {settled_s:.1f} s"
    print(f"\n/health p90 {ms[int(0.9 * (len(ms) - 1))]:.0f} ms; failures: {failures}; "
          f"requests the engine finished: {finished:.0f}; "
          f"server alive and healthy after: {healthy}; in flight and KV pages back to 0 "
          f"{settled}")
    if locust.returncode not in (0, 1):
        print(locust.stdout[-3000:], locust.stderr[-3000:])
    return 0 if failures == 0 and down == 0 and healthy and settled_s is not None else 1


def _probe(url: str, stop: threading.Event, seconds: list[float]) -> None:
    """GET /health every 50 ms until ``stop``; each latency (-1: not a 200)."""
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            start = time.monotonic()
            ok = client.get("/health").status_code == 200
            seconds.append(time.monotonic() - start if ok else -1.0)
            time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
