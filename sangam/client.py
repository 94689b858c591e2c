"""``sangam chat`` and ``sangam complete``: talk to a running Sangam (or any OpenAI-compatible)
server from a terminal, as vLLM's ``vllm chat`` / ``vllm complete``. Replies stream in as the
server commits them, block by block."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from typing import IO

import httpx

DEFAULT_URL = "http://localhost:8000/v1"


class ServerError(Exception):
    """The server could not be reached, or refused the request (its message)."""


class ApiClient:
    def __init__(self, url: str, api_key: str | None = None, model: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=None)
        self.url = url
        self.model = model or self._first_model()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ServerError(f"cannot reach the server at {self.url} ({e}); is `sangam serve` "
                              "running there?") from None

    def _first_model(self) -> str:
        r = self._request("GET", "/models")
        _raise_for_error(r)
        models = r.json().get("data") or []
        if not models:
            raise ServerError(f"the server at {self.url} lists no model")
        return models[0]["id"]

    def stream(self, path: str, body: dict) -> Iterator[str]:
        """POST ``body`` (streamed) to ``path``; yield the text of each chunk as it comes."""
        body = {**body, "model": self.model, "stream": True}
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    _raise_for_error(response)
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        raise ServerError(event["error"].get("message", "the stream failed"))
                    for choice in event.get("choices", []):
                        text = (choice["delta"].get("content") if "delta" in choice
                                else choice["text"])
                        if text:
                            yield text
        except httpx.TransportError as e:
            raise ServerError(f"lost the server at {self.url} ({e})") from None


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise ServerError(f"HTTP {response.status_code}: {message}")


def _echo(pieces: Iterator[str], out: IO[str]) -> str:
    """Write the pieces as they come, then a newline (also when the stream fails midway, so
    that the error starts a line of its own); return them joined."""
    reply = []
    try:
        for piece in pieces:
            out.write(piece)
            out.flush()
            reply.append(piece)
    except ServerError:
        if reply:
            out.write("\n")
        raise
    out.write("\n")
    return "".join(reply)


def _options(args: argparse.Namespace) -> dict:
    return {} if args.max_tokens is None else {"max_tokens": args.max_tokens}


def chat(args: argparse.Namespace, stdin: IO[str] = sys.stdin, out: IO[str] = sys.stdout) -> int:
    """A conversation: each line read is a user message; the history goes with every turn."""
    client = ApiClient(args.url, args.api_key, args.model_name)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        try:
            reply = _echo(client.stream("/chat/completions",
                                        {"messages": messages, **_options(args)}), out)
        except ServerError:  # a refused turn is forgotten; the conversation goes on
            messages.pop()
            raise
        messages.append({"role": "assistant", "content": reply})

    return _session(client, turn, args.quick, "message", stdin, out)


def complete(args: argparse.Namespace, stdin: IO[str] = sys.stdin,
             out: IO[str] = sys.stdout) -> int:
    """Each line read is a prompt; its completion follows it."""
    client = ApiClient(args.url, args.api_key, args.model_name)

    def one(prompt: str) -> None:
        _echo(client.stream("/completions", {"prompt": prompt, **_options(args)}), out)

    return _session(client, one, args.quick, "prompt", stdin, out)


def _session(client: ApiClient, send: Callable[[str], None], quick: str | None, what: str,
             stdin: IO[str], out: IO[str]) -> int:
    """``send`` the ``quick`` text alone (its error ends the command), or each line read (an
    error is shown, and the next line read)."""
    if quick is not None:
        send(quick)
        return 0
    out.write(f"Using model {client.model}. Type a {what}; Ctrl-D ends.\n")
    for line in _lines(stdin, out):
        try:
            send(line)
        except ServerError as e:
            out.write(f"error: {e}\n")
    return 0


def _lines(stdin: IO[str], out: IO[str]) -> Iterator[str]:
    """Non-empty input lines, each after a "> " prompt."""
    while True:
        out.write("> ")
        out.flush()
        line = stdin.readline()
        if not line:
            out.write("\n")
            return
        if line.strip():
            yield line.rstrip("\n")


def add_client_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"the server's OpenAI API base (default {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None,
                        help="the model to ask (default: the first the server lists)")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="response length (default: the server's)")
    parser.add_argument("-q", "--quick", metavar=what.upper(), default=None,
                        help=f"send this one {what}, print the reply and exit")
