"""Structured output (docs/decoding.md "Structured output"): constraints compile, every output
of a constrained request parses and validates, the frontier rule's invariants, and batch
invariance in float64, in process and across worker processes."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_engine import staggered_outputs

from sangam import LLM, SamplingParams
from sangam.config import EngineConfig
from sangam.decoding.grammar import Constraint, ConstraintError
from sangam.demo.tokenizer import VOCAB_SIZE, write_tokenizer
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.reference_decoder import ReferenceDecoder
from sangam.engine.validation import new_state
from sangam.sampling_params import StructuredOutputsParams as SO
from sangam.testing import make_tiny_checkpoint

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]},
                                  "maxItems": 2}}}


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    return LoadedModel.load(EngineConfig(model="sangam-demo", device="cpu", dtype="float64"))


@pytest.fixture(scope="module")
def random_path(tmp_path_factory) -> str:
    """A random-weight model with the demo tokenizer: unconstrained, it emits garbage."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("rand"), seed=3, vocab_size=VOCAB_SIZE,
                                logit_scale=3.0)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def rand(random_path) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=random_path, device="cpu", dtype="float64"))


# Constraints and compiling.
def test_params_take_exactly_one_constraint():
    assert SO(json=PERSON).kind == "json" and json.loads(SO(json=PERSON).json) == PERSON
    assert SO(choice=["x", "y"]).choice == ("x", "y")
    for bad in (dict(), dict(regex="a", choice=["b"]), dict(choice=[]), dict(json="[1]"),
                dict(choice=[1])):
        with pytest.raises(ValueError, match="structured_outputs"):
            SO(**bad)
    with pytest.raises(ValueError, match="edit_threshold"):
        SamplingParams(structured_outputs=SO(regex="a"), edit_threshold=0.5)


def test_compile_errors_carry_the_compilers_message_and_results_are_cached(demo):
    compiler = demo.grammar_compiler()
    for so, message in ((SO(regex="a(b"), "unclosed group"),
                        (SO(grammar="start: foo"), "foo"),
                        (SO(json={"type": "nonsense"}), "nonsense")):
        with pytest.raises(ConstraintError, match=message):
            compiler.compile(Constraint.of(so))
    info = compiler._compile.cache_info()
    compiler.compile(Constraint.of(SO(json=PERSON)))
    compiler.compile(Constraint.of(SO(json=dict(PERSON))))  # an equal schema: a cache hit
    after = compiler._compile.cache_info()
    assert (after.misses - info.misses, after.hits - info.hits) == (1, 1)
    with pytest.raises(ValueError, match="tokenizer"):
        LoadedModel.load(EngineConfig(model=make_tiny_checkpoint(
            __import__("tempfile").mkdtemp()), device="cpu")).grammar_compiler()


# The frontier rule.
def test_steps_commit_a_prefix_of_the_block_and_the_grammar_accepts_it(demo):
    """On random logits (confident and not): each step extends the block's committed prefix by
    at least one position, never leaves a committed position right of a masked one, and the
    response so far is always a prefix the grammar accepts; EOS comes only where it is
    complete."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        params = SamplingParams(max_tokens=96, block_length=8, threshold=0.5,
                                structured_outputs=SO(json=PERSON), seed=trial,
                                temperature=[0.0, 1.0][trial % 2])
        state = new_state(demo, [7, 8, 9], params, random.Random(0))
        fresh = demo.grammar_compiler().matcher(Constraint.of(params.structured_outputs))
        while not state.finished:
            plan = state.plan()
            s, e = state.cursor.block_bounds()
            before = int((state.tokens[s:e] != state.mask_token_id).sum())
            scale = [0.5, 20.0][trial % 3 == 0]
            logits = scale * torch.randn(len(plan.positions), VOCAB_SIZE, generator=gen,
                                         dtype=torch.float64)
            state.commit(plan.positions, plan.num_forced, None, None, 0, logits, plan.row_keys)
            block = state.tokens[s:e] != state.mask_token_id
            assert block.sum() > before or block.all()
            assert not (~block[:-1] & block[1:]).any()  # a prefix
        assert state.finish_reason == "stop"
        response = state.tokens[state.cursor.prompt_len:].tolist()
        text = demo.text.decode(state.output_token_ids())
        assert fresh.validate_tokens(response[:len(state.output_token_ids()) + 1]) >= len(
            state.output_token_ids())
        jsonschema.validate(json.loads(text), PERSON)


# Every output parses and validates.
_LEAF = st.one_of(
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.builds(lambda xs: {"enum": sorted(set(xs))},
              st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=1, max_size=3)),
    st.just({"type": "boolean"}),
    # Bounded digits (a number's fraction is otherwise unbounded, like a regex's star).
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10,
                          "multipleOf": 0.25}, st.integers(-5, 5)),
)


def _object(children):
    return st.dictionaries(st.sampled_from(["a", "b", "cd", "id", "k"]), children, min_size=1,
                           max_size=3).flatmap(lambda props: st.lists(
                               st.sampled_from(sorted(props)), unique=True).map(
                               lambda req: {"type": "object", "properties": props,
                                            "required": req, "additionalProperties": False}))


SCHEMAS = st.recursive(
    _LEAF, lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                  children, st.integers(0, 3))), max_leaves=5).map(
    lambda s: s if s.get("type") == "object" else
    {"type": "object", "properties": {"v": s}, "required": ["v"],
     "additionalProperties": False})
# Bounded languages: a model need not ever choose to end an unbounded one (a random model may
# repeat "ab" forever under (ab)*e), and no rule can force it to.
REGEXES = st.sampled_from([r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)!?", r"[A-Z][a-z]{0,5} [0-9]{1,4}",
                           r"\d{1,6}(\.\d{1,2})?", r"(ab|cd){0,4}e"])
CHOICES = st.lists(st.text("abc xyz!", min_size=1, max_size=8), min_size=1, max_size=5,
                   unique=True)


def _check(so: SO, text: str) -> None:
    if so.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(so.json))
    elif so.kind == "regex":
        assert re.fullmatch(so.regex, text), (so.regex, text)
    elif so.kind == "choice":
        assert text in so.choice, (so.choice, text)


@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=2, max_size=2), regex=REGEXES, choice=CHOICES,
       temperature=st.sampled_from([0.0, 1.0]), which=st.sampled_from(["demo", "rand"]),
       seed=st.integers(0, 2**20))
def test_every_constrained_output_parses_and_validates(demo, rand, schemas, regex, choice,
                                                       temperature, which, seed):
    """Generated schemas (objects, arrays, enums, bounded numbers, nested, optional fields),
    regexes and choice lists, greedy and sampled, on the demo model and a random one, batched
    with unconstrained requests whose tokens stay exactly what they are alone."""
    loaded = demo if which == "demo" else rand
    constraints = [SO(json=s) for s in schemas] + [SO(regex=regex), SO(choice=choice)]
    free = SamplingParams(max_tokens=24, block_length=8, temperature=temperature, seed=seed)
    params = [SamplingParams(max_tokens=160, block_length=8, temperature=temperature,
                             seed=seed + i, structured_outputs=so)
              for i, so in enumerate(constraints)]
    engine = Engine(EngineConfig(model=loaded.path, device="cpu", dtype="float64",
                                 page_size=8, num_pages=600), loaded)
    alone = ReferenceDecoder(loaded.model).run(new_state(loaded, [5, 6, 7], free,
                                                         random.Random(0)))
    engine.add_request("free", [5, 6, 7], free)
    for i, p in enumerate(params):
        engine.add_request(f"c{i}", [5, 6, 7, 8 + i], p)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done["free"].token_ids == alone.output_token_ids()
    for i, so in enumerate(constraints):
        out = done[f"c{i}"]
        assert out.finish_reason == "stop", (so, out.text)
        _check(so, out.text)


# Batch invariance.
def _mixed(rng: random.Random, n: int) -> list[tuple[str, list[int], SamplingParams]]:
    reqs = []
    for i in range(n):
        so = rng.choice([SO(json=PERSON), SO(regex=r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"),
                         SO(choice=["red", "green", "blue"]), SO(json_object=True), None])
        reqs.append((f"r{i}", [rng.randrange(6, 90) for _ in range(rng.randrange(1, 12))],
                     SamplingParams(max_tokens=rng.choice([24, 64]), block_length=8,
                                    threshold=rng.choice([0.5, 0.9]),
                                    unmasking=rng.choice(["threshold", "threshold", "factor"]),
                                    temperature=rng.choice([0.0, 1.0]), seed=i,
                                    structured_outputs=so)))
    return reqs


def _alone(loaded, reqs):
    return {rid: ReferenceDecoder(loaded.model).run(
        new_state(loaded, prompt, p, random.Random(0))).output_token_ids()
        for rid, prompt, p in reqs}


def test_constrained_tokens_are_the_same_alone_and_batched(rand):
    rng = random.Random(1)
    reqs = _mixed(rng, 10)
    want = _alone(rand, reqs)
    engine = Engine(EngineConfig(model=rand.path, device="cpu", dtype="float64", page_size=8,
                                 num_pages=600, token_budget=256), rand)
    got = {rid: o.token_ids for rid, o in staggered_outputs(engine, reqs, rng).items()}
    assert got == want
    assert engine.pool.allocator.num_free == engine.pool.num_pages


@pytest.mark.parametrize("layout", [
    dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
    # One worker of two ranks: the constrained rows' whole vocabulary is gathered.
    dict(tensor_parallel_size=2)], ids=["1P2D", "tp2"])
def test_constrained_requests_move_between_processes(random_path, rand, layout):
    """1P2D: each block's K/V and the request's state cross processes; the matcher is rebuilt
    on the other side by replaying the committed tokens. Tensor-parallel: the grammar reads
    rows gathered from every rank's vocabulary columns."""
    reqs = _mixed(random.Random(2), 8)
    want = _alone(rand, reqs)
    llm = LLM(random_path, device="cpu", dtype="float64", page_size=8, num_pages=400,
              **layout)
    try:
        outs = llm.generate(prompt_token_ids=[p for _, p, _ in reqs],
                            sampling_params=[s for _, _, s in reqs])
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [want[r] for r, _, _ in reqs]


def test_a_request_with_no_allowed_token_fails_alone(demo):
    """min_tokens forbids EOS where the grammar allows nothing else: that request ends with an
    error; its neighbour finishes."""
    engine = Engine(EngineConfig(model="sangam-demo", device="cpu", dtype="float64"), demo)
    engine.add_request("bad", [5, 6], SamplingParams(
        max_tokens=32, min_tokens=20, structured_outputs=SO(choice=["ok"])))
    engine.add_request("good", [5, 6], SamplingParams(max_tokens=16))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done["bad"].finish_reason == "error" and "no token" in done["bad"].error
    assert done["good"].finish_reason in ("stop", "length")


def test_the_grammar_state_pickles_and_replays(demo):
    import pickle

    params = SamplingParams(max_tokens=96, block_length=8, structured_outputs=SO(json=PERSON))
    state = new_state(demo, [5], params, random.Random(0))
    ReferenceDecoder(demo.model).run(state)
    assert state.finish_reason == "stop" and state.grammar._matcher.is_stopped()
    moved = pickle.loads(pickle.dumps(state))
    assert moved.grammar._matcher is None  # rebuilt on first use, by replaying
    response = moved.tokens[moved.cursor.prompt_len:]
    assert moved.grammar.sync(response, moved.mask_token_id).is_stopped()
    assert moved.grammar.consumed == state.grammar.consumed
    assert np.array_equal(moved.tokens, state.tokens)


def test_every_stop_id_may_end_a_complete_response(demo):
    """A chat model ends its turn with its end-of-turn token, not the tokenizer's EOS: where the
    grammar is complete, each of the request's stop ids is allowed and taken as EOS."""
    from sangam.decoding.grammar import GrammarState
    from sangam.demo.tokenizer import EOS_ID, EOT_ID

    compiler = demo.grammar_compiler()
    constraint = Constraint.of(SO(choice=["ab", "abc"]))
    grammar = GrammarState(constraint, demo.tokenizer_path, compiler.vocab_size,
                           compiler.eos_token_id, ends=frozenset({EOS_ID, EOT_ID}))
    codec = demo.text.tokenizer
    response = np.array(codec.encode("ab", add_special_tokens=False), dtype=np.int64)
    grammar.sync(response, demo.config.mask_token_id)
    allowed = grammar.allowed(compiler.vocab_size)
    assert allowed[EOS_ID] and allowed[EOT_ID] and allowed[codec.encode(
        "c", add_special_tokens=False)[0]]
    grammar.consume(EOT_ID)
    assert grammar._matcher.is_stopped()
    # End to end: the demo's answers end with <|eot_id|>; constrained, they end there too.
    params = SamplingParams(max_tokens=24, block_length=8, structured_outputs=SO(
        regex="[a-z]{3,8}"))
    prompt = demo.text.encode_chat([{"role": "user", "content": "Reverse: sangam"}])
    out = ReferenceDecoder(demo.model).run(new_state(demo, prompt, params, random.Random(0)))
    assert demo.text.decode(out.output_token_ids()) == "magnas"
