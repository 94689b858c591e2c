"""Edits of a request's logits before they are scored: logit_bias, penalties, min_tokens.

These options change a request's logits, and so its choice, its sampling and its confidence
(DESIGN.md §2 scores the edited logits):
- ``logit_bias`` (OpenAI): a fixed value added to the given tokens.
- Penalties on the tokens the response already holds: its committed tokens before the first
  stop id, within ``max_tokens`` (what the output would return; still-masked positions hold no
  token yet, and the EOS tail of a block is padding an AR model would never have produced).
  ``presence_penalty`` is subtracted once from each such token, ``frequency_penalty`` once per
  occurrence (OpenAI). ``repetition_penalty`` r divides positive logits by r and multiplies
  negative ones by r, over those tokens and the prompt's (vLLM).
- ``min_tokens`` (vLLM): the stop ids get -inf on rows that predict one of the first
  ``min_tokens`` response positions.
The repetition penalty applies first, then the sum of the additive edits, then temperature.
A step's edits depend only on the request's own canvas, never on the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from sangam.decoding.state import DecodeState


class RequestEdits(NamedTuple):
    """One step's edits of one request, whose logits rows predict ``positions``."""

    add_ids: np.ndarray  # int64, unique: added to every row ...
    add_values: np.ndarray  # float64: ... these values
    ban_ids: np.ndarray  # int64: -inf on the rows ...
    ban_rows: np.ndarray  # int64: ... at these offsets among the request's rows
    rep_ids: np.ndarray  # int64, unique: the repetition penalty's tokens
    repetition_penalty: float


class LogitEdits(NamedTuple):
    """Sparse edits of a ``[rows, vocab]`` logits matrix, as parallel arrays (numpy on the host,
    tensors on the device): ``x[rows, ids] += values`` (values may be -inf) after the tokens
    ``x[rep_rows, rep_ids]`` are penalized by ``rep_values``."""

    rows: np.ndarray | torch.Tensor
    ids: np.ndarray | torch.Tensor
    values: np.ndarray | torch.Tensor
    rep_rows: np.ndarray | torch.Tensor
    rep_ids: np.ndarray | torch.Tensor
    rep_values: np.ndarray | torch.Tensor

    def map(self, fn: Callable[[np.ndarray | torch.Tensor], torch.Tensor]) -> LogitEdits:
        """The same edits with every array converted by ``fn`` (e.g. moved to a device)."""
        return LogitEdits(*(fn(a) for a in self))


def response_token_counts(state: DecodeState) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens the response holds so far and how often (see the module doc)."""
    response = state.tokens[state.prompt_len:state.prompt_len + state.params.max_tokens]
    if state.stop_ids:
        stops = np.isin(response, list(state.stop_ids)).nonzero()[0]
        if stops.size:
            response = response[:stops[0]]
    return np.unique(response[response != state.mask_token_id], return_counts=True)


def request_edits(state: DecodeState, positions: np.ndarray) -> RequestEdits | None:
    """The edits of the step of ``state`` whose rows predict canvas ``positions``; None if
    there are none."""
    p = state.params
    empty = np.zeros(0, dtype=np.int64)
    ids = [np.array([t for t, _ in p.logit_bias], dtype=np.int64)]
    values = [np.array([b for _, b in p.logit_bias], dtype=np.float64)]
    rep_ids = empty
    if p.penalizes:
        seen, counts = response_token_counts(state)
        if p.presence_penalty or p.frequency_penalty:
            ids.append(seen)
            values.append(-(p.presence_penalty + p.frequency_penalty * counts))
        if p.repetition_penalty != 1.0:
            rep_ids = np.union1d(seen, state.tokens[:state.prompt_len])
    add_ids, where = np.unique(np.concatenate(ids), return_inverse=True)
    add_values = np.zeros(len(add_ids), dtype=np.float64)
    np.add.at(add_values, where, np.concatenate(values))  # logit_bias first, then penalties
    ban_ids, ban_rows = empty, empty
    if p.min_tokens and state.stop_ids:
        ban_rows = (positions < state.prompt_len + p.min_tokens).nonzero()[0]
        if ban_rows.size:
            ban_ids = np.array(sorted(state.stop_ids), dtype=np.int64)
    if not (add_ids.size or ban_ids.size or rep_ids.size):
        return None
    return RequestEdits(add_ids, add_values, ban_ids, ban_rows, rep_ids, p.repetition_penalty)


def pack_edits(edits: list[RequestEdits | None], counts: list[int]) -> LogitEdits | None:
    """The edits of consecutive groups of rows (group g: ``counts[g]`` rows, edited by
    ``edits[g]``) as one :class:`LogitEdits` over all rows; None if there are none."""
    parts: list[list[np.ndarray]] = [[] for _ in LogitEdits._fields]
    start = 0
    for e, n in zip(edits, counts, strict=True):
        if e is not None:
            every_row = np.arange(start, start + n)
            parts[0] += [np.repeat(every_row, len(e.add_ids)),
                         np.repeat(start + e.ban_rows, len(e.ban_ids))]
            parts[1] += [np.tile(e.add_ids, n), np.tile(e.ban_ids, len(e.ban_rows))]
            parts[2] += [np.tile(e.add_values, n),
                         np.full(len(e.ban_rows) * len(e.ban_ids), -np.inf)]
            parts[3].append(np.repeat(every_row, len(e.rep_ids)))
            parts[4].append(np.tile(e.rep_ids, n))
            parts[5].append(np.full(n * len(e.rep_ids), e.repetition_penalty))
        start += n
    if not parts[0]:
        return None
    return LogitEdits(*(np.concatenate(p) for p in parts))


def apply_edits(x: torch.Tensor, edits: LogitEdits) -> None:
    """Edit the logits ``x`` in place (tensors of ``edits`` on its device)."""
    if len(edits.rep_rows):
        picked = x[edits.rep_rows, edits.rep_ids]
        penalty = edits.rep_values.to(x.dtype)
        x[edits.rep_rows, edits.rep_ids] = torch.where(picked > 0, picked / penalty,
                                                       picked * penalty)
    # A (row, token) pair repeats only when a banned token is also biased: -inf either way.
    x.index_put_((edits.rows, edits.ids), edits.values.to(x.dtype), accumulate=True)
