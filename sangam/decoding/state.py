"""One request's canvas and its progress through blocks and steps (DESIGN.md §2).

Both the single-request reference decoder and the batched engine drive requests through this
object, which is what makes their tokens identical: the engine differs only in how many
requests share a forward.

Infilling: with ``suffix_ids`` the sequence is prompt + [MASK]*G + suffix (T = P + G + S). The
suffix is context like the prompt: every refresh covers it, ``cache="prefix"`` spans reach it,
and the response is the canvas between the two.

Block-causal models (SDAR, ``block_causal=True``; README "Block-causal models"): blocks lie on
the grid from position 0, so block 0 is [floor(P/B)·B, +B) and may start with the prompt's tail;
T = ceil((P + max_tokens)/B)·B. A finished block's K/V is exact and never refreshed: the
request's first forward spans [0, e) (the prompt's K/V and block 0's first step under the
block-causal mask), the first step of every later block spans [s - B, e) (it writes the
finished block's final K/V as it steps the new one), and other steps span [s, e).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.noise import noise_key, row_keys
from sangam.decoding.rules import select_commits
from sangam.sampling_params import FULL_REFRESH, RESPONSE_REFRESH, SamplingParams


@dataclass
class StepPlan:
    """What the next forward of one request computes."""

    span_start: int
    span_end: int
    positions: np.ndarray  # candidate positions: forced ones first, then rule candidates
    num_forced: int  # Dream's refresh commits its block's first position regardless
    rows: np.ndarray  # hidden-state row (within the span) whose logits predict each position
    row_keys: np.ndarray  # uint32 noise key per row (used when temperature > 0)

    @property
    def span_len(self) -> int:
        return self.span_end - self.span_start


@dataclass
class BlockProgress:
    """What the forwards of one block changed in a request's state: that block's positions
    and the counters. The multi-worker front and its workers exchange this instead of the
    whole state, whose prompt, suffix and other blocks the receiving side already has."""

    start: int  # the block's first position
    tokens: np.ndarray
    confidence: np.ndarray
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
    block: int
    step: int
    num_forwards: int
    finished: bool
    finish_reason: str | None
    stop_len: int | None
    stop_string: str | None
    stop_text: IncrementalDetokenizer | None
    force_refresh: bool  # the next block refreshes fully (the adaptive trigger fired)
    threshold: float  # the threshold the block used (load-adaptive)


class DecodeState:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, mask_token_id: int,
                 stop_ids: frozenset[int], shift_logits: bool, seed: int = 0,
                 suffix_ids: list[int] | tuple[int, ...] = (), block_causal: bool = False):
        if not prompt_ids:
            raise ValueError("the prompt is empty: a request needs at least one prompt token")
        if block_causal and (suffix_ids or shift_logits):
            raise ValueError("a block-causal model has no infilling and no shifted logits")
        self.params = params
        self.mask_token_id = mask_token_id
        # The ids that end the response: EOS (given) under stop_at_eos, and the request's own.
        self.stop_ids = ((stop_ids if params.stop_at_eos else frozenset())
                         | frozenset(params.stop_token_ids))
        self.stop_array = np.array(sorted(self.stop_ids), dtype=np.int64)  # the same, for numpy
        self.shift = int(shift_logits)  # 1: row p - 1 predicts position p (Dream)
        self.seed = seed
        self.prompt_len = len(prompt_ids)
        self.block_causal = block_causal
        b = params.block_length
        # Block-causal: the block grid from position 0 (see the module docstring).
        self.block_origin = self.prompt_len // b * b if block_causal else self.prompt_len
        canvas = params.canvas_after(self.prompt_len, block_causal)
        self.canvas_end = self.prompt_len + canvas  # where the suffix begins
        self.tokens = np.array(
            list(prompt_ids) + [mask_token_id] * canvas + list(suffix_ids), dtype=np.int64)
        # Each response position's confidence (DESIGN.md §2) at the step that committed it.
        self.confidence = np.zeros(len(self.tokens), dtype=np.float64)
        # With logprobs = n > 0: each response position's n most probable tokens at that step.
        n = params.logprobs or 0
        self.top_ids = np.zeros((canvas, n), dtype=np.int64) if n else None
        self.top_logprobs = np.zeros((canvas, n), dtype=np.float64) if n else None
        # Each block's threshold: the request's, or for a load-adaptive one (min_threshold) what
        # the worker that started the block set (set_load).
        self.block_thresholds = np.full(self.num_blocks, params.threshold, dtype=np.float64)
        self.block = 0
        self.step = 0  # steps taken in the current block; 0 = the next is the block's first
        # The current block starts with a full refresh whatever the cadence says: the adaptive
        # trigger fired when the block before it ended (SamplingParams.refresh_confidence), or
        # the K/V its worker kept is gone (the front sets it then). Its first step clears it.
        self.force_refresh = False
        # Block-causal chunked prefill: prompt positions whose K/V is stored, and the end of
        # the chunk the scheduler admitted for the next forward (None: the whole rest).
        self.prefilled = 0
        self.chunk_end: int | None = None
        self.num_chunks = 0  # forwards that only stored prompt K/V
        self.num_forwards = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_len: int | None = None  # response tokens kept when a stop string ended it
        self.stop_string: str | None = None  # that stop string
        # The response's text as far as the stop strings were searched (it travels with the
        # state between workers, so each block is decoded once).
        self.stop_text = (IncrementalDetokenizer(params.skip_special_tokens) if params.stop
                          else None)

    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (after any truncation)."""
        return self.tokens[:self.prompt_len].tolist()

    def suffix_ids(self) -> list[int]:
        """The infilling suffix's token ids (empty without one)."""
        return self.tokens[self.canvas_end:].tolist()

    @functools.cached_property
    def input_tokens(self) -> np.ndarray:
        """The distinct token ids of the prompt and suffix (for the repetition penalty)."""
        return np.unique(np.concatenate([self.tokens[:self.prompt_len],
                                         self.tokens[self.canvas_end:]]))

    # Between processes.
    def progress(self, block: int) -> BlockProgress:
        """What the forwards of ``block`` changed (positions are only ever committed in the
        current block, so its positions and the counters are all of it)."""
        s = self.block_origin + block * self.params.block_length
        e = s + self.params.block_length
        top = slice(max(0, s - self.prompt_len), e - self.prompt_len)
        return BlockProgress(
            s, self.tokens[s:e].copy(), self.confidence[s:e].copy(),
            None if self.top_ids is None else self.top_ids[top].copy(),
            None if self.top_logprobs is None else self.top_logprobs[top].copy(),
            self.block, self.step, self.num_forwards, self.finished, self.finish_reason,
            self.stop_len, self.stop_string, self.stop_text, self.force_refresh,
            float(self.block_thresholds[block]))

    def catch_up(self, p: BlockProgress) -> None:
        """Take ``p`` (a copy of this state's ``progress``, from another process) in."""
        e = p.start + len(p.tokens)
        self.tokens[p.start:e] = p.tokens
        self.confidence[p.start:e] = p.confidence
        if p.top_ids is not None:
            top = slice(max(0, p.start - self.prompt_len), e - self.prompt_len)
            self.top_ids[top] = p.top_ids
            self.top_logprobs[top] = p.top_logprobs
        self.block, self.step, self.num_forwards = p.block, p.step, p.num_forwards
        self.finished, self.finish_reason = p.finished, p.finish_reason
        self.stop_len, self.stop_string, self.stop_text = p.stop_len, p.stop_string, p.stop_text
        self.force_refresh = p.force_refresh
        self.block_thresholds[(p.start - self.block_origin) // self.params.block_length] = \
            p.threshold

    # Geometry.
    @property
    def total_len(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        return (self.canvas_end - self.block_origin) // self.params.block_length

    def block_bounds(self) -> tuple[int, int]:
        s = self.block_origin + self.block * self.params.block_length
        return s, s + self.params.block_length

    @property
    def threshold(self) -> float:
        """The current block's threshold (what the threshold rule commits above)."""
        return float(self.block_thresholds[self.block])

    def set_load(self, load: float) -> None:
        """A worker at ``load`` (0 to 1) runs this request's next forward: if it starts a block
        of a load-adaptive request, that block's threshold is set from it."""
        if self.step == 0 and self.params.min_threshold is not None and not self.finished:
            self.block_thresholds[self.block] = self.params.threshold_under(load)

    def output_block_thresholds(self) -> list[float] | None:
        """The thresholds of the blocks decoded so far (a load-adaptive request's only)."""
        if self.params.min_threshold is None:
            return None
        return self.block_thresholds[:self.block + self.finished].tolist()

    def span(self) -> tuple[int, int]:
        """The next forward's span of query positions (DESIGN.md §2)."""
        s, e = self.block_bounds()
        p, end = self.params, self.total_len
        if self.block_causal:  # the cache is exact: nothing after a block ever attends to it
            if self.step > 0:
                return s, e
            if self.block == 0 or self.force_refresh:  # the prompt's K/V (what is left of it)
                start = 0 if self.force_refresh else self.prefilled
                return start, e if self.chunk_end is None else self.chunk_end
            return s - p.block_length, e
        if p.cache == "none":
            return 0, end
        if self.step == 0:  # the block's first step, as the refresh cadence says
            start = FULL_REFRESH if self.force_refresh else p.block_refresh(self.block)
            if start == FULL_REFRESH:
                return 0, end
            if start == RESPONSE_REFRESH:
                return self.prompt_len, end
            s -= self.shift  # a cached first step: with shifted logits, row s - 1 predicts s
        return (s, e) if p.cache == "dual" else (s, end)

    def keys_attended(self, span_end: int) -> int:
        """How many cached positions a forward ending at ``span_end`` attends over: all T, or
        for a block-causal model those up to its span's end (nothing after it is visible, and
        its pages hold nothing written yet)."""
        return span_end if self.block_causal else self.total_len

    # One step.
    def plan(self) -> StepPlan:
        start, end = self.span()
        s, e = self.block_bounds()
        if end <= s:  # a prefill chunk: it stores K/V and predicts nothing
            empty = np.zeros(0, dtype=np.int64)
            return StepPlan(start, end, empty, 0, empty, empty)
        offsets = (self.tokens[s:e] == self.mask_token_id).nonzero()[0]  # masked, in-block
        num_forced = 0
        shift = 1 if self.shift else 0
        if shift and offsets.size and offsets[0] == 0:
            # No row predicts position s in a block's later cached steps (its predictor is
            # s - 1), so it is no candidate there; a block's first step does predict it and
            # commits it outright: it stays first in the list, as the forced position.
            if self.step == 0 or self.params.cache == "none":
                num_forced = 1
            else:
                offsets = offsets[1:]
        positions = offsets + s
        rows = positions - (start + shift)
        if self.params.temperature > 0:
            keys = row_keys(noise_key(self.seed, self.block, self.step), offsets)
        else:  # greedy: no noise is drawn
            keys = np.zeros(len(positions), dtype=np.int64)
        return StepPlan(start, end, positions, num_forced, rows, keys)

    def apply(self, plan: StepPlan, tokens: np.ndarray, conf: np.ndarray) -> bool:
        """Commit this step's tokens (aligned with ``plan.positions``); True if a block ended."""
        return self.commit(plan.positions, plan.num_forced, tokens, conf)

    def commit(self, positions: np.ndarray, num_forced: int, tokens: np.ndarray,
               conf: np.ndarray) -> bool:
        """``apply`` on a plan's parts: the first ``num_forced`` positions are committed
        regardless, the rule picks among the rest; True if a block ended."""
        p = self.params
        if self.chunk_end is not None:  # the forward was a prefill chunk (no rows)
            self.prefilled, self.chunk_end = self.chunk_end, None
            self.num_chunks += 1
            self.num_forwards += 1
            return False
        k = num_forced
        chosen = select_commits(conf[k:].tolist(), p.unmasking, self.threshold, p.factor,
                                p.tokens_per_step)
        commit = list(range(k)) + [k + i for i in chosen]
        self.tokens[positions[commit]] = tokens[commit]
        self.confidence[positions[commit]] = conf[commit]
        self.step += 1
        self.force_refresh = False
        self.num_forwards += 1
        s, e = self.block_bounds()
        if self.mask_token_id in self.tokens[s:e]:
            return False
        # A stop id beyond max_tokens (the last block's padding) is no stop: the response
        # reached its length first.
        response = self.tokens[self.prompt_len:min(e, self.prompt_len + p.max_tokens)]
        if self.stop_index(response) < len(response):
            self.finished, self.finish_reason = True, "stop"
        elif self.block + 1 == self.num_blocks:
            self.finished, self.finish_reason = True, "length"
        else:
            self.block += 1
            self.step = 0
            # Adaptive refresh: an unsure block leaves the next one no stale cache to trust.
            self.force_refresh = bool(
                p.refresh_confidence > 0 and p.block_refresh(self.block) != FULL_REFRESH
                and self.confidence[s:e].min() < p.refresh_confidence)
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
        self.finished, self.finish_reason = True, "stop"
        self.stop_len, self.stop_string = num_tokens, stop_string

    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string or the ``stop_token_ids`` id that ended the
        response; None when something else did (EOS, the length) or it has not ended."""
        if self.finish_reason != "stop" or self.stop_string is not None:
            return self.stop_string
        response = self.tokens[self.prompt_len:self.prompt_len + self.params.max_tokens]
        token = int(response[self.stop_index(response)])
        return token if token in self.params.stop_token_ids else None

    def output_logprobs(self, num_tokens: int) -> list[float]:
        """Log-probability of each of the first ``num_tokens`` response tokens under the model
        at the step that committed it (the log of its confidence; floored at the smallest
        normal double so that it stays finite)."""
        conf = self.confidence[self.prompt_len:self.prompt_len + num_tokens]
        return np.log(np.maximum(conf, np.finfo(np.float64).tiny)).tolist()

    def record_top(self, positions: np.ndarray, logprobs: np.ndarray, ids: np.ndarray) -> None:
        """Keep, for the ``positions`` this step committed (call after :meth:`apply`), the most
        probable tokens of their rows (``logprobs``, ``ids``: ``[len(positions), n]``)."""
        done = self.tokens[positions] != self.mask_token_id
        at = positions[done] - self.prompt_len
        self.top_ids[at] = ids[done]
        self.top_logprobs[at] = logprobs[done]

    def output_top_logprobs(self, num_tokens: int) -> list[list[tuple[int, float]]]:
        """The first ``num_tokens`` response tokens' alternatives, as (token id, logprob), most
        probable first; tokens that could not be chosen (log-probability -inf) are left out."""
        return [[(t, lp) for t, lp in zip(ids, lps, strict=True) if lp != -np.inf]
                for ids, lps in zip(self.top_ids[:num_tokens].tolist(),
                                    self.top_logprobs[:num_tokens].tolist(), strict=True)]

    def output_token_ids(self) -> list[int]:
        """The response decoded so far (whole blocks), cut before the first stop id, to a stop
        string's end and to max_tokens."""
        s, _ = self.block_bounds()
        end = self.canvas_end if self.finished else s
        out = self.tokens[self.prompt_len:end]
        out = out[:self.stop_index(out)].tolist()
        limit = self.params.max_tokens
        return out[:limit if self.stop_len is None else min(limit, self.stop_len)]
