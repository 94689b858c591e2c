"""The Responses API's store (``--responses-store-size N``): the newest N responses that asked
to be stored, in memory, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sangam.serve.protocol import ChatMessage, FunctionCall, ToolCall
from sangam.serve.responses import OutputMessage, ResponseObject, add_call


def output_messages(response: ResponseObject) -> list[ChatMessage]:
    """A response's output as the assistant turn that continues its conversation."""
    messages: list[ChatMessage] = []
    for item in response.output:
        if isinstance(item, OutputMessage):
            text = "".join(part.text for part in item.content)
            messages.append(ChatMessage(role="assistant", content=text))
        else:
            add_call(messages, ToolCall(id=item.call_id, function=FunctionCall(
                name=item.name, arguments=item.arguments)))
    return messages


@dataclass
class StoredResponse:
    history: list[ChatMessage]  # the turns it answered, without its instructions
    response: ResponseObject


class ResponseStore:
    """The newest ``capacity`` stored responses, in memory: for ``previous_response_id`` and
    ``GET``/``DELETE /v1/responses/{id}``. Not thread-safe: the event loop alone uses it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, history: list[ChatMessage], response: ResponseObject) -> None:
        self._responses[response.id] = StoredResponse(history, response)
        self._responses.move_to_end(response.id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def continued(self, response_id: str) -> list[ChatMessage] | None:
        """The conversation a response ended, its output included (None: not stored)."""
        stored = self.get(response_id)
        if stored is None:
            return None
        return [*stored.history, *output_messages(stored.response)]
