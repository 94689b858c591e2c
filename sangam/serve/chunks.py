"""What the API sends of a request's outputs: each choice's new text, tokens and logprobs
since its last chunk (``Delta``), in OpenAI's formats, and usage."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from pydantic import BaseModel

from sangam.sampling_params import RequestOutput
from sangam.serve.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    Usage,
)


@dataclasses.dataclass
class Step:
    """What one response chunk (or a whole response) adds."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None  # per token, when the request asked for them
    pieces: list[str]  # each token's own text (only with logprobs)
    offset: int  # characters of the pieces sent before these (legacy text_offset)
    top: list[list[tuple[str, float]]]  # per token, its alternatives' texts and logprobs
    stop_reason: int | str | None  # the output's
    block_thresholds: list[float] | None  # of the blocks these tokens complete (min_threshold)
    draft: str | None = None  # a draft output's provisional block (it adds nothing else)
    draft_token_ids: list[int] | None = None
    trajectory: list[list[tuple[int, int, float]]] | None = None  # per token (trajectories)
    weight_version: int = 0  # the output's


class Delta:
    """What one choice has sent so far; ``advance`` gives what a new output adds.
    ``pieces`` turns token ids into their texts (needed only for logprobs)."""

    def __init__(self, pieces: Callable[[list[int]], list[str]]) -> None:
        self.pieces = pieces
        self.text = ""
        self.num_tokens = 0
        self.num_chunks = 0
        self.num_blocks = 0  # block thresholds sent
        self.offset = 0

    def advance(self, out: RequestOutput) -> Step:
        self.num_chunks += 1
        if out.draft_token_ids is not None:  # provisional: nothing is committed by it
            return Step("", [], None if out.logprobs is None else [], [], self.offset, [],
                        None, None, out.draft_text or "", out.draft_token_ids,
                        None if out.trajectory is None else [], out.weight_version)
        text = out.text or ""
        if not out.finished:
            # An unfinished multi-byte character decodes to U+FFFD: send it once complete.
            text = text.rstrip("\ufffd")
        delta = text[len(self.text):]
        self.text += delta
        tokens = out.token_ids[self.num_tokens:]
        logprobs = None if out.logprobs is None else out.logprobs[self.num_tokens:]
        pieces = self.pieces(tokens) if logprobs is not None else []
        top: list[list[tuple[str, float]]] = []
        if out.top_logprobs is not None:
            alternatives = out.top_logprobs[self.num_tokens:]
            texts = iter(self.pieces([t for alt in alternatives for t, _ in alt]))
            top = [[(next(texts), lp) for _, lp in alt] for alt in alternatives]
        thresholds = None
        if out.block_thresholds is not None:
            thresholds = out.block_thresholds[self.num_blocks:]
            self.num_blocks = len(out.block_thresholds)
        step = Step(delta, tokens, logprobs, pieces, self.offset, top, out.stop_reason,
                    thresholds, trajectory=None if out.trajectory is None
                    # its tokens' (and, in the last, the decoded tail's past them)
                    else out.trajectory[self.num_tokens:None if out.finished
                                        else len(out.token_ids)],
                    weight_version=out.weight_version)
        self.num_tokens = len(out.token_ids)
        self.offset += sum(map(len, pieces))
        return step


def completion_logprobs(step: Step) -> CompletionLogprobs | None:
    if step.logprobs is None:
        return None
    offsets = itertools.accumulate(map(len, step.pieces[:-1]), initial=step.offset)
    return CompletionLogprobs(
        tokens=step.pieces, token_logprobs=step.logprobs,
        top_logprobs=[{p: lp, **dict(alt)}
                      for p, lp, alt in itertools.zip_longest(step.pieces, step.logprobs,
                                                              step.top, fillvalue=())],
        text_offset=list(offsets) if step.pieces else [])


def chat_logprobs(step: Step) -> ChatLogprobs | None:
    if step.logprobs is None:
        return None
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=p, logprob=lp, bytes=list(p.encode()), top_logprobs=[
            ChatTopLogprob(token=t, logprob=tlp, bytes=list(t.encode())) for t, tlp in alt])
        for p, lp, alt in itertools.zip_longest(step.pieces, step.logprobs, step.top,
                                                fillvalue=())])


def finish_reason_of(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def usage_of(outs: list[RequestOutput], n: int) -> Usage:
    """Token counts of ``outs``, ``n`` choices per prompt: each prompt counts once."""
    prompt = sum(len(o.prompt_token_ids) for o in outs[::n])
    completion = sum(len(o.token_ids) for o in outs)
    cached = [o.num_cached_tokens for o in outs[::n]]
    details = (None if None in cached or not cached
               else PromptTokensDetails(cached_tokens=sum(cached)))
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion, num_forwards=sum(o.num_forwards for o in outs),
                 prompt_tokens_details=details)


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"
