"""The OpenAPI schema (``GET /openapi.json``) as the server behaves: each route's statuses with
their bodies, a generation's two response types (JSON, or server-sent events when streamed),
the request constraints the server enforces (declared on the request models), and, with
``--api-key``, the bearer scheme on every route but ``OPEN_PATHS``. FastAPI's default 422 is
dropped: validation errors are 400s, in OpenAI's error format.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from sangam.serve.errors import OPEN_PATHS
from sangam.serve.protocol import ErrorResponse

_ERRORS = {
    400: "The request is invalid (its body, a parameter, or what the model can serve)",
    401: "The API key is missing or wrong (--api-key)",
    404: "No such model, stored response or route",
    413: "The request body is larger than --max-request-body-bytes",
    500: "The request failed in the server (the message says how); others go on",
    503: "Overloaded (retry after Retry-After seconds), or the engine has failed",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def json_or_events(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation's 200: ``model`` as JSON, or with ``stream: true`` server-sent events."""
    return {200: {"model": model, "description": "The response (JSON), or with stream: true "
                  "its chunks as server-sent events, one per committed block",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def install_schema(app: FastAPI, api_key: bool) -> None:
    """Make ``app.openapi()`` return the schema described above."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {})
        unauthorized = {"description": _ERRORS[401], "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if api_key and path not in OPEN_PATHS:
                    operation["responses"]["401"] = unauthorized
                    operation["security"] = [{"bearer": []}]
        for unused in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(unused, None)
        if api_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
