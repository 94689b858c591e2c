"""Stop strings (``SamplingParams.stop``), looked for in the text of each completed block.

A diffusion request commits a whole block before any of it is returned, so its stop strings are
checked when a block completes, over the response's text so far. The response then ends with
the token that completes the first stop string, where an autoregressive engine would have
stopped, and its text is cut before that string (vLLM's semantics). While a request runs, text
that could be the start of a stop string is held back, so a stream never sends part of one.
Token-level stops (EOS, ``stop_token_ids``) are the DecodeState's own and need no text.
"""

from __future__ import annotations

from collections.abc import Callable

from sangam.decoding.state import DecodeState

Decode = Callable[[list[int]], "str | None"]


def apply_stop_strings(state: DecodeState, decode: Decode) -> bool:
    """Call when ``state`` has completed a block: if its response text holds a stop string, end
    the request at the token that completes the first one. Returns whether it did."""
    stop = state.params.stop
    if not stop or state.stop_len is not None:
        return False
    tokens = state.output_token_ids()

    def holds_stop(n: int) -> bool:
        text = decode(tokens[:n]) or ""
        return any(s in text for s in stop)

    if not holds_stop(len(tokens)):
        return False
    lo, hi = 0, len(tokens)  # the text of tokens[:lo] holds no stop string, tokens[:hi] does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds_stop(mid) else (mid, hi)
    state.stop_after(hi)
    return True


def visible_text(text: str | None, stop: tuple[str, ...], finished: bool) -> str | None:
    """What an output shows of its decoded ``text``: cut before the first stop string, and,
    while the request runs, without a tail that a later block could complete into one."""
    if text is None or not stop:
        return text
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    text = text[:cut]
    if not finished:
        text = text[:len(text) - max(_partial_match(text, s) for s in stop)]
    return text


def _partial_match(text: str, stop: str) -> int:
    """The longest k < len(stop) such that ``text`` ends with ``stop[:k]`` (0 if none)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):  # longest first: stop at a match
        if text.endswith(stop[:k]):
            return k
    return 0
