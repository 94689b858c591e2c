"""``python -m sangam.engine.multi.zygote``: fork this node's workers from one warmed-up
process (see ``launcher.start_local_workers``). Reads the pickled worker specs on stdin,
prints the workers' pids on one line, then reaps them and exits when they all have; if the
front disappears, it kills them."""

from __future__ import annotations

import os
import pickle
import signal
import sys

from sangam.engine.multi import launcher
from sangam.engine.multi.worker import run_worker  # imported once, before forking


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the front shuts the workers down
    front = os.getppid()
    specs = pickle.load(sys.stdin.buffer)
    pids = launcher.fork_workers(specs, run_worker)
    print(" ".join(map(str, pids)), flush=True)
    os.dup2(2, 1)
    return launcher.supervise(set(pids), front)


if __name__ == "__main__":
    os._exit(main())  # no interpreter teardown: unloading torch takes a second
