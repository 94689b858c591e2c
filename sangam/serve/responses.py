"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

A request's ``instructions`` and ``input`` (a text, or message, ``function_call`` and
``function_call_output`` items) become chat messages through the chat template; its function
tools are the template's tools and, with ``--enable-auto-tool-choice``, the calls the model
writes come back as ``function_call`` output items. With ``--responses-store-size N`` the
newest N responses that ask to be stored (``store``, true by default) are kept in memory, so a
request may continue one (``previous_response_id``: its conversation and output come before
the new input; its instructions do not carry over) and ``GET``/``DELETE /v1/responses/{id}``
work; by default, as in vLLM, nothing is stored. Streamed, the response is OpenAI's
sequence of events: created, in progress, the message's item and text part, one text delta per
committed block, then the closing events of each item and ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it or it was aborted, with status
``cancelled`` then).

Here: the bodies and the ``ResponseBuilder``; the store is response_store.py, the route
serving_responses.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from sangam.sampling_params import RequestOutput
from sangam.serve.protocol import (
    MAX_MESSAGES,
    QUIET_GUIDED,
    QUIET_NULL,
    QUIET_TEXT_FORMAT,
    QUIET_TOOL_CHOICE,
    ChatMessage,
    ChatTemplateOptions,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    JsonObjectFormat,
    JsonSchemaSpec,
    Length,
    MakeConstraint,
    OnlyOne,
    RequestBody,
    TextFormat,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    _GenerationRequest,
    _with_format,
    refuse_non_text,
)
from sangam.serve.tool_calls import HermesToolParser, ParsedCall, ToolCallStream

# Request.


class InputText(RequestBody):
    type: Literal["input_text", "output_text"]  # output_text: an earlier reply sent back
    text: str


class InputMessage(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return refuse_non_text(content, ("input_text", "output_text"))

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


class FunctionCallItem(RequestBody):
    """A call the model made earlier, sent back with its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(RequestBody):
    """The Responses API's function tool: the chat API's, flattened."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestBody):
    """The Responses API's named tool choice: ``{"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str

    @property
    def function_name(self) -> str:
        return self.name


class JsonSchemaTextFormat(JsonSchemaSpec):
    """The Responses API's JSON schema format: chat's ``json_schema``, flattened."""

    type: Literal["json_schema"]


class TextConfig(RequestBody):
    """A response's ``text``: its ``format`` (plain text unless given)."""

    format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat,
                      Field(discriminator="type")] | None = None


def _item_type(item: Any) -> str:
    """An input item's kind; a message may leave its type out."""
    return ((item.get("type") or "message") if isinstance(item, dict)  # null: unset
            else getattr(item, "type", "message"))


# Validated by kind, so that an error names the item's own fields.
InputItem = Annotated[Annotated[InputMessage, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type)]


class ResponsesRequest(_GenerationRequest, ToolChoice):
    input: (Annotated[str, Field(min_length=1)]
            | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)])
    instructions: str | None = None
    max_output_tokens: Length | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoiceMode | NamedFunctionChoice | None = None
    store: bool = True  # kept with --responses-store-size (OpenAI's default: true)
    previous_response_id: str | None = None  # a stored response this one continues
    text: TextConfig | None = None
    n: OnlyOne | None = None  # OpenAI's Responses API has no n
    # Its output items have no place for a trajectory (chat and completions carry one): the
    # schema allows only false, and true is refused by name (unsupported_fields).
    return_trajectory: Annotated[bool, Field(json_schema_extra={"enum": [False]})] | None = None

    QUIET = {**QUIET_GUIDED, "text": {"anyOf": [QUIET_NULL, {"type": "object", "properties": {
        "format": QUIET_TEXT_FORMAT}}]}, "tool_choice": QUIET_TOOL_CHOICE}

    def unsupported_fields(self) -> list[str]:
        """Fields set to a value whose behaviour Sangam does not implement."""
        return [name for name, given in (("n", self.n not in (None, 1)),
                                         ("return_trajectory", bool(self.return_trajectory)))
                if given]

    def tool_functions(self) -> list[FunctionDefinition]:
        return [FunctionDefinition(name=t.name, description=t.description,
                                   parameters=t.parameters) for t in self.tools or ()]

    def text_format(self) -> TextFormat | JsonObjectFormat | JsonSchemaTextFormat:
        if self.text is None or self.text.format is None:
            return TextFormat(type="text")
        return self.text.format

    def output_constraints(self) -> dict[str, MakeConstraint]:
        return self.with_tool_constraint(_with_format(
            super().output_constraints(), "text.format", self.text_format()))

    def sampling_overrides(self) -> dict[str, object]:
        overrides = super().sampling_overrides()
        if self.max_output_tokens is not None:
            overrides["max_tokens"] = self.max_output_tokens
        return overrides

    def input_messages(self) -> list[ChatMessage]:
        """The input as chat messages: a model's function calls and their outputs as assistant
        and tool messages."""
        items = ([InputMessage(role="user", content=self.input)] if isinstance(self.input, str)
                 else self.input)
        messages: list[ChatMessage] = []
        for item in items:
            if isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallItem):
                add_call(messages, ToolCall(id=item.call_id, function=FunctionCall(
                    name=item.name, arguments=item.arguments)))
            else:
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                            content=item.output))
        return messages

    def conversation(self, history: list[ChatMessage]) -> list[ChatMessage]:
        """What the chat template renders: the instructions first, as a system message, then
        ``history`` (earlier turns, if any, and this input)."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions \
            else []
        return system + history

    def template_options(self) -> ChatTemplateOptions:
        tools = [ChatTool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters))
            for t in self.tools] if self.tools else None
        return ChatTemplateOptions(tools=tools)


def add_call(messages: list[ChatMessage], call: ToolCall) -> None:
    """Append an assistant's call: calls in a row are one turn (parallel calls)."""
    if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
        messages[-1].tool_calls.append(call)
    elif messages and messages[-1].role == "assistant" and messages[-1].tool_calls is None:
        messages[-1].tool_calls = [call]  # the text the calls came after: the same turn
    else:
        messages.append(ChatMessage(role="assistant", tool_calls=[call]))


# Response.


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed"] = "completed"


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict = Field(default_factory=lambda: {"reasoning_tokens": 0})
    num_forwards: int  # Sangam: model forwards spent


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "cancelled"]
    incomplete_details: dict | None = None
    error: dict | None = None
    instructions: str | None
    output: list[OutputMessage | FunctionCallOutput]
    parallel_tool_calls: bool
    tool_choice: str | dict
    tools: list[dict]
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    usage: ResponseUsage | None = None
    # Sangam: with min_threshold, the threshold each block used (streamed: the completed event's)
    block_thresholds: list[float] | None = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One request's Response object: whole (``final``), or as events (``start``, then
    ``advance`` with each output)."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest,
                 tools: HermesToolParser | None):
        self.id = response_id
        self.model = model
        self.body = body
        self.tools = tools
        self.created_at = int(time.time())
        self.message_id = _new_id("msg")
        self.sequence = 0
        self.sent = ""  # text sent in deltas
        self.message_open = False
        self.streamed: ResponseObject | None = None  # the whole response, once streamed
        self._where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        self.calls = (ToolCallStream(tools, body.parallel_tool_calls) if tools is not None
                      else None)

    def _response(self, status: str, output: list, out: RequestOutput | None) -> ResponseObject:
        body = self.body
        usage = None if out is None else ResponseUsage(
            input_tokens=len(out.prompt_token_ids), output_tokens=len(out.token_ids),
            total_tokens=len(out.prompt_token_ids) + len(out.token_ids),
            input_tokens_details={"cached_tokens": out.num_cached_tokens or 0},
            num_forwards=out.num_forwards)
        incomplete = ({"reason": "max_output_tokens"}
                      if status == "incomplete" and out is not None
                      and out.finish_reason == "length" else None)
        return ResponseObject(
            id=self.id, created_at=self.created_at, model=self.model, status=status,
            incomplete_details=incomplete, instructions=body.instructions, output=output,
            parallel_tool_calls=body.parallel_tool_calls,
            tool_choice=(body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
                         else body.tool_choice or ("auto" if body.tools else "none")),
            text={"format": body.text_format().model_dump(by_alias=True, exclude_none=True)},
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            temperature=body.temperature, top_p=body.top_p,
            max_output_tokens=body.max_output_tokens, usage=usage,
            block_thresholds=None if out is None else out.block_thresholds)

    def _output(self, text: str, calls: tuple[ParsedCall, ...], status: str) -> list:
        """The output items: the message (unless only calls were written), then the calls."""
        items: list = []
        if text or not calls:
            items.append(OutputMessage(id=self.message_id, status=status,
                                       content=[OutputText(text=text)]))
        items += [FunctionCallOutput(id=_new_id("fc"), call_id=_new_id("call"),
                                     name=c.name, arguments=c.arguments) for c in calls]
        return items

    @staticmethod
    def _status(out: RequestOutput, called: bool) -> str:
        """Completed, unless aborted or cut short; a response that called tools is complete
        (as the chat API's finish_reason is then "tool_calls")."""
        if out.finish_reason == "abort":
            return "cancelled"
        return "incomplete" if out.finish_reason == "length" and not called else "completed"

    def final(self, text: str, out: RequestOutput) -> ResponseObject:
        """The whole response, from the finished output and its text."""
        content, calls = text, ()
        if self.tools is not None:
            parsed = self.tools.parse(text, self.body.parallel_tool_calls)
            content, calls = (parsed.content or "", parsed.calls) if parsed.calls else (text, ())
        status = self._status(out, bool(calls))
        return self._response(status, self._output(content, calls, _item_status(status)), out)

    # Streaming.
    def error(self, message: str) -> dict:
        """The event that ends a stream which failed after it began."""
        return self._event("error", code="server_error", message=message, param=None)

    def _event(self, type_: str, **fields: Any) -> dict:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        """The events before any output: the response created, and in progress."""
        pending = self._response("in_progress", [], None).model_dump()
        return [self._event("response.created", response=pending),
                self._event("response.in_progress", response=pending)]

    def _open_message(self) -> list[dict]:
        self.message_open = True
        message = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return [self._event("response.output_item.added", output_index=0,
                            item=message.model_dump()),
                self._event("response.content_part.added", **self._where,
                            part=OutputText(text="").model_dump())]

    def advance(self, new_text: str, out: RequestOutput) -> list[dict]:
        """The events of one output that adds ``new_text``: its text delta (the message item
        opens before the first), and when the output is the last, every closing event. The
        items are those ``final`` gives: the message unless only calls were written, then
        one item per call."""
        delta, calls = ((new_text, ()) if self.calls is None
                        else self.calls.advance(new_text, out.finished))
        events = []
        if delta:
            if not self.message_open:
                events += self._open_message()
            events.append(self._event("response.output_text.delta", **self._where, delta=delta,
                                      logprobs=[]))
            self.sent += delta
        if not out.finished:
            return events
        status = self._status(out, bool(calls))
        output = self._output(self.sent, calls, _item_status(status))
        if isinstance(output[0], OutputMessage):
            if not self.message_open:
                events += self._open_message()
            events += [
                self._event("response.output_text.done", **self._where, text=self.sent,
                            logprobs=[]),
                self._event("response.content_part.done", **self._where,
                            part=OutputText(text=self.sent).model_dump()),
                self._event("response.output_item.done", output_index=0,
                            item=output[0].model_dump())]
        for index, item in enumerate(output):
            if isinstance(item, FunctionCallOutput):
                opened = item.model_copy(update={"arguments": ""}).model_dump()
                where = {"item_id": item.id, "output_index": index}
                events += [  # a call is known whole: its arguments in one delta
                    self._event("response.output_item.added", output_index=index, item=opened),
                    self._event("response.function_call_arguments.delta", **where,
                                delta=item.arguments),
                    self._event("response.function_call_arguments.done", **where,
                                arguments=item.arguments),
                    self._event("response.output_item.done", output_index=index,
                                item=item.model_dump())]
        self.streamed = self._response(status, output, out)
        # There is no cancelled event: an aborted response ends as incomplete ones do.
        end = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(end, response=self.streamed.model_dump()))
        return events


def _item_status(status: str) -> str:
    """An output item's status in a response of ``status``."""
    return "completed" if status == "completed" else "incomplete"
