"""The hermes tool-call parser, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from sangam.serve.tool_calls import HermesToolParser, ParsedCall, ToolCallStream, make_tool_parser

PARSER = HermesToolParser()


def _call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_text_without_calls_is_all_content():
    for text in ("", "Paris is sunny.", "a < b and <tool", "<tool_cal"):
        parsed = PARSER.parse(text)
        assert parsed.content == text and parsed.calls == ()


def test_calls_and_the_content_before_them():
    text = "Let me look." + _call("weather", city="Paris") + "\n" + _call("time", tz="CET")
    parsed = PARSER.parse(text)
    assert parsed.content == "Let me look."
    assert parsed.calls == (ParsedCall("weather", '{"city": "Paris"}'),
                            ParsedCall("time", '{"tz": "CET"}'))
    assert PARSER.parse(text, parallel=False).calls == parsed.calls[:1]
    # Only calls: no content at all (OpenAI's null).
    assert PARSER.parse(_call("time")).content is None
    # Arguments keep non-ASCII text as is; missing arguments are an empty object.
    assert PARSER.parse(_call("say", text="héllo")).calls[0].arguments == '{"text": "héllo"}'
    assert PARSER.parse('<tool_call>{"name": "now"}</tool_call>').calls == (
        ParsedCall("now", "{}"),)


def test_the_last_call_may_lack_its_closing_tag():
    parsed = PARSER.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert parsed.calls == (ParsedCall("f", '{"x": 1}'),) and parsed.content is None


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # not JSON
    '<tool_call>["f"]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"x": 1}}',  # truncated: fine alone...
])
def test_a_call_that_does_not_parse_makes_it_all_content(bad):
    if bad.endswith("}}"):  # ...but not before a call that follows it
        bad += _call("g")
    text = "Hm." + _call("ok") + bad
    parsed = PARSER.parse(text)
    assert parsed.content == text and parsed.calls == ()


def test_settled_content_holds_back_what_may_open_a_call():
    assert PARSER.settled_content("Hi <tool_") == "Hi "
    assert PARSER.settled_content("Hi <") == "Hi "
    assert PARSER.settled_content("Hi <b>") == "Hi <b>"
    assert PARSER.settled_content("Hi" + _call("f")[:20]) == "Hi"
    assert PARSER.settled_content("x" + _call("f") + "tail") == "x"


@pytest.mark.parametrize("seed", range(20))
def test_a_stream_adds_up_to_the_whole_response(seed):
    """Cut into random pieces, the streamed content and calls equal the parse of the whole
    text, and content is sent before the end whenever it is settled."""
    rng = random.Random(seed)
    parts = ["Sure.", " <b>ok</b> ", _call("f", a=rng.random()), "\n", _call("g"), "<tool_ca",
             '<tool_call>{"name": broken</tool_call>', "bye"]
    text = "".join(rng.sample(parts, rng.randint(0, len(parts))))
    cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parallel = rng.random() < 0.5
    stream = ToolCallStream(PARSER, parallel)
    sent, calls = "", ()
    for k, piece in enumerate(pieces):
        finished = k == len(pieces) - 1
        content, new_calls = stream.advance(piece, finished)
        sent += content
        if not finished:
            assert new_calls == ()
            assert sent == PARSER.settled_content(text[:len("".join(pieces[:k + 1]))])
        calls += new_calls
    whole = PARSER.parse(text, parallel)
    assert sent == (whole.content or "") and calls == whole.calls


def test_unknown_parser_is_refused():
    assert isinstance(make_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_tool_parser("mistral")


def test_server_flags_are_checked_at_startup():
    from sangam.serve import ServerConfig

    with pytest.raises(ValueError, match="needs tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ServerConfig(tool_call_parser="mistral")
    assert ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
