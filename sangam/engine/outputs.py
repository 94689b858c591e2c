"""What a caller sees of a request: a ``RequestOutput`` made from its decode state."""

from __future__ import annotations

import functools

from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.engine.stop_strings import response_text
from sangam.engine.text import TextCodec
from sangam.sampling_params import RequestOutput


def request_output(codec: TextCodec, request_id: str, prompt_ids: list[int],
                   state: DecodeState, finished: bool, reason: str | None, metrics: dict,
                   text: IncrementalDetokenizer | None = None,
                   error: str | None = None,
                   num_cached_tokens: int | None = None,
                   draft: list[int] | None = None,
                   weight_version: int = 0) -> RequestOutput:
    """What the caller sees of a request now: its tokens, their text (which, while the
    request runs, holds back what could still become a stop string), their logprobs when
    asked for. ``text``, the request's own, makes reading its outputs in order decode each
    block once. ``draft``: the block in progress, provisional (a draft output)."""
    tokens = state.output_token_ids()
    decode = codec.decode if text is None else functools.partial(text, codec.decode)
    return RequestOutput(
        request_id=request_id, prompt_token_ids=prompt_ids, token_ids=tokens,
        make_text=functools.partial(response_text, tokens, state.params, finished, decode),
        num_forwards=state.num_forwards,
        logprobs=(state.output_logprobs(len(tokens))
                  if state.params.logprobs is not None else None),
        top_logprobs=(state.output_top_logprobs(len(tokens))
                      if state.params.logprobs else None),
        finished=finished, finish_reason=reason if finished else None,
        stop_reason=state.stop_reason() if finished and reason == "stop" else None,
        block_thresholds=state.output_block_thresholds(), metrics=metrics, error=error,
        num_cached_tokens=num_cached_tokens, draft_token_ids=draft,
        trajectory=(state.output_trajectory()
                    if state.trajectory is not None else None),
        weight_version=weight_version,
        draft_text=None if draft is None or codec.tokenizer is None else codec.decode(
            draft, skip_special_tokens=state.params.skip_special_tokens))
