"""Tool calls in a chat response, as vLLM's ``--tool-call-parser``.

The model writes a call as text; a parser turns that text into OpenAI's ``tool_calls``. The
``hermes`` format (Hermes, Qwen2.5 and so Dream) is one JSON object per call between tags::

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The response's content is then the text before the first call (None if there is none). As in
vLLM, a response whose calls do not all parse is plain content with no calls, and the last call
may lack its closing tag (the model stopped right after its JSON).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes",)


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
