"""K/V transfers under faults (docs/design.md §4.6): a worker killed or hung with transfers in
flight to or from it (each pair of workers has its own process group, aborted when either end
dies, so the survivors never wait on it), transfer buffers held to a byte budget, and an
out-of-memory error while gathering or receiving, which fails that transfer only. Every request
still finishes with the single-request reference's tokens (float64 on CPU, gloo)."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_multi_worker import PAGE_SIZE, WORKLOADS, _options, _reference, _run, _settle, _tokens

from sangam.config import MAX_TRANSFER_TIMEOUT_S, EngineConfig
from sangam.engine.multi import kv_transfer, make_engine
from sangam.models import read_config

# (layout, the worker to strike, the signal).
STRIKES = {
    "1P2D-receiver-killed": (dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
                             1, signal.SIGKILL),
    "2P1D-sender-killed": (dict(mode="disaggregated", prefill_workers=2, decode_workers=1,
                                layerwise_kv_streaming=True), 0, signal.SIGKILL),
    # Hung, not dead: its sockets stay open until the front declares it dead (watchdog), which
    # fails the survivors' transfers with it at once and aborts its pairs.
    "1P2D-receiver-hung": (dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
                           2, signal.SIGSTOP),
}


def _per_page_bytes(paths) -> int:
    """Bytes one page of a request moves: every layer, K and V (float64)."""
    cfg = read_config(paths["llada"])
    return cfg.num_layers * 2 * PAGE_SIZE * cfg.num_kv_heads * cfg.head_dim * 8


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(STRIKES))
def test_a_worker_lost_mid_transfer_loses_nothing(paths, case, seed):
    """The victim is struck at a random step once it has transfers open (receives waiting for a
    small buffer budget keep several in flight); the survivors go on, nothing is lost."""
    layout, victim, sig = STRIKES[case]
    reqs = WORKLOADS["llada"]
    want = _reference(paths["llada"], "llada")
    engine = make_engine(EngineConfig(**_options(paths["llada"], **layout),
                                      watchdog_timeout=3.0,
                                      transfer_buffer_bytes=40 * _per_page_bytes(paths)))
    rng = random.Random(f"{case}-{seed}")
    strike_at = rng.randint(3, 30)
    steps, struck = [0], []

    def strike(_out=None) -> None:
        steps[0] += 1
        state = engine.worker_states()[victim]
        if not struck and steps[0] >= strike_at and state.open_transfers:
            os.kill(state.pid, sig)
            struck.append(state.open_transfers)

    original_step = engine.step

    def step():
        strike()
        return original_step()

    engine.step = step
    try:
        outs = _run(engine, reqs)
        assert struck, "the victim never had a transfer open"
        assert engine.dead_workers == [victim]
        assert _tokens(outs) == want
        assert engine.placement.counters.restarts > 0
        _settle(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("layout", [
    dict(mode="disaggregated", prefill_workers=2, decode_workers=1),
    dict(mode="disaggregated", prefill_workers=1, decode_workers=2,
         layerwise_kv_streaming=True),
], ids=["2P1D", "1P2D-streaming"])
def test_a_small_transfer_budget_binds_and_loses_nothing(paths, layout):
    """With room for about two transfers, receives wait their turn (in order: sends to one
    receiver match its receives in posting order) and senders hold back forwards; every
    transfer lands whole and every request matches the reference."""
    reqs = WORKLOADS["llada"]
    want = _reference(paths["llada"], "llada")
    engine = make_engine(EngineConfig(**_options(paths["llada"], **layout),
                                      transfer_buffer_bytes=20 * _per_page_bytes(paths)))
    try:
        outs = _run(engine, reqs)
        assert _tokens(outs) == want
        assert engine.counters.kv_budget_waits > 0
        records = [r for r in engine.transfers if not r.drained]
        assert records and all(r.ok and r.bytes_received == r.bytes_sent for r in records)
        assert engine.placement.counters.failed_transfers == 0
        _settle(engine)
    finally:
        engine.shutdown()


# Worker processes whose every n-th K/V gather, and n-th whole-transfer receive buffer, is out
# of memory (installed at startup through ``sitecustomize``, as tests/faults.py does).
_OOM_SITE = """
import os
if os.environ.get("SANGAM_TEST_KV_OOM"):
    import itertools
    import torch
    from sangam.engine.multi import kv_transfer

    every = int(os.environ["SANGAM_TEST_KV_OOM"])
    gathers, receives = itertools.count(1), itertools.count(1)
    page_ops = kv_transfer._page_ops

    def flaky_page_ops(device):
        gather, scatter = page_ops(device)

        def flaky_gather(*args):
            if next(gathers) % every == 0:
                raise torch.OutOfMemoryError("test fault: gather")
            return gather(*args)

        return flaky_gather, scatter

    class FlakyTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, shape, **kw):
            if shape[0] > 1 and next(receives) % every == 0:
                raise torch.OutOfMemoryError("test fault: receive buffer")
            return torch.empty(shape, **kw)

    kv_transfer._page_ops = flaky_page_ops
    kv_transfer.torch = FlakyTorch()
"""


def test_out_of_memory_in_transfers_fails_them_not_the_workers(paths, tmp_path, monkeypatch,
                                                               caplog):
    """Every third gather and receive buffer runs out of memory: those transfers fail (the
    sender's at once, with filler sent for the receiver to discard; the receiver's waits for
    memory or drains through one layer), their blocks are placed again, no worker exits."""
    site = tmp_path / "oom_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_OOM_SITE)
    monkeypatch.setenv("SANGAM_TEST_KV_OOM", "3")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site),
                                                      os.environ.get("PYTHONPATH", "")]))
    reqs = WORKLOADS["llada"][:16]
    want = {rid: _reference(paths["llada"], "llada")[rid] for rid, *_ in reqs}
    engine = make_engine(EngineConfig(**_options(paths["llada"], mode="disaggregated",
                                                 prefill_workers=1, decode_workers=2)))
    caplog.set_level(logging.INFO, logger="sangam.engine.front")
    try:
        outs = _run(engine, reqs)
        assert _tokens(outs) == want
        assert engine.dead_workers == []
        restarts = [r.getMessage() for r in caplog.records if "restarts block" in r.getMessage()]
        assert any("failed at the sender" in m for m in restarts)
        assert any(m.endswith("failed") for m in restarts)  # at a receiver
        _settle(engine)
    finally:
        engine.shutdown()


def test_transfer_flags_are_bounded():
    for bad in (dict(transfer_timeout=0), dict(transfer_timeout=MAX_TRANSFER_TIMEOUT_S + 1),
                dict(transfer_buffer_bytes=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
    EngineConfig(transfer_timeout=MAX_TRANSFER_TIMEOUT_S, transfer_buffer_bytes=1)


# Out of memory: one transport, its process group replaced by works that complete at once.


class _Work:
    def wait(self) -> bool:
        return True


@pytest.fixture
def transport(monkeypatch):
    posted = []
    monkeypatch.setattr(kv_transfer.dist, "isend",
                        lambda t, dst, group: posted.append(("send", t)) or _Work())
    monkeypatch.setattr(kv_transfer.dist, "irecv",
                        lambda t, src, group: posted.append(("recv", t)) or _Work())
    kv = torch.randn(3, 2, 8, 4, 2, 5, dtype=torch.float64)  # [L, K/V, pages, page, Hkv, D]
    t = kv_transfer.KVTransport(kv, budget_bytes=1 << 20, give_up_s=60.0)
    t._groups = {1: "pair-1"}  # what the aborted group stands for
    t._ranks = {1: 1}
    t.posted = posted
    return t


def _poll_until(t: kv_transfer.KVTransport, n: int) -> list[kv_transfer.Done]:
    out, deadline = [], time.monotonic() + 10
    while len(out) < n:
        assert time.monotonic() < deadline
        out += t.poll()
        time.sleep(0.01)
    return out


def test_out_of_memory_gathering_fails_the_transfer_not_the_worker(transport, monkeypatch):
    """The sender still posts every layer (the receiver posts its receives all the same), from
    one layer's filler, and says the K/V did not go out: whole, and streamed layer by layer
    with the first layer's gather out of memory."""
    gather = transport.gather
    calls = []

    def oom_once(*args):
        calls.append(None)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("test")
        return gather(*args)

    monkeypatch.setattr(transport, "gather", oom_once)
    tid = transport.open_send(1)
    transport.send_layers(1, tid, torch.tensor([0, 3]), range(1))
    transport.send_layers(1, tid, torch.tensor([0, 3]), range(1, 3))
    nbytes, ok = transport.close_send(1, tid)
    assert not ok and nbytes == 3 * 2 * 2 * 4 * 2 * 5 * 8
    assert len(transport.posted) == 3
    (done,) = _poll_until(transport, 1)
    assert done.is_send and not done.ok and "out of memory" in done.error
    transport.poll()
    assert transport.held_send == 0


def test_out_of_memory_receiving_drains_through_one_layer(transport, monkeypatch):
    empty = torch.empty

    def tight(shape, **kw):
        if shape[0] > 1:
            raise torch.OutOfMemoryError("test")
        return empty(shape, **kw)

    monkeypatch.setattr(kv_transfer.torch, "empty", tight)
    transport.receive(1, 7, num_pages=2)
    assert [kind for kind, _ in transport.posted] == ["recv"] * 3
    assert len({t.data_ptr() for _, t in transport.posted}) == 1  # one buffer, every layer
    (done,) = _poll_until(transport, 1)
    assert not done.ok and done.buffer is None and "out of memory" in done.error
    transport.poll()
    assert transport.held_recv == 0


def test_receives_wait_for_the_budget_in_order(transport):
    """A receive that does not fit waits until the buffers before it are let go; one larger
    than the whole budget goes alone."""
    transport.budget = 2 * 3 * 2 * 4 * 2 * 5 * 8  # two pages' worth of transfer
    transport.receive(1, 0, num_pages=2)
    transport.receive(1, 1, num_pages=1)
    assert len(transport.posted) == 3  # the first only
    first = _poll_until(transport, 1)
    assert [d.transfer_id for d in first] == [0] and not first[0].waited
    second = _poll_until(transport, 1)  # posted by that poll's successor, once released
    assert [d.transfer_id for d in second] == [1] and second[0].waited and second[0].ok
    transport.receive(1, 2, num_pages=5)  # larger than the whole budget: it goes alone
    assert _poll_until(transport, 1)[0].ok


def test_a_timed_out_pair_is_used_no_more(transport, monkeypatch):
    """A wait that times out (its peer alive) fails its transfer like a dead peer's; the pair
    has lost its posting order, so later transfers on it are refused, and unless the front
    declares the peer dead within ``give_up_s`` the worker gives up (raises)."""
    class TimedOut:
        def wait(self) -> bool:
            raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    monkeypatch.setattr(kv_transfer.dist, "irecv", lambda t, src, group: TimedOut())
    transport.give_up_s = 0.2
    transport.receive(1, 0, num_pages=1)
    (done,) = _poll_until(transport, 1)
    assert not done.ok and "Timed out" in done.error
    transport.receive(1, 1, num_pages=1)  # refused at once, never posted
    (done,) = _poll_until(transport, 1)
    assert not done.ok and "failed" in done.error
    time.sleep(0.3)
    with pytest.raises(RuntimeError, match="lives on"):
        transport.poll()
    aborted = []
    monkeypatch.setattr(kv_transfer.dist.distributed_c10d, "_abort_process_group",
                        aborted.append)
    transport.peer_dead(1)  # the front's verdict: the pair is aborted, nothing to give up
    assert aborted == ["pair-1"] and transport.poll() == []


def test_gpu_fault_check_skips_without_two_gpus():
    script = Path(__file__).resolve().parents[1] / "microbench" / "nccl_transfer_fault.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "skip" in out.stdout.lower()


@pytest.fixture(scope="module")
def paths(llada_path):
    return {"llada": llada_path}
