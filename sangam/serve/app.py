"""The OpenAI-compatible HTTP API over an ``AsyncEngine`` (docs/design.md §3).

``build_app(engine, config)`` returns the FastAPI app: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``. Here the app is
wired: its middleware, its lifespan, and each route to the module that serves it
(serving_completions.py, serving_chat.py, serving_responses.py, serving_tokenization.py).

A request's life: validate (400 before any work), submit every prompt and wait for each one's
first committed block (the engine refuses a bad request at once: 400, or 503 when the queue is
full), then stream one chunk per committed block or return the whole response. Whatever ends a
request early - a client that disconnects, a rejected sibling prompt, server shutdown - closes
its ``AsyncEngine.generate`` generator, which aborts it and frees its KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import FastAPI, Path, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.convertors import Convertor, register_url_convertor

from sangam import __version__
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.validation import family_refusals
from sangam.serve.config import ServerConfig
from sangam.serve.engine_requests import EngineRequests
from sangam.serve.errors import ApiError, ApiKeyMiddleware, install_error_handlers
from sangam.serve.intake import Admission, Intake, RequestIds, RequestValidator, ServedModel
from sangam.serve.limits import BodyLimitMiddleware, JSONRoute
from sangam.serve.metrics import ServerMetrics, ingest_forever
from sangam.serve.offload import Offloader
from sangam.serve.openapi import errors, install_schema, json_or_events
from sangam.serve.prompts import Prompts
from sangam.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DeletedResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ProfileStarted,
    ProfileStopped,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from sangam.serve.response_store import ResponseStore
from sangam.serve.responses import ResponseObject, ResponsesRequest
from sangam.serve.serving_chat import ServingChat
from sangam.serve.serving_choices import ChoiceResponder
from sangam.serve.serving_completions import ServingCompletions
from sangam.serve.serving_responses import ServingResponses
from sangam.serve.serving_rollout import add_rollout_routes
from sangam.serve.serving_tokenization import ServingTokenization
from sangam.serve.tool_calls import make_tool_parser

logger = logging.getLogger(__name__)


class _AnyText(Convertor):
    """A path parameter of any characters, "/" and newlines included (Starlette's ``path``
    stops at a newline): a model id such as "org/name", and for any other text the API's own
    404 (no such model) rather than a route's."""

    regex = "(?s:.+)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("text", _AnyText())


def build_app(engine: AsyncEngine, server_config: ServerConfig) -> FastAPI:
    """The HTTP app; its lifespan shuts ``engine`` down when the server stops."""
    loaded = engine.engine.loaded
    server_metrics = ServerMetrics(engine)
    offload = Offloader()
    prompts = Prompts(loaded, server_config.chat_template_text, offload)
    served_model = ServedModel(server_config.model_name(engine.config.model),
                               loaded.context_length)
    tool_parser = (make_tool_parser(server_config.tool_call_parser)
                   if server_config.enable_auto_tool_choice else None)
    if tool_parser is not None and not prompts.template_shows_tools():
        logger.warning("--enable-auto-tool-choice: this chat template ignores tools, so "
                       "the model never sees them; give a --chat-template that renders "
                       "tools (as Qwen2.5's and Dream's do)")
    request_ids = RequestIds(server_config.enable_request_id_headers)
    intake = Intake(served_model,
                    RequestValidator(served_model, loaded.default_params, tool_parser,
                                     loaded.grammar_compiler),
                    request_ids, Admission(engine, server_metrics))
    requests = EngineRequests(engine, server_metrics, server_config.enable_log_requests)
    responder = ChoiceResponder(served_model.name, prompts.token_pieces, request_ids)
    serving_completions = ServingCompletions(intake, prompts, requests, responder)
    serving_chat = ServingChat(intake, prompts, requests, responder)
    store = (ResponseStore(server_config.responses_store_size)
             if server_config.responses_store_size else None)
    serving_responses = ServingResponses(intake, prompts, requests, store)
    serving_tokenization = ServingTokenization(served_model, prompts, offload)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(ingest_forever(server_metrics,
                                                  server_config.log_stats_interval))
        try:
            yield
        finally:
            task.cancel()
            offload.close()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Sangam", version=__version__, lifespan=lifespan)
    app.router.route_class = JSONRoute
    app.state.engine_requests = requests  # server.py aborts them at shutdown
    if server_config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_config.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_request_body_bytes)
    if server_config.origins():  # added last, so outermost: it answers preflights, keyless
        app.add_middleware(CORSMiddleware, allow_origins=list(server_config.origins()),
                           allow_methods=["*"], allow_headers=["*"])
    install_error_handlers(app)
    install_schema(app, api_key=server_config.api_key is not None,
                   vocab_size=prompts.vocab_size, responses_store=store is not None,
                   events=(ChatCompletionChunk,), refused=family_refusals(loaded.config))
    body_errors = errors(400, 404, 413, 500)  # a route with a body that names a model
    generation_errors = errors(400, 404, 413, 500, 503)

    @app.get("/health", responses=errors(503))
    async def health() -> HealthResponse:
        if engine.dead is not None:
            raise ApiError(503, f"engine failed: {engine.dead!r}", "server_error",
                           code="engine_dead")
        return HealthResponse()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus metrics (text exposition format)."""
        return Response(server_metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=body_errors)
    async def tokenize(body: TokenizeRequest) -> Response:
        return await serving_tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=body_errors)
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await serving_tokenization.detokenize(body)

    @app.get("/tokenizer_info", responses=errors(400))
    async def tokenizer_info() -> TokenizerInfoResponse:
        return serving_tokenization.tokenizer_info()

    if server_config.profiler_dir is not None:  # a developer's tool: only when asked for
        @app.post("/start_profile", responses=errors(400))
        async def start_profile() -> ProfileStarted:
            try:
                await engine.start_profile(server_config.profiler_dir)
            except ValueError as e:
                raise ApiError(400, str(e)) from None
            return ProfileStarted()

        @app.post("/stop_profile", responses=errors(400))
        async def stop_profile() -> ProfileStopped:
            try:
                return ProfileStopped(trace=await engine.stop_profile())
            except ValueError as e:
                raise ApiError(400, str(e)) from None

    if server_config.enable_rollout_routes:  # a trainer's: only when asked for
        add_rollout_routes(app, engine)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[served_model.card()])

    @app.get("/v1/models/{model:text}", responses=errors(404))
    async def model(model: Annotated[str, Path(min_length=1)]) -> ModelCard:
        served_model.check(model)
        return served_model.card()

    @app.post("/v1/completions", response_model=None,
              responses={**json_or_events(CompletionResponse, CompletionResponse),
                         **generation_errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving_completions.create(body, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**json_or_events(ChatCompletionResponse, ChatCompletionChunk),
                         **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving_chat.create(body, request)

    @app.post("/v1/responses", response_model=None,
              responses={**json_or_events(ResponseObject), **generation_errors})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await serving_responses.create(body, request)

    @app.get("/v1/responses/{response_id}", response_model=None,
             responses={200: {"model": ResponseObject}, **errors(404)})
    async def get_response(response_id: str) -> Response:
        return serving_responses.get(response_id)

    @app.delete("/v1/responses/{response_id}", responses=errors(404))
    async def delete_response(response_id: str) -> DeletedResponse:
        return serving_responses.delete(response_id)

    return app
