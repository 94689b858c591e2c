"""``sangam-bench``: one subcommand per benchmark module in ``sangam.bench``.

Each module named in SUBCOMMANDS defines ``register(subparsers)``, which adds its parser and
sets ``func`` (args -> exit code) as the parser's default.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("kernels", "graphs", "host", "batching", "workers", "quality", "serve", "sim",
               "capacity", "calibrate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sangam-bench", description="Benchmarks for the Sangam diffusion-LLM engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"sangam.bench.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
