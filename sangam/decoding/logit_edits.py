"""Edits of a request's logits before they are scored: logit_bias, penalties, min_tokens.

These options change a request's logits, and so its choice, its sampling and its confidence
(docs/design.md §2 scores the edited logits):
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

``request_edits`` states one request's edits and ``pack_edits`` lays them out over the rows
(the reference decoder uses both); the engine builds the same edits for a whole batch at once
with ``batch_edits``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from sangam.decoding.state import DecodeState


class RequestEdits(NamedTuple):
    """One step's edits of one request, whose logits rows predict ``positions`` (ascending, as
    a step plan lists them)."""

    add_ids: np.ndarray  # int64, unique: added to every row ...
    add_values: np.ndarray  # float64: ... these values
    ban_ids: np.ndarray  # int64: -inf on the first ``num_banned`` rows
    num_banned: int
    rep_ids: np.ndarray  # int64 (repeats allowed): the repetition penalty's tokens
    repetition_penalty: float


class LogitEdits(NamedTuple):
    """Sparse edits of a ``[rows, vocab]`` logits matrix, by groups of consecutive rows edited
    alike (group g: rows ``starts[g]`` to ``starts[g] + counts[g]``, at most ``width`` rows).
    Each entry names a group, a token and a value: the repetition entries penalize their token
    on every row of their group, then the additive ones add their value (may be -inf). Arrays
    are numpy on the host, tensors on the device; the expansion to (row, token) pairs happens
    there, so the host never builds rows x tokens arrays (a 1K-token prompt, 32 rows)."""

    starts: np.ndarray | torch.Tensor
    counts: np.ndarray | torch.Tensor
    add_groups: np.ndarray | torch.Tensor
    add_ids: np.ndarray | torch.Tensor
    add_values: np.ndarray | torch.Tensor
    rep_groups: np.ndarray | torch.Tensor
    rep_ids: np.ndarray | torch.Tensor
    rep_values: np.ndarray | torch.Tensor
    width: int

    def map(self, fn: Callable[[np.ndarray | torch.Tensor], torch.Tensor]) -> LogitEdits:
        """The same edits with every array converted by ``fn`` (e.g. moved to a device)."""
        return LogitEdits(*(a if isinstance(a, int) else fn(a) for a in self))


def response_token_counts(state: DecodeState) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens the response holds so far and how often (see the module doc)."""
    p = state.cursor.prompt_len
    response = state.tokens[p:p + state.params.max_tokens]
    response = response[:state.stop_index(response)]
    return np.unique(response[response != state.mask_token_id], return_counts=True)


def request_edits(state: DecodeState, positions: np.ndarray) -> RequestEdits | None:
    """The edits of the step of ``state`` whose rows predict canvas ``positions`` (ascending);
    None if there are none."""
    p = state.params
    empty = np.zeros(0, dtype=np.int64)
    added: list[tuple[np.ndarray, np.ndarray]] = []  # (unique ids, values): logit_bias first
    if p.logit_bias:
        added.append((np.array([t for t, _ in p.logit_bias], dtype=np.int64),
                      np.array([b for _, b in p.logit_bias], dtype=np.float64)))
    rep_ids = empty
    if p.penalizes:
        seen, counts = response_token_counts(state)
        if p.presence_penalty or p.frequency_penalty:
            added.append((seen, -(p.presence_penalty + p.frequency_penalty * counts)))
        if p.repetition_penalty != 1.0:  # a token in both is penalized once: pairs repeat
            rep_ids = np.concatenate([state.input_tokens, seen])
    if len(added) > 1:  # the same token in several: one entry, the sum
        add_ids, where = np.unique(np.concatenate([i for i, _ in added]), return_inverse=True)
        add_values = np.zeros(len(add_ids), dtype=np.float64)
        np.add.at(add_values, where, np.concatenate([v for _, v in added]))
    else:
        add_ids, add_values = added[0] if added else (empty, np.zeros(0))
    ban_ids, num_banned = empty, 0
    if p.min_tokens and state.stop_ids:
        num_banned = int(np.count_nonzero(positions < state.cursor.prompt_len + p.min_tokens))
        if num_banned:
            ban_ids = state.stop_array
    if not (add_ids.size or ban_ids.size or rep_ids.size):
        return None
    return RequestEdits(add_ids, add_values, ban_ids, num_banned, rep_ids, p.repetition_penalty)


def pack_edits(edits: list[RequestEdits | None], counts: list[int]) -> LogitEdits | None:
    """The edits of consecutive groups of rows (group g: ``counts[g]`` rows, edited by
    ``edits[g]``) as one :class:`LogitEdits` over all rows; None if there are none."""
    starts, sizes = [], []
    parts: dict[str, list[np.ndarray]] = {name: [] for name in LogitEdits._fields[2:-1]}

    def group(start: int, size: int) -> int:
        starts.append(start)
        sizes.append(size)
        return len(starts) - 1

    def entries(kind: str, g: int, ids: np.ndarray, values: np.ndarray | float) -> None:
        parts[f"{kind}_groups"].append(np.full(len(ids), g, dtype=np.int64))
        parts[f"{kind}_ids"].append(ids)
        parts[f"{kind}_values"].append(np.broadcast_to(np.float64(values), ids.shape))

    start = 0
    for e, n in zip(edits, counts, strict=True):
        if e is not None:
            every_row = group(start, n)
            entries("add", every_row, e.add_ids, e.add_values)
            entries("rep", every_row, e.rep_ids, e.repetition_penalty)
            if e.num_banned:
                entries("add", group(start, e.num_banned), e.ban_ids, -np.inf)
        start += n
    if not starts:
        return None
    return LogitEdits(np.array(starts, dtype=np.int64), np.array(sizes, dtype=np.int64),
                      *(np.concatenate(a) for a in parts.values()), width=max(sizes))


def _rows(edits: LogitEdits, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of each entry's group, ``[entries, width]``, and which of them are real: the
    slots beyond a group's rows point at its first row."""
    offsets = torch.arange(edits.width, device=groups.device)[None, :]
    real = offsets < edits.counts[groups][:, None]
    return edits.starts[groups][:, None] + torch.where(real, offsets, 0), real


def apply_edits(x: torch.Tensor, edits: LogitEdits) -> None:
    """Edit the logits ``x`` in place (tensors of ``edits`` on its device)."""
    if len(edits.rep_ids):
        # Repeated (row, token) pairs read the same logit and write the same value.
        rows, _ = _rows(edits, edits.rep_groups)
        ids = edits.rep_ids[:, None].expand_as(rows)
        picked = x[rows, ids]
        penalty = edits.rep_values.to(x.dtype)[:, None]
        x[rows, ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if len(edits.add_ids):
        # The slots that are not real add 0; a real pair repeats only when a banned token is
        # also biased: -inf either way. So the sums do not depend on the order of addition.
        rows, real = _rows(edits, edits.add_groups)
        values = torch.where(real, edits.add_values.to(x.dtype)[:, None], 0.0)
        x.index_put_((rows, edits.add_ids[:, None].expand_as(rows)), values, accumulate=True)


_ID_BITS = 32  # an entry's key: (group << 32) | token id, one sortable int64 per (group, token)


def batch_edits(states: list[DecodeState], positions: list[np.ndarray],
                counts: list[int]) -> LogitEdits | None:
    """``pack_edits`` of each request's ``request_edits`` (request i: ``counts[i]`` rows that
    predict ``positions[i]``), built for the whole batch at once: a few numpy calls in all, not
    a dozen per request, which dominate the host's time when many requests are penalized. The
    same edits, listed in another order (which ``apply_edits`` does not depend on)."""
    starts: list[int] = []
    sizes: list[int] = []
    add_keys: list[np.ndarray] = []
    add_values: list[np.ndarray] = []
    penalized: list[tuple[int, DecodeState]] = []  # (group, state)
    responses: list[np.ndarray] = []  # their committed response tokens (response_token_counts)
    start = 0
    for st, pos, n in zip(states, positions, counts, strict=True):
        p = st.params
        banned = 0
        if p.min_tokens and st.stop_ids:
            banned = int(np.count_nonzero(pos < st.cursor.prompt_len + p.min_tokens))
        if p.logit_bias or p.penalizes or banned:
            g = len(starts)
            starts.append(start)
            sizes.append(n)
            if p.logit_bias:
                add_keys.append((g << _ID_BITS) | np.array([t for t, _ in p.logit_bias]))
                add_values.append(np.array([b for _, b in p.logit_bias], dtype=np.float64))
            if p.penalizes:
                response = st.tokens[st.cursor.prompt_len:st.cursor.prompt_len + p.max_tokens]
                response = response[:st.stop_index(response)]
                responses.append(response[response != st.mask_token_id])
                penalized.append((g, st))
            if banned:  # a group of its own: its first rows
                starts.append(start)
                sizes.append(banned)
                add_keys.append(((g + 1) << _ID_BITS) | st.stop_array)
                add_values.append(np.full(len(st.stop_array), -np.inf))
        start += n
    if not starts:
        return None
    rep_groups, rep_ids, rep_values = [], [], []
    if penalized:
        owners = np.array([g for g, _ in penalized], dtype=np.int64)
        keys, seen_counts = np.unique(
            (np.repeat(owners, [len(r) for r in responses]) << _ID_BITS)
            | np.concatenate(responses), return_counts=True)
        seen_groups = keys >> _ID_BITS
        presence, frequency = np.zeros(len(starts)), np.zeros(len(starts))
        presence[owners] = [st.params.presence_penalty for _, st in penalized]
        frequency[owners] = [st.params.frequency_penalty for _, st in penalized]
        additive = (presence[seen_groups] != 0) | (frequency[seen_groups] != 0)
        add_keys.append(keys[additive])
        add_values.append(-(presence[seen_groups[additive]]
                            + frequency[seen_groups[additive]] * seen_counts[additive]))
        bounds = np.searchsorted(seen_groups, owners, side="left")
        ends = np.searchsorted(seen_groups, owners, side="right")
        for (g, st), a, b in zip(penalized, bounds, ends, strict=True):
            if st.params.repetition_penalty != 1.0:  # pairs may repeat, as in request_edits
                ids = np.concatenate([st.input_tokens, keys[a:b] & ((1 << _ID_BITS) - 1)])
                rep_groups.append(np.full(len(ids), g, dtype=np.int64))
                rep_ids.append(ids)
                rep_values.append(np.full(len(ids), st.params.repetition_penalty))
    keys, where = np.unique(np.concatenate(add_keys) if add_keys else np.zeros(0, np.int64),
                            return_inverse=True)
    values = np.zeros(len(keys))
    np.add.at(values, where, np.concatenate(add_values) if add_values else np.zeros(0))

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    return LogitEdits(np.array(starts, dtype=np.int64), np.array(sizes, dtype=np.int64),
                      keys >> _ID_BITS, keys & ((1 << _ID_BITS) - 1), values,
                      cat(rep_groups, np.int64), cat(rep_ids, np.int64),
                      cat(rep_values, np.float64), width=max(sizes))
