"""The commit rule of a request with structured output (docs/design.md §2.10).

A grammar reads left to right, while a diffusion step commits positions in any order. So a
constrained request commits from its *frontier* f, the first masked position of the current
block (its committed positions always form a prefix of the block): f's row is masked by the
matcher's allowed set and always commits (progress); then f+1, f+2, ... in turn, each masked by
the matcher advanced over the tokens before it, commit while their constrained confidence
passes the request's rule, and the first that does not stops the step (positions right of it
stay masked whatever their confidence). EOS is allowed only where the grammar is complete;
after that, the canvas pads with EOS and the output is cut there.

Scoring is the contract's (``score_logits``: greedy or the row's Gumbel noise, the request's
logit edits) on the row with the disallowed tokens at −inf, so the confidence is the
probability within the allowed set. The step depends only on the request's own rows and
tokens: it is batch-invariant like every rule.
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.grammar import ConstraintError
from sangam.decoding.logit_edits import pack_edits, request_edits
from sangam.decoding.state import DecodeState


def passes(state: DecodeState, conf: float, n: int) -> bool:
    """Whether the ``n``-th position after the frontier (n >= 1) commits at ``conf``: the
    request's rule read left to right (threshold; factor's 1 - f/(n+2); topk's count)."""
    p = state.params
    if p.unmasking == "threshold":
        return conf >= state.threshold
    if p.unmasking == "factor":
        return conf >= 1.0 - p.factor / (n + 2)
    return n < p.tokens_per_step


def commit_constrained(state: DecodeState, positions: np.ndarray, logits: torch.Tensor,
                       row_keys: np.ndarray) -> bool:
    """``DecodeState.commit`` for a constrained request: ``logits`` ``[len(positions), vocab]``
    are the raw rows of this step's candidate ``positions`` (position order: the frontier
    first), ``row_keys`` their noise keys. Returns whether a block ended."""
    if state.begin_step():  # a prefill chunk: nothing scored
        return False
    grammar, p = state.grammar, state.params
    grammar.sync(state.tokens[state.cursor.prompt_len:state.cursor.canvas_end], state.mask_token_id)
    vocab = logits.shape[-1]
    one = lambda value, dtype: torch.full((1,), value, dtype=dtype)
    for n, pos in enumerate(positions.tolist()):
        allowed = torch.from_numpy(grammar.allowed(vocab)).to(logits.device)
        row = logits[n:n + 1].masked_fill(~allowed, float("-inf"))
        edits = pack_edits([request_edits(state, positions[n:n + 1])], [1])
        tokens, conf, _ = score_logits(
            row, state.mask_token_id, one(p.temperature, torch.float64),
            torch.from_numpy(row_keys[n:n + 1]), one(p.top_p, torch.float64),
            one(p.top_k, torch.int64), one(p.min_p, torch.float64),
            None if edits is None else edits.map(torch.from_numpy), 0)
        token, c = int(tokens[0]), float(conf[0])
        if n and not passes(state, c, n):
            break
        if not allowed[token]:
            raise ConstraintError("no token satisfies both the constraint and the request's "
                                  "other options (min_tokens, logit_bias) at position "
                                  f"{pos - state.cursor.prompt_len} of the response")
        state.tokens[pos] = token
        state.confidence[pos] = c
        grammar.consume(token)  # the committed prefix grows by this position
    return state.end_step(had_masks=True, changed=True)
