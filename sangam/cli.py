"""``sangam``: the command line. ``sangam serve [flags]`` runs the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys

from sangam.serve.server import add_cli_args, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sangam", description="Sangam: serve diffusion LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="OpenAI-compatible HTTP server for diffusion LLMs.")
    add_cli_args(serve)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
