"""Structured output through the API (docs/api.md, "Structured output"): every way a request
asks for it (``response_format``, the Responses API's ``text.format``, vLLM's
``structured_outputs`` and older ``guided_*`` fields, a ``tool_choice`` that forces calls)
reaches SamplingParams as the right constraint; two at once, a constraint that does not compile
or a model without a tokenizer are 400s; and against the demo server the output parses and
validates, through the official ``openai`` client too."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel
from test_serve_openai import serve_subprocess

from sangam.config import EngineConfig
from sangam.decoding.grammar import Constraint, ConstraintError
from sangam.engine.loaded_model import LoadedModel
from sangam.sampling_params import StructuredOutputsParams
from sangam.serve.errors import ApiError
from sangam.serve.intake import RequestValidator, ServedModel
from sangam.serve.protocol import ChatCompletionRequest, CompletionRequest
from sangam.serve.responses import ResponsesRequest
from sangam.serve.tool_calls import HermesToolParser, tool_call_grammar

MODEL = "sangam-demo"
USER = [{"role": "user", "content": "Is 7 odd?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}
# A tool whose parameters refer to their own definitions ($defs), as pydantic writes them.
UNITS = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}},
         "required": ["unit"], "additionalProperties": False,
         "$defs": {"Unit": {"enum": ["C", "F"]}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
              {"type": "function", "function": {"name": "units", "parameters": UNITS}},
              {"type": "function", "function": {"name": "now"}}]  # no parameters: {}
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
FUNCTIONS = [(t["function"]["name"], t["function"].get("parameters")) for t in CHAT_TOOLS]
BODIES = {"chat": (ChatCompletionRequest, {"messages": USER}),
          "completions": (CompletionRequest, {"prompt": "x"}),
          "responses": (ResponsesRequest, {"input": "x"})}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return LoadedModel.load(EngineConfig(device="cpu"))  # the demo model


@pytest.fixture(scope="module")
def validator(loaded) -> RequestValidator:
    return RequestValidator(ServedModel(MODEL, loaded.context_length), loaded.default_params,
                            None, loaded.grammar_compiler)


def _body(api: str, **fields: Any) -> BaseModel:
    body_type, required = BODIES[api]
    return body_type.model_validate_json(json.dumps({**required, **fields}))


def _params(validator: RequestValidator, api: str, **fields: Any):
    body = _body(api, **fields)
    if api == "completions":
        return asyncio.run(validator.params(body))
    return asyncio.run(validator.params_and_tools(body))[0]


S = StructuredOutputsParams
FORMS = [  # (APIs, body fields, the constraint they make; None: none)
    (("chat", "completions"), {"response_format": {"type": "json_schema", "json_schema": {
        "name": "yes_no", "schema": SCHEMA, "strict": True}}}, S(json=SCHEMA)),
    (("chat", "completions"), {"response_format": {"type": "json_schema", "json_schema": {
        "name": "anything"}}}, S(json_object=True)),
    (("chat", "completions"), {"response_format": {"type": "json_object"}}, S(json_object=True)),
    (("chat", "completions"), {"response_format": {"type": "text"}}, None),
    (("responses",), {"text": {"format": {"type": "json_schema", "name": "yes_no",
                                          "schema": SCHEMA, "strict": True}}}, S(json=SCHEMA)),
    (("responses",), {"text": {"format": {"type": "json_object"}}}, S(json_object=True)),
    (("responses",), {"text": {"format": {"type": "text"}}}, None),
    (("responses",), {"text": {}}, None),
    (tuple(BODIES), {"structured_outputs": {"json": SCHEMA}}, S(json=SCHEMA)),
    (tuple(BODIES), {"structured_outputs": {"json": json.dumps(SCHEMA)}},
     S(json=json.dumps(SCHEMA))),
    (tuple(BODIES), {"structured_outputs": {"regex": "[0-9]{3}"}}, S(regex="[0-9]{3}")),
    (tuple(BODIES), {"structured_outputs": {"choice": ["yes", "no"]}}, S(choice=("yes", "no"))),
    (tuple(BODIES), {"structured_outputs": {"grammar": 'start: "a"+'}}, S(grammar='start: "a"+')),
    (tuple(BODIES), {"structured_outputs": {"json_object": True, "regex": None}},
     S(json_object=True)),
    (tuple(BODIES), {"guided_json": SCHEMA}, S(json=SCHEMA)),
    (tuple(BODIES), {"guided_json": json.dumps(SCHEMA)}, S(json=json.dumps(SCHEMA))),
    (tuple(BODIES), {"guided_regex": "[0-9]{3}"}, S(regex="[0-9]{3}")),
    (tuple(BODIES), {"guided_choice": ["yes", "no"]}, S(choice=("yes", "no"))),
    (tuple(BODIES), {"guided_grammar": 'root ::= "a"+'}, S(grammar='root ::= "a"+')),
    (tuple(BODIES), {}, None),
    (("chat",), {"tools": CHAT_TOOLS, "tool_choice": "required"},
     S(grammar=tool_call_grammar(FUNCTIONS, many=True))),
    (("chat",), {"tools": CHAT_TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
     S(grammar=tool_call_grammar(FUNCTIONS, many=False))),
    (("chat",), {"tools": CHAT_TOOLS, "tool_choice": {"type": "function",
                                                      "function": {"name": "units"}}},
     S(grammar=tool_call_grammar(FUNCTIONS[1:2], many=False))),
    (("responses",), {"tools": RESPONSES_TOOLS, "tool_choice": "required"},
     S(grammar=tool_call_grammar(FUNCTIONS, many=True))),
    (("responses",), {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function",
                                                                "name": "weather"}},
     S(grammar=tool_call_grammar(FUNCTIONS[:1], many=False))),
    (("chat",), {"tools": CHAT_TOOLS, "tool_choice": "none"}, None),
    (("responses",), {"tools": RESPONSES_TOOLS, "tool_choice": "none"}, None),
]


@pytest.mark.parametrize("apis,fields,want", FORMS)
def test_each_form_reaches_sampling_params(validator, apis, fields, want):
    for api in apis:
        assert _params(validator, api, **fields).structured_outputs == want, api


@pytest.mark.parametrize("api,fields", [
    ("completions", {"guided_regex": "a", "guided_choice": ["a"]}),
    ("chat", {"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}),
    ("completions", {"response_format": {"type": "json_object"},
                     "structured_outputs": {"regex": "a"}}),
    ("chat", {"response_format": {"type": "json_object"}, "tools": CHAT_TOOLS,
              "tool_choice": "required"}),
    ("responses", {"text": {"format": {"type": "json_object"}}, "guided_grammar": 'start: "a"'}),
    ("responses", {"text": {"format": {"type": "json_object"}}, "tools": RESPONSES_TOOLS,
                   "tool_choice": "required"}),
])
def test_two_forms_at_once_are_refused(validator, api, fields):
    with pytest.raises(ApiError, match="at most one output constraint") as e:
        _params(validator, api, **fields)
    assert e.value.status == 400
    named = {"text": "text.format"}
    assert all(named.get(f, f) in e.value.message for f in fields if f != "tools")


@pytest.mark.parametrize("fields,constraint", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}},
     Constraint("json", json.dumps({"type": "nonsense"}))),
    ({"structured_outputs": {"json": {"properties": {"a": {"$ref": "#/nowhere"}}}}},
     Constraint("json", json.dumps({"properties": {"a": {"$ref": "#/nowhere"}}}))),
    ({"guided_regex": "a("}, Constraint("regex", "a(")),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}},
     Constraint("grammar", "start: undefined_rule")),
    ({"guided_grammar": "root ::= ("}, Constraint("grammar", "root ::= (")),
])
def test_a_constraint_that_does_not_compile_is_a_400(validator, loaded, fields, constraint):
    with pytest.raises(ConstraintError) as compiled:
        loaded.grammar_compiler().compile(constraint)
    with pytest.raises(ApiError) as e:
        _params(validator, "chat", **fields)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert "does not compile" in e.value.message and str(compiled.value) in e.value.message
    assert e.value.param == next(iter(fields))


@pytest.mark.parametrize("api,fields,fragment", [
    ("chat", {"structured_outputs": {}}, "give exactly one"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "give exactly one"),
    ("chat", {"guided_json": "not JSON"}, "json must be a JSON schema"),
    ("chat", {"guided_choice": []}, "at least 1 item"),
    ("chat", {"guided_regex": "x" * 100_001}, "at most 100000 characters"),
    ("chat", {"response_format": {"type": "json_schema"}}, "json_schema"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("chat", {"tools": CHAT_TOOLS, "tool_choice": {"type": "function",
                                                    "function": {"name": "nope"}}},
     "not among the tools"),
    ("chat", {"tool_choice": "required"}, "needs tools"),
    ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}], "tool_choice": "required"},
     "must be an object's JSON schema"),
    ("responses", {"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "name"),
    ("responses", {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function",
                                                             "function": {"name": "now"}}},
     "tool_choice"),
    ("chat", {"guided_regex": "a", "edit_threshold": 0.9}, "edit_threshold"),
])
def test_bad_constraint_fields_are_400s(validator, api, fields, fragment):
    try:
        _params(validator, api, **fields)
    except ApiError as e:
        assert e.status == 400 and fragment in e.message, e.message
    except ValueError as e:  # pydantic's ValidationError: the server's 400 too
        assert fragment in str(e), str(e)
    else:
        raise AssertionError("accepted")


def test_a_model_without_a_tokenizer_is_a_400(dream_path):
    tokenless = LoadedModel.load(EngineConfig(model=dream_path, device="cpu"))
    validator = RequestValidator(ServedModel(MODEL, tokenless.context_length),
                                 tokenless.default_params, None, tokenless.grammar_compiler)
    with pytest.raises(ApiError, match="needs a tokenizer") as e:
        _params(validator, "completions", prompt=[5, 6], guided_choice=["a"])
    assert e.value.status == 400 and e.value.param == "guided_choice"


def _walk(loaded: LoadedModel, grammar: str, rng: random.Random, limit: int = 600) -> str:
    """A random text the grammar allows: random allowed tokens until it is complete."""
    matcher = loaded.grammar_compiler().matcher(Constraint("grammar", grammar))
    tokens: list[int] = []
    eos = loaded.config.eos_token_id
    while not matcher.is_stopped() and len(tokens) < limit:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:loaded.config.vocab_size]
        allowed = np.flatnonzero(bits).tolist()
        token = eos if eos in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.consume_token(token), matcher.get_error()
        if token == eos:
            break
        tokens.append(token)
    assert matcher.is_accepting(), "the walk did not finish"
    return loaded.text.decode(tokens)


@pytest.mark.parametrize("functions,many", [(FUNCTIONS, True), (FUNCTIONS, False),
                                            (FUNCTIONS[1:2], False)])
def test_every_text_the_tool_call_grammar_allows_parses(loaded, functions, many):
    """The grammar of forced calls allows only what the hermes parser reads as calls of the
    given functions, with arguments valid under their parameters: random walks through it."""
    grammar = tool_call_grammar(functions, many)
    schemas = {name: params or {"type": "object", "maxProperties": 0}
               for name, params in functions}
    rng = random.Random(0)
    counts = set()
    for _ in range(12):
        text = _walk(loaded, grammar, rng)
        parsed = HermesToolParser().parse(text)
        assert parsed.content is None and parsed.calls, text
        counts.add(len(parsed.calls))
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    if many:
        assert max(counts) > 1
    else:
        assert counts == {1}


# End to end, against the demo server.
@pytest.fixture(scope="module")
def demo_server(tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("structured") / "server.log"
    with serve_subprocess(["--device", "cpu", "--log-level", "warning"], log) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(demo_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{demo_server}/v1", api_key="x", max_retries=0)


def test_response_format_json_schema_output_validates(client):
    res = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=64,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "yes_no", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(res.choices[0].message.content), SCHEMA)
    assert res.choices[0].finish_reason == "stop"


def test_every_api_honours_its_form(client, demo_server):
    """A regex in completions, choices in chat, a schema in the Responses API (streamed)."""
    done = client.completions.create(model=MODEL, prompt="Count: ", max_tokens=16,
                                      extra_body={"guided_regex": "[0-9]{3}"})
    assert done.choices[0].text.isdigit() and len(done.choices[0].text) == 3
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=16,
                                          extra_body={"structured_outputs": {
                                              "choice": ["odd", "even"]}})
    assert chat.choices[0].message.content in ("odd", "even")
    with client.responses.stream(model=MODEL, input="Is 7 odd?", max_output_tokens=64,
                                 text={"format": {"type": "json_schema", "name": "yes_no",
                                                  "schema": SCHEMA}}) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    assert final.text.format.type == "json_schema"


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


def test_openai_client_parse(client):
    res = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Verdict,
                                        max_tokens=64)
    assert isinstance(res.choices[0].message.parsed, Verdict)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_valid_calls(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=CHAT_TOOLS, tool_choice="required", max_tokens=128)
    if stream:
        calls: dict[int, Any] = {}
        reason = None
        for chunk in client.chat.completions.create(**kw, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or ():
                    calls[call.index] = call
                reason = choice.finish_reason or reason
        calls = list(calls.values())
    else:
        res = client.chat.completions.create(**kw)
        calls, reason = res.choices[0].message.tool_calls, res.choices[0].finish_reason
    schemas = dict(FUNCTIONS)
    assert calls and reason == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments),
                            schemas[call.function.name] or {"maxProperties": 0})


def test_named_tool_choice_calls_that_function(client, demo_server):
    res = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Which unit?"}], tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "units"}}, max_tokens=128)
    (call,) = res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "units"
    jsonschema.validate(json.loads(call.function.arguments), UNITS)
    r = httpx.post(f"{demo_server}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "Weather in Paris?", "tools": RESPONSES_TOOLS,
        "tool_choice": {"type": "function", "name": "weather"}, "max_output_tokens": 128}).json()
    (item,) = r["output"]
    assert item["type"] == "function_call" and item["name"] == "weather"
    jsonschema.validate(json.loads(item["arguments"]), CITY)
    assert r["tool_choice"] == {"type": "function", "name": "weather"}


def test_errors_over_http(demo_server):
    url = f"{demo_server}/v1/chat/completions"
    r = httpx.post(url, json={"model": MODEL, "messages": USER, "guided_regex": "a(",
                              "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "at most one output constraint" in r.text
    r = httpx.post(url, json={"model": MODEL, "messages": USER, "guided_regex": "a("})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error"
    assert "does not compile" in err["message"] and "unclosed group" in err["message"]
    assert err["param"] == "guided_regex"


def test_a_forced_call_that_cannot_fit_max_tokens_is_a_400_naming_its_minimum(client,
                                                                             demo_server):
    """tool_choice "required" whose shortest call is longer than max_tokens: a 400 with the
    minimum, not a cut call in content; at that minimum, a call that parses (the budget-aware
    rule closes it in time, docs/decoding.md)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": CHAT_TOOLS[:1], "tool_choice": "required", "max_tokens": 8}
    r = httpx.post(f"{demo_server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    need = int(message.split("max_tokens of at least ")[1].split()[0])
    assert need > 8 and "max_tokens is 8" in message
    res = client.chat.completions.create(**{**body, "max_tokens": need})
    (call,) = res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), CITY)
