"""``sangam``: the command line. ``sangam serve [MODEL] [flags]`` runs the OpenAI-compatible
server; MODEL may be given positionally, as in ``vllm serve``, or as ``--model``.
``sangam chat`` and ``sangam complete`` talk to a running server, as ``vllm chat`` and
``vllm complete``; ``sangam bench ...`` is ``sangam-bench ...``, as ``vllm bench``."""

from __future__ import annotations

import argparse
import sys

from sangam import client
from sangam.serve.server import add_cli_args, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sangam", description="Sangam: serve diffusion LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="OpenAI-compatible HTTP server for diffusion LLMs.")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="checkpoint directory (the same as --model)")
    add_cli_args(serve)
    serve.set_defaults(func=run)
    chat = sub.add_parser("chat", help="chat with a running server from the terminal",
                          description="Chat with a running server; each line is a message.")
    client.add_client_args(chat, "message")
    chat.add_argument("--system-prompt", default=None, help="a system message to begin with")
    chat.set_defaults(func=client.chat)
    complete = sub.add_parser("complete", help="complete prompts with a running server",
                              description="Complete prompts; each line is a prompt.")
    client.add_client_args(complete, "prompt")
    complete.set_defaults(func=client.complete)
    # Listed for --help; main() hands "bench" and everything after it to sangam-bench.
    sub.add_parser("bench", help="benchmarks: the same as sangam-bench", add_help=False)
    args = parser.parse_args(argv)
    if args.command == "serve" and args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            serve.error(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from sangam.bench.cli import main as bench_main  # only here: it imports every bench

        return bench_main(argv[1:])
    args = parse_args(argv)
    try:
        return args.func(args)
    except client.ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
