"""The request bodies (sangam/serve/protocol.py) against SamplingParams, field by field: every
SamplingParams field is set by the bodies under its own name (or an OpenAI name listed here) or
is listed as not exposed, with why; and for every bound and allowed set, a value just inside is
accepted by both SamplingParams and each body (and reaches SamplingParams unchanged), a value
just outside refused by both. A bound changed in one place only fails here."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from sangam.sampling_params import (
    CACHE_MODES,
    MAX_BIAS,
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    MAX_DENOISING_STEPS,
    MAX_ENTROPY,
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_POST_STEPS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SEED_BITS,
    UNMASKING_RULES,
    SamplingParams,
    StructuredOutputsParams,
)
from sangam.serve.protocol import BIAS_KEY_DIGITS, ChatCompletionRequest, CompletionRequest
from sangam.serve.responses import ResponsesRequest

# Each body with the fields it requires.
BODIES: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"prompt": "x"},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "x"}]},
    ResponsesRequest: {"input": "x"},
}
# SamplingParams fields no body sets, and why. (None at present.)
NOT_EXPOSED: dict[str, str] = {
    "include_drafts": "a stream option: stream_options.include_drafts sets it (tests/"
                      "test_drafts.py)"}
# SamplingParams fields a body sets under another name only (OpenAI's), with the body fields
# that name needs: chat's own "logprobs" is a flag, its count top_logprobs.
RENAMED = {(ChatCompletionRequest, "logprobs"): ("top_logprobs", {"logprobs": True})}
# Other names (OpenAI's) that set a field as well as its own name.
ALIASES = {(ChatCompletionRequest, "max_tokens"): ("max_completion_tokens", {}),
           (ResponsesRequest, "max_tokens"): ("max_output_tokens", {})}
# Fields a body leaves out, and why.
ABSENT = {(ResponsesRequest, "logprobs"): "Sangam's Responses output carries no logprobs"}
# Fields whose SamplingParams value is built from the body's JSON value (the probes give the
# JSON value). structured_outputs' other forms (response_format, guided_*, tool_choice) are
# tests/test_serve_structured.py's.
BUILT = {"structured_outputs": lambda value: StructuredOutputsParams(**value)}


def _below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def _above(x: float) -> float:
    return math.nextafter(x, math.inf)


def _lengths() -> list[tuple[Any, bool]]:
    return [(1, True), (0, False), (MAX_INT32, True), (MAX_INT32 + 1, False)]


def _fractions() -> list[tuple[Any, bool]]:
    return [(0.0, True), (_below(0.0), False), (1.0, True), (_above(1.0), False)]


def _flags() -> list[tuple[Any, bool]]:
    return [(True, True), (False, True), ("yes", False)]


def _json_text(length: int) -> str:
    """A JSON schema's text of exactly ``length`` characters."""
    head = '{"description": "'
    return head + "x" * (length - len(head) - 2) + '"}'


def _constraints() -> list[tuple[Any, bool]]:
    out: list[tuple[Any, bool]] = [({}, False), ({"regex": "a", "grammar": "b"}, False),
                                   ({"json_object": True}, True),
                                   ({"json": {"type": "object"}}, True),
                                   ({"json": "not JSON"}, False), ({"json": [1]}, False),
                                   ({"choice": []}, False), ({"choice": [1]}, False),
                                   ({"choice": ["a"] * MAX_CHOICES}, True),
                                   ({"choice": ["a"] * (MAX_CHOICES + 1)}, False),
                                   ({"json": _json_text(MAX_CONSTRAINT_CHARS)}, True),
                                   ({"json": _json_text(MAX_CONSTRAINT_CHARS + 1)}, False),
                                   ({"json": json.loads(_json_text(MAX_CONSTRAINT_CHARS))}, True),
                                   ({"json": json.loads(_json_text(MAX_CONSTRAINT_CHARS + 1))},
                                    False)]
    for kind in ("regex", "grammar"):
        out += [({kind: "x" * MAX_CONSTRAINT_CHARS}, True),
                ({kind: "x" * (MAX_CONSTRAINT_CHARS + 1)}, False)]
    return out


def _choices(allowed: tuple[str, ...]) -> list[tuple[Any, bool]]:
    return [(a, True) for a in allowed] + [("none-such", False)]


def _symmetric(bound: float) -> list[tuple[Any, bool]]:
    return [(-bound, True), (_below(-bound), False), (bound, True), (_above(bound), False)]


# (value, accepted?) probes at every bound of each exposed field, as SamplingParams takes the
# value; and the other fields each one needs (a bound relative to another field at its widest).
PROBES: dict[str, list[tuple[Any, bool]]] = {
    "max_tokens": _lengths(),
    "block_length": _lengths(),
    "unmasking": _choices(UNMASKING_RULES),
    "threshold": _fractions(),
    "factor": [(_above(0.0), True), (0.0, False), (1e300, True)],
    "tokens_per_step": _lengths(),
    "cache": _choices(CACHE_MODES),
    "temperature": [(0.0, True), (_below(0.0), False), (MAX_TEMPERATURE, True),
                    (_above(MAX_TEMPERATURE), False)],
    "seed": [(0, True), (-1, False), (2**SEED_BITS - 1, True)],  # beyond: taken modulo, below
    "stop_at_eos": _flags(),
    "stop": [("x", True), ("", False), ("x" * MAX_STOP_CHARS, True),
             ("x" * (MAX_STOP_CHARS + 1), False), (["x"] * MAX_STOP_STRINGS, True),
             (["x"] * (MAX_STOP_STRINGS + 1), False)],
    "include_stop_str_in_output": _flags(),
    "stop_token_ids": [([MAX_INT32], True), ([MAX_INT32 + 1], False), ([-1], False),
                       ([0] * MAX_STOP_TOKEN_IDS, True), ([0] * (MAX_STOP_TOKEN_IDS + 1), False)],
    "logprobs": [(0, True), (-1, False), (MAX_LOGPROBS, True), (MAX_LOGPROBS + 1, False)],
    "top_p": [(_above(0.0), True), (0.0, False), (1.0, True), (_above(1.0), False)],
    "top_k": [(-1, True), (-2, False), (MAX_INT32, True), (MAX_INT32 + 1, False)],
    "min_p": _fractions(),
    "logit_bias": [({0: b}, ok) for b, ok in _symmetric(MAX_BIAS)] + [
        ({t: 1.0 for t in range(MAX_LOGIT_BIAS)}, True),
        ({t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}, False), ({-1: 1.0}, False)],
    "presence_penalty": _symmetric(MAX_PENALTY),
    "frequency_penalty": _symmetric(MAX_PENALTY),
    "repetition_penalty": [(MIN_REPETITION_PENALTY, True), (_below(MIN_REPETITION_PENALTY), False),
                           (MAX_REPETITION_PENALTY, True),
                           (_above(MAX_REPETITION_PENALTY), False)],
    "min_tokens": [(0, True), (-1, False), (MAX_INT32, True), (MAX_INT32 + 1, False)],
    "skip_special_tokens": _flags(),
    "truncate_prompt_tokens": [(-1, True), (-2, False), (0, False), *_lengths()],
    "priority": [(-MAX_INT32, True), (-MAX_INT32 - 1, False), (MAX_INT32, True),
                 (MAX_INT32 + 1, False)],
    "n": [(1, True), (0, False), (MAX_N, True), (MAX_N + 1, False)],
    "return_trajectory": _flags(),
    "refresh_interval": _lengths(),
    "prompt_refresh_interval": _lengths(),
    "refresh_confidence": _fractions(),
    "min_threshold": _fractions(),
    "edit_threshold": _fractions(),
    "max_post_steps": [(0, True), (-1, False), (MAX_POST_STEPS, True),
                       (MAX_POST_STEPS + 1, False)],
    "structured_outputs": _constraints(),
    "max_denoising_steps": [(1, True), (0, False), (MAX_DENOISING_STEPS, True),
                            (MAX_DENOISING_STEPS + 1, False)],
    "stability_threshold": [(0, True), (-1, False), (MAX_DENOISING_STEPS, True),
                            (MAX_DENOISING_STEPS + 1, False)],
    "entropy_bound": [(0.0, False), (_above(0.0), True), (MAX_ENTROPY, True),
                      (_above(MAX_ENTROPY), False)],
    "confidence_threshold": [(0.0, True), (_below(0.0), False), (MAX_ENTROPY, True),
                             (_above(MAX_ENTROPY), False)],
    "t_min": [(0.0, False), (_above(0.0), True), (MAX_TEMPERATURE, True),
              (_above(MAX_TEMPERATURE), False)],
    "t_max": [(0.0, False), (_above(0.0), True), (MAX_TEMPERATURE, True),
              (_above(MAX_TEMPERATURE), False)],
}
CONTEXT: dict[str, dict[str, Any]] = {
    "min_tokens": {"max_tokens": MAX_INT32},  # min_tokens <= max_tokens
    "min_threshold": {"threshold": 1.0},  # min_threshold <= threshold
}


def _params(**fields: Any) -> SamplingParams | None:
    try:
        return SamplingParams(**{k: BUILT[k](v) if k in BUILT else v for k, v in fields.items()})
    except (ValueError, TypeError):
        return None


def _body(body_type: type[BaseModel], fields: dict[str, Any]) -> BaseModel | None:
    """The body parsed as the server parses it, from JSON text (None: refused)."""
    as_json = {k: {str(t): b for t, b in v.items()} if isinstance(v, dict) else v
               for k, v in fields.items()}  # logit_bias: token ids are JSON keys, strings
    try:
        return body_type.model_validate_json(json.dumps({**BODIES[body_type], **as_json}))
    except ValidationError:
        return None


def _setters(field: str) -> list[tuple[type[BaseModel], str, dict[str, Any]]]:
    """(body, the name it sets ``field`` by, the other body fields that name needs)."""
    found = []
    for body_type in BODIES:
        if (body_type, field) in ABSENT:
            continue
        found.append((body_type, *RENAMED.get((body_type, field), (field, {}))))
        if (body_type, field) in ALIASES:
            found.append((body_type, *ALIASES[(body_type, field)]))
    return found


def test_every_field_is_exposed_or_says_why_not():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(PROBES) | set(NOT_EXPOSED) == names and not set(PROBES) & set(NOT_EXPOSED)
    for field in PROBES:
        for body_type, name, needs in _setters(field):
            assert {name, *needs} <= set(body_type.model_fields), (body_type.__name__, name)
    for body_type in BODIES:  # a body field named like a SamplingParams field sets that field
        for name in names & set(body_type.model_fields):
            assert (body_type, name) not in ABSENT
            assert any(name in (n, *needs) for _, n, needs in _setters(name)), name


@pytest.mark.parametrize("field", sorted(PROBES))
def test_bounds_agree(field):
    for value, accepted in PROBES[field]:
        context = CONTEXT.get(field, {})
        direct = _params(**context, **{field: value})
        assert (direct is not None) == accepted, ("SamplingParams", field, value)
        for body_type, name, needs in _setters(field):
            body = _body(body_type, {**context, **needs, name: value})
            where = (body_type.__name__, name, value)
            assert (body is not None) == accepted, where
            if accepted:  # and it reaches SamplingParams as given
                assert SamplingParams(**body.sampling_overrides()) == direct, where


@pytest.mark.parametrize("field,allowed", [("unmasking", UNMASKING_RULES),
                                           ("cache", CACHE_MODES)])
def test_allowed_sets_are_sampling_params_own(field, allowed):
    for body_type in BODIES:
        schema = body_type.model_json_schema()["properties"][field]
        enums = [s["enum"] for s in schema["anyOf"] if "enum" in s]
        assert enums == [list(allowed)], body_type.__name__


def test_an_openai_name_sets_its_field():
    """ignore_eos (vLLM's) is the inverse of stop_at_eos, in every body."""
    for body_type in BODIES:
        for ignore in (True, False):
            body = _body(body_type, {"ignore_eos": ignore})
            assert SamplingParams(**body.sampling_overrides()).stop_at_eos is not ignore
        assert _body(body_type, {"ignore_eos": "yes"}) is None


def test_any_seed_is_taken_modulo():
    """As OpenAI's, a body takes any non-negative seed; SamplingParams' are SEED_BITS wide."""
    assert _params(seed=2**SEED_BITS) is None
    for body_type in BODIES:
        body = _body(body_type, {"seed": 2**SEED_BITS + 5})
        assert SamplingParams(**body.sampling_overrides()).seed == 5


def test_logit_bias_keys_are_bounded_by_their_digits():
    """A JSON key is a string: the body bounds a token id by its digits, the most digits every
    number of which SamplingParams accepts as a token id (the vocabulary is the real bound,
    checked with the model)."""
    widest, wider = int("9" * BIAS_KEY_DIGITS), int("9" * (BIAS_KEY_DIGITS + 1))
    assert _params(logit_bias={widest: 1.0}) is not None
    assert _params(logit_bias={wider: 1.0}) is None
    for body_type in BODIES:
        assert _body(body_type, {"logit_bias": {widest: 1.0}}) is not None
        assert _body(body_type, {"logit_bias": {10**BIAS_KEY_DIGITS: 1.0}}) is None


# Each output constraint alone, in each body that has it; "quiet" values constrain nothing.
_CONSTRAINTS = {
    "guided_regex": "a", "guided_choice": ["a"], "guided_json": {"type": "object"},
    "guided_grammar": 'start: "a"', "structured_outputs": {"regex": "a"},
    "response_format": {"type": "json_object"}, "tool_choice": "required",
    "text": {"format": {"type": "json_object"}},
}
_QUIET = {"response_format": {"type": "text"}, "tool_choice": "auto",
          "text": {"format": {"type": "text"}}, "guided_regex": None}
_BODIES = {CompletionRequest: {"prompt": "hi"},
           ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
           ResponsesRequest: {"input": "hi"}}


def _server_takes(model: type[BaseModel], body: dict) -> bool:
    try:
        return len(model.model_validate(body).output_constraints()) <= 1
    except ValidationError:
        return False


@pytest.mark.parametrize("model", list(_BODIES), ids=lambda m: m.__name__)
def test_the_schema_allows_one_output_constraint_as_the_server_does(model):
    """The served schema states the rule the server applies: at most one output constraint
    (any of the fields, in any quiet value of the others), and exactly one form of
    ``structured_outputs``; checked against the bodies themselves."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(model.model_json_schema())
    fields = [f for f in _CONSTRAINTS if f in model.model_fields]
    tool = {"tools": [{"type": "function", "function": {"name": "f"}}] if model is not
            ResponsesRequest else [{"type": "function", "name": "f"}]}
    cases = [{}]
    cases += [{f: _CONSTRAINTS[f]} for f in fields]
    cases += [{f: _CONSTRAINTS[f], g: _CONSTRAINTS[g]} for f in fields for g in fields if f < g]
    cases += [{f: _CONSTRAINTS[f], **{g: v for g, v in _QUIET.items()
                                      if g in model.model_fields and g != f}} for f in fields]
    cases += [{"structured_outputs": so} for so in (
        {}, {"regex": "a", "choice": ["a"]}, {"regex": "a", "json_object": False},
        {"json_object": True}, {"json_object": False})]
    for extra in cases:
        body = {**_BODIES[model], **tool, **extra}
        assert validator.is_valid(body) == _server_takes(model, body), extra
