"""``POST /v1/chat/completions``: a conversation through the chat template, ``n`` choices, whole
or streamed; with tools (and ``--enable-auto-tool-choice``) the calls the model writes come
back as OpenAI's ``tool_calls``."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from sangam.sampling_params import RequestOutput
from sangam.serve.chunks import Delta, Step, chat_logprobs, usage_of
from sangam.serve.engine_requests import EngineRequests
from sangam.serve.intake import Intake
from sangam.serve.prompts import Prompts
from sangam.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from sangam.serve.serving_choices import ChoiceResponder
from sangam.serve.streams import unless_disconnected
from sangam.serve.tool_calls import HermesToolParser, ParsedCall, ToolCallStream


class ServingChat:
    def __init__(self, intake: Intake, prompts: Prompts, requests: EngineRequests,
                 responder: ChoiceResponder):
        self.intake = intake
        self.prompts = prompts
        self.requests = requests
        self.responder = responder

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        intake = self.intake
        params, tools = await intake.validator.params_and_tools(body)
        request_id = intake.ids.of(request, body, "chatcmpl-")
        with intake.admission.admitting(params.n):
            prompt = await self.prompts.chat_ids(body.messages, body)
            streams = await unless_disconnected(request, self.requests.open(
                [prompt], params, request_id))
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
                                   block_thresholds=step.block_thresholds, draft=step.draft,
                                   draft_token_ids=step.draft_token_ids,
                                   trajectory=step.trajectory,
                                   weight_version=step.weight_version)

        return await self.responder.respond(
            request, body, streams, request_id, params.n, ChatCompletionChunk, choice,
            lambda outs: self._whole(request_id, outs, tools, body.parallel_tool_calls))

    def _whole(self, request_id: str, outs: list[RequestOutput],
               tools: HermesToolParser | None, parallel_tool_calls: bool
               ) -> ChatCompletionResponse:
        steps = [Delta(self.prompts.token_pieces).advance(o) for o in outs]
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
                                      block_thresholds=st.block_thresholds,
                                    trajectory=st.trajectory, weight_version=st.weight_version))
        return ChatCompletionResponse(id=request_id, model=self.intake.model.name,
                                      choices=choices, usage=usage_of(outs, len(outs)))


def _function(call: ParsedCall) -> FunctionCall:
    return FunctionCall(name=call.name, arguments=call.arguments)


def _with_calls(reason: str | None) -> str | None:
    """A finished response that called tools ends with "tool_calls" (as OpenAI's), unless it
    was aborted."""
    return reason if reason == "abort" else "tool_calls"
