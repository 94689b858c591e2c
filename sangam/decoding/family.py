"""Decoding families (docs/design.md §2): what a request's step does with its forward, behind one
interface. A family says which positions the step's rows predict (``plan``), what the step
writes from those rows and how the request's record moves (``commit``), and when a block is
done. It is composed per request from step rules, each one part of the step:

- a selector, over the block's masked positions: an unmasking rule (``Unmasking``: threshold,
  factor or topk, §2.6) or the grammar frontier of structured output (``Frontier``, §2.10,
  which reads its rows' whole logits);
- optionally token editing (``Editing``, §2.9: LLaDA2.1's, over the block's filled response
  positions), which also decides whether a block whose masks are all filled goes on.

``MaskedDiffusion`` is the family every served model uses: a step commits masked positions; a
block ends when none is left (and editing has stopped); then the request stops at a stop id or
the canvas's end. The C++ host path (csrc/host_batch.cpp) mirrors its plans, and its commits
with an unmasking rule; it leaves the commits of a request whose record says otherwise
(``host_commits`` 0: the frontier) to Python, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.grammar import ConstraintError
from sangam.decoding.logit_edits import pack_edits, request_edits
from sangam.decoding.noise import noise_key, row_keys
from sangam.decoding.rules import select_commits
from sangam.sched.block_cursor import FULL_REFRESH

if TYPE_CHECKING:
    from sangam.decoding.state import DecodeState


@dataclass
class StepPlan:
    """What the next forward of one request computes."""

    span_start: int
    span_end: int
    # Candidate positions: forced ones first, then the rule's (masked), then with token editing
    # the block's filled response positions (the last num_editable).
    positions: np.ndarray
    num_forced: int  # Dream's refresh commits its block's first position regardless
    rows: np.ndarray  # hidden-state row (within the span) whose logits predict each position
    row_keys: np.ndarray  # uint32 noise key per row (used when temperature > 0)
    num_editable: int = 0

    @property
    def span_len(self) -> int:
        return self.span_end - self.span_start


class Unmasking:
    """Commit the masked candidates the request's rule picks from their confidences (always
    at least one): §2.6."""

    reads_logits = False  # it reads each row's token and confidence
    host_commits = True  # the C++ host path mirrors it

    def write(self, st: DecodeState, positions: np.ndarray, num_forced: int,
              tokens: np.ndarray, conf: np.ndarray, logits: torch.Tensor | None,
              keys: np.ndarray | None) -> bool:
        """Write the forced rows and the rule's choice among the rest; whether it wrote any."""
        p = st.params
        chosen = select_commits(conf[num_forced:].tolist(), p.unmasking, st.threshold,
                                p.factor, p.tokens_per_step)
        commit = list(range(num_forced)) + [num_forced + i for i in chosen]
        st.tokens[positions[commit]] = tokens[commit]
        st.confidence[positions[commit]] = conf[commit]
        return bool(commit)


class Frontier:
    """Structured output's rule (§2.10): from the block's first masked position f (the block's
    committed positions are always a prefix), each position's row, masked by the grammar as
    advanced over the tokens before it, is scored as §2.5 says; f always commits, and f+1,
    f+2, ... while their confidence passes the request's rule read left to right."""

    reads_logits = True  # its rows come back whole, and it scores them itself
    host_commits = False  # Python commits it (the C++ host path plans it, as Unmasking)

    @staticmethod
    def passes(st: DecodeState, conf: float, n: int) -> bool:
        """Whether the ``n``-th position after the frontier (n >= 1) commits at ``conf``: the
        request's rule read left to right (threshold; factor's 1 - f/(n+2); topk's count)."""
        p = st.params
        if p.unmasking == "threshold":
            return conf >= st.threshold
        if p.unmasking == "factor":
            return conf >= 1.0 - p.factor / (n + 2)
        return n < p.tokens_per_step

    def write(self, st: DecodeState, positions: np.ndarray, num_forced: int,
              tokens: np.ndarray | None, conf: np.ndarray | None, logits: torch.Tensor,
              keys: np.ndarray) -> bool:
        """``logits`` ``[len(positions), vocab]``: the raw rows of the candidate ``positions``
        (the frontier first), ``keys`` their noise keys."""
        grammar, p, c = st.grammar, st.params, st.cursor
        grammar.sync(st.tokens[c.prompt_len:c.canvas_end], st.mask_token_id)
        vocab = logits.shape[-1]
        one = lambda value, dtype: torch.full((1,), value, dtype=dtype)
        for n, pos in enumerate(positions.tolist()):
            allowed = torch.from_numpy(grammar.allowed(vocab)).to(logits.device)
            row = logits[n:n + 1].masked_fill(~allowed, float("-inf"))
            edits = pack_edits([request_edits(st, positions[n:n + 1])], [1])
            token, score, _ = score_logits(
                row, st.mask_token_id, one(p.temperature, torch.float64),
                torch.from_numpy(keys[n:n + 1]), one(p.top_p, torch.float64),
                one(p.top_k, torch.int64), one(p.min_p, torch.float64),
                None if edits is None else edits.map(torch.from_numpy), 0)
            token, score = int(token[0]), float(score[0])
            if n and not self.passes(st, score, n):
                break
            if not allowed[token]:
                raise ConstraintError("no token satisfies both the constraint and the request's "
                                      "other options (min_tokens, logit_bias) at position "
                                      f"{pos - c.prompt_len} of the response")
            fitted = grammar.fit(token)
            if fitted != token:  # the completion's token, so that the output ends in time
                if n:  # only the frontier takes it in the model's stead
                    break
                if grammar.is_end(fitted) and pos - c.prompt_len < p.min_tokens:
                    raise ConstraintError(f"the constraint must end at position "
                                          f"{pos - c.prompt_len} of the response to fit "
                                          f"max_tokens, before min_tokens ({p.min_tokens})")
                token = fitted
                score = float(torch.softmax(row[0].double(), -1)[token])
            st.tokens[pos] = token
            st.confidence[pos] = score
            grammar.consume(token)  # the committed prefix grows by this position
        return True


class Editing:
    """LLaDA2.1's token editing (§2.9): a filled response position of the block takes its row's
    token when that differs and is sure beyond ``edit_threshold`` (strictly); a block whose
    masks are filled takes editing-only steps while they change something, at most
    ``max_post_steps`` of them."""

    def candidates(self, st: DecodeState, block: np.ndarray, s: int) -> np.ndarray:
        """The block's filled response positions, as offsets from its start ``s``."""
        filled = (block != st.mask_token_id).nonzero()[0]
        return filled[filled >= st.cursor.prompt_len - s]

    def write(self, st: DecodeState, positions: np.ndarray, tokens: np.ndarray,
              conf: np.ndarray) -> bool:
        edit = (conf > st.params.edit_threshold) & (tokens != st.tokens[positions])
        st.tokens[positions[edit]] = tokens[edit]
        st.confidence[positions[edit]] = conf[edit]
        return bool(edit.any())

    def goes_on(self, st: DecodeState, had_masks: bool, edited: bool) -> bool:
        """Whether the block, whose masks are all filled, takes another editing-only step:
        after the step that filled its last mask, if max_post_steps allows one; after an
        editing-only step, if it changed something and the allowance is not spent."""
        if not had_masks:
            st.post_steps += 1
            if not edited:
                return False
        return st.post_steps < st.params.max_post_steps


UNMASKING, FRONTIER, EDITING = Unmasking(), Frontier(), Editing()


class MaskedDiffusion:
    """The masked family: a ``selector`` (``UNMASKING`` or ``FRONTIER``) over the block's masked
    positions, with ``editing`` (``EDITING``) or without."""

    __slots__ = ("selector", "editing", "reads_logits", "host_commits")
    device_logits = False  # rows it reads whole come to the host

    def __init__(self, selector: Unmasking | Frontier, editing: Editing | None = None):
        self.selector = selector
        self.editing = editing
        # Read for every request of every iteration: the selector's, kept as attributes.
        self.reads_logits = selector.reads_logits
        self.host_commits = selector.host_commits

    @staticmethod
    def for_request(structured: bool, editing: bool) -> MaskedDiffusion:
        """The composition a request's options ask for: one of four, shared by every request
        that asks for it (a family holds rules, not state)."""
        return _MASKED[bool(structured), bool(editing)]

    def __reduce__(self) -> tuple:  # travels as what it is composed of (the rules are shared)
        return MaskedDiffusion.for_request, (self.selector is FRONTIER, self.editing is not None)

    def plan(self, st: DecodeState) -> StepPlan:
        """The next forward's span and the positions its rows predict: the block's masked
        positions, then (with editing) its filled response positions. With shifted logits
        (Dream) no row of a later cached step predicts the block's first position, and a
        block's first step commits it outright (the forced row)."""
        c = st.cursor
        start, end = c.span()
        s, e = c.block_bounds()
        if end <= s:  # a prefill chunk: it stores K/V and predicts nothing
            empty = np.zeros(0, dtype=np.int64)
            return StepPlan(start, end, empty, 0, empty, empty)
        block = st.tokens[s:e]
        offsets = (block == st.mask_token_id).nonzero()[0]  # masked, in-block
        num_editable = 0
        if self.editing is not None:
            filled = self.editing.candidates(st, block, s)
            num_editable = len(filled)
            offsets = np.concatenate([offsets, filled])
        num_forced = 0
        shift = 1 if c.shift else 0
        if shift and offsets.size and offsets[0] == 0:
            # Its predictor is s - 1: a block's first step has that row and commits s outright
            # (it stays first, as the forced position); a later cached step has not.
            if c.step == 0 or c.cache == "none":
                num_forced = 1
            else:
                offsets = offsets[1:]
        positions = offsets + s
        rows = positions - (start + shift)
        if st.params.temperature > 0:
            keys = row_keys(noise_key(st.seed, c.block, c.step), offsets)
        else:  # greedy: no noise is drawn
            keys = np.zeros(len(positions), dtype=np.int64)
        return StepPlan(start, end, positions, num_forced, rows, keys, num_editable)

    def commit(self, st: DecodeState, positions: np.ndarray, num_forced: int,
               tokens: np.ndarray | None, conf: np.ndarray | None, num_editable: int = 0,
               logits: torch.Tensor | None = None, keys: np.ndarray | None = None) -> bool:
        """Write this step from its rows (aligned with ``positions``: their tokens and
        confidences, or with ``reads_logits`` their whole ``logits`` and noise ``keys``) and
        move the request on; whether its block ended."""
        if st.begin_step():
            return False
        if not num_editable:
            changed = self.selector.write(st, positions, num_forced, tokens, conf, logits, keys)
            return self.end_step(st, len(positions) > 0, changed)
        m = len(positions) - num_editable  # the selector's rows, then the editable ones
        changed = self.selector.write(st, positions[:m], num_forced, tokens[:m], conf[:m],
                                      logits, keys)
        # Disjoint from the masked positions: the order of the two writes does not matter.
        changed = self.editing.write(st, positions[m:], tokens[m:], conf[m:]) or changed
        return self.end_step(st, m > 0, changed)

    def end_step(self, st: DecodeState, had_masks: bool, changed: bool) -> bool:
        """After a step's tokens are written: end the block (and the request, at a stop id or
        the canvas's end) or take another step; moves the cursor; True if a block ended.
        ``had_masks``: the step began with masks; ``changed``: it wrote some token."""
        p, c = st.params, st.cursor
        s, e = c.block_bounds()
        if st.mask_token_id in st.tokens[s:e]:
            c.advance(block_done=False, finished=False)
            return False
        if self.editing is not None and self.editing.goes_on(st, had_masks, edited=changed):
            c.advance(block_done=False, finished=False)
            return False
        st.post_steps = 0
        # A stop id beyond max_tokens (the last block's padding) is no stop: the response
        # reached its length first.
        response = st.tokens[c.prompt_len:min(e, c.prompt_len + p.max_tokens)]
        if st.stop_index(response) < len(response):
            st.finish("stop")
        elif c.block + 1 == c.num_blocks:
            st.finish("length")
        # Adaptive refresh: an unsure block leaves the next one no stale cache to trust.
        force = (not st.finished and p.refresh_confidence > 0
                 and c.block_refresh(c.block + 1) != FULL_REFRESH
                 and st.confidence[s:e].min() < p.refresh_confidence)
        c.advance(block_done=True, finished=st.finished, force_next=force)
        return True


_MASKED = {(structured, editing): MaskedDiffusion(FRONTIER if structured else UNMASKING,
                                                 EDITING if editing else None)
           for structured in (False, True) for editing in (False, True)}
