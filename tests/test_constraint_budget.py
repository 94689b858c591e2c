"""Budget-aware structured output (docs/decoding.md, "Structured output"): a constrained
response keeps a completion of its grammar that fits the positions left, so it ends complete
within max_tokens whatever the model would write; a constraint whose shortest output cannot fit
is refused with the minimum it needs."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sangam.config import EngineConfig
from sangam.decoding.completion import TokenTable
from sangam.decoding.grammar import Constraint
from sangam.demo.tokenizer import VOCAB_SIZE, write_tokenizer
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.validation import new_state
from sangam.sampling_params import SamplingParams
from sangam.sampling_params import StructuredOutputsParams as SO
from sangam.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    return LoadedModel.load(EngineConfig(model="sangam-demo", device="cpu", dtype="float64"))


@pytest.fixture(scope="module", params=["llada", "dream", "sdar"])
def rand(request, tmp_path_factory) -> LoadedModel:
    """Random weights with the demo tokenizer: unconstrained, they write garbage forever."""
    extra = dict(block_size=8) if request.param == "sdar" else {}
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param,
                                seed=5, vocab_size=VOCAB_SIZE, logit_scale=3.0, **extra)
    write_tokenizer(path)
    return LoadedModel.load(EngineConfig(model=path, device="cpu", dtype="float64"))


def _text(demo, so: SO) -> str:
    start = demo.grammar_compiler().start_completion(Constraint.of(so))
    return demo.text.tokenizer.decode(list(start))


# The search.
@pytest.mark.parametrize("so, want", [
    (SO(choice=["abcdef", "xy", "zzz"]), "xy"),
    (SO(json={"type": "object"}), "{}"),
    (SO(json={"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}}}),
     '{"a": ""}'),
    (SO(json={"type": "object", "required": ["name", "n", "l"], "properties": {
        "name": {"type": "string", "minLength": 3}, "n": {"type": "integer"},
        "l": {"type": "array", "items": {"type": "number"}, "minItems": 2}}}),
     None),  # checked by length below: 36 tokens
    (SO(regex=r"[a-z]+@[a-z]+\.com"), None),
    (SO(regex=r"(ab)*c{3,}"), "ccc"),
    (SO(grammar='start: "x" start "y" | "q"'), "q"),
])
def test_the_shortest_completion_of_a_constraint(demo, so, want):
    text = _text(demo, so)
    if want is not None:
        assert text == want
    elif so.kind == "regex":
        assert len(text) == len("a@a.com") and text.endswith("@a.com") or text == "a@a.com"
    else:
        assert len(text) == len('{"name": "   ", "n": 0, "l": [0, 0]}')
        jsonschema.validate(json.loads(text), json.loads(so.json))


def test_representatives_are_the_shortest_plain_token_per_first_byte():
    table = TokenTable([b"", b'{"', b"a", b'": ', b'"', b"}", b"ab", b'"}', b"x", b"\\n",
                        "é".encode()])
    every = bytes([0b11111110, 0b111])  # all but id 0 (a special token)
    assert list(table.representatives(every)) == [4, 2, 8, 1, 5]  # no escape, no non-ASCII
    assert list(table.representatives(bytes([0, 0b110]))) == [9, 10]  # unless nothing else


def test_a_bpe_vocabulary_completes_in_its_own_multibyte_tokens(tmp_path):
    """A byte-level BPE tokenizer (as Qwen's and Llama's): the completion's forced text is
    the tokenizer's own multi-byte tokens, so it takes fewer tokens than bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sangam.decoding.grammar import GrammarCompiler

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris"}}'] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    compiler = GrammarCompiler(tok, len(tok), tok.eos_token_id)
    so = SO(json=UNBOUNDED[-1])
    start = compiler.start_completion(Constraint.of(so))
    text = tok.decode(list(start))
    assert text == '{"name": "get_weather", "arguments": {"city": ""}}'
    assert len(start) < len(text.encode())


def test_a_constraint_that_cannot_fit_is_refused_with_its_minimum(demo):
    so = SO(json={"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}}})
    need = len('{"name": ""}') + 1
    with pytest.raises(ValueError, match=f"max_tokens of at least {need} "):
        new_state(demo, [5, 6], SamplingParams(max_tokens=need - 1, structured_outputs=so),
                  random.Random(0))
    new_state(demo, [5, 6], SamplingParams(max_tokens=need, structured_outputs=so),
              random.Random(0))


# Unbounded languages under small budgets: every output completes.
UNBOUNDED = [
    {"type": "object", "required": ["name", "bio"], "properties": {
        "name": {"type": "string"}, "bio": {"type": "string"}}},
    {"type": "object", "required": ["n", "x"], "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}}},
    {"type": "object"},  # open to any keys and values
    {"type": "object", "required": ["items"], "properties": {
        "items": {"type": "array", "items": {"type": "string"}}}},
    {"type": "array", "items": {"type": "object", "required": ["k"],
                                "properties": {"k": {"type": "integer"}}}},
    # A required tool call's shape, as tool_choice "required" asks for it.
    {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}},
]
REGEXES = [r"[a-z]+(,[a-z]+)*", r"\d+(\.\d+)?", r"(ab|cd)*e+"]


def valid(so: SO, text: str) -> bool:
    """Whether ``text`` is in the language of ``so`` (a JSON schema, a regex or a choice)."""
    import re

    if so.kind == "json":
        try:
            jsonschema.validate(json.loads(text), json.loads(so.json))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if so.kind == "regex":
        return re.fullmatch(so.regex, text) is not None
    return text in so.choice


@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(which=st.lists(st.integers(0, len(UNBOUNDED) + len(REGEXES) - 1), min_size=3,
                      max_size=3), slack=st.lists(st.integers(0, 12), min_size=3, max_size=3),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**20))
def test_unbounded_constraints_end_complete_within_small_budgets(rand, demo, which, slack,
                                                                  temperature, seed):
    """Random weights (which never choose to end an unbounded language), max_tokens from the
    minimum to 12 above it: every response ends with a stop and parses."""
    engine = Engine(EngineConfig(model=rand.path, device="cpu", dtype="float64", page_size=8,
                                 num_pages=400), rand)
    sos = [SO(json=UNBOUNDED[i]) if i < len(UNBOUNDED) else
           SO(regex=REGEXES[i - len(UNBOUNDED)]) for i in which]
    for i, (so, extra) in enumerate(zip(sos, slack, strict=True)):
        need = len(demo.grammar_compiler().start_completion(Constraint.of(so))) + 1
        engine.add_request(f"c{i}", [5, 6, 7 + i], SamplingParams(
            max_tokens=need + extra, block_length=8, temperature=temperature, seed=seed + i,
            structured_outputs=so))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    for i, so in enumerate(sos):
        out = done[f"c{i}"]
        assert out.finish_reason == "stop", (so, out.text, out.finish_reason)
        assert valid(so, out.text), (so, out.text)
    assert engine.pool.allocator.num_free == engine.pool.num_pages


def test_the_plan_is_a_function_of_the_committed_tokens(demo):
    """A request moved between processes replays its tokens: the plan it rebuilds, and so
    every later decision, is the one it had in place (random allowed tokens proposed at a
    tight budget, the state pickled and replayed after each)."""
    import pickle

    import numpy as np

    from sangam.decoding.grammar import GrammarState

    compiler = demo.grammar_compiler()
    so = SO(json=UNBOUNDED[1])
    need = len(compiler.start_completion(Constraint.of(so))) + 1
    live = GrammarState(Constraint.of(so), demo.tokenizer_path, compiler.vocab_size,
                        compiler.eos_token_id, max_tokens=need + 4)
    rng = np.random.default_rng(0)
    committed, replaced = [], 0
    while not live.done() and len(committed) < need + 4:
        allowed = np.flatnonzero(live.allowed(compiler.vocab_size))
        proposed = int(rng.choice(allowed))
        moved = pickle.loads(pickle.dumps(live))
        moved.sync_to(np.array(committed, dtype=np.int64))
        assert moved.plan == live.plan
        token = live.fit(proposed)
        assert moved.fit(proposed) == token
        replaced += token != proposed
        live.consume(token)
        committed.append(token)
    assert live.done() and replaced > 0  # the budget bound, and ended the output in time
    text = demo.text.tokenizer.decode([t for t in committed if t != compiler.eos_token_id])
    assert valid(so, text), text


def test_an_end_the_budget_forces_before_min_tokens_fails_that_request(rand):
    """min_tokens = max_tokens leaves the grammar no position for its end: where the budget
    would force it, the request ends with an error that says so (it is never cut silently);
    its neighbour finishes."""
    engine = Engine(EngineConfig(model=rand.path, device="cpu", dtype="float64", page_size=8,
                                 num_pages=64), rand)
    engine.add_request("bad", [5, 6], SamplingParams(
        max_tokens=4, min_tokens=4, block_length=8, structured_outputs=SO(regex=r"[0-9]+")))
    engine.add_request("good", [5, 6], SamplingParams(max_tokens=8, block_length=8))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done["bad"].finish_reason == "error" and "min_tokens" in done["bad"].error
    assert done["good"].finish_reason in ("stop", "length")
    assert engine.pool.allocator.num_free == engine.pool.num_pages
