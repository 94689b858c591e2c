"""Stop strings (``SamplingParams.stop``), looked for in the text of each completed block.

A diffusion request commits a whole block before any of it is returned, so its stop strings are
checked when a block completes, over the response's text so far. The response then ends with
the token that completes the first stop string, where an autoregressive engine would have
stopped, and its text is cut before that string, or after it with
``include_stop_str_in_output`` (vLLM's semantics). As in vLLM, a stop string that ends within
the text of the first ``min_tokens`` tokens does not count. While a request runs, text that
could be the start of a stop string is held back, so a stream never sends part of one.
Token-level stops (EOS, ``stop_token_ids``) are the DecodeState's own and need no text.
"""

from __future__ import annotations

import functools

from sangam.decoding.detokenizer import Decode
from sangam.decoding.state import DecodeState
from sangam.sampling_params import SamplingParams


def apply_stop_strings(state: DecodeState, decode: Decode) -> bool:
    """Call when ``state`` has completed a block: if its response text holds a stop string, end
    the request at the token that completes the first one. Returns whether it did."""
    params = state.params
    if not params.stop or state.stop_len is not None:
        return False
    tokens = state.output_token_ids()
    decode = functools.partial(state.stop_text, decode)  # decodes only the new block
    floor = min(params.min_tokens, len(tokens))  # tokens[:floor] cannot end the response
    start = _chars_before_search(tokens, params, decode)

    def stop_in(n: int) -> str | None:
        """The stop string the text of tokens[:n] holds, if any."""
        text = decode(tokens[:n], params.skip_special_tokens) or ""
        found = find_stop(text, params.stop, start)
        return None if found is None else text[found[0]:found[1]]

    found = stop_in(len(tokens))
    if found is None:
        return False
    # The text of tokens[:lo] holds no stop string (that counts), that of tokens[:hi] holds
    # ``found``. Blocks are searched as they complete, so the stop is in the last one.
    lo, hi = max(floor, len(tokens) - params.block_length), len(tokens)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        at_mid = stop_in(mid)
        if at_mid is None:
            lo = mid
        else:
            hi, found = mid, at_mid
    state.stop_after(hi, found)
    return True


def response_text(tokens: list[int], params: SamplingParams, finished: bool,
                  decode: Decode) -> str | None:
    """What an output shows of the text of its response ``tokens``: cut at the first stop
    string, and, while the request runs, without a tail that a later block could complete into
    one (none is held back when the stop string is shown anyway)."""
    text = decode(tokens, params.skip_special_tokens)
    if text is None or not params.stop:
        return text
    found = find_stop(text, params.stop, _chars_before_search(tokens, params, decode))
    if found is not None:
        return text[:found[1] if params.include_stop_str_in_output else found[0]]
    if finished or params.include_stop_str_in_output:
        return text
    return text[:len(text) - max(_partial_match(text, s) for s in params.stop)]


def find_stop(text: str, stop: tuple[str, ...], start: int = 0) -> tuple[int, int] | None:
    """The (begin, end) of the earliest stop string in ``text`` that ends beyond its first
    ``start`` characters, or None."""
    spans = [(i, i + len(s)) for s in stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(spans, default=None)


def _chars_before_search(tokens: list[int], params: SamplingParams, decode: Decode) -> int:
    """How many leading characters no stop string may end within: the text of the first
    ``min_tokens`` tokens."""
    if not params.min_tokens:
        return 0
    return len(decode(tokens[:params.min_tokens], params.skip_special_tokens) or "")


def _partial_match(text: str, stop: str) -> int:
    """The longest k < len(stop) such that ``text`` ends with ``stop[:k]`` (0 if none)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):  # longest first: stop at a match
        if text.endswith(stop[:k]):
            return k
    return 0
