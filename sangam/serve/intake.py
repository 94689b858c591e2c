"""A generation request's way in, before any work is done for it: the model it names, its
parameters, output constraint and tools checked (400s), its id, and its places in the server
(a 503 when full). Shared by completions, chat and responses (``Intake``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterator

from fastapi import Request

from sangam.decoding.grammar import Constraint, ConstraintError, GrammarCompiler
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.front import QueueFull, check_queue
from sangam.sampling_params import SamplingParams, StructuredOutputsParams
from sangam.serve.errors import ApiError
from sangam.serve.metrics import ServerMetrics
from sangam.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard
from sangam.serve.responses import ResponsesRequest
from sangam.serve.tool_calls import HermesToolParser

GenerationRequest = CompletionRequest | ChatCompletionRequest | ResponsesRequest

RETRY_AFTER_S = 1  # a full queue drains at the pace of whole requests: retry soon
MAX_REQUEST_ID_CHARS = 256


class ServedModel:
    """The model as the API names it: its card, and the check that a request names it."""

    def __init__(self, name: str, context_length: int):
        self.name = name
        self.context_length = context_length

    def card(self) -> ModelCard:
        return ModelCard(id=self.name, max_model_len=self.context_length)

    def check(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{self.name}'", param="model", code="model_not_found")


class RequestValidator:
    """A generation body's SamplingParams (request defaults merged in, its output constraint
    compiled) and the parser of the tool calls in its responses, or the 400 (404: another
    model) that refuses it."""

    def __init__(self, model: ServedModel, default_params: Callable[..., SamplingParams],
                 tool_parser: HermesToolParser | None,
                 grammar_compiler: Callable[[], GrammarCompiler]):
        self.model = model
        self.default_params = default_params  # LoadedModel.default_params
        self.tool_parser = tool_parser  # None: no --enable-auto-tool-choice
        self.grammar_compiler = grammar_compiler  # LoadedModel.grammar_compiler

    async def params(self, body: GenerationRequest) -> SamplingParams:
        self.model.check(body.model)
        unsupported = body.unsupported_fields()
        if unsupported:
            raise ApiError(400, f"unsupported parameter(s): {', '.join(unsupported)}; Sangam "
                           "does not implement best_of > 1, nor n > 1 or return_trajectory in "
                           "/v1/responses",
                           param=unsupported[0], code="unsupported_parameter")
        try:
            params = self.default_params(**body.sampling_overrides())
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        if params.structured_outputs is not None:
            await self._compile(next(iter(body.output_constraints()), "structured_outputs"),
                                params.structured_outputs)
        return params

    async def _compile(self, field: str, structured: StructuredOutputsParams) -> None:
        """Compile the output constraint that ``field`` gave, on a thread (a schema can take
        a while; the compiler caches it for the engine): a 400 with the compiler's message
        when it does not compile, or when the model has no tokenizer to compile it for."""
        def compile_() -> None:
            compiler, constraint = self.grammar_compiler(), Constraint.of(structured)
            compiler.compile(constraint)
            compiler.start_completion(constraint)  # searched once, here, for the engine

        try:
            await asyncio.to_thread(compile_)
        except ConstraintError as e:
            raise ApiError(400, f"{field}: the output constraint does not compile: {e}",
                           param=field, code="invalid_constraint") from None
        except ValueError as e:  # no tokenizer; a constraint beyond the compiler's bounds
            raise ApiError(400, f"{field}: {e}", param=field) from None

    async def params_and_tools(self, body: ChatCompletionRequest | ResponsesRequest
                               ) -> tuple[SamplingParams, HermesToolParser | None]:
        """``params``, plus the parser of the tool calls in the responses (None: no tools to
        call). As in vLLM, a request whose calls are parsed keeps special tokens in its text
        unless it says otherwise: the tags a parser reads may be special tokens."""
        params = await self.params(body)
        tools = self._tool_parser_for(body)
        if tools is not None and body.skip_special_tokens is None:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params, tools

    def _tool_parser_for(self, body: ChatCompletionRequest | ResponsesRequest
                         ) -> HermesToolParser | None:
        try:
            calls_tools = body.calls_tools()
        except ValueError as e:
            raise ApiError(400, str(e), param="tool_choice") from None
        if not calls_tools:
            return None
        if body.forces_calls():  # constrained to the hermes format, whatever the flags say
            return HermesToolParser()
        if self.tool_parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs the server '
                           "started with --enable-auto-tool-choice and --tool-call-parser; or "
                           'send tool_choice "none" or "required"', param="tool_choice")
        return self.tool_parser


class RequestIds:
    """A request's id, and the headers that send it back (``--enable-request-id-headers``)."""

    def __init__(self, echo: bool):
        self.echo = echo

    def of(self, request: Request, body: GenerationRequest, prefix: str) -> str:
        """``prefix`` + BASE: BASE is the request's X-Request-Id header, else its body's
        request_id (as vLLM), else random. Engine ids derive from it, so while one request
        runs another with the same id is refused."""
        base = request.headers.get("x-request-id") or body.request_id
        if base is None:
            return f"{prefix}{uuid.uuid4().hex}"
        if not 0 < len(base) <= MAX_REQUEST_ID_CHARS or not base.isprintable():
            raise ApiError(400, f"a request id (X-Request-Id, request_id) is 1 to "
                           f"{MAX_REQUEST_ID_CHARS} printable characters", param="request_id")
        return f"{prefix}{base}"

    def headers(self, request_id: str) -> dict[str, str]:
        return {"X-Request-Id": request_id} if self.echo else {}


def overloaded(detail: str) -> ApiError:
    """The 503 of a server that holds all the requests it may: retry soon."""
    return ApiError(503, f"server overloaded: {detail}; retry later", "server_error",
                    code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


class Admission:
    """Places for engine requests while their prompts are tokenized, before they open (and
    ``AsyncEngine.generate`` counts them): a full server refuses a request at once, before
    that work is done. AsyncEngine's own check (QueueFull) still decides the races."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.preparing = 0  # engine requests being prepared (tokenized) before they open

    @contextlib.contextmanager
    def admitting(self, num_requests: int) -> Iterator[None]:
        """Hold ``num_requests`` engine requests' places from validation until they are open:
        503 when the engine could not take them now, 400 when it never could."""
        limit = self.engine.config.max_queue_len
        if num_requests > limit:
            raise ApiError(400, f"this request makes {num_requests} engine requests (prompts "
                           f"x n), more than the server ever holds (--max-queue-len {limit})",
                           param="n")
        try:
            check_queue(self.preparing + self.engine.open_requests, limit, num_requests)
        except QueueFull as e:
            self.metrics.requests_rejected.labels("queue_full").inc()
            raise overloaded(str(e)) from None
        self.preparing += num_requests
        try:
            yield
        finally:
            self.preparing -= num_requests


@dataclasses.dataclass(frozen=True)
class Intake:
    """The parts of a generation request's way in, as the generation APIs use them."""

    model: ServedModel
    validator: RequestValidator
    ids: RequestIds
    admission: Admission
