"""The OpenAI-compatible HTTP API over an ``AsyncEngine`` (DESIGN.md §3).

``build_app(engine, config)`` returns the FastAPI app: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/responses``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

A request's life: validate (400 before any work), submit every prompt and wait for each one's
first committed block (the engine refuses a bad request at once: 400, or 503 when the queue is
full), then stream one chunk per committed block or return the whole response. Whatever ends a
request early - a client that disconnects, a rejected sibling prompt, server shutdown - closes
its ``AsyncEngine.generate`` generator, which aborts it and frees its KV pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Path, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.convertors import Convertor, register_url_convertor

from sangam import __version__
from sangam.engine.async_engine import AsyncEngine, RequestFailed
from sangam.engine.engine import QueueFull, RequestRejected
from sangam.sampling_params import RequestOutput, SamplingParams
from sangam.serve.chunks import (
    Delta,
    Step,
    chat_logprobs,
    completion_logprobs,
    finish_reason_of,
    sse,
    usage_of,
)
from sangam.serve.config import ServerConfig
from sangam.serve.errors import ApiError, ApiKeyMiddleware, install_error_handlers
from sangam.serve.limits import BodyLimitMiddleware, JSONRoute
from sangam.serve.metrics import ServerMetrics
from sangam.serve.openapi import errors, install_schema, json_or_events
from sangam.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTemplateOptions,
    ChatTool,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeletedResponse,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    FunctionDefinition,
    HealthResponse,
    ModelCard,
    ModelList,
    ProfileStarted,
    ProfileStopped,
    StreamOptions,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    ToolCall,
    VersionResponse,
)
from sangam.serve.responses import (
    ResponseBuilder,
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
)
from sangam.serve.streams import (
    EventStream,
    Stream,
    close_all,
    collect,
    merge,
    unless_disconnected,
)
from sangam.serve.tool_calls import HermesToolParser, ParsedCall, ToolCallStream, make_tool_parser

logger = logging.getLogger(__name__)

Chunk = CompletionResponse | ChatCompletionChunk  # a streamed response's events
GenerationRequest = CompletionRequest | ChatCompletionRequest | ResponsesRequest

T = TypeVar("T")

RETRY_AFTER_S = 1  # a full queue drains at the pace of whole requests: retry soon
# Tokenizing and chat templates run on this many threads, never on the event loop. One: a
# tokenizer holds the GIL for long stretches (its Rust encode does not release it, its Python
# wrapper rarely pauses), and with several of them the loop's thread waits behind each in turn.
TOKENIZER_THREADS = 1
METRICS_INGEST_PERIOD_S = 1.0
LOGGED_PARAMS_CHARS = 500  # --enable-log-requests: stop strings can make parameters long
MAX_REQUEST_ID_CHARS = 256


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


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class _Server:
    """Request handling, shared by the routes."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.loaded = engine.engine.loaded
        self.model_name = config.model_name(engine.config.model)
        self.metrics = ServerMetrics(engine)
        self.in_flight: set[str] = set()  # engine request ids of open generators
        self.preparing = 0  # engine requests being prepared (tokenized) before they open
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="sangam-tokenize")
        self.tool_parser = (make_tool_parser(config.tool_call_parser)
                            if config.enable_auto_tool_choice else None)
        self.store = (ResponseStore(config.responses_store_size)
                      if config.responses_store_size else None)
        if self.tool_parser is not None and not self._template_shows_tools():
            logger.warning("--enable-auto-tool-choice: this chat template ignores tools, so "
                           "the model never sees them; give a --chat-template that renders "
                           "tools (as Qwen2.5's and Dream's do)")

    def _template_shows_tools(self) -> bool:
        """Whether the chat template renders a conversation differently with a tool (LLaDA's,
        for one, does not). Without a tokenizer or template there is nothing to warn about."""
        probe = ChatTemplateOptions(tools=[ChatTool(type="function", function=FunctionDefinition(
            name="probe_tool", description="Sangam's startup check"))])
        try:
            plain = self._render_chat([ChatMessage(role="user", content="hi")],
                                      ChatTemplateOptions())
            with_tool = self._render_chat([ChatMessage(role="user", content="hi")], probe)
        except ApiError:
            return True
        return plain != with_tool

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a tokenizer thread: the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizing, functools.partial(fn, *args))

    async def json_response(self, body: BaseModel) -> Response:
        """``body`` as a JSON response, serialized on a tokenizer thread."""
        return Response(await self.offload(body.model_dump_json), media_type="application/json")

    @contextlib.contextmanager
    def admitting(self, num_requests: int) -> Iterator[None]:
        """Hold ``num_requests`` engine requests' places from validation until they are open
        (while their prompts are tokenized): an engine that could not take them anyway is a
        503 at once, before that work is done, and a request that could never fit a 400."""
        limit = self.engine.config.max_queue_len
        if num_requests > limit:
            raise ApiError(400, f"this request makes {num_requests} engine requests (prompts "
                           f"x n), more than the server ever holds (--max-queue-len {limit})",
                           param="n")
        busy = self.preparing + self.engine.open_requests
        if busy + num_requests > limit:
            self.metrics.requests_rejected.labels("queue_full").inc()
            raise ApiError(503, f"server overloaded: {busy} requests in flight (max_queue_len "
                           f"{limit}); retry later", "server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.preparing += num_requests
        try:
            yield
        finally:
            self.preparing -= num_requests

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, max_model_len=self.loaded.context_length)

    # Validation (all before any work is submitted).
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'", param="model", code="model_not_found")

    def check(self, body: GenerationRequest) -> SamplingParams:
        self.check_model(body.model)
        unsupported = body.unsupported_fields()
        if unsupported:
            raise ApiError(400, f"unsupported parameter(s): {', '.join(unsupported)}; Sangam "
                           "does not implement best_of, response_format (or text.format), "
                           "n > 1 in /v1/responses, or a tool_choice other than auto and none "
                           "(they need constrained decoding)",
                           param=unsupported[0], code="unsupported_parameter")
        try:
            return self.loaded.default_params(**body.sampling_overrides())
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def check_with_tools(self, body: ChatCompletionRequest | ResponsesRequest
                         ) -> tuple[SamplingParams, HermesToolParser | None]:
        """``check``, plus the parser of the tool calls in the responses (None: no tools to
        call). As in vLLM, a request whose calls are parsed keeps special tokens in its text
        unless it says otherwise: the tags a parser reads may be special tokens."""
        params = self.check(body)
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
        if self.tool_parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs the server '
                           "started with --enable-auto-tool-choice and --tool-call-parser; or "
                           'send tool_choice "none"', param="tool_choice")
        return self.tool_parser

    def request_id(self, request: Request, body: GenerationRequest, prefix: str) -> str:
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

    def id_headers(self, request_id: str) -> dict[str, str]:
        return {"X-Request-Id": request_id} if self.config.enable_request_id_headers else {}

    def _tokenizer(self, what: str) -> Any:
        if self.loaded.tokenizer is None:
            raise ApiError(400, f"this model has no tokenizer, so {what} cannot be served; "
                           "send /v1/completions a prompt of token ids")
        return self.loaded.tokenizer

    def completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]
                           ) -> list[str | list[int]]:
        """The body's prompt as a list of prompts (texts or token ids)."""
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(
            prompt[0], int) else [prompt]
        vocab = self.loaded.config.vocab_size
        for p in prompts:
            if isinstance(p, str):
                self._tokenizer("text prompts")
            elif any(t >= vocab for t in p):  # before anything decodes them (echo)
                raise ApiError(400, f"prompt token ids must be in [0, {vocab}); got "
                               f"{[t for t in p if t >= vocab][:5]}", param="prompt")
        return prompts

    async def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return await self.offload(self.loaded.encode, prompt, add_special_tokens)
        return prompt

    async def suffix_ids(self, suffix: str | None) -> list[int]:
        """The token ids of an infilling ``suffix`` (OpenAI's field), without special tokens."""
        if not suffix:
            return []
        self._tokenizer("a suffix")
        return await self.offload(self.loaded.encode, suffix, False)

    async def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt's text, for echo: as given, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        self._tokenizer("echo of token prompts")
        return await self.offload(self.loaded.decode, prompt) or ""

    async def chat_prompt(self, messages: list[ChatMessage], options: ChatTemplateOptions
                          ) -> list[int]:
        self._tokenizer("chat (it needs a chat template)")
        return await self.offload(self._render_chat, messages, options)

    def _render_chat(self, messages: list[ChatMessage], options: ChatTemplateOptions
                     ) -> list[int]:
        try:
            return self.loaded.encode_chat(
                [m.for_template() for m in messages], self.config.chat_template_text,
                options.add_generation_prompt, options.continue_final_message,
                options.chat_template_kwargs, options.tool_dicts())
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (``token_id:N`` without a tokenizer, as vLLM)."""
        tokenizer = self.loaded.tokenizer
        if tokenizer is None:
            return [f"token_id:{t}" for t in token_ids]
        return [tokenizer.decode([t]) for t in token_ids]

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        self._tokenizer("/tokenize")
        if isinstance(body, TokenizeChatRequest):
            ids = await self.chat_prompt(body.messages, body)
        else:
            ids = await self.offload(self.loaded.encode, body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.loaded.context_length,
                                tokens=ids)

    def tokenizer_info(self) -> TokenizerInfoResponse:
        """vLLM's: the tokenizer's class and configuration, and the chat template served."""
        tokenizer = self._tokenizer("/tokenizer_info")
        config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if not k.endswith("_file") and k not in ("name_or_path", "tokenizer_object")}
        config = json.loads(json.dumps(config, default=str))  # added tokens and the like
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # as strings
            config[name] = getattr(tokenizer, name, None)
        template = self.config.chat_template_text or getattr(tokenizer, "chat_template", None)
        if template:
            config["chat_template"] = template
        return TokenizerInfoResponse(**{**config, "tokenizer_class": type(tokenizer).__name__})

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        tokenizer = self._tokenizer("/detokenize")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}",
                           param="tokens")
        return DetokenizeResponse(prompt=await self.offload(tokenizer.decode, body.tokens))

    # Submission.
    async def _generate(self, ids: list[int], params: SamplingParams, request_id: str,
                        suffix: list[int], started: set[str]
                        ) -> AsyncGenerator[RequestOutput, None]:
        """``engine.generate`` plus outcome counters (and log lines, with
        --enable-log-requests); closing this closes (aborts) that. Its id joins ``started``
        once it runs (one closed before that counts as aborted where it was opened)."""
        m = self.metrics
        log = self.config.enable_log_requests
        done = rejected = False
        started.add(request_id)
        self.in_flight.add(request_id)
        if log:
            start = time.monotonic()
            logger.info("Received request %s: %d prompt tokens, %s", request_id, len(ids),
                        _clip(repr(params), LOGGED_PARAMS_CHARS))
        sent: int | None = None  # response tokens counted; None before the first output
        try:
            async with contextlib.aclosing(
                    self.engine.generate(ids, params, request_id, suffix)) as outs:
                async for out in outs:
                    if sent is None:  # accepted
                        m.prompt_tokens.inc(len(out.prompt_token_ids))
                        sent = 0
                    m.generation_tokens.inc(max(0, len(out.token_ids) - sent))
                    sent = max(sent, len(out.token_ids))
                    if out.finished:
                        done = True
                        if out.finish_reason == "abort":
                            m.requests_aborted.inc()
                        else:
                            m.requests_finished.labels(out.finish_reason).inc()
                            if "tokens_per_forward" in out.metrics:
                                m.tokens_per_forward.observe(out.metrics["tokens_per_forward"])
                        if log:
                            logger.info("Finished request %s: %s, %d tokens, %d forwards, "
                                        "%.3f s", request_id, out.finish_reason,
                                        len(out.token_ids), out.num_forwards,
                                        time.monotonic() - start)
                    yield out
        except ValueError as e:  # refused at submission: counted, then mapped to a status
            rejected = True
            reason = ("queue_full" if isinstance(e, QueueFull) else
                      "kv_pool" if isinstance(e, RequestRejected) else "invalid")
            m.requests_rejected.labels(reason).inc()
            if log:
                logger.info("Refused request %s (%s): %s", request_id, reason, e)
            raise
        except RequestFailed as e:  # it failed in the engine: ended, counted as such
            done = True
            m.requests_finished.labels("error").inc()
            if log:
                logger.info("Failed request %s: %s", request_id, e)
            raise
        finally:
            self.in_flight.discard(request_id)
            if not done and not rejected:
                m.requests_aborted.inc()
                if log:
                    logger.info("Aborted request %s before it finished", request_id)

    async def abort_all(self) -> None:
        """End every request in flight now: each finishes with finish_reason "abort", so its
        client still gets a complete response."""
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)

    async def open(self, prompts: list[list[int]], params: SamplingParams, n: int,
                   request_id: str, suffix: list[int] = ()) -> list[Stream]:
        """Submit ``n`` requests per prompt (choice ``i * n + j`` is prompt i's j-th; each
        infills before ``suffix`` if given) and wait for each one's first output, so that a
        refusal becomes an error status before any response byte is sent. All or nothing."""
        if self.engine.dead is not None:
            raise ApiError(503, f"the engine failed: {self.engine.dead!r}", "server_error",
                           code="engine_dead")
        # Choices differ through their noise seeds: seed + j when the request gives a seed
        # (reproducible), else a random seed each.
        samples = [params if params.seed is None or j == 0 else
                   dataclasses.replace(params, seed=(params.seed + j) % 2**63) for j in range(n)]
        work = [(ids, p) for ids in prompts for p in samples]
        ids_of = [request_id if len(work) == 1 else f"{request_id}-{i}" for i in range(len(work))]
        started: set[str] = set()
        gens = [self._generate(ids, p, rid, list(suffix), started)
                for rid, (ids, p) in zip(ids_of, work)]
        try:
            # return_exceptions: gather returns (or raises CancelledError) only once every
            # generator is idle again, so each can be closed.
            firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
        except BaseException:  # the client left (or we are shutting down) meanwhile
            await close_all(gens)
            self.metrics.requests_aborted.inc(len(set(ids_of) - started))  # never ran
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if not errors:
            return list(zip(gens, firsts))
        await close_all(gens)
        e = errors[0]
        if isinstance(e, QueueFull):
            raise ApiError(503, f"server overloaded: {e}; retry later", "server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        if isinstance(e, ValueError):  # bad ids, too long for the context or the KV pool
            raise ApiError(400, str(e))
        raise e

    # Responses.
    def completion_response(self, request_id: str, outs: list[RequestOutput], n: int,
                            echoed: list[str]) -> CompletionResponse:
        steps = [Delta(self.token_pieces).advance(o) for o in outs]
        choices = [CompletionChoice(index=i, text=echoed[i // n] + st.text,
                                    token_ids=st.token_ids,
                                    logprobs=completion_logprobs(st),
                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                    block_thresholds=st.block_thresholds)
                   for i, (o, st) in enumerate(zip(outs, steps))]
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=usage_of(outs, n))

    def chat_response(self, request_id: str, outs: list[RequestOutput],
                      tools: HermesToolParser | None, parallel_tool_calls: bool
                      ) -> ChatCompletionResponse:
        steps = [Delta(self.token_pieces).advance(o) for o in outs]
        choices = []
        for i, (o, st) in enumerate(zip(outs, steps)):
            message, reason = AssistantMessage(content=st.text), o.finish_reason
            if tools is not None:
                parsed = tools.parse(st.text, parallel_tool_calls)
                if parsed.calls:
                    message = AssistantMessage(content=parsed.content, tool_calls=[
                        ToolCall(id=ParsedCall.new_id(), function=_function(c))
                        for c in parsed.calls])
                    reason = _with_calls(reason)
            choices.append(ChatChoice(index=i, message=message, token_ids=st.token_ids,
                                      logprobs=chat_logprobs(st), finish_reason=reason,
                                      stop_reason=o.stop_reason,
                                      block_thresholds=st.block_thresholds))
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=usage_of(outs, len(outs)))

    async def respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                      streams: list[Stream], request_id: str, chunk_type: type[Chunk],
                      choice: Callable[[int, bool, Step, str | None], BaseModel],
                      whole: Callable[[list[RequestOutput]], BaseModel]) -> Response:
        """The response to opened ``streams``: server-sent ``chunk_type`` chunks, one
        ``choice(index, first, step, finish_reason)`` each, or when not streaming ``whole``
        of the final outputs."""
        headers = self.id_headers(request_id)
        if body.stream:
            return EventStream(self.events(streams, request_id, body.n or 1,
                                           body.stream_options, chunk_type, choice), streams,
                               headers)
        outs = await unless_disconnected(request, collect(streams))
        return JSONResponse(whole(outs).model_dump(), headers=headers)

    async def response_events(self, streams: list[Stream], builder: ResponseBuilder,
                              keep: list[ChatMessage] | None) -> AsyncGenerator[str, None]:
        """SSE of the Responses API: named events, one text delta per committed block; the
        whole response is stored at the end when ``keep`` (its history) is given."""
        for event in builder.start():
            yield _named_sse(event)
        delta = Delta(self.token_pieces)
        try:
            async with contextlib.aclosing(merge(streams)) as merged:
                async for _, out in merged:
                    for event in builder.advance(delta.advance(out).text, out):
                        yield _named_sse(event)
        except Exception as e:  # the status line is long gone: report in-band, then end
            logger.exception("stream %s failed", builder.id)
            yield _named_sse(builder.error(f"generation failed: {e}"))
            return
        if keep is not None and builder.streamed is not None:
            self.store.put(keep, builder.streamed)

    def responses_history(self, body: ResponsesRequest) -> list[ChatMessage]:
        """The turns a Responses request answers: the stored conversation it continues
        (``previous_response_id``), then its input."""
        if body.previous_response_id is None:
            return body.input_messages()
        if self.store is None:
            raise ApiError(400, "previous_response_id needs stored responses: start the server "
                           "with --responses-store-size N", param="previous_response_id")
        earlier = self.store.continued(body.previous_response_id)
        if earlier is None:
            raise ApiError(404, f"no stored response {body.previous_response_id!r}",
                           param="previous_response_id", code="response_not_found")
        return [*earlier, *body.input_messages()]

    def stored(self, response_id: str) -> StoredResponse:
        found = self.store.get(response_id) if self.store is not None else None
        if found is None:
            raise ApiError(404, f"no stored response {response_id!r}",
                           code="response_not_found")
        return found

    async def events(self, streams: list[Stream], request_id: str, n: int,
                     options: StreamOptions | None, chunk_type: type[Chunk],
                     choice: Callable[[int, bool, Step, str | None], BaseModel]
                     ) -> AsyncGenerator[str, None]:
        """SSE: one chunk per committed block per choice, then usage if asked, then [DONE].
        With vLLM's ``continuous_usage_stats`` every chunk also carries its choice's usage so
        far."""
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        deltas = [Delta(self.token_pieces) for _ in streams]
        finals: dict[int, RequestOutput] = {}  # by choice index
        try:
            async with contextlib.aclosing(merge(streams)) as merged:
                async for i, out in merged:
                    first = deltas[i].num_chunks == 0
                    payload = chunk_type(id=request_id, model=self.model_name, choices=[
                        choice(i, first, deltas[i].advance(out), finish_reason_of(out))])
                    if continuous:
                        payload.usage = usage_of([out], 1)
                    yield sse(payload)
                    if out.finished:
                        finals[i] = out
        except Exception as e:  # the status line is long gone: report in-band, then end
            logger.exception("stream %s failed", request_id)
            yield sse(ErrorResponse(error=ErrorInfo(message=f"generation failed: {e}",
                                                     type="server_error")))
            return
        if include_usage:
            yield sse(chunk_type(id=request_id, model=self.model_name, choices=[],
                                 usage=usage_of([finals[i] for i in sorted(finals)], n)))
        yield "data: [DONE]\n\n"


def build_app(engine: AsyncEngine, server_config: ServerConfig) -> FastAPI:
    """The HTTP app; its lifespan shuts ``engine`` down when the server stops."""
    srv = _Server(engine, server_config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def ingest() -> None:
            interval = server_config.log_stats_interval
            next_log = asyncio.get_running_loop().time() + interval
            while True:
                await asyncio.sleep(METRICS_INGEST_PERIOD_S)
                srv.metrics.ingest()
                now = asyncio.get_running_loop().time()
                if interval and now >= next_log:
                    next_log = now + interval
                    line = srv.metrics.stats_line()
                    if line:
                        logger.info("engine: %s", line)

        task = asyncio.create_task(ingest())
        try:
            yield
        finally:
            task.cancel()
            srv.close()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Sangam", version=__version__, lifespan=lifespan)
    app.router.route_class = JSONRoute
    app.state.server = srv
    if server_config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_config.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_config.max_request_body_bytes)
    if server_config.origins():  # added last, so outermost: it answers preflights, keyless
        app.add_middleware(CORSMiddleware, allow_origins=list(server_config.origins()),
                           allow_methods=["*"], allow_headers=["*"])
    install_error_handlers(app)
    install_schema(app, api_key=server_config.api_key is not None,
                   vocab_size=srv.loaded.config.vocab_size, events=(ChatCompletionChunk,))
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
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # Their responses may be megabytes: serialized off the event loop too.
    @app.post("/tokenize", response_model=TokenizeResponse, responses=body_errors)
    async def tokenize(body: TokenizeRequest) -> Response:
        out = await srv.tokenize(body)
        return Response(await srv.offload(_tokenize_json, out), media_type="application/json")

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=body_errors)
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await srv.json_response(await srv.detokenize(body))

    @app.get("/tokenizer_info", responses=errors(400))
    async def tokenizer_info() -> TokenizerInfoResponse:
        return srv.tokenizer_info()

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

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[srv.model_card()])

    @app.get("/v1/models/{model:text}", responses=errors(404))
    async def model(model: Annotated[str, Path(min_length=1)]) -> ModelCard:
        srv.check_model(model)
        return srv.model_card()

    @app.post("/v1/completions", response_model=None,
              responses={**json_or_events(CompletionResponse, CompletionResponse),
                         **generation_errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = srv.check(body)
        prompts = srv.completion_prompts(body.prompt)
        request_id = srv.request_id(request, body, "cmpl-")
        n = body.n or 1
        with srv.admitting(len(prompts) * n):
            # echo: each choice's text begins with its prompt's (in its first chunk, streamed).
            echoed = [await srv.prompt_text(p) if body.echo else "" for p in prompts]
            suffix = await srv.suffix_ids(body.suffix)
            ids = [await srv.prompt_ids(p, body.add_special_tokens) for p in prompts]
            streams = await unless_disconnected(request, srv.open(ids, params, n, request_id,
                                                                   suffix))

        def choice(i: int, first: bool, step: Step, reason: str | None) -> BaseModel:
            return CompletionChoice(index=i, text=echoed[i // n] + step.text if first else
                                    step.text, token_ids=step.token_ids,
                                    logprobs=completion_logprobs(step), finish_reason=reason,
                                    stop_reason=step.stop_reason,
                                    block_thresholds=step.block_thresholds)

        return await srv.respond(
            request, body, streams, request_id, CompletionResponse, choice,
            lambda outs: srv.completion_response(request_id, outs, n, echoed))

    @app.post("/v1/chat/completions", response_model=None,
              responses={**json_or_events(ChatCompletionResponse, ChatCompletionChunk),
                         **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        params, tools = srv.check_with_tools(body)
        request_id = srv.request_id(request, body, "chatcmpl-")
        n = body.n or 1
        with srv.admitting(n):
            prompt = await srv.chat_prompt(body.messages, body)
            streams = await unless_disconnected(request, srv.open([prompt], params, n,
                                                                   request_id))
        # Streamed, each choice's tool calls are parsed as its text grows.
        calls = [ToolCallStream(tools, body.parallel_tool_calls) for _ in streams
                 ] if tools is not None and body.stream else []

        def choice(i: int, first: bool, step: Step, reason: str | None) -> BaseModel:
            content, new_calls = (calls[i].advance(step.text, reason is not None) if calls
                                  else (step.text, ()))
            if new_calls:
                reason = _with_calls(reason)
            delta = DeltaMessage(role="assistant" if first else None, content=content,
                                 tool_calls=[DeltaToolCall(index=k, id=ParsedCall.new_id(),
                                                           function=_function(c))
                                             for k, c in enumerate(new_calls)] or None)
            return ChatChunkChoice(index=i, delta=delta, token_ids=step.token_ids,
                                   logprobs=chat_logprobs(step), finish_reason=reason,
                                   stop_reason=step.stop_reason,
                                   block_thresholds=step.block_thresholds)

        return await srv.respond(
            request, body, streams, request_id, ChatCompletionChunk, choice,
            lambda outs: srv.chat_response(request_id, outs, tools, body.parallel_tool_calls))

    @app.post("/v1/responses", response_model=None,
              responses={**json_or_events(ResponseObject), **generation_errors})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        params, tools = srv.check_with_tools(body)
        history = srv.responses_history(body)
        response_id = srv.request_id(request, body, "resp_")
        with srv.admitting(1):
            prompt = await srv.chat_prompt(body.conversation(history), body.template_options())
            streams = await unless_disconnected(request, srv.open([prompt], params, 1,
                                                                   response_id))
        builder = ResponseBuilder(response_id, srv.model_name, body, tools)
        keep = srv.store is not None and body.store
        headers = srv.id_headers(response_id)
        if body.stream:
            return EventStream(srv.response_events(streams, builder, history if keep else None),
                               streams, headers)
        out = (await unless_disconnected(request, collect(streams)))[0]
        response = builder.final(out.text or "", out)
        if keep:
            srv.store.put(history, response)
        return JSONResponse(response.model_dump(), headers=headers)

    @app.get("/v1/responses/{response_id}", response_model=None,
             responses={200: {"model": ResponseObject}, **errors(404)})
    async def get_response(response_id: str) -> Response:
        return JSONResponse(srv.stored(response_id).response.model_dump())

    @app.delete("/v1/responses/{response_id}", responses=errors(404))
    async def delete_response(response_id: str) -> DeletedResponse:
        srv.stored(response_id)
        srv.store.delete(response_id)
        return DeletedResponse(id=response_id)

    return app


IDS_PER_CHUNK = 16_384  # a serializer holds the GIL for one chunk at a time, never a million ids


def _tokenize_json(out: TokenizeResponse) -> str:
    """``out`` as JSON (``TokenizeResponse.model_dump_json``'s text), its token ids written
    chunk by chunk, so that the event loop's thread is never locked out for long."""
    ids = out.tokens
    tokens = ",".join(",".join(map(str, ids[i:i + IDS_PER_CHUNK]))
                      for i in range(0, len(ids), IDS_PER_CHUNK))
    return f'{{"count":{out.count},"max_model_len":{out.max_model_len},"tokens":[{tokens}]}}'


def _named_sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _function(call: ParsedCall) -> FunctionCall:
    return FunctionCall(name=call.name, arguments=call.arguments)


def _with_calls(reason: str | None) -> str | None:
    """A finished response that called tools ends with "tool_calls" (as OpenAI's), unless it
    was aborted."""
    return reason if reason == "abort" else "tool_calls"


