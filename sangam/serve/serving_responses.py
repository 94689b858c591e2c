"""``POST /v1/responses`` (whole, or streamed as the Responses API's named events),
``GET``/``DELETE /v1/responses/{id}``: OpenAI's Responses API over the chat path (see
responses.py), with the store of response_store.py."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sangam.serve.chunks import Delta
from sangam.serve.engine_requests import EngineRequests
from sangam.serve.errors import ApiError
from sangam.serve.intake import Intake
from sangam.serve.prompts import Prompts
from sangam.serve.protocol import ChatMessage, DeletedResponse
from sangam.serve.response_store import ResponseStore, StoredResponse
from sangam.serve.responses import ResponseBuilder, ResponsesRequest
from sangam.serve.streams import EventStream, Stream, collect, merge, unless_disconnected

logger = logging.getLogger(__name__)


class ServingResponses:
    def __init__(self, intake: Intake, prompts: Prompts, requests: EngineRequests,
                 store: ResponseStore | None):
        self.intake = intake
        self.prompts = prompts
        self.requests = requests
        self.store = store  # None: --responses-store-size 0, nothing is stored

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        intake = self.intake
        params, tools = await intake.validator.params_and_tools(body)
        history = self._history(body)
        response_id = intake.ids.of(request, body, "resp_")
        with intake.admission.admitting(1):
            prompt = await self.prompts.chat_ids(body.conversation(history),
                                                 body.template_options())
            streams = await unless_disconnected(request, self.requests.open(
                [prompt], params, response_id))
        builder = ResponseBuilder(response_id, intake.model.name, body, tools)
        keep = self.store is not None and body.store
        headers = intake.ids.headers(response_id)
        if body.stream:
            return EventStream(self._events(streams, builder, history if keep else None),
                               streams, headers)
        out = (await unless_disconnected(request, collect(streams)))[0]
        response = builder.final(out.text or "", out)
        if keep:
            self.store.put(history, response)
        return JSONResponse(response.model_dump(), headers=headers)

    def get(self, response_id: str) -> Response:
        return JSONResponse(self._stored(response_id).response.model_dump())

    def delete(self, response_id: str) -> DeletedResponse:
        self._stored(response_id)
        self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    def _history(self, body: ResponsesRequest) -> list[ChatMessage]:
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

    def _stored(self, response_id: str) -> StoredResponse:
        found = self.store.get(response_id) if self.store is not None else None
        if found is None:
            raise ApiError(404, f"no stored response {response_id!r}",
                           code="response_not_found")
        return found

    async def _events(self, streams: list[Stream], builder: ResponseBuilder,
                      keep: list[ChatMessage] | None) -> AsyncGenerator[str, None]:
        """SSE of the Responses API: named events, one text delta per committed block; the
        whole response is stored at the end when ``keep`` (its history) is given."""
        for event in builder.start():
            yield _named_sse(event)
        delta = Delta(self.prompts.token_pieces)
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


def _named_sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
