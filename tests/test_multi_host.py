"""Multi-host serving between separate network stacks: each "host" is a network namespace this
test creates (``ip netns``), joined to the others through a bridge in a namespace of its own by
veth pairs, with addresses the test assigns there; everything is removed at the end. Every
process's hostname resolves to a loopback address (as on many stock hosts), which is what a
data plane that trusts the hostname gets wrong.

Node 0 (the front and its workers) runs ``tests/multi_host_front.py`` in host 0; node 1 runs
``python -m sangam.engine.multi.node`` in host 1. Tokens are compared with the one-process
engine in float64. Needs root (CI runs as root); skipped with the reason otherwise.

Each case adds a row to the table printed at the end (pytest -s): requests served, tokens
compared, the time to detect a partition and the time for a node to rejoin.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sangam import LLM
from sangam.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
PORT = 29500
SUBNET = "10.231.0"  # host i is SUBNET.(i + 1) on its eth0
HEARTBEAT_TIMEOUT = 3.0
ROWS: list[tuple] = []


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"sgprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


_WHY_NOT = _can_make_namespaces()
pytestmark = [pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT)), pytest.mark.slow]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Hosts:
    """``n`` namespaces on one bridge; host i's interface is ``eth0`` at SUBNET.(i+1)/24."""

    def __init__(self, n: int):
        tag = f"sg{os.getpid() % 100000}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            host_end, switch_end = f"{tag}h{i}", f"{tag}s{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", switch_end, "netns", self.switch)
            _ip("-n", ns, "link", "set", host_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
            _ip("-n", self.switch, "link", "set", switch_end, "up")

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], cwd=REPO, **kw)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[i], *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)

    def cut(self, i: int, up: bool = False) -> None:
        """Host i's link down (a partition: its processes live on), or back up."""
        _ip("-n", self.names[i], "link", "set", "eth0", "up" if up else "down")

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process in host i's namespace (a node lost at once)."""
        pids = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True,
                              text=True).stdout.split()
        for pid in map(int, pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return [int(p) for p in pids]

    def close(self) -> None:
        for i in range(len(self.names)):
            self.kill_host(i)
        for p in self.procs:
            p.kill()
            p.wait()
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def hosts():
    h = Hosts(2)
    try:
        yield h
    finally:
        h.close()


def _requests(n: int, seed: int) -> list[list]:
    rng = random.Random(seed)
    return [[f"q{seed}-{i}", [rng.randrange(2, 150) for _ in range(rng.choice([5, 17, 30]))],
             dict(max_tokens=rng.choice([16, 24]), block_length=rng.choice([4, 8]),
                  cache="dual", temperature=rng.choice([0.0, 2.0]), seed=i,
                  unmasking="threshold", threshold=rng.choice([0.9, 0.5]))]
            for i in range(n)]


_REFERENCE: dict[str, list[int]] = {}


def _reference(path: str, reqs: list[list]) -> dict[str, list[int]]:
    """The one-process engine's tokens (float64)."""
    missing = [r for r in reqs if r[0] not in _REFERENCE]
    if missing:
        llm = LLM(model=path, device="cpu", dtype="float64")
        outs = llm.generate([{"prompt_token_ids": p} for _, p, _ in missing],
                            [SamplingParams(**kw) for *_, kw in missing])
        _REFERENCE.update({r[0]: o.token_ids for r, o in zip(missing, outs)})
    return {r[0]: _REFERENCE[r[0]] for r in reqs}


def _options(path: str, **layout) -> dict:
    return dict(model=path, device="cpu", dtype="float64", page_size=4, num_pages=64,
                nnodes=2, dist_init_addr=f"{Hosts.addr(0)}:{PORT}",
                heartbeat_timeout=HEARTBEAT_TIMEOUT, **layout)


def _flags(options: dict) -> list[str]:
    flags = []
    for k, v in options.items():
        flags += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)]
    return flags


class Front:
    """Node 0's front in host 0, spoken to over its pipes."""

    def __init__(self, hosts: Hosts, options: dict):
        self.p = hosts.popen(0, [sys.executable, str(REPO / "tests" / "multi_host_front.py"),
                                 json.dumps(options)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self, timeout: float = float(os.environ.get("SANGAM_T", 180))) -> dict:
        if not select.select([self.p.stdout], [], [], timeout)[0]:
            raise TimeoutError("the front did not answer")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the front exited ({self.p.wait()})")
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer

    def send(self, **cmd) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def resume(self) -> None:
        self.p.stdin.write("continue\n")
        self.p.stdin.flush()

    def close(self) -> None:
        self.send(exit=True)
        assert self.p.wait(timeout=60) == 0


def _node(hosts: Hosts, options: dict, rank: int = 1, **kw) -> subprocess.Popen:
    return hosts.popen(rank, [sys.executable, "-m", "sangam.engine.multi.node",
                              *_flags(options), "--node-rank", str(rank)], **kw)


def _deploy(hosts: Hosts, options: dict) -> tuple[subprocess.Popen, Front]:
    """Node 1's process, then node 0's front, up."""
    node1 = _node(hosts, options)
    front = Front(hosts, options)
    assert front.read()["ready"]
    return node1, front


def _fault_mid_run(front: Front, reqs: list[list], fault) -> dict:
    """Run ``reqs``; after their third output, ``fault()`` (the front waits), then the rest."""
    front.send(run=reqs, pause_after=3)
    assert front.read()["paused"]
    fault()
    front.resume()
    return front.read()


def _served(case: str, answer: dict, want: dict, detected=None, rejoined=None) -> None:
    got = {rid: tokens for rid, (tokens, _) in answer["outputs"].items()}
    assert got == want
    ROWS.append((case, len(got), "equal", detected, rejoined))


@pytest.mark.parametrize("case,layout", [
    ("colocated, 2 hosts", dict(num_workers=2)),
    ("1P1D across hosts", dict(mode="disaggregated", prefill_workers=1, decode_workers=1)),
    ("2P1D across hosts", dict(mode="disaggregated", prefill_workers=2, decode_workers=1,
                               layerwise_kv_streaming=True)),
])
def test_serving_across_hosts_then_losing_a_node(hosts, llada_path, case, layout):
    """The deployment serves across the hosts with the one-process tokens; then node 1's every
    process is SIGKILLed mid-run and its requests complete on node 0, tokens unchanged."""
    options = _options(llada_path, **layout)
    total = layout.get("num_workers", 0) + layout.get("prefill_workers", 0) \
        + layout.get("decode_workers", 0)
    node1, front = _deploy(hosts, options)
    reqs = _requests(10, seed=1)
    front.send(run=reqs)
    answer = front.read()
    if "num_workers" in layout:  # node 1's worker ran prefills
        assert answer["prefills_by_worker"].get(str(total - 1), 0) > 0
    else:  # K/V crossed the hosts
        assert answer["kv_transfers"] > 0
    _served(case, answer, _reference(llada_path, reqs))
    reqs = _requests(12, seed=2)
    answer = _fault_mid_run(front, reqs, lambda: hosts.kill_host(1))
    assert answer["dead"] == [total - 1]  # node 1 runs the last worker
    _served(f"{case}: node 1 SIGKILLed mid-run", answer, _reference(llada_path, reqs),
            detected=answer["detected_after"])
    assert answer["detected_after"] <= HEARTBEAT_TIMEOUT + 2.0
    front.close()
    node1.wait(timeout=10)


def test_a_tensor_parallel_group_spans_hosts(hosts, llada_path):
    """One worker of two ranks with fewer workers than nodes: rank 0 on host 0, rank 1 on
    host 1, every forward's collectives crossing the link; tokens as one process's."""
    _, front = _deploy(hosts, _options(llada_path, num_workers=1, tensor_parallel_size=2))
    reqs = _requests(10, seed=5)
    front.send(run=reqs)
    _served("tensor-parallel group of 2 spanning the hosts", front.read(),
            _reference(llada_path, reqs))
    front.close()


def test_partition_is_detected_and_a_colocated_node_rejoins(hosts, llada_path):
    """Host 1's link goes down mid-run: the front declares its worker dead within the heartbeat
    bound and finishes its requests on node 0; node 1's worker, hearing no front, stops by
    itself. With the link back, node 1 started again rejoins and serves."""
    options = _options(llada_path, num_workers=2)
    node1, front = _deploy(hosts, options)
    reqs = _requests(12, seed=3)
    answer = _fault_mid_run(front, reqs, lambda: hosts.cut(1))
    assert answer["dead"] == [1]
    detected = answer["detected_after"]
    assert HEARTBEAT_TIMEOUT - 1.0 <= detected <= HEARTBEAT_TIMEOUT + 2.0
    _served("colocated: host 1 cut off mid-run", answer, _reference(llada_path, reqs),
            detected=detected)
    assert node1.wait(timeout=HEARTBEAT_TIMEOUT + 10) == 1  # stopped: it heard no front
    hosts.cut(1, up=True)
    start = time.monotonic()
    _node(hosts, options)
    front.send(await_workers=2)
    front.read()
    rejoined = time.monotonic() - start
    reqs = _requests(12, seed=4)
    front.send(run=reqs)
    answer = front.read()
    assert answer["dead"] == []
    assert answer["prefills_by_worker"].get("1", 0) > 0  # the rejoined worker serves
    _served("colocated: node 1 started again, rejoined", answer, _reference(llada_path, reqs),
            rejoined=rejoined)
    front.close()


def test_a_node_cannot_rejoin_a_running_process_group(hosts, llada_path):
    """Disaggregated workers share a process group formed once: a node started again against
    a serving deployment is refused at once, in one line, instead of waiting in vain."""
    options = _options(llada_path, mode="disaggregated", prefill_workers=1, decode_workers=1)
    _, front = _deploy(hosts, options)
    hosts.kill_host(1)
    again = hosts.run(1, [sys.executable, "-m", "sangam.engine.multi.node", *_flags(options),
                          "--node-rank", "1"], timeout=60)
    assert again.returncode == 2
    assert "already serving" in again.stderr.strip().splitlines()[-1]
    front.close()


@pytest.mark.parametrize("rank,extra,says", [
    # No route at all (nothing leaves these namespaces).
    (1, dict(dist_init_addr="10.232.0.1:29500"), "no route from this host to 10.232.0.1"),
    # On the subnet, but nobody there.
    (1, dict(dist_init_addr=f"{SUBNET}.99:29500"), "cannot reach node 0"),
    (1, dict(network_interface="lo"), "--network-interface lo (127.0.0.1) does not carry"),
    (1, dict(network_interface="eth9"), "'eth9' is not an interface of this host"),
    (1, dict(node_ip="10.231.0.77"), "--node-ip 10.231.0.77 is not an address"),
    (0, dict(dist_init_addr=f"{SUBNET}.2:29500"), "is not an address of this host"),
])
def test_a_wrong_address_is_one_line_within_seconds(hosts, llada_path, rank, extra, says):
    options = {**_options(llada_path, num_workers=2), **extra}
    if rank == 0:
        argv = [sys.executable, "-m", "sangam.serve", *_flags(options)]
    else:
        argv = [sys.executable, "-m", "sangam.engine.multi.node", *_flags(options),
                "--node-rank", "1"]
    start = time.monotonic()
    done = hosts.run(rank, argv, timeout=60)
    elapsed = time.monotonic() - start
    lines = [ln for ln in done.stderr.strip().splitlines() if ln]
    assert done.returncode != 0
    assert says in lines[-1], done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 30  # imports included; the check itself takes at most REACH_TIMEOUT_S
    ROWS.append((f"startup refused in {elapsed:.1f} s: {says}", 0, "-", None, None))


def teardown_module() -> None:
    if ROWS:
        print("\n| case | requests | tokens vs one process | partition detected (s) "
              "| rejoined (s) |")
        for case, n, cmp, det, rej in ROWS:
            fmt = (lambda x: "-" if x is None else f"{x:.1f}")
            print(f"| {case} | {n} | {cmp} | {fmt(det)} | {fmt(rej)} |")
