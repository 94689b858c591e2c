"""OpenAI's Responses API (/v1/responses) through the official client: text, streamed events,
tool calls and conversations with calls, equal to the chat path (float64, CPU)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_serve_openai import (
    MODEL,
    SCRIPTED,
    TOOL_TEMPLATE,
    TOOL_TURNS,
    WEATHER,
    script_text,
    serve_in_thread,
)

from sangam import LLM, SamplingParams

# The Responses API's function tools are the chat API's, flattened.
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
PARAMS = dict(block_length=4, stop_at_eos=False)


@pytest.fixture(scope="module")
def url(chat_ckpt) -> Iterator[str]:  # noqa: F811
    with serve_in_thread(chat_ckpt, chat_template=TOOL_TEMPLATE, enable_auto_tool_choice=True,
                         tool_call_parser="hermes") as url:
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def llm(chat_ckpt) -> LLM:  # noqa: F811
    return LLM(chat_ckpt, device="cpu", dtype="float64")


def _chat(llm: LLM, messages: list[dict], max_tokens: int, **kw):
    params = SamplingParams(max_tokens=max_tokens, **PARAMS)
    return llm.chat(messages, params, chat_template=TOOL_TEMPLATE, **kw)[0]


def test_text_response_equals_chat(client, llm):
    """input + instructions are the chat path's user and system messages; the response says it
    is incomplete when max_output_tokens cut it."""
    res = client.responses.create(model=MODEL, input="Say hi", instructions="Be brief.",
                                  max_output_tokens=8, extra_body={"stop_at_eos": False})
    ref = _chat(llm, [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Say hi"}], 8)
    assert res.id.startswith("resp_") and res.object == "response"
    assert res.output_text == ref.text
    assert [item.type for item in res.output] == ["message"]
    assert res.status == "incomplete" and res.incomplete_details.reason == "max_output_tokens"
    assert (res.usage.input_tokens, res.usage.output_tokens) == (len(ref.prompt_token_ids), 8)
    assert res.instructions == "Be brief." and res.max_output_tokens == 8
    # Message items (text, or parts) are the same conversation.
    parts = client.responses.create(model=MODEL, max_output_tokens=8, instructions="Be brief.",
                                    input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": "Say "},
                                        {"type": "input_text", "text": "hi"}]}],
                                    extra_body={"stop_at_eos": False})
    assert parts.output_text == ref.text


def test_streamed_events_add_up_to_the_response(client):
    ask = dict(model=MODEL, input="Tell me", max_output_tokens=12,
               extra_body={"stop_at_eos": False})
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) <= 3  # one per committed block of 4 (an empty one sends nothing)
    assert "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_function_calls(client, llm, monkeypatch):
    """The calls the model writes are function_call items after the message; streamed, the
    same items arrive, each with its events."""
    script_text(monkeypatch)
    ask = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL],
               max_output_tokens=16, extra_body={"stop_at_eos": False})
    res = client.responses.create(**ask)
    assert [item.type for item in res.output] == ["message", "function_call", "function_call"]
    assert res.output[0].content[0].text == "Checking." and res.status == "completed"
    calls = res.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"}), ("time", {})]
    assert calls[0].call_id != calls[1].call_id
    one = client.responses.create(**ask, parallel_tool_calls=False)
    assert [item.type for item in one.output] == ["message", "function_call"]
    assert client.responses.create(**ask, tool_choice="none").output_text == SCRIPTED

    events = list(client.responses.create(**ask, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, getattr(i, "name", None)) for i in done] == [
        ("message", None), ("function_call", "weather"), ("function_call", "time")]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == [c.arguments for c in calls]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas == args
    # The client's own stream helper follows the events to the same response.
    with client.responses.stream(**ask) as stream:
        followed = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in followed.output] == [
        (i.type, getattr(i, "arguments", None)) for i in res.output]
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == [i.type for i in res.output]


def test_a_conversation_with_function_calls(client, llm):
    """function_call and function_call_output items render as the chat API's assistant
    tool_calls and tool messages."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "c1", "name": "weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    res = client.responses.create(model=MODEL, input=items, tools=[WEATHER_TOOL],
                                  max_output_tokens=8, extra_body={"stop_at_eos": False})
    as_objects = [{**m, "tool_calls": [{**c, "function": {"name": "weather",
                                                          "arguments": {"city": "Paris"}}}
                                       for c in m["tool_calls"]]} if "tool_calls" in m else m
                  for m in TOOL_TURNS]
    ref = _chat(llm, as_objects, 8, tools=[WEATHER])
    assert res.usage.input_tokens == len(ref.prompt_token_ids)
    assert res.output_text == ref.text


@pytest.mark.parametrize("body,match", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}),
     "text.format: the output constraint does not compile"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "nope"}),
     "not among the tools"),
    (dict(tool_choice="auto"), "needs tools"),
    (dict(extra_body={"n": 2}), "n"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "call_id"),
])
def test_refused(client, body, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.responses.create(**{"model": MODEL, "input": "hi", **body})


@pytest.fixture(scope="module")
def store_url(chat_ckpt) -> Iterator[str]:  # noqa: F811
    with serve_in_thread(chat_ckpt, chat_template=TOOL_TEMPLATE, enable_auto_tool_choice=True,
                         tool_call_parser="hermes", responses_store_size=3) as url:
        yield url


def test_schema_allows_previous_response_id_with_a_store(store_url):
    props = httpx.get(f"{store_url}/openapi.json").json()["components"]["schemas"][
        "ResponsesRequest"]["properties"]
    assert {"type": "string"} in props["previous_response_id"]["anyOf"]


def test_stored_responses_continue_conversations(store_url, llm):
    """--responses-store-size: previous_response_id continues a stored response (its turns
    and output, not its instructions); GET and DELETE /v1/responses/{id}; the oldest go first;
    store: false keeps nothing."""
    client = openai.OpenAI(base_url=f"{store_url}/v1", api_key="x", max_retries=0)
    ask = dict(model=MODEL, max_output_tokens=8, extra_body={"stop_at_eos": False})
    first = client.responses.create(input="Say hi", instructions="Be brief.", **ask)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(input="Again", previous_response_id=first.id, **ask)
    ref = _chat(llm, [{"role": "user", "content": "Say hi"},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "Again"}], 8)
    assert second.usage.input_tokens == len(ref.prompt_token_ids)
    assert second.output_text == ref.text
    # Streamed responses are stored too, whole.
    events = list(client.responses.create(input="Go on", previous_response_id=second.id,
                                           stream=True, **ask))
    third = client.responses.retrieve(events[-1].response.id)
    assert third.output_text == events[-1].response.output_text
    unkept = client.responses.create(input="Forget me", store=False, **ask)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    client.responses.create(input="One more", **ask)  # a fourth: the first is evicted
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    client.responses.delete(second.id)
    for gone in (lambda: client.responses.retrieve(second.id),
                 lambda: client.responses.create(input="x", previous_response_id=second.id,
                                                 **ask)):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            gone()


def test_a_stored_call_continues_with_its_output(store_url, llm, monkeypatch):
    """A stored response's function calls come back as the assistant's tool calls, before
    the function_call_output items that answer them."""
    client = openai.OpenAI(base_url=f"{store_url}/v1", api_key="x", max_retries=0)
    with monkeypatch.context() as patch:
        script_text(patch)
        called = client.responses.create(model=MODEL, input="Weather in Paris?",
                                         tools=[WEATHER_TOOL], max_output_tokens=16,
                                         extra_body={"stop_at_eos": False})
    calls = [item for item in called.output if item.type == "function_call"]
    answers = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
               for c in calls]
    after = client.responses.create(model=MODEL, input=answers, tools=[WEATHER_TOOL],
                                    previous_response_id=called.id, max_output_tokens=8,
                                    extra_body={"stop_at_eos": False})
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "Checking.", "tool_calls": [
                 {"id": c.call_id, "type": "function",
                  "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                 for c in calls]},
             *[{"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls]]
    ref = _chat(llm, turns, 8, tools=[WEATHER])
    assert after.usage.input_tokens == len(ref.prompt_token_ids)
    assert after.output_text == ref.text
