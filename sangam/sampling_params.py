"""User-facing request options and results (docs/design.md §3)."""

from __future__ import annotations

import functools
import json as _json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

UNMASKING_RULES = ("threshold", "factor", "topk")
CACHE_MODES = ("dual", "prefix", "none")
GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily, as in vLLM
MAX_TEMPERATURE = 1e4  # beyond it logits / t underflow to a uniform draw anyway
# Stop strings are matched against each block's text (the hold-back scan is quadratic in a
# string's length): generous bounds that keep a request from stalling the server.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # biased tokens per request
MAX_BIAS = 100.0  # a logit_bias value is in [-MAX_BIAS, MAX_BIAS], OpenAI's range
MAX_LOGPROBS = 20  # alternatives per token, vLLM's default max_logprobs
MAX_PENALTY = 2.0  # presence / frequency penalties, OpenAI's range
# Logits are divided (or multiplied) by it: far beyond any use, far from fp32 overflow.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_N = 128  # samples per prompt, OpenAI's limit
MAX_STOP_TOKEN_IDS = 1024
# Lengths, counts and token ids reach int32 arrays on the device and int64 ones on the host:
# bounded here, so no request can overflow either downstream.
MAX_INT32 = 2**31 - 1
SEED_BITS = 63  # a seed is in [0, 2**SEED_BITS): a non-negative int64
MAX_POST_STEPS = 1024  # editing-only forwards per block (LLaDA2.1's default is 16)


MAX_DENOISING_STEPS = 1024  # a uniform-state canvas's steps: far beyond use (the release: 48)
MAX_ENTROPY = 1e6  # an entropy is at most ln(vocab): a larger bound accepts everything anyway


@dataclass(frozen=True)
class UniformStateParams:
    """A uniform-state request's denoising options (DiffusionGemma, docs/design.md §2.12);
    defaults: transformers' (a checkpoint's generation_config.json and the request's fields
    override them). ``confidence_threshold`` 0 turns adaptive stopping off."""

    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    def __post_init__(self) -> None:
        for f in fields(self):
            check_uniform_field(f.name, getattr(self, f.name))
        if not self.t_min < self.t_max:
            raise ValueError(f"t_min ({self.t_min}) must be below t_max ({self.t_max})")


UNIFORM_FIELDS = tuple(f.name for f in fields(UniformStateParams))


def check_uniform_field(name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is within ``name``'s bounds (``UNIFORM_FIELDS``)."""
    if name in ("max_denoising_steps", "stability_threshold"):
        low = 1 if name == "max_denoising_steps" else 0
        ok = _is_int(value) and low <= value <= MAX_DENOISING_STEPS
        what = f"an integer in [{low}, {MAX_DENOISING_STEPS}]"
    elif name in ("t_min", "t_max"):
        ok = _is_num(value) and 0 < value <= MAX_TEMPERATURE
        what = f"in (0, {MAX_TEMPERATURE:g}]"
    elif name == "entropy_bound":
        ok = _is_num(value) and 0 < value <= MAX_ENTROPY
        what = f"in (0, {MAX_ENTROPY:g}]"
    elif name == "confidence_threshold":
        ok = _is_num(value) and 0 <= value <= MAX_ENTROPY
        what = f"in [0, {MAX_ENTROPY:g}] (0: no adaptive stopping)"
    else:
        raise ValueError(f"{name!r} is not a uniform-state option; those are {UNIFORM_FIELDS}")
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


# What a uniform-state request (DiffusionGemma) cannot take: the masked family's decoding
# options, and those its canvases do not implement (refused when set, never ignored).
MASKED_ONLY_FIELDS = (
    "block_length", "unmasking", "threshold", "factor", "tokens_per_step", "cache",
    "temperature", "top_p", "top_k", "min_p", "logit_bias", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "refresh_interval",
    "prompt_refresh_interval", "refresh_confidence", "min_threshold", "edit_threshold",
    "max_post_steps")


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's names
MAX_CHOICES = 1024  # a choice constraint's options
MAX_CONSTRAINT_CHARS = 100_000  # a schema's JSON, a regex or a grammar


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-output request: exactly one of a JSON schema (a dict or its JSON
    text), a regex, a list of choices, a grammar (Lark or GBNF), or any JSON object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"structured_outputs: {msg}")

        given = [n for n in CONSTRAINT_KINDS if getattr(self, n) not in (None, False)]
        need(len(given) == 1, f"give exactly one of json, regex, choice, grammar, json_object; "
             f"got {given or 'none'}")
        if isinstance(self.json, dict):  # text (the compile cache key), in the schema's order
            try:
                object.__setattr__(self, "json", _json.dumps(self.json))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs: json is not a JSON schema: {e}") from None
        if self.json is not None:
            try:
                need(isinstance(_json.loads(self.json), (dict, bool)),
                     "json must be a JSON schema (an object)")
            except (TypeError, ValueError):
                need(False, "json must be a JSON schema (an object)")
        if self.choice is not None:
            choice = self.choice
            need(isinstance(choice, (list, tuple)) and 0 < len(choice) <= MAX_CHOICES
                 and all(isinstance(c, str) for c in choice),
                 f"choice must be a list of 1 to {MAX_CHOICES} strings")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, str) and len(value) <= MAX_CONSTRAINT_CHARS),
                 f"{name} must be a string of at most {MAX_CONSTRAINT_CHARS} characters")
        need(self.json_object is None or isinstance(self.json_object, bool),
             "json_object must be a bool")

    @property
    def kind(self) -> str:
        return next(n for n in CONSTRAINT_KINDS if getattr(self, n) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Validated on construction; see docs/design.md §2."""

    max_tokens: int = 256
    block_length: int = 32
    unmasking: str = "threshold"
    threshold: float = 0.9
    factor: float = 1.0
    tokens_per_step: int = 1
    cache: str = "dual"
    temperature: float = 0.0
    seed: int | None = None
    stop_at_eos: bool = True
    stop: tuple[str, ...] = ()  # stop strings (a str or list is accepted), as in vLLM
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before
    stop_token_ids: tuple[int, ...] = ()  # end the response like EOS, even without stop_at_eos
    # Each output token's log-probability at the step that committed it, and with logprobs=n > 0
    # the n most probable tokens of that step too (vLLM's meaning); None: none.
    logprobs: int | None = None
    # With temperature > 0, sample only among the most probable tokens (vLLM's meaning): those
    # with at least min_p times the top token's probability (0: all) and among the top_k first
    # (0 or -1: all); of those, the fewest reaching top_p of their probability (1: all).
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # OpenAI's logit_bias: {token id: bias in [-MAX_BIAS, MAX_BIAS]} added to this request's
    # logits before they are scored, so the choice, the sampling and the confidence all see the
    # biased logits. Kept as sorted (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Penalties on tokens the response already holds (its committed tokens before the first stop
    # id; see sangam/decoding/logit_edits.py): OpenAI's presence / frequency penalties, subtracted
    # from the logits, and vLLM's repetition_penalty (1: off), which also covers prompt tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's min_tokens: the stop ids (EOS, stop_token_ids) cannot be committed at the first
    # min_tokens response positions, and a stop string ending within their text does not count.
    min_tokens: int = 0
    skip_special_tokens: bool = True  # the text leaves out special tokens (vLLM's default)
    # vLLM's: keep only the prompt's last k tokens (-1: as many as fit the context beside the
    # response canvas); None: the whole prompt, which must fit.
    truncate_prompt_tokens: int | None = None
    # vLLM's priority: waiting prefills are admitted lower value first (then by arrival); a
    # request's tokens never depend on it, only its latency.
    priority: int = 0
    # vLLM's n: LLM.generate samples each prompt n times (as n requests, seeds seed + j when
    # seed is set) and returns them as one output's ``outputs``. A request is one sequence:
    # the engines take n = 1 only (the server's n makes n requests itself).
    n: int = 1
    # Refresh cadence (docs/design.md §2): block b > 0 starts with a refresh only when b is a
    # multiple of refresh_interval (else with a cached step over its span), and of those
    # refreshes every prompt_refresh_interval-th is full, the others response-only. 1 and 1:
    # every block starts with a full refresh (Fast-dLLM's cache).
    refresh_interval: int = 1
    prompt_refresh_interval: int = 1
    # Adaptive refresh: a block the cadence starts from cached K/V starts with a full refresh
    # instead when the block before it committed a token with confidence below this (the model
    # was unsure where its cache is stale); 0: never. The request's own state decides, so
    # batching does not change it.
    refresh_confidence: float = 0.0
    # Load-adaptive threshold, opt-in: with min_threshold set (at most threshold; the threshold
    # rule), the worker that starts each block lowers this request's threshold for that block
    # toward min_threshold as it fills up (threshold_under). The one option whose tokens depend
    # on load: RequestOutput.block_thresholds reports each block's.
    min_threshold: float | None = None
    # Token editing (LLaDA2.1's T2T), block-causal models only, opt-in: besides filling masks,
    # each step replaces a filled response position of the current block whose most likely
    # token differs from it with probability above edit_threshold (None: no editing); once the
    # block has no masks left, editing-only steps follow until one changes nothing or
    # max_post_steps of them have run.
    edit_threshold: float | None = None
    max_post_steps: int = 16
    # Structured output: the response must match this constraint (docs/decoding.md); a step
    # then commits left to right from the block's first masked position.
    structured_outputs: StructuredOutputsParams | None = None
    # Streamed drafts (``stream_options.include_drafts``): after every step that does not end
    # its block, an output whose ``draft_token_ids`` are the block's provisional content (a
    # uniform-state canvas's argmax; a masked block's committed tokens with each masked
    # position's token as the step predicted it). The response itself never changes.
    include_drafts: bool = False
    # Each response token's trajectory (RequestOutput.trajectory): the forward that committed
    # it, its log-probability then, and every value an edit gave it before (RL rollouts).
    return_trajectory: bool = False
    # Uniform-state models only (DiffusionGemma, UniformStateParams): None takes the model's
    # default (its generation_config.json, else transformers').
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"SamplingParams: {msg}")

        need(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], "
             f"got {self.n!r}")
        for name in ("max_tokens", "block_length", "tokens_per_step", "refresh_interval",
                     "prompt_refresh_interval"):
            value = getattr(self, name)
            need(_is_int(value) and 1 <= value <= MAX_INT32,
                 f"{name} must be an integer in [1, {MAX_INT32}], got {value!r}")
        need(self.unmasking in UNMASKING_RULES,
             f"unmasking must be one of {UNMASKING_RULES}, got {self.unmasking!r}")
        need(_is_num(self.threshold) and 0.0 <= self.threshold <= 1.0,
             f"threshold must be in [0, 1], got {self.threshold!r}")
        need(_is_num(self.factor) and self.factor > 0.0,
             f"factor must be > 0, got {self.factor!r}")
        need(self.cache in CACHE_MODES, f"cache must be one of {CACHE_MODES}, got {self.cache!r}")
        need(self.min_threshold is None or (
            _is_num(self.min_threshold) and 0.0 <= self.min_threshold <= self.threshold
            and self.unmasking == "threshold"),
             f"min_threshold must be None or in [0, threshold] with the threshold rule, got "
             f"{self.min_threshold!r}")
        if self.min_threshold is not None:
            object.__setattr__(self, "min_threshold", float(self.min_threshold))
        need(self.edit_threshold is None or (_is_num(self.edit_threshold)
                                             and 0.0 <= self.edit_threshold <= 1.0),
             f"edit_threshold must be None or in [0, 1], got {self.edit_threshold!r}")
        if self.edit_threshold is not None:
            object.__setattr__(self, "edit_threshold", float(self.edit_threshold))
        need(_is_int(self.max_post_steps) and 0 <= self.max_post_steps <= MAX_POST_STEPS,
             f"max_post_steps must be an integer in [0, {MAX_POST_STEPS}], got "
             f"{self.max_post_steps!r}")
        need(self.edit_threshold is None or self.logprobs is None,
             "logprobs cannot be combined with edit_threshold: an edited position was "
             "committed by more than one step")
        need(self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams")
        need(self.structured_outputs is None or self.edit_threshold is None,
             "structured_outputs cannot be combined with edit_threshold: an edit could break "
             "the grammar behind it")
        need(_is_num(self.refresh_confidence) and 0.0 <= self.refresh_confidence <= 1.0,
             f"refresh_confidence must be in [0, 1], got {self.refresh_confidence!r}")
        object.__setattr__(self, "refresh_confidence", float(self.refresh_confidence))
        need(self.cache != "none" or self.refresh_interval == self.prompt_refresh_interval == 1,
             'refresh_interval and prompt_refresh_interval need a cache: with cache="none" '
             "every step is a full refresh")
        need(_is_num(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
             f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if self.temperature < GREEDY_TEMPERATURE:  # below fp32 resolution: plain argmax
            object.__setattr__(self, "temperature", 0.0)
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**SEED_BITS),
             f"seed must be None or an integer in [0, 2**{SEED_BITS}), got {self.seed!r}")
        need(isinstance(self.stop_at_eos, bool), "stop_at_eos must be a bool")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop or ()
        need(isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop),
             f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        need(len(stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in stop),
             f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
             f"characters")
        object.__setattr__(self, "stop", tuple(stop))
        need(isinstance(self.include_stop_str_in_output, bool),
             "include_stop_str_in_output must be a bool")
        need(isinstance(self.skip_special_tokens, bool), "skip_special_tokens must be a bool")
        need(isinstance(self.include_drafts, bool), "include_drafts must be a bool")
        need(isinstance(self.return_trajectory, bool), "return_trajectory must be a bool")
        ids = self.stop_token_ids or ()
        need(isinstance(ids, (list, tuple)) and len(ids) <= MAX_STOP_TOKEN_IDS
             and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in ids),
             f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers "
             f"in [0, {MAX_INT32}]), got {_short(self.stop_token_ids)}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        need(self.logprobs is None or (_is_int(self.logprobs)
                                       and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
             f"{self.logprobs!r}")
        need(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0,
             f"top_p must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and -1 <= self.top_k <= MAX_INT32,
             f"top_k must be an integer in [0, {MAX_INT32}] (0 or -1: all tokens), got "
             f"{self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        need(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0,
             f"min_p must be in [0, 1], got {self.min_p!r}")
        object.__setattr__(self, "min_p", float(self.min_p))
        bias = self.logit_bias or ()
        pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
        need(isinstance(pairs, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and _is_int(p[0])
            and 0 <= p[0] <= MAX_INT32 and _is_num(p[1]) and math.isfinite(p[1])
            and -MAX_BIAS <= p[1] <= MAX_BIAS for p in pairs),
            f"logit_bias must map token ids (in [0, {MAX_INT32}]) to biases in [-{MAX_BIAS:g}, "
            f"{MAX_BIAS:g}], got {_short(self.logit_bias)}")
        need(len(pairs) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
        need(len({t for t, _ in pairs}) == len(pairs), "logit_bias names a token twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_num(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                 f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
            object.__setattr__(self, name, float(value))
        need(_is_num(self.repetition_penalty)
             and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        need(_is_int(self.priority) and abs(self.priority) <= MAX_INT32,
             f"priority must be an integer in [-{MAX_INT32}, {MAX_INT32}], got "
             f"{self.priority!r}")
        for name in UNIFORM_FIELDS:
            value = getattr(self, name)
            if value is not None:
                try:
                    check_uniform_field(name, value)
                except ValueError as e:
                    need(False, str(e))
        k = self.truncate_prompt_tokens
        need(k is None or (_is_int(k) and (1 <= k <= MAX_INT32 or k == -1)),
             f"truncate_prompt_tokens must be None, -1 or an integer in [1, {MAX_INT32}], got "
             f"{k!r}")

    def uniform_given(self) -> dict[str, object]:
        """The uniform-state options this request sets (not None)."""
        return {n: getattr(self, n) for n in UNIFORM_FIELDS if getattr(self, n) is not None}

    def masked_given(self) -> list[str]:
        """The masked-family options this request sets away from their defaults."""
        return [n for n in MASKED_ONLY_FIELDS if getattr(self, n) != _DEFAULTS[n]]

    def for_sample(self, j: int) -> SamplingParams:
        """The ``j``-th of this request's ``n`` samples, as one request (n=1): with a seed, its
        seed is seed + j (modulo 2**SEED_BITS), so samples differ yet reproduce; without one,
        each draws its own."""
        seed = None if self.seed is None else (self.seed + j) % 2**SEED_BITS
        return replace(self, n=1, seed=seed)

    @property
    def restricts_sampling(self) -> bool:
        """Whether top_p / top_k / min_p change anything (greedy decoding takes the top token
        anyway)."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0)

    @property
    def penalizes(self) -> bool:
        """Whether any penalty on the tokens already generated is on."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_full_scoring(self) -> bool:
        """Whether scoring must rank or reweight the whole vocabulary at every step (top_p /
        top_k / min_p sampling, logit_bias, penalties, logprobs alternatives), which the fused
        unmasking kernel does not do."""
        return (self.restricts_sampling or bool(self.logit_bias) or self.penalizes
                or bool(self.logprobs))

    @functools.cached_property  # read for every request of every iteration
    def full_scoring_blocks(self) -> float:
        """How many leading blocks need full scoring: all of them (inf) when
        ``needs_full_scoring``, else those holding the first ``min_tokens`` positions (when
        there are stop ids to hold back)."""
        if self.needs_full_scoring:
            return math.inf
        if self.stop_at_eos or self.stop_token_ids:
            return -(-self.min_tokens // self.block_length)
        return 0

    def threshold_under(self, load: float) -> float:
        """This request's threshold for a block started at ``load`` (0: idle, 1: full): the
        threshold lowered linearly toward ``min_threshold``; the threshold itself without one."""
        load = min(1.0, max(0.0, load))
        if self.min_threshold is None or load == 0:
            return self.threshold
        return max(self.min_threshold,  # not below it by a rounding
                   self.threshold - (self.threshold - self.min_threshold) * load)

    def check_block_causal(self, suffix_len: int = 0) -> None:
        """Raise what a block-causal model (SDAR) cannot do with these options: its finished
        blocks' K/V is exact, so the cache modes and refresh knobs of bidirectional models do
        not apply, and it has no infilling (a suffix would sit after the canvas, invisible to
        it)."""
        unsupported = [name for name, bad in (
            ("cache (only 'dual')", self.cache != "dual"),
            ("refresh_interval", self.refresh_interval != 1),
            ("prompt_refresh_interval", self.prompt_refresh_interval != 1),
            ("refresh_confidence", self.refresh_confidence > 0),
            ("suffix (infilling)", suffix_len > 0)) if bad]
        if unsupported:
            raise ValueError(f"a block-causal model (SDAR) does not take "
                             f"{', '.join(unsupported)}: its finished blocks' K/V is exact and "
                             "never refreshed")


_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _short(value: object, limit: int = 200) -> str:
    """A value's repr for an error message, clipped: a field may hold a thousand entries."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class Logprob(NamedTuple):
    """vLLM's record of one token's log-probability at the step that committed a position."""

    logprob: float
    rank: int | None  # 1: the most probable; None: not among the alternatives asked for
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's view of a completion: ``RequestOutput.outputs[0]``, so that code written for
    vLLM's ``LLM`` runs unchanged."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None  # with logprobs: the sum over the tokens
    logprobs: list[dict[int, Logprob]] | None  # per token: it, then its step's alternatives
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(repr=False)
class RequestOutput:
    """A request's response so far (streamed) or in full (``finished=True``). Its ``text`` (None
    without a tokenizer) is made from ``make_text`` when first read: the engine loop does not
    detokenize outputs nobody reads (the intermediate ones of a request that is not streamed),
    and a reader on another thread detokenizes there."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    make_text: Callable[[], str | None] = field(compare=False)
    num_forwards: int
    finished: bool = False
    # "stop" (EOS, a stop token or string), "length", "abort", or "error": the request failed
    # (``error`` says why) and everything it held was freed; other requests go on.
    finish_reason: str | None = None
    # vLLM's: the stop string or stop_token_ids id that ended the response (None: EOS or other).
    stop_reason: int | str | None = None
    metrics: dict = field(default_factory=dict)
    logprobs: list[float] | None = None  # per token of token_ids, when SamplingParams asked
    # With SamplingParams.min_threshold: the threshold each decoded block used (per block of
    # the response so far), which the worker's load lowered toward min_threshold.
    block_thresholds: list[float] | None = None
    # Per token of token_ids, with SamplingParams.logprobs = n > 0: the n most probable tokens
    # at the step that committed it, as (token id, logprob), most probable first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # LLM.generate with n > 1: the prompt's other samples (this output is the first).
    siblings: list[RequestOutput] = field(default_factory=list, compare=False)
    error: str | None = None  # with finish_reason "error": what failed
    # vLLM's: prompt tokens whose K/V came from the prefix cache (None: the engine caches no
    # prefixes; a bidirectional model's never does).
    num_cached_tokens: int | None = None
    # A draft (SamplingParams.include_drafts): the block in progress as it stands, provisional,
    # after ``token_ids`` (which a draft never changes); None in every other output.
    draft_token_ids: list[int] | None = None
    draft_text: str | None = None
    # With SamplingParams.return_trajectory, per position of the response canvas: every value
    # a forward wrote there, in order, as (forward index, token id, log-probability at that
    # forward); the last is its token (several only where LLaDA2.1's editing rewrote it). The
    # first len(token_ids) are the output's; the rest are the canvas past it (decoded after a
    # stop in its block, or never: empty), which the forwards saw as their input.
    trajectory: list[list[tuple[int, int, float]]] | None = None
    # The weights version the response was generated with (0: as loaded; each update adds 1).
    weight_version: int = 0

    @property
    def step_map(self) -> list[int] | None:
        """The forward index at which each token of token_ids was committed (with
        return_trajectory)."""
        return None if self.trajectory is None else [
            t[-1][0] for t in self.trajectory[:len(self.token_ids)]]

    @property
    def step_logprobs(self) -> list[float] | None:
        """Each token's log-probability at the forward that committed it (with
        return_trajectory)."""
        return None if self.trajectory is None else [
            t[-1][2] for t in self.trajectory[:len(self.token_ids)]]

    @functools.cached_property
    def text(self) -> str | None:
        return self.make_text()

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The response in vLLM's shape: its completion, then its siblings' (``n`` > 1)."""
        return [out._completion(j) for j, out in enumerate([self, *self.siblings])]

    def _completion(self, index: int) -> CompletionOutput:
        per_token = None
        if self.logprobs is not None:
            per_token = []
            for i, (token, logprob) in enumerate(zip(self.token_ids, self.logprobs)):
                ranked = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(
                    self.top_logprobs[i] if self.top_logprobs else (), start=1)}
                # The token's own value, as in .logprobs (its alternative's agrees to rounding).
                own = Logprob(logprob, ranked[token].rank if token in ranked else None)
                per_token.append({token: own, **{t: r for t, r in ranked.items() if t != token}})
        return CompletionOutput(
            index, self.text, self.token_ids,
            None if self.logprobs is None else math.fsum(self.logprobs), per_token,
            self.finish_reason, self.stop_reason)

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.compare]
        shown.insert(3, f"text={self.text!r}")
        return f"RequestOutput({', '.join(shown)})"

    def __getstate__(self) -> dict:
        # Pickled with its text made: the maker holds the tokenizer.
        return {**self.__dict__, "text": self.text, "make_text": _no_text}


def _no_text() -> None:
    return None
