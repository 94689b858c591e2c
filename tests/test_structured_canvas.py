"""Structured output on uniform-state canvases (DiffusionGemma; docs/decoding.md, "Structured
output"): every output parses and validates — generated schemas, regexes and choice lists, and
unbounded languages under small budgets —; a constrained request's tokens are the same alone and
batched, and across worker processes with a worker killed mid-run."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_constraint_budget import UNBOUNDED, valid
from test_engine import staggered_outputs
from test_structured_output import CHOICES, REGEXES, SCHEMAS

from sangam.config import EngineConfig
from sangam.decoding.grammar import Constraint
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel
from sangam.sampling_params import SamplingParams
from sangam.sampling_params import StructuredOutputsParams as SO
from tests.gemma_checkpoint import write_checkpoint
from tests.test_sdar import run_in_mode


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> LoadedModel:
    """A random tiny DiffusionGemma (canvases of 8) with the Gemma-layout tokenizer."""
    from sangam.demo.tokenizer import GEMMA_VOCAB, write_tokenizer

    path = write_checkpoint(tmp_path_factory.mktemp("dgemma-so"), seed=3,
                            vocab_size=len(GEMMA_VOCAB))
    write_tokenizer(path, layout="gemma")
    return LoadedModel.load(EngineConfig(model=str(path), device="cpu", dtype="float64"))


def _minimum(loaded: LoadedModel, so: SO) -> int:
    return len(loaded.grammar_compiler().start_completion(Constraint.of(so))) + 1


def _params(i: int, so: SO, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed + i, structured_outputs=so,
                          max_denoising_steps=[2, 4][i % 2], entropy_bound=[0.5, 3.0][i % 2])


def _run(engine: Engine, reqs: list) -> dict:
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS, regex=REGEXES, choice=CHOICES,
       unbounded=st.sampled_from(range(len(UNBOUNDED))), slack=st.integers(0, 10),
       seed=st.integers(0, 2**20))
def test_every_canvas_output_parses_and_validates(gemma, schema, regex, choice, unbounded,
                                                  slack, seed):
    """Random weights, several canvases a request: a generated schema, a regex and a choice
    list with room, and an unbounded language with max_tokens at most 10 above its minimum,
    batched with an unconstrained request: each ends with a stop and its text validates."""
    sos = [SO(json=schema), SO(regex=regex), SO(choice=choice), SO(json=UNBOUNDED[unbounded])]
    budgets = [_minimum(gemma, so) + (40 if i < 3 else slack) for i, so in enumerate(sos)]
    reqs = [(f"c{i}", [3, 4, 5 + i], _params(i, so, n, seed))
            for i, (so, n) in enumerate(zip(sos, budgets, strict=True))]
    reqs.append(("free", [3, 4], SamplingParams(max_tokens=16, seed=seed)))
    engine = Engine(EngineConfig(model=gemma.path, device="cpu", dtype="float64", page_size=4,
                                 num_pages=300), gemma)
    done = _run(engine, reqs)
    for i, so in enumerate(sos):
        out = done[f"c{i}"]
        assert out.finish_reason == "stop", (so, out.text, out.finish_reason)
        assert valid(so, out.text), (so, out.text)
        assert len(out.token_ids) < budgets[i]
    assert engine.pool.allocator.num_free == engine.pool.num_pages


def _workload() -> list:
    rng = random.Random(4)
    sos = [SO(json=UNBOUNDED[0]), SO(json=UNBOUNDED[5]), SO(regex=r"[a-z]+(,[a-z]+)*"),
           SO(choice=["red", "green", "blue"]), None]
    reqs = []
    for i in range(8):
        so = sos[i % len(sos)]
        params = (_params(i, so, rng.choice([56, 72]), 300) if so is not None else
                  SamplingParams(max_tokens=24, seed=300 + i))
        reqs.append((f"r{i}", [rng.randrange(3, 60) for _ in range(rng.randrange(2, 30))],
                     params))
    return reqs


def test_canvas_constraints_are_batch_invariant(gemma):
    """Each request's tokens alone equal its tokens batched with staggered arrivals."""
    reqs = _workload()
    config = EngineConfig(model=gemma.path, device="cpu", dtype="float64", page_size=4,
                          num_pages=300, token_budget=64)
    alone = {rid: _run(Engine(config, gemma), [(rid, p, s)])[rid].token_ids
             for rid, p, s in reqs}
    got = staggered_outputs(Engine(config, gemma), reqs, random.Random(1))
    assert {rid: o.token_ids for rid, o in got.items()} == alone


@pytest.mark.parametrize("layout,kill", [(dict(mode="disaggregated", prefill_workers=1,
                                               decode_workers=2), 2),
                                         (dict(num_workers=2), None)], ids=["1P2D-kill", "2C"])
def test_canvas_constraints_cross_worker_processes(gemma, layout, kill):
    """A constrained request's grammar (rebuilt by replay) crosses processes with it; with a
    decode worker SIGKILLed mid-run, its requests restart their canvas elsewhere; every
    request's tokens equal the in-process run's."""
    reqs = _workload()
    config = EngineConfig(model=gemma.path, device="cpu", dtype="float64", page_size=4,
                          num_pages=300, token_budget=64)
    want = {rid: o.token_ids for rid, o in _run(Engine(config, gemma), reqs).items()}
    run = run_in_mode(gemma.path, reqs, layout, kill)
    assert {r: o.token_ids for r, o in run["outs"].items()} == want
    assert run["dead"] == ([] if kill is None else [kill])


def test_structured_output_through_the_api(tmp_path):
    """A DiffusionGemma server (random weights, the Gemma chat layout) honours every form:
    response_format's JSON schema, a Lark grammar, and tool_choice "required" (a call that
    parses, finish_reason "tool_calls"); a forced call that cannot fit max_tokens is a 400
    naming the minimum."""
    import json
    import re

    import jsonschema
    import openai

    from sangam.demo.tokenizer import GEMMA_VOCAB, write_tokenizer
    from tests.test_serve_openai import serve_subprocess

    path = write_checkpoint(tmp_path / "dg", seed=3, vocab_size=len(GEMMA_VOCAB))
    write_tokenizer(path, layout="gemma")
    city = {"type": "object", "required": ["city"], "additionalProperties": False,
            "properties": {"city": {"type": "string"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    args = ["--model", str(path), "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "dg", "--num-pages", "256"]
    with serve_subprocess(args, tmp_path / "server.log") as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        res = client.chat.completions.create(
            model="dg", messages=messages, max_tokens=40, seed=1,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": city}})
        assert res.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(res.choices[0].message.content), city)
        res = client.chat.completions.create(
            model="dg", messages=messages, max_tokens=16, seed=2,
            extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no" "!"*'}})
        assert re.fullmatch(r"yes|no!*", res.choices[0].message.content)
        tools = [{"type": "function", "function": {"name": "weather", "parameters": city}}]
        res = client.chat.completions.create(model="dg", messages=messages, max_tokens=96,
                                             seed=3, tools=tools, tool_choice="required")
        (call,) = res.choices[0].message.tool_calls
        assert res.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), city)
        with pytest.raises(openai.BadRequestError, match="max_tokens of at least"):
            client.chat.completions.create(model="dg", messages=messages, max_tokens=8,
                                           tools=tools, tool_choice="required")


@pytest.mark.parametrize("kv_pool", ["single", "hybrid"])
def test_two_hundred_constrained_canvases_at_once(gemma, kv_pool):
    """200 requests in one engine (a default-sized batch cap), a third unconstrained, the rest
    under schemas, regexes and choices at budgets from their minimum up, prompts up to 20
    sliding windows long: every constrained one ends with a stop and validates, and every page
    comes back, of both kinds in a hybrid pool."""
    rng = random.Random(7)
    forms = [SO(json=UNBOUNDED[i]) for i in range(len(UNBOUNDED))] + [
        SO(regex=r"[a-z]+(,[a-z]+)*"), SO(choice=["red", "green", "blue"])]
    engine = Engine(EngineConfig(model=gemma.path, device="cpu", dtype="float64", page_size=4,
                                 num_pages=4096, token_budget=512, kv_pool=kv_pool), gemma)
    sos = {}
    for i in range(200):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(2, 120))]
        if i % 3 == 0:
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, seed=i))
            continue
        so = sos[f"r{i}"] = rng.choice(forms)
        budget = _minimum(gemma, so) + rng.randrange(0, 24)
        engine.add_request(f"r{i}", prompt, _params(i, so, budget, 500))
    done = _run(engine, [])
    assert len(done) == 200
    for rid, so in sos.items():
        assert done[rid].finish_reason == "stop" and valid(so, done[rid].text), (so, done[rid])
    assert engine.pool.allocator.num_free == engine.pool.num_pages
    rings = engine.pool.rings
    assert (rings is not None) == (kv_pool == "hybrid")
    assert rings is None or rings.allocator.num_used == 0
