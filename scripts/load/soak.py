"""Soak the demo server and watch its resident memory.

Starts the demo server (``python -m sangam.serve``), then for ``--minutes`` keeps ``--clients``
closed-loop clients sending a mix: plain completions and chats, streams dropped half-way,
structured output with a new JSON schema every time (each compiles: the grammar caches fill
and turn over), tool calls, and bad bodies (not JSON, wrong types, unknown models, two
constraints, schemas that do not compile, oversized texts). Every ``--sample`` seconds it
records the server's RSS (``/proc/PID/status``, the server process alone: the demo serves in
process). After ``--warmup`` minutes RSS must stay flat: the growth over the rest, fitted as a
line, at most ``--max-growth-mb`` over the whole run. Writes ``rss.csv`` and, with
``--figure``, a plot; prints a summary; exits 1 when the server died, a request got a 5xx, or
RSS grew.

    .venv/bin/python scripts/load/soak.py --minutes 20 --figure docs/figures/soak_rss.png
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from demo_server import demo_server


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _schema(rng: random.Random) -> dict:
    """A JSON schema nobody sent before (a new compile each time)."""
    props = {f"k{rng.randrange(10**9)}": rng.choice([{"type": "integer"}, {"type": "boolean"},
                                                      {"enum": ["a", "b"]}])
             for _ in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _requests(rng: random.Random) -> tuple[str, object, bool]:
    """(path, body or raw bytes, stream and drop) of one request of the mix."""
    user = [{"role": "user", "content": "".join(rng.choice("abcdefgh ") for _ in range(
        rng.randint(1, 200)))}]
    kind = rng.randrange(10)
    if kind == 0:
        return "/v1/completions", {"prompt": "copy: abc", "max_tokens": rng.choice([8, 32])}, False
    if kind == 1:
        return "/v1/chat/completions", {"messages": user, "max_tokens": 16}, False
    if kind == 2:
        return "/v1/chat/completions", {"messages": user, "max_tokens": 64, "stream": True}, True
    if kind == 3:
        return "/v1/chat/completions", {"messages": user, "max_tokens": 48, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": _schema(rng)}}}, False
    if kind == 4:
        return "/v1/completions", {"prompt": "x", "max_tokens": 24,
                                   "guided_regex": f"[a-c]{{{rng.randint(1, 9)}}}z"}, False
    if kind == 5:
        return "/v1/chat/completions", b"{not json", False
    if kind == 6:
        return "/v1/chat/completions", {"messages": user, "max_tokens": "ten"}, False
    if kind == 7:
        return "/v1/chat/completions", {"messages": user, "model": f"m{rng.randrange(10**9)}"}, \
            False
    if kind == 8:
        return "/v1/chat/completions", {"messages": user, "guided_regex": "a",
                                        "guided_choice": ["a"]}, False
    return "/v1/chat/completions", {"messages": user, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": f"#/nope{rng.randrange(10**9)}"}},
            "required": ["a"]}}}}, False


class Load:
    def __init__(self, url: str, clients: int, seed: int):
        self.url = url
        self.stop = threading.Event()
        self.status: dict[int, int] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True)
                        for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _count(self, code: int, text: str = "") -> None:
        with self.lock:
            self.status[code] = self.status.get(code, 0) + 1
            if code >= 500 and len(self.errors) < 10:
                self.errors.append(f"{code}: {text[:300]}")

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self.stop.is_set():
                path, body, drop = _requests(rng)
                try:
                    if isinstance(body, bytes):
                        r = http.post(path, content=body,
                                      headers={"Content-Type": "application/json"})
                        self._count(r.status_code, r.text)
                    elif drop:  # read a few chunks, then hang up
                        with http.stream("POST", path, json=body) as r:
                            for i, _ in enumerate(r.iter_lines()):
                                if i == 2:
                                    break
                            self._count(r.status_code)
                    else:
                        r = http.post(path, json=body)
                        self._count(r.status_code, r.text)
                except httpx.HTTPError as e:
                    self._count(599, repr(e))


def _slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (r - mr) for t, r in samples) / var if var else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the soak")
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="minutes before RSS must be flat (caches and pools fill)")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--max-growth-mb", type=float, default=16.0,
                        help="largest RSS growth after warm-up (fitted) that passes")
    parser.add_argument("--seed", type=int, default=0, help="the load's randomness")
    parser.add_argument("--out", default=None, help="directory for rss.csv and server.log")
    parser.add_argument("--figure", default=None, help="write the RSS plot here (PNG)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="sangam-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    with demo_server([], out / "server.log") as (server, url):
        load = Load(url, args.clients, args.seed)
        start = time.monotonic()
        samples: list[tuple[float, float]] = []
        load.start()
        with open(out / "rss.csv", "w") as f:
            f.write("seconds,rss_mb\n")
            while (now := time.monotonic() - start) < 60 * args.minutes:
                if server.poll() is not None:
                    print("the server died", file=sys.stderr)
                    return 1
                samples.append((now, rss_mb(server.pid)))
                f.write(f"{now:.1f},{samples[-1][1]:.1f}\n")
                f.flush()
                time.sleep(args.sample)
        load.join()
        after = [(t, r) for t, r in samples if t >= 60 * args.warmup]
        slope = _slope_mb_per_min(after)
        span = (after[-1][0] - after[0][0]) / 60 if len(after) > 1 else 0.0
        growth = slope * span
        summary = {
            "minutes": args.minutes, "clients": args.clients,
            "requests": sum(load.status.values()), "by_status": load.status,
            "rss_mb_start": samples[0][1], "rss_mb_after_warmup": after[0][1] if after else None,
            "rss_mb_end": samples[-1][1], "rss_mb_max": max(r for _, r in samples),
            "slope_mb_per_min_after_warmup": round(slope, 3),
            "fitted_growth_mb_after_warmup": round(growth, 1),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        if args.figure:
            _plot(samples, args, Path(args.figure))
        failed = [c for c in load.status if c >= 500]
        if failed:
            print(f"5xx answers: {load.errors}", file=sys.stderr)
        if growth > args.max_growth_mb:
            print(f"RSS grew {growth:.1f} MB after warm-up (> {args.max_growth_mb})",
                  file=sys.stderr)
        return 1 if failed or growth > args.max_growth_mb else 0


def _plot(samples: list[tuple[float, float]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([t / 60 for t, _ in samples], [r for _, r in samples], lw=1.2)
    ax.axvline(args.warmup, color="grey", ls="--", lw=0.8, label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MB)")
    ax.set_title(f"sangam-demo server, {args.clients} clients, mixed load")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
