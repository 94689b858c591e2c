"""The response of completions and chat to their opened streams: a whole JSON body of choices,
or with ``stream: true`` server-sent chunks, one per committed block per choice, then usage if
asked, then ``[DONE]``. A stream that fails after it began reports the error in-band."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from sangam.sampling_params import RequestOutput
from sangam.serve.chunks import Delta, Step, finish_reason_of, sse, usage_of
from sangam.serve.intake import RequestIds
from sangam.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    StreamOptions,
)
from sangam.serve.streams import EventStream, Stream, collect, merge, unless_disconnected

logger = logging.getLogger(__name__)

Chunk = CompletionResponse | ChatCompletionChunk  # a streamed response's events
# One choice's part of a chunk: (choice index, its first chunk?, what it adds, finish reason).
ChoiceChunk = Callable[[int, bool, Step, str | None], BaseModel]


class ChoiceResponder:
    def __init__(self, model_name: str, token_pieces: Callable[[list[int]], list[str]],
                 ids: RequestIds):
        self.model_name = model_name
        self.token_pieces = token_pieces
        self.ids = ids

    async def respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                      streams: list[Stream], request_id: str, n: int, chunk_type: type[Chunk],
                      choice: ChoiceChunk,
                      whole: Callable[[list[RequestOutput]], BaseModel]) -> Response:
        """The response to opened ``streams`` (``n`` per prompt): server-sent ``chunk_type``
        chunks, one ``choice(index, first, step, finish_reason)`` each, or when not streaming
        ``whole`` of the final outputs."""
        headers = self.ids.headers(request_id)
        if body.stream:
            return EventStream(self._events(streams, request_id, n, body.stream_options,
                                            chunk_type, choice), streams, headers)
        outs = await unless_disconnected(request, collect(streams))
        return JSONResponse(whole(outs).model_dump(), headers=headers)

    async def _events(self, streams: list[Stream], request_id: str, n: int,
                      options: StreamOptions | None, chunk_type: type[Chunk],
                      choice: ChoiceChunk) -> AsyncGenerator[str, None]:
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
