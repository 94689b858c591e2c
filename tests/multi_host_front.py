"""Node 0 of tests/test_multi_host.py: the front, run inside its network namespace (``ip netns
exec``), driven by JSON lines on stdin and answering with JSON lines on stdout (pipes cross
namespaces; the test's own process cannot reach the namespace's addresses).

    python tests/multi_host_front.py '{"model": ..., "nnodes": 2, ...}'

Commands: ``{"run": [[id, prompt ids, SamplingParams kwargs], ...], "pause_after": k}`` adds
the requests and steps until all finish; after ``k`` outputs it says ``{"paused": true}`` and
waits for a ``continue`` line (the test kills or cuts a node meanwhile), then times how long
the front takes to declare a worker dead. ``{"await_workers": n, "timeout": s}`` watches until
``n`` workers are alive (a node rejoining). ``{"exit": true}`` shuts down.
"""

from __future__ import annotations

import json
import sys
import time

from sangam.config import EngineConfig
from sangam.engine.multi import make_engine
from sangam.sampling_params import SamplingParams


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def run(engine, cmd: dict) -> None:
    for rid, prompt, params in cmd["run"]:
        engine.add_request(rid, prompt, SamplingParams(**params))
    pause_after = cmd.get("pause_after")
    seen, done = 0, {}
    dead_before = len(engine.dead_workers)
    resumed = detected = None
    deadline = time.monotonic() + cmd.get("timeout", 300)
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            say(error=f"stuck: {sorted(engine.requests)}")
            return
        for out in engine.step():
            seen += 1
            if out.finished:
                done[out.request_id] = [out.token_ids, out.finish_reason]
        if pause_after is not None and resumed is None and seen >= pause_after:
            say(paused=True, finished=len(done))
            assert sys.stdin.readline().strip() == "continue"
            resumed = time.monotonic()
        if resumed is not None and detected is None and len(engine.dead_workers) > dead_before:
            detected = time.monotonic() - resumed
    if resumed is not None and detected is None:  # declared dead after the last output
        while len(engine.dead_workers) == dead_before and time.monotonic() < deadline:
            engine.watch()
            time.sleep(0.01)
        detected = time.monotonic() - resumed
    say(outputs=done, dead=engine.dead_workers, detected_after=detected,
        prefills_by_worker=engine.placement.counters.prefills_by_worker,
        kv_transfers=engine.counters.kv_transfers)


def await_workers(engine, cmd: dict) -> None:
    start = time.monotonic()
    while sum(w.alive for w in engine.worker_states()) < cmd["await_workers"]:
        if time.monotonic() - start > cmd.get("timeout", 120):
            say(error="the node did not rejoin")
            return
        engine.watch()
        time.sleep(0.01)
    say(alive_after=time.monotonic() - start, dead=engine.dead_workers)


def main() -> int:
    engine = make_engine(EngineConfig(**json.loads(sys.argv[1])))
    say(ready=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        if "run" in cmd:
            run(engine, cmd)
        elif "await_workers" in cmd:
            await_workers(engine, cmd)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
