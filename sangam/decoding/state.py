"""One request's canvas and its progress through blocks and steps (docs/design.md §2).

Both the single-request reference decoder and the batched engine drive requests through this
object, which is what makes their tokens identical: the engine differs only in how many
requests share a forward.

Infilling: with ``suffix_ids`` the sequence is prompt + [MASK]*G + suffix (T = P + G + S). The
suffix is context like the prompt: every refresh covers it, ``cache="prefix"`` spans reach it,
and the response is the canvas between the two.

Which positions each forward covers, and where the request stands, is its ``BlockCursor``
(sangam/sched/block_cursor.py), which the scheduler's ``Request`` of the same request shares; a
commit moves it. Block-causal models (SDAR, ``block_causal=True``) lay their blocks on the grid
from position 0, so block 0 may start with the prompt's tail. What a step does with its rows
is the request's decoding family (``family``, sangam/decoding/family.py), composed from its
options: this object holds the request's state, the family its rules.

The C++ host path (csrc/host_batch.cpp) reads ``host_buffers``: the cursor's record, this
object's ``record`` and ``floats`` (fields ``DECODE_FIELDS`` and ``DECODE_FLOAT_FIELDS``) and
its arrays, and mirrors ``plan`` and ``commit`` of the family it mirrors (``host_commits``).
"""

from __future__ import annotations

import functools
import math
from array import array

import numpy as np

from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.family import MaskedDiffusion, StepPlan
from sangam.decoding.grammar import GrammarState
from sangam.decoding.rules import RULE_IDS
from sangam.decoding.uniform import UNIFORM_STATE, Canvas, CanvasSpec
from sangam.sampling_params import SamplingParams
from sangam.sched.block_cursor import BlockCursor

# The decoder's record (beside its cursor's): the request's fixed integer parameters, then its
# counters. finish_reason is an index into FINISH_REASONS; seed is its low 64 bits;
# host_commits is 1 when the C++ host path commits its steps (its family's
# ``MaskedDiffusion.host_commits``), 0 when Python does.
DECODE_FIELDS = ("mask_token_id", "seed", "rule", "tokens_per_step", "max_tokens",
                 "max_post_steps", "host_commits", "num_forwards", "num_chunks", "finished",
                 "finish_reason", "post_steps")
# edit_threshold is +inf without editing (no probability exceeds it).
DECODE_FLOAT_FIELDS = ("temperature", "factor", "refresh_confidence", "edit_threshold")
FINISH_REASONS = (None, "stop", "length")
# What the C++ host path reads of a request, in ``DecodeState.host_buffers`` order.
HOST_BUFFERS = ("cursor", "record", "floats", "tokens", "confidence", "block_thresholds",
                "stop_ids")
_FORWARDS, _CHUNKS, _FINISHED, _REASON, _POST = (
    DECODE_FIELDS.index(n) for n in ("num_forwards", "num_chunks", "finished", "finish_reason",
                                     "post_steps"))


def stop_ids_of(params: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """The ids that end a request's response: the model's EOS ids under stop_at_eos, and the
    request's own stop_token_ids."""
    return (eos_ids if params.stop_at_eos else frozenset()) | frozenset(params.stop_token_ids)


class DecodeState:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, mask_token_id: int,
                 stop_ids: frozenset[int], shift_logits: bool, seed: int = 0,
                 suffix_ids: list[int] | tuple[int, ...] = (), block_causal: bool = False,
                 grammar: GrammarState | None = None, canvas: CanvasSpec | None = None):
        if not prompt_ids:
            raise ValueError("the prompt is empty: a request needs at least one prompt token")
        if block_causal and (suffix_ids or shift_logits):
            raise ValueError("a block-causal model has no infilling and no shifted logits")
        self.params = params
        # Structured output: the request's matcher; its steps commit by the frontier rule.
        self.grammar = grammar
        # What its steps do with their rows (sangam/decoding/family.py).
        self.family = UNIFORM_STATE if canvas is not None else MaskedDiffusion.for_request(
            structured=grammar is not None, editing=params.edit_threshold is not None)
        # Uniform-state requests (DiffusionGemma): what their canvases are, and the current one.
        self.canvas_spec = canvas
        self.canvas: Canvas | None = None
        # With include_drafts: the current block's provisional content after a step that did
        # not end it (the runner sets it, the worker reports it and clears it).
        self.draft: np.ndarray | None = None
        self.mask_token_id = mask_token_id
        self.stop_ids = stop_ids_of(params, stop_ids)
        self.stop_array = np.array(sorted(self.stop_ids), dtype=np.int64)  # the same, for numpy
        self.seed = seed
        # Which positions each forward covers, and where the request stands (shared with the
        # scheduler's Request): the one place its geometry and position are read.
        if canvas is None:
            self.cursor = BlockCursor.for_request(params, len(prompt_ids),
                                                  suffix_len=len(suffix_ids),
                                                  shift=int(shift_logits),
                                                  block_causal=block_causal)
        else:
            self.cursor = BlockCursor.for_canvases(len(prompt_ids), params.max_tokens,
                                                   canvas.length)
        canvas = self.cursor.canvas_end - self.cursor.prompt_len
        self.tokens = np.array(
            list(prompt_ids) + [mask_token_id] * canvas + list(suffix_ids), dtype=np.int64)
        # Each response position's confidence (docs/design.md §2) at the step that committed it.
        self.confidence = np.zeros(len(self.tokens), dtype=np.float64)
        # With logprobs = n > 0: each response position's n most probable tokens at that step.
        n = params.logprobs or 0
        self.top_ids = np.zeros((canvas, n), dtype=np.int64) if n else None
        self.top_logprobs = np.zeros((canvas, n), dtype=np.float64) if n else None
        # Each block's threshold: the request's, or for a load-adaptive one (min_threshold) what
        # the worker that started the block set (set_load).
        self.block_thresholds = np.full(self.cursor.num_blocks, params.threshold, dtype=np.float64)
        # With return_trajectory: every value a response position took, as (position, token,
        # forward index, log-probability at that forward), in the order they were written.
        self.trajectory: list[tuple[int, int, int, float]] | None = (
            [] if params.return_trajectory else None)
        low = seed & (2**64 - 1)  # the noise key reads the seed's low 64 bits
        self.record = array("q", (mask_token_id, low - 2**64 if low >= 2**63 else low,
                                  RULE_IDS[params.unmasking], params.tokens_per_step,
                                  params.max_tokens, params.max_post_steps,
                                  int(self.family.host_commits), 0, 0, 0, 0, 0))
        edit = math.inf if params.edit_threshold is None else params.edit_threshold
        self.floats = array("d", (params.temperature, params.factor, params.refresh_confidence,
                                  edit))
        self.host_buffers = (self.cursor.record, self.record, self.floats, self.tokens,
                             self.confidence, self.block_thresholds, self.stop_array)
        self.stop_len: int | None = None  # response tokens kept when a stop string ended it
        self.stop_string: str | None = None  # that stop string
        # The response's text as far as the stop strings were searched (it travels with the
        # state between workers, so each block is decoded once).
        self.stop_text = (IncrementalDetokenizer(params.skip_special_tokens) if params.stop
                          else None)

    # The counters (kept in the record the C++ host path shares).
    @property
    def num_forwards(self) -> int:
        return self.record[_FORWARDS]

    @num_forwards.setter
    def num_forwards(self, value: int) -> None:
        self.record[_FORWARDS] = value

    @property
    def num_chunks(self) -> int:
        """Forwards that only stored prompt K/V (block-causal chunked prefill)."""
        return self.record[_CHUNKS]

    @property
    def post_steps(self) -> int:
        """The current block's editing-only steps so far (token editing)."""
        return self.record[_POST]

    @post_steps.setter
    def post_steps(self, value: int) -> None:
        self.record[_POST] = value

    @property
    def finished(self) -> bool:
        return bool(self.record[_FINISHED])

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS[self.record[_REASON]]

    def finish(self, reason: str | None) -> None:
        """End (``reason`` "stop" or "length") or, with None, reopen the request."""
        self.record[_FINISHED] = reason is not None
        self.record[_REASON] = FINISH_REASONS.index(reason)

    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (after any truncation)."""
        return self.tokens[:self.cursor.prompt_len].tolist()

    def suffix_ids(self) -> list[int]:
        """The infilling suffix's token ids (empty without one)."""
        return self.tokens[self.cursor.canvas_end:].tolist()

    @functools.cached_property
    def input_tokens(self) -> np.ndarray:
        """The distinct token ids of the prompt and suffix (for the repetition penalty)."""
        c = self.cursor
        return np.unique(np.concatenate([self.tokens[:c.prompt_len], self.tokens[c.canvas_end:]]))

    @property
    def threshold(self) -> float:
        """The current block's threshold (what the threshold rule commits above)."""
        return float(self.block_thresholds[self.cursor.block])

    def set_load(self, load: float) -> None:
        """A worker at ``load`` (0 to 1) runs this request's next forward: if it starts a block
        of a load-adaptive request, that block's threshold is set from it."""
        c = self.cursor
        if c.step == 0 and self.params.min_threshold is not None and not self.finished:
            self.block_thresholds[c.block] = self.params.threshold_under(load)

    def output_block_thresholds(self) -> list[float] | None:
        """The thresholds of the blocks decoded so far (a load-adaptive request's only)."""
        if self.params.min_threshold is None:
            return None
        return self.block_thresholds[:self.cursor.block + self.finished].tolist()

    # One step, by the request's family.
    def plan(self) -> StepPlan:
        """The next forward's span and the positions its rows predict."""
        return self.family.plan(self)

    def apply(self, plan: StepPlan, tokens: np.ndarray, conf: np.ndarray) -> bool:
        """Commit this step's tokens (aligned with ``plan.positions``); True if a block ended."""
        return self.commit(plan.positions, plan.num_forced, tokens, conf, plan.num_editable)

    def commit(self, positions: np.ndarray, num_forced: int, tokens: np.ndarray | None,
               conf: np.ndarray | None, num_editable: int = 0, logits: object = None,
               keys: np.ndarray | None = None) -> bool:
        """``apply`` on a plan's parts (a family that reads its rows' whole ``logits`` takes
        them and their noise ``keys`` instead of tokens and confidences): the first
        ``num_forced`` positions are committed regardless, the selector picks among the rest
        but the last ``num_editable`` (filled positions, edited where their token is sure and
        different); moves the cursor; True if a block ended."""
        return self.family.commit(self, positions, num_forced, tokens, conf, num_editable,
                                  logits, keys)

    def begin_step(self) -> bool:
        """Count a forward; if it was a prefill chunk (it stored K/V and scored nothing), move
        past the chunk and return True."""
        c, r = self.cursor, self.record
        r[_FORWARDS] += 1
        if c.chunk_end is None:
            return False
        c.store_chunk()
        r[_CHUNKS] += 1
        return True

    def stop_index(self, response: np.ndarray) -> int:
        """Where ``response`` (response tokens) holds its first stop id; its length if none."""
        if not self.stop_ids:
            return len(response)
        if len(self.stop_array) <= 4:  # EOS and end-of-turn, typically: np.isin costs 10x more
            hit = response == self.stop_array[0]
            for t in self.stop_array[1:]:
                hit |= response == t
        else:
            hit = np.isin(response, self.stop_array)
        return int(hit.argmax()) if hit.any() else len(response)

    def stop_after(self, num_tokens: int, stop_string: str) -> None:
        """End the request with its first ``num_tokens`` response tokens (``stop_string`` ended
        there: the engine finds those in text, which this class never sees)."""
        self.finish("stop")
        self.stop_len, self.stop_string = num_tokens, stop_string

    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string or the ``stop_token_ids`` id that ended the
        response; None when something else did (EOS, the length) or it has not ended."""
        if self.finish_reason != "stop" or self.stop_string is not None:
            return self.stop_string
        p = self.cursor.prompt_len
        response = self.tokens[p:p + self.params.max_tokens]
        token = int(response[self.stop_index(response)])
        return token if token in self.params.stop_token_ids else None

    def output_logprobs(self, num_tokens: int) -> list[float]:
        """Log-probability of each of the first ``num_tokens`` response tokens under the model
        at the step that committed it (the log of its confidence; floored at the smallest
        normal double so that it stays finite)."""
        conf = self.confidence[self.cursor.prompt_len:self.cursor.prompt_len + num_tokens]
        return np.log(np.maximum(conf, np.finfo(np.float64).tiny)).tolist()

    def record_top(self, positions: np.ndarray, logprobs: np.ndarray, ids: np.ndarray) -> None:
        """Keep, for the ``positions`` this step committed (call after :meth:`apply`), the most
        probable tokens of their rows (``logprobs``, ``ids``: ``[len(positions), n]``)."""
        done = self.tokens[positions] != self.mask_token_id
        at = positions[done] - self.cursor.prompt_len
        self.top_ids[at] = ids[done]
        self.top_logprobs[at] = logprobs[done]

    def output_top_logprobs(self, num_tokens: int) -> list[list[tuple[int, float]]]:
        """The first ``num_tokens`` response tokens' alternatives, as (token id, logprob), most
        probable first; tokens that could not be chosen (log-probability -inf) are left out."""
        return [[(t, lp) for t, lp in zip(ids, lps, strict=True) if lp != -np.inf]
                for ids, lps in zip(self.top_ids[:num_tokens].tolist(),
                                    self.top_logprobs[:num_tokens].tolist(), strict=True)]

    # Trajectories (return_trajectory): what each forward wrote.
    def block_snapshot(self) -> tuple[int, np.ndarray]:
        """The current block's start and tokens, before a step (for ``note_step``)."""
        s, e = self.cursor.block_bounds()
        return s, self.tokens[s:e].copy()

    def note_step(self, before: tuple[int, np.ndarray]) -> None:
        """Record in the trajectory each position the step after ``before`` (its
        ``block_snapshot``) wrote: its token, the step's forward index and the token's
        log-probability then (the log of the confidence it was committed with)."""
        s, old = before
        new = self.tokens[s:s + len(old)]
        at = (new != old).nonzero()[0]
        if len(at):
            self.note(s + at, np.log(np.maximum(self.confidence[s + at],
                                                np.finfo(np.float64).tiny)))

    def note(self, positions: np.ndarray, logprobs: np.ndarray) -> None:
        """Record that the forward just counted wrote ``positions`` (their tokens now) with
        these log-probabilities."""
        step = self.num_forwards - 1
        self.trajectory += [(p, t, step, lp) for p, t, lp in zip(
            positions.tolist(), self.tokens[positions].tolist(), logprobs.tolist())]

    def output_trajectory(self) -> list[list[tuple[int, int, float]]]:
        """For each position of the response canvas, every value a forward wrote there, in
        order, as (forward index, token, log-probability): the last is its token; none for a
        position no forward decoded (after the block a stop ended). The forwards' input is the
        prompt, the canvas (each position as the forwards before had left it, else masked) and
        the suffix, so a trainer can rebuild every one."""
        p = self.cursor.prompt_len
        out: list[list[tuple[int, int, float]]] = [
            [] for _ in range(self.cursor.canvas_end - p)]
        for pos, token, step, lp in self.trajectory:
            out[pos - p].append((step, token, lp))
        return out

    def num_committed(self) -> int:
        """Response positions committed so far: unmasked ones, or a uniform-state request's
        finished canvases (its canvas in progress holds noise, committed nowhere)."""
        c = self.cursor
        if self.canvas_spec is not None:  # the canvases before this one, and it if it ended
            s, e = c.block_bounds()
            return (e if self.finished else s) - c.prompt_len
        return int(np.count_nonzero(self.tokens[c.prompt_len:c.canvas_end]
                                    != self.mask_token_id))

    def make_draft(self, positions: np.ndarray, predicted: np.ndarray) -> None:
        """Set ``draft`` from a step that did not end the block: its response positions'
        tokens, masked ones as ``predicted`` at ``positions`` (a uniform-state canvas: its
        argmax, all committed nowhere yet)."""
        c = self.cursor
        s, e = c.block_bounds()
        start, end = max(s, c.prompt_len), min(e, c.prompt_len + self.params.max_tokens)
        block = self.tokens[s:e].copy()
        if self.canvas is not None:
            block[:] = self.canvas.argmax.cpu().numpy()
        else:
            open_ = block[positions - s] == self.mask_token_id
            block[positions[open_] - s] = predicted[open_]
        self.draft = block[start - s:end - s]

    def output_token_ids(self) -> list[int]:
        """The response decoded so far (whole blocks), cut before the first stop id, to a stop
        string's end and to max_tokens."""
        s, _ = self.cursor.block_bounds()
        end = self.cursor.canvas_end if self.finished else s
        out = self.tokens[self.cursor.prompt_len:end]
        out = out[:self.stop_index(out)].tolist()
        limit = self.params.max_tokens
        return out[:limit if self.stop_len is None else min(limit, self.stop_len)]
