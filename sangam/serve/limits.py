"""Bounded inputs: no request body can stall the server or reach the engine malformed.

- ``BodyLimitMiddleware``: a body beyond ``--max-request-body-bytes`` is refused with 413,
  from its Content-Length before anything is read, or as soon as a chunked body passes it.
- ``JSONRoute``: JSON bodies beyond 64 KiB are parsed off the event loop (a megabyte of JSON
  takes milliseconds to parse: on the loop, every other client would wait), a number such as ``4.0``
  is the integer it equals (JSON Schema's rule, and the schema says "integer"), and text that
  is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON can escape but no
  tokenizer can encode) is a 400 naming the field.

Tokenizing and chat templates run off the loop too (``Offloader`` in offload.py).
"""

from __future__ import annotations

import asyncio
import decimal
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sangam.serve.errors import ApiError

# A surrogate escape (\ud800-\udfff) in JSON text: only then can the parsed text hold a lone one.
INLINE_PARSE_BYTES = 64 * 1024  # well under a millisecond of parsing
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI passes HTTPException through
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.max_bytes} bytes "
                        "(--max-request-body-bytes)", code="body_too_large")


class JSONRoute(APIRoute):
    """A route whose JSON body is parsed, and checked for invalid text, on a worker thread."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()

        async def parse_then_handle(request: Request) -> Response:
            body = await request.body()
            if body and "json" in request.headers.get("content-type", "json"):
                # A small body parses faster than a hand-off to a thread and back.
                parsed = (_parse(body) if len(body) <= INLINE_PARSE_BYTES
                          else await asyncio.to_thread(_parse, body))
                if parsed is not _MALFORMED:
                    request._json = parsed  # Starlette's cache of request.json(): FastAPI reads it
            return await handle(request)

        return parse_then_handle


_MALFORMED = object()  # left for FastAPI to report, with the position of the error
# Far beyond any real request (a JSON schema or tool parameters nest a few dozen levels), far
# within Python's recursion limit, which validation and the handlers share.
MAX_JSON_DEPTH = 256
_TOO_DEEP = f"the request body nests deeper than {MAX_JSON_DEPTH} levels"


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (iteratively: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in node)
    return deepest


def _parse(body: bytes) -> Any:
    try:
        value = json.loads(body, parse_float=_number)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError:
        return _MALFORMED
    except RecursionError:  # deeper than the parser recurses
        raise ApiError(400, _TOO_DEEP) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if _depth(value) > MAX_JSON_DEPTH:  # validation and the handlers recurse too
        raise ApiError(400, _TOO_DEEP)
    if _SURROGATE_ESCAPE.search(body):
        where = _lone_surrogate(value, [])
        if where is not None:
            raise ApiError(400, f"{'.'.join(where) or 'body'}: the text holds a lone surrogate "
                           "(an unpaired \\ud800-\\udfff escape), which is not Unicode text",
                           param=where[0] if where else None, code="invalid_value")
    return value


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an integer if it has an integer's value, as
    JSON Schema counts it (``4.0`` is a valid ``max_tokens``; float fields take integers),
    exactly (``9223372036854775807.0`` is no float's value); beyond 10^40 a float, never a
    huge integer."""
    exact = decimal.Decimal(text)
    if abs(exact.adjusted()) <= 40 and exact == exact.to_integral_value():
        return int(exact)
    return float(text)


def _lone_surrogate(value: Any, path: list[str]) -> list[str] | None:
    """The path of the first string (value or key) in ``value`` that UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for key in value:
            if _lone_surrogate(key, path) is not None:
                return [*path, "(key)"]
        items = value.items()
    else:
        return None
    for key, item in items:
        found = _lone_surrogate(item, [*path, key])
        if found is not None:
            return found
    return None
