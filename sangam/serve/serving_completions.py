"""``POST /v1/completions``: one prompt or a batch (texts or token ids), ``n`` choices each,
with echo, infilling (``suffix``) and logprobs, whole or streamed."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from sangam.sampling_params import RequestOutput
from sangam.serve.chunks import Delta, Step, completion_logprobs, usage_of
from sangam.serve.engine_requests import EngineRequests
from sangam.serve.intake import Intake
from sangam.serve.prompts import Prompts
from sangam.serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from sangam.serve.serving_choices import ChoiceResponder
from sangam.serve.streams import unless_disconnected


class ServingCompletions:
    def __init__(self, intake: Intake, prompts: Prompts, requests: EngineRequests,
                 responder: ChoiceResponder):
        self.intake = intake
        self.prompts = prompts
        self.requests = requests
        self.responder = responder

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        intake, prompts = self.intake, self.prompts
        params = await intake.validator.params(body)
        texts_or_ids = prompts.completion_prompts(body.prompt)
        request_id = intake.ids.of(request, body, "cmpl-")
        n = params.n
        with intake.admission.admitting(len(texts_or_ids) * n):
            # echo: each choice's text begins with its prompt's (in its first chunk, streamed).
            echoed = [await prompts.text(p) if body.echo else "" for p in texts_or_ids]
            suffix = await prompts.suffix_ids(body.suffix)
            ids = [await prompts.ids(p, body.add_special_tokens) for p in texts_or_ids]
            streams = await unless_disconnected(request, self.requests.open(
                ids, params, request_id, suffix))

        def choice(i: int, first: bool, step: Step, reason: str | None) -> BaseModel:
            return CompletionChoice(index=i, text=echoed[i // n] + step.text if first else
                                    step.text, token_ids=step.token_ids,
                                    logprobs=completion_logprobs(step), finish_reason=reason,
                                    stop_reason=step.stop_reason,
                                    block_thresholds=step.block_thresholds, draft=step.draft,
                                    draft_token_ids=step.draft_token_ids,
                                    trajectory=step.trajectory,
                                    weight_version=step.weight_version)

        return await self.responder.respond(
            request, body, streams, request_id, n, CompletionResponse, choice,
            lambda outs: self._whole(request_id, outs, n, echoed))

    def _whole(self, request_id: str, outs: list[RequestOutput], n: int, echoed: list[str]
               ) -> CompletionResponse:
        steps = [Delta(self.prompts.token_pieces).advance(o) for o in outs]
        choices = [CompletionChoice(index=i, text=echoed[i // n] + st.text,
                                    token_ids=st.token_ids,
                                    logprobs=completion_logprobs(st),
                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                    block_thresholds=st.block_thresholds,
                                    trajectory=st.trajectory, weight_version=st.weight_version)
                   for i, (o, st) in enumerate(zip(outs, steps))]
        return CompletionResponse(id=request_id, model=self.intake.model.name, choices=choices,
                                  usage=usage_of(outs, n))
