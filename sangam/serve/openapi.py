"""The OpenAPI schema (``GET /openapi.json``) as the server behaves: each route's statuses with
their bodies, a generation's two response types (JSON, or server-sent events when streamed),
the request constraints the server enforces (declared on the request models; a token id's
bound is the served model's vocabulary; a field that needs a server flag is null-only without
it), and, with ``--api-key``, the bearer scheme on every route but ``OPEN_PATHS``. FastAPI's
default 422 is dropped: validation errors are 400s, in OpenAI's error format.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from sangam.serve.errors import OPEN_PATHS
from sangam.serve.protocol import TOKEN_ID_MARK, ErrorResponse

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


def json_or_events(model: type[BaseModel], event: type[BaseModel] | None = None
                   ) -> dict[int | str, dict[str, Any]]:
    """A generation's 200: ``model`` as JSON, or with ``stream: true`` server-sent events whose
    data is an ``event`` (its JSON), an error, or the closing ``[DONE]``; without ``event``,
    named events (the Responses API's) whose data is an object with their ``type``."""
    data = ({"anyOf": [_ref(event.__name__), _ref("ErrorResponse")]} if event is not None else
            {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}})
    item = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string",
                                                   "contentMediaType": "application/json",
                                                   "contentSchema": data}]}}}
    return {200: {"model": model, "description": "The response (JSON), or with stream: true "
                  "its chunks as server-sent events, one per committed block",
                  "content": {"text/event-stream": {"itemSchema": item}}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def install_schema(app: FastAPI, api_key: bool, vocab_size: int, responses_store: bool,
                   events: tuple[type[BaseModel], ...] = (),
                   refused: dict[str, str] | None = None) -> None:
    """Make ``app.openapi()`` return the schema described above; ``events`` are the models
    streamed events hold (``json_or_events``), which no route returns whole. Without a
    responses store (``responses_store``) no ``previous_response_id`` can be served: the
    schema allows only null there; nor in the request fields ``refused`` names (field: why),
    those of the other decoding family than the served model's."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for model in events:
            found = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, definition in {**found.pop("$defs", {}), model.__name__: found}.items():
                schemas.setdefault(name, definition)
        unauthorized = {"description": _ERRORS[401], "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if api_key and path not in OPEN_PATHS:
                    operation["responses"]["401"] = unauthorized
                    operation["security"] = [{"bearer": []}]
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        if api_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        _bound_token_ids(schema, vocab_size)
        if not responses_store:
            schemas["ResponsesRequest"]["properties"]["previous_response_id"] = {
                "type": "null", "default": None,
                "description": "Needs stored responses (--responses-store-size)"}
        for name, definition in schemas.items():
            props = definition.get("properties", {})
            if name.endswith("Request"):
                for field, why in (refused or {}).items():
                    if field in props:
                        props[field] = {"type": "null", "default": None, "description": why}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARK, False):
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)
