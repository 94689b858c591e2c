"""NCCL transfer fault check (docs/design.md §4.6): a decode worker killed with K/V transfers
pending under NCCL must not take its sender down (each sender-receiver pair has its own
communicator, aborted when the front declares the receiver dead; NCCL errors fail the transfer
without tearing the process down), and every request still finishes.

Needs two GPUs (1P1D; 1P2D with three or more) and pyzmq; otherwise prints why it skips and
exits 0. A tiny random LLaDA checkpoint, so it takes well under a minute. Prints one JSON line;
exits 1 if the check fails.

    PYTHONPATH=. python microbench/nccl_transfer_fault.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time

DEADLINE_S = 50.0  # a hang (the bug this checks for) shows as running out of it (the step: 60 s)
NUM_REQUESTS = 48


def _skip(why: str) -> int:
    print(json.dumps({"check": "nccl_transfer_fault", "skipped": why}))
    return 0


def main() -> int:
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return _skip(f"skip: needs 2 GPUs, found {gpus}")
    try:
        import zmq  # noqa: F401  (the front speaks to its workers over ZeroMQ)
    except ImportError:
        return _skip("skip: needs pyzmq (multi-worker serving)")

    from sangam.config import EngineConfig
    from sangam.engine.multi import make_engine
    from sangam.sampling_params import SamplingParams
    from sangam.testing import make_tiny_checkpoint

    decode = 2 if gpus >= 3 else 1
    layout = f"1P{decode}D"
    path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="nccl_fault_"), arch="llada", seed=1)
    engine = make_engine(EngineConfig(
        model=path, mode="disaggregated", prefill_workers=1, decode_workers=decode,
        devices=",".join(f"cuda:{i}" for i in range(1 + decode)), dtype="float32",
        page_size=4, num_pages=512, watchdog_timeout=10.0, transfer_timeout=30.0))
    victim = 1  # the first decode worker: it receives
    rng = random.Random(0)
    params = SamplingParams(max_tokens=32, block_length=8, temperature=0.0)
    for i in range(NUM_REQUESTS):
        engine.add_request(f"r{i}", [rng.randrange(2, 150) for _ in range(40)], params)
    finished, killed_at, pending_at_kill = {}, None, 0
    start = time.monotonic()
    try:
        while engine.has_unfinished_requests() and time.monotonic() - start < DEADLINE_S:
            state = engine.worker_states()[victim]
            if killed_at is None and state.open_transfers:
                os.kill(state.pid, signal.SIGKILL)
                killed_at, pending_at_kill = time.monotonic(), state.open_transfers
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.finish_reason
        states = engine.worker_states()
        result = {
            "check": "nccl_transfer_fault", "layout": layout,
            "requests": NUM_REQUESTS, "finished": len(finished),
            "errors": sum(r == "error" for r in finished.values()),
            "killed_mid_transfer": pending_at_kill, "dead_workers": engine.dead_workers,
            "survivors_alive": [s.alive for i, s in enumerate(states) if i != victim],
            "restarts": engine.placement.counters.restarts,
            "failed_transfers": engine.placement.counters.failed_transfers,
            "kill_to_done_s": (round(time.monotonic() - killed_at, 2)
                               if killed_at is not None else None),
        }
        result["ok"] = (killed_at is not None and len(finished) == NUM_REQUESTS
                        and result["errors"] == 0 and engine.dead_workers == [victim]
                        and all(result["survivors_alive"]))
    finally:
        engine.shutdown()
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
