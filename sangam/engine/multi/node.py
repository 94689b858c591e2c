"""Start this node's workers of a multi-node deployment (SGLang-style flags).

Node 0 runs the front (``LLM(..., nnodes=N, dist_init_addr=HOST:PORT)`` or the server with
``--nnodes N --dist-init-addr HOST:PORT``); every other node runs, with the same engine flags::

    python -m sangam.engine.multi.node --model PATH --mode disaggregated \\
        --prefill-workers 2 --decode-workers 2 --nnodes 2 --node-rank 1 \\
        --dist-init-addr HOST:PORT

Its workers connect to the front over ZeroMQ (``HOST:PORT+1``) and join the torch.distributed
group through the TCP store at ``HOST:PORT``. The process exits when its workers do: after the
front's shutdown, or when the front goes away (each worker watches its connection). Ctrl-C or
SIGTERM stops them.
"""

from __future__ import annotations

import argparse
import signal
import sys

from sangam.config import EngineConfig
from sangam.engine.multi import launcher
from sangam.engine.multi.worker import run_worker  # imported once, before forking


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sangam.engine.multi.node",
                                     description=__doc__.split("\n\n")[0])
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(argv))
    if config.node_rank == 0 or config.nnodes < 2:
        parser.error("node 0 runs the front (LLM or the server); this entry point is for "
                     "--node-rank 1 .. nnodes-1")
    roles = launcher.validate(config)
    host, port = launcher.split_addr(config.dist_init_addr)
    store = (host, port) if launcher.needs_data_plane(config) else None
    specs = launcher.make_specs(config, roles, config.node_rank, f"tcp://{host}:{port + 1}",
                                store)
    live = set(launcher.fork_workers(specs, run_worker))
    signal.signal(signal.SIGTERM, lambda signum, frame: launcher.kill_all(set(live)))
    signal.signal(signal.SIGINT, lambda signum, frame: launcher.kill_all(set(live)))
    return launcher.supervise(live)


if __name__ == "__main__":
    sys.exit(main())
