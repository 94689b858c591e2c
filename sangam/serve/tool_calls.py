"""Tool calls in a chat response, as vLLM's ``--tool-call-parser``.

The model writes a call as text; a parser turns that text into OpenAI's ``tool_calls``. The
``hermes`` format (Hermes, Qwen2.5 and so Dream) is one JSON object per call between tags::

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The response's content is then the text before the first call (None if there is none). As in
vLLM, a response whose calls do not all parse is plain content with no calls, and the last call
may lack its closing tag (the model stopped right after its JSON).

``tool_call_grammar`` is the grammar of exactly that format for given functions: what
``tool_choice: "required"`` or a named function constrains a response to, so that its calls
always parse and their arguments match the functions' parameter schemas.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from sangam.decoding.grammar import JSON_OPTIONS

TOOL_CALL_PARSERS = ("hermes",)
# A function without parameters (OpenAI: an empty parameter list) takes an empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text

    @staticmethod
    def new_id() -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ParsedResponse:
    content: str | None
    calls: tuple[ParsedCall, ...]


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, parallel: bool = True) -> ParsedResponse:
        """The content and calls of a whole response; ``parallel=False`` keeps the first call
        only (OpenAI's ``parallel_tool_calls``)."""
        first = text.find(self.START)
        if first < 0:
            return ParsedResponse(text, ())
        calls = []
        pos = first
        while pos >= 0:
            body_start = pos + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start:end if end >= 0 else len(text)]
            call = self._call(body)
            if call is None:
                return ParsedResponse(text, ())
            calls.append(call)
            pos = -1 if end < 0 else text.find(self.START, end + len(self.END))
        return ParsedResponse(text[:first] or None, tuple(calls if parallel else calls[:1]))

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return None
        return ParsedCall(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))

    def settled_content(self, text: str) -> str:
        """The part of an unfinished response's text that is content whatever comes next: up
        to the first call, and short of a tail that may be the start of one (``<tool_``)."""
        first = text.find(self.START)
        if first >= 0:
            return text[:first]
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return text[:-keep]
        return text


def make_tool_parser(name: str) -> HermesToolParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {TOOL_CALL_PARSERS}")
    return HermesToolParser()


class ToolCallStream:
    """One streamed choice's content and calls. Content is sent as soon as it is settled; the
    calls (and any text that turned out not to be calls) when the response finishes, so that a
    stream always adds up to the response the same request gets unstreamed."""

    def __init__(self, parser: HermesToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel
        self.text = ""
        self.sent = 0  # characters of content sent
        self.calls: tuple[ParsedCall, ...] = ()

    def advance(self, new_text: str, finished: bool) -> tuple[str, tuple[ParsedCall, ...]]:
        """(content to send now, calls to send now) once the response has ``new_text`` more."""
        self.text += new_text
        if finished:
            parsed = self.parser.parse(self.text, self.parallel)
            content, self.calls = parsed.content or "", parsed.calls
        else:
            content = self.parser.settled_content(self.text)
        delta = content[self.sent:]
        self.sent = len(content)
        return delta, self.calls if finished else ()


def tool_call_grammar(functions: list[tuple[str, dict | None]], many: bool) -> str:
    """The grammar (llguidance's Lark) of a response that is only calls in the hermes format,
    each of one of ``functions`` ((name, parameters schema) pairs) with arguments that match
    its schema: one call, or with ``many`` one or more, a newline apart. Raises ValueError for
    a parameters schema that is not an object's."""
    start, newline, end = (json.dumps(text) for text in (
        HermesToolParser.START + "\n", "\n", "\n" + HermesToolParser.END))
    names = [f"fn_{i}" for i in range(len(functions))]
    more = f" ({newline} call)*" if many else ""
    rules = [f"start: call{more}", f"call: {start} ({' | '.join(names)}) {end}"]
    rules += [f"{rule}: %json {json.dumps(_call_schema(name, parameters))}"
              for rule, (name, parameters) in zip(names, functions)]
    return "\n".join(rules) + "\n"


def _call_schema(name: str, parameters: dict | None) -> dict:
    """The JSON schema of one call's object: ``{"name": NAME, "arguments": {...}}``, laid out
    as every constrained JSON is (``JSON_OPTIONS``: no free whitespace, which a model could
    otherwise fill its whole canvas with; a %json rule takes no compiler defaults). The
    parameters' definitions ($defs) move to the root, where their references point."""
    arguments = dict(parameters) if parameters else dict(NO_PARAMETERS)
    if arguments.setdefault("type", "object") != "object":
        raise ValueError(f"the parameters of tool {name!r} must be an object's JSON schema, "
                         f"got type {arguments['type']!r}")
    definitions = {k: arguments.pop(k) for k in ("$defs", "definitions") if k in arguments}
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": JSON_OPTIONS, **definitions}
