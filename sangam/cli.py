"""``sangam``: the command line. ``sangam serve [MODEL] [flags]`` runs the OpenAI-compatible
server; MODEL may be given positionally, as in ``vllm serve``, or as ``--model``."""

from __future__ import annotations

import argparse
import sys

from sangam.serve.server import add_cli_args, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sangam", description="Sangam: serve diffusion LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="OpenAI-compatible HTTP server for diffusion LLMs.")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="checkpoint directory (the same as --model)")
    add_cli_args(serve)
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            serve.error(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
