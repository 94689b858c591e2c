"""``sangam-bench``: one subcommand per benchmark module in ``sangam.bench``.

Each module in SUBCOMMANDS defines ``register(subparsers)``, which adds its parser and sets
``func`` (args -> exit code) as the parser's default. ``capacity`` searches the load of the
benchmarks in CAPACITY_TARGETS; this module is the one that knows them all.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

from sangam.bench import (
    batching,
    calibrate,
    capacity,
    graphs,
    host,
    kernels,
    memory,
    quality,
    rollout,
    serve,
    workers,
)
from sangam.bench.sim import cli as sim_cli

SUBCOMMANDS = (kernels, graphs, host, batching, workers, quality, serve, sim_cli, calibrate,
               memory, rollout)
CAPACITY_TARGETS = {
    "sim": capacity.CapacityTarget(
        "probe the simulator", partial(sim_cli.add_sim_args, for_capacity=True),
        sim_cli.config_labels, sim_cli.capacity_probe),
    "serve": capacity.CapacityTarget(
        "probe the engine or a server", partial(serve.add_serve_args, for_capacity=True),
        serve.config_labels, serve.capacity_probe),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sangam-bench", description="Benchmarks for the Sangam diffusion-LLM engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    capacity.register(sub, CAPACITY_TARGETS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
