"""Start this node's workers of a multi-node deployment (SGLang-style flags).

Node 0 runs the front (``LLM(..., nnodes=N, dist_init_addr=HOST:PORT)`` or the server with
``--nnodes N --dist-init-addr HOST:PORT``); every other node runs, with the same engine flags::

    python -m sangam.engine.multi.node --model PATH --mode disaggregated \\
        --prefill-workers 2 --decode-workers 2 --nnodes 2 --node-rank 1 \\
        --dist-init-addr HOST:PORT

Its workers connect to the front over ZeroMQ (``HOST:PORT+1``) and join the torch.distributed
group through the TCP store at ``HOST:PORT``, on the interface ``network.node_address`` chose.
The process exits when its workers do: after the front's shutdown, or when the front goes
away or cannot be heard (each worker watches its connection). Ctrl-C or SIGTERM stops them.
Started again (by hand or a supervisor), a colocated node's workers rejoin the serving front.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys

import torch.distributed as dist

from sangam.config import EngineConfig
from sangam.engine.multi import data_plane, launcher, network
from sangam.engine.multi.worker import run_worker  # imported once, before forking


def refuse_to_join_a_running_group(host: str, port: int) -> None:
    """A node coming back to a deployment already serving: its workers could not join the
    process group (its ranks are fixed when it forms), and would wait for the others in vain.
    Workers without one (colocated) rejoin instead."""
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=data_plane.STORE_TIMEOUT_S))
    if store.check([data_plane.SERVING_KEY]):
        raise network.NetworkError(
            "node 0's deployment is already serving: workers that move K/V or split forwards "
            "(disaggregated, hybrid, tensor parallel) cannot join its process group once it "
            "formed; restart the deployment (node 0 first) to bring this node back")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sangam.engine.multi.node",
                                     description=__doc__.split("\n\n")[0])
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(argv))
    if config.node_rank == 0 or config.nnodes < 2:
        parser.error("node 0 runs the front (LLM or the server); this entry point is for "
                     "--node-rank 1 .. nnodes-1")
    roles = launcher.validate(config)
    host, port = network.split_addr(config.dist_init_addr)
    try:
        address = network.node_address(config, launcher.worker_device(config, 0).split(":")[0])
        store = None
        if launcher.needs_data_plane(config):
            store = (host, port)
            refuse_to_join_a_running_group(host, port)
    except network.NetworkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    specs = launcher.make_specs(config, roles, config.node_rank, f"tcp://{host}:{port + 1}",
                                store, address)
    live = set(launcher.fork_workers(specs, run_worker))
    signal.signal(signal.SIGTERM, lambda signum, frame: launcher.kill_all(set(live)))
    signal.signal(signal.SIGINT, lambda signum, frame: launcher.kill_all(set(live)))
    return launcher.supervise(live)


if __name__ == "__main__":
    sys.exit(main())
