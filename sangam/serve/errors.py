"""Errors as the OpenAI API shows them (``{"error": {...}}`` with the right status), for every
way a request can go wrong, and the API key check."""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from sangam.engine.async_engine import EngineDead, RequestFailed
from sangam.serve.protocol import ErrorInfo, ErrorResponse
from sangam.serve.streams import ClientGone

logger = logging.getLogger(__name__)

MAX_ERRORS_SHOWN = 4
# Open with --api-key (as in vLLM): a load balancer's probe and a Prometheus scrape.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiError(Exception):
    """An error the client should see as ``{"error": {...}}`` with this status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every route but ``OPEN_PATHS``."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(401, "invalid or missing API key: send 'Authorization: Bearer "
                                 "<key>'", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        # Nobody is listening; 499 ("client closed request") only shows in the access log.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> Response:
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}"
                            ).response()
        errors = _relevant(errors)
        shown = [f"{'.'.join(_where(err)) or 'body'}: {err.get('msg', 'invalid')}"
                 for err in errors[:MAX_ERRORS_SHOWN]]
        if len(errors) > MAX_ERRORS_SHOWN:
            shown.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more")
        first = errors[0] if errors else {}
        param = _where(first)[0] if _where(first) else None
        if "json" not in request.headers.get("content-type", ""):
            shown.insert(0, "send a JSON object with 'Content-Type: application/json'")
        return ApiError(400, "; ".join(shown), param=param, code="invalid_value").response()

    @app.exception_handler(RequestFailed)
    async def request_failed(request: Request, e: RequestFailed) -> Response:
        return ApiError(500, str(e), "server_error", code="request_failed").response()

    @app.exception_handler(EngineDead)
    async def engine_dead(request: Request, e: EngineDead) -> Response:
        return ApiError(503, str(e), "server_error", code="engine_dead").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        headers = e.headers
        if e.status_code == 405:  # every method of the path, not just the first route's
            headers = {**(headers or {}), "Allow": ", ".join(_methods(app, request))}
        return ApiError(e.status_code, str(e.detail), type_, headers=headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return ApiError(500, f"internal error: {e!r}", "server_error").response()


# Pydantic names a union member in an error's location ("prompt", "list[constrained-int]", 0):
# these are no field names.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _where(err: dict) -> list[str]:
    """An error's field path, without "body" and union member names."""
    return [str(x) for x in err.get("loc", ()) if x != "body" and (
        not isinstance(x, str) or (x.isidentifier() and x not in _TYPE_NAMES))]


def _relevant(errors: list[dict]) -> list[dict]:
    """A union field fails once per member; of a field's errors, drop those that only say its
    value is not of a member's type when another says what is wrong with it."""
    def field(err: dict) -> tuple:
        return tuple(_where(err)[:1])

    substantive = {field(e) for e in errors if not e.get("type", "").endswith("_type")}
    return [e for e in errors
            if not (e.get("type", "").endswith("_type") and field(e) in substantive)]


def _methods(app: FastAPI, request: Request) -> list[str]:
    """The methods some route of ``app`` serves at the request's path."""
    path = request.scope["path"]
    found: set[str] = set()
    for route in app.routes:
        methods = getattr(route, "methods", None)
        regex = getattr(route, "path_regex", None)
        if methods and regex is not None and regex.match(path):
            found |= methods
    return sorted(found)
