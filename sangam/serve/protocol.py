"""Request and response bodies of the OpenAI-compatible API, plus Sangam's diffusion options.

Requests validate strictly (``"3"`` is not an integer, ``NaN`` is not a number) so that a field of
the wrong type is a 400, never a surprise deep in the engine. Unknown fields are ignored, as the
OpenAI API does. OpenAI fields Sangam cannot honour are accepted only at their neutral value;
``unsupported_fields`` names the others so the server can refuse them with a 400.

A request constrains its output (structured output) in one of vLLM's ways: ``response_format``
(``text.format`` in the Responses API), ``structured_outputs``, the older ``guided_*`` fields,
or a ``tool_choice`` that forces a tool call; ``output_constraint`` gives the one it names as
``StructuredOutputsParams`` (two at once are a 400).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

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
from sangam.serve.tool_calls import tool_call_grammar

MAX_MESSAGES = 4096  # messages (or Responses input items) per conversation


def _says_what_is_accepted(schema: dict[str, Any], model: type) -> None:
    """The schema of a request body says what the server accepts: ``null`` for every optional
    field (``RequestBody`` takes it as unset), and at most one (or exactly one) of the fields
    in ``QUIET`` outside the values that constrain nothing (one output constraint, one form of
    a constraint): an ``anyOf`` of one branch per field that may speak."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or any(s.get("type") == "null" for s in prop.get("anyOf", ())):
            continue
        keep = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        schema["properties"][name] = {"anyOf": [dict(prop), {"type": "null"}], **keep}
    quiet = getattr(model, "QUIET", None)
    if quiet:
        def others(speaker: str) -> dict[str, Any]:
            return {name: q for name, q in quiet.items() if name != speaker}

        branches = [{"required": [speaker],
                     "properties": {speaker: {"not": quiet[speaker]}, **others(speaker)}}
                    for speaker in quiet]
        if not model.EXACTLY_ONE:
            branches.insert(0, {"properties": dict(quiet)})
        schema["anyOf"] = branches


QUIET_NULL = {"type": "null"}
# The values of output-constraint fields that constrain nothing (output_constraints' rule).
QUIET_TEXT_FORMAT = {"anyOf": [QUIET_NULL, {"type": "object",
                                           "properties": {"type": {"const": "text"}}}]}
QUIET_TOOL_CHOICE = {"enum": [None, "none", "auto"]}
QUIET_GUIDED = {name: QUIET_NULL for name in ("structured_outputs", "guided_json", "guided_regex",
                                              "guided_choice", "guided_grammar")}


class RequestBody(BaseModel):
    """Every request body and its parts: strict types (``"3"`` is not an integer, ``NaN`` not a
    number), unknown fields ignored, and ``null`` meaning "unset" for every optional field, as
    in OpenAI's API."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore",
                              json_schema_extra=_says_what_is_accepted)
    # Fields of which at most one (EXACTLY_ONE: exactly one) may hold a value outside its
    # schema here (see _says_what_is_accepted); the body's own validation states the same rule.
    QUIET: ClassVar[dict[str, dict[str, Any]]] = {}
    EXACTLY_ONE: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk too
    # Sangam's: after each step that does not end a block, a chunk whose ``draft`` is the block
    # in progress as it stands (provisional: the next draft or block replaces it; ``content``
    # stays empty in such chunks). transformers' streamer calls it put_draft.
    include_drafts: bool = False


# Bounds the engine enforces (SamplingParams), stated in the schema too, from SamplingParams'
# constants (tests/test_serve_protocol_fields.py holds the two to each other). A token id's
# bound is the model's vocabulary: the served schema says so (TOKEN_ID_MARK, see openapi.py).
TOKEN_ID_MARK = "x-sangam-token-id"
# An OpenAI field of which Sangam serves one value only (best_of, the Responses API's n): an
# integer in n's bounds validates, so that another is refused by name with a 400 that says
# why, but the schema states the value served.
OnlyOne = Annotated[int, Field(ge=1, le=MAX_N, json_schema_extra={"minimum": 1, "maximum": 1})]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32, json_schema_extra={TOKEN_ID_MARK: True})]
Length = Annotated[int, Field(ge=1, le=MAX_INT32)]
Probability = Annotated[float, Field(ge=0, le=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
# A logit_bias key is a token id as JSON keys are, a string: bounded by its digits, the most
# digits every number of which is a token id (<= MAX_INT32).
BIAS_KEY_DIGITS = len(str(MAX_INT32)) - 1
BiasKey = Annotated[str, Field(pattern=rf"^[0-9]{{1,{BIAS_KEY_DIGITS}}}$")]
Bias = Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


# Structured output (docs/api.md, "Structured output"). A JSON schema given as an object is
# bounded by its JSON text's length, which StructuredOutputsParams checks.
ConstraintText = Annotated[str, Field(max_length=MAX_CONSTRAINT_CHARS)]
Choices = Annotated[list[ConstraintText], Field(min_length=1, max_length=MAX_CHOICES)]
JsonSchema = dict[str, Any]
# A constraint: what makes the request's StructuredOutputsParams (raises ValueError).
MakeConstraint = Callable[[], StructuredOutputsParams]


class StructuredOutputsBody(RequestBody):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex, choices, a grammar
    (Lark or GBNF) or ``json_object: true``."""

    json_: JsonSchema | ConstraintText | None = Field(default=None, alias="json")
    regex: ConstraintText | None = None
    choice: Choices | None = None
    grammar: ConstraintText | None = None
    json_object: bool | None = None

    QUIET = {"json": QUIET_NULL, "regex": QUIET_NULL, "choice": QUIET_NULL, "grammar": QUIET_NULL,
             "json_object": {"enum": [None, False]}}
    EXACTLY_ONE = True

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsBody:
        self.params()
        return self

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object)


class JsonSchemaSpec(RequestBody):
    """OpenAI's ``json_schema`` of a response format; no ``schema``: any JSON object."""

    name: str
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.schema_) if self.schema_ is not None else \
            StructuredOutputsParams(json_object=True)


class TextFormat(RequestBody):
    type: Literal["text"]


class JsonObjectFormat(RequestBody):
    type: Literal["json_object"]

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json_object=True)


class JsonSchemaFormat(RequestBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec

    def params(self) -> StructuredOutputsParams:
        return self.json_schema.params()


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class _GenerationRequest(RequestBody):
    """Fields shared by completions, chat completions and responses. Unset means the server's
    default."""

    model: str | None = None
    max_tokens: Length | None = None
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)  # vLLM's extra field
    min_p: Probability | None = None  # vLLM's extra field
    seed: int | None = Field(default=None, ge=0)  # taken modulo 2**SEED_BITS
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM's: the response id's base (X-Request-Id wins)
    # Sangam's diffusion options (docs/design.md §2), as extra body fields.
    block_length: Length | None = None
    unmasking: Literal[UNMASKING_RULES] | None = None
    threshold: Probability | None = None
    factor: float | None = Field(default=None, gt=0)
    tokens_per_step: Length | None = None
    cache: Literal[CACHE_MODES] | None = None
    refresh_interval: Length | None = None
    prompt_refresh_interval: Length | None = None
    refresh_confidence: Probability | None = None
    min_threshold: Probability | None = None  # opt-in: load-adaptive
    edit_threshold: Probability | None = None  # opt-in: token editing (LLaDA2.1)
    max_post_steps: int | None = Field(default=None, ge=0, le=MAX_POST_STEPS)
    # Sangam (RL rollouts): each choice's trajectory (the forward that committed each token,
    # its log-probability then, and any values an edit replaced).
    return_trajectory: bool | None = None
    # Uniform-state models' options (DiffusionGemma, docs/design.md §2.12).
    max_denoising_steps: int | None = Field(default=None, ge=1, le=MAX_DENOISING_STEPS)
    entropy_bound: float | None = Field(default=None, gt=0, le=MAX_ENTROPY)
    t_min: float | None = Field(default=None, gt=0, le=MAX_TEMPERATURE)
    t_max: float | None = Field(default=None, gt=0, le=MAX_TEMPERATURE)
    stability_threshold: int | None = Field(default=None, ge=0, le=MAX_DENOISING_STEPS)
    confidence_threshold: float | None = Field(default=None, ge=0, le=MAX_ENTROPY)
    stop_at_eos: bool | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None \
        = None
    include_stop_str_in_output: bool | None = None  # vLLM's extra field
    skip_special_tokens: bool | None = None  # vLLM's extra field
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None \
        = None  # vLLM's extra field
    ignore_eos: bool | None = None  # vLLM's extra field: the inverse of stop_at_eos
    n: int | None = Field(default=None, ge=1, le=MAX_N)  # choices per prompt (None: 1)
    # token id (a JSON key: a string) -> bias
    logit_bias: Annotated[dict[BiasKey, Bias], Field(
        max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})] | None \
        = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(  # vLLM's extra field
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT32)  # vLLM's extra field
    # vLLM's extra field: the prompt's last k tokens, or -1: as many as fit
    truncate_prompt_tokens: Length | Literal[-1] | None = None
    priority: int | None = Field(default=None, ge=-MAX_INT32, le=MAX_INT32)  # vLLM's
    # Structured output: vLLM's field, and its older extra fields.
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: JsonSchema | ConstraintText | None = None
    guided_regex: ConstraintText | None = None
    guided_choice: Choices | None = None
    guided_grammar: ConstraintText | None = None

    QUIET = QUIET_GUIDED

    def output_constraints(self) -> dict[str, MakeConstraint]:
        """The fields that constrain the output, each with what makes its constraint."""
        found: dict[str, MakeConstraint] = {}
        if self.structured_outputs is not None:
            found["structured_outputs"] = self.structured_outputs.params
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found[f"guided_{kind}"] = functools.partial(StructuredOutputsParams,
                                                            **{kind: value})
        return found

    def output_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The field that constrains the output and its constraint (None: none does); a
        ValueError for two of them, or for one that is not a constraint."""
        found = self.output_constraints()
        if len(found) > 1:
            raise ValueError(f"give at most one output constraint (structured output); got "
                             f"{', '.join(found)}")
        if not found:
            return None
        (name, make), = found.items()
        try:
            return name, make()
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith(name) else f"{name}: {message}"
                             ) from None

    def sampling_overrides(self) -> dict[str, object]:
        """The SamplingParams fields this request sets explicitly."""
        out = {k: getattr(self, k) for k in _AS_GIVEN if getattr(self, k) is not None}
        constraint = self.output_constraint()
        if constraint is not None:
            out["structured_outputs"] = constraint[1]
        if self.seed is not None:  # any integer is a seed, as OpenAI's; the engine's are int63
            out["seed"] = self.seed % 2**SEED_BITS
        if self.ignore_eos is not None:
            if self.stop_at_eos is not None and self.stop_at_eos == self.ignore_eos:
                raise ValueError("ignore_eos and stop_at_eos contradict each other: give one")
            out["stop_at_eos"] = not self.ignore_eos
        if self.logit_bias:
            out["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        if self.stream and self.stream_options is not None and self.stream_options.include_drafts:
            out["include_drafts"] = True
        return out


# The SamplingParams fields a request sets under their own names, as given: all of them but
# those whose value is converted (seed, logit_bias, structured_outputs) or means something else
# in each API (logprobs: a count in completions, a flag in chat).
_CONVERTED = frozenset({"seed", "logit_bias", "logprobs", "structured_outputs"})
_AS_GIVEN = tuple(f.name for f in dataclasses.fields(SamplingParams)
                  if f.name in _GenerationRequest.model_fields and f.name not in _CONVERTED)


PromptText = Annotated[str, Field(min_length=1)]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_GenerationRequest):
    # One prompt or a batch; a prompt is text or token ids.
    prompt: (PromptText | PromptIds | Annotated[list[PromptText], Field(min_length=1)]
             | Annotated[list[PromptIds], Field(min_length=1)])
    echo: bool | None = None
    best_of: OnlyOne | None = None
    logprobs: TopLogprobs | None = None
    suffix: str | None = None  # infilling: the response fills the gap before it
    # vLLM's: the tokenizer's special tokens (BOS...) around text prompts; false for a prompt
    # that already holds them (a chat template applied by the client)
    add_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # vLLM's, as chat's

    QUIET = {**QUIET_GUIDED, "response_format": QUIET_TEXT_FORMAT}

    def unsupported_fields(self) -> list[str]:
        """Fields set to a value whose behaviour Sangam does not implement."""
        return ["best_of"] if self.best_of not in (None, 1) else []

    def output_constraints(self) -> dict[str, MakeConstraint]:
        return _with_format(super().output_constraints(), "response_format",
                            self.response_format)

    def sampling_overrides(self) -> dict[str, object]:
        overrides = super().sampling_overrides()
        if self.logprobs is not None:  # each token's own, and this many alternatives
            if self.echo:
                raise ValueError("echo with logprobs needs the prompt tokens' log-probabilities,"
                                 " which a diffusion model does not produce: drop one of them")
            overrides["logprobs"] = self.logprobs
        return overrides


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


def refuse_non_text(content: Any, allowed: tuple[str, ...]) -> Any:
    """A message's content as given, unless one of its parts is not text (an image, audio):
    refused by name, with why, rather than by the schema's bare mismatch."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                raise ValueError(f"content parts of type {kind!r} are not served: Sangam serves "
                                 "text only (no vision or audio tower is loaded)")
    return content


class FunctionCall(RequestBody):
    name: str
    arguments: str  # a JSON object's text, as the model wrote it (possibly not JSON)


class ToolCall(RequestBody):
    """A call the assistant made: in a response, and in the history a client sends back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return refuse_non_text(content, ("text",))

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content and, as vLLM gives them, tool
        call arguments as objects (templates write them with ``tojson``); arguments that are
        not JSON stay the string given (OpenAI's models may write such calls, and a history
        holding one is the client's to send: templates write a string as it is)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = call.function.arguments
                calls.append({"id": call.id, "type": call.type, "function": {
                    "name": call.function.name, "arguments": arguments}})
            message["tool_calls"] = calls
        return message


class FunctionDefinition(RequestBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class ChatTemplateOptions(RequestBody):
    """What the chat template renders besides the messages: vLLM's options (see
    ``LoadedModel.encode_chat``) and the tools the model may call."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    """Chat's named tool choice: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction

    @property
    def function_name(self) -> str:
        return self.function.name


ToolChoiceMode = Literal["none", "auto", "required"]


class ToolChoice(RequestBody):
    """How a request with ``tools`` (a field of the class this mixes into) lets them be
    called: ``tool_choice`` None is "auto" with tools (OpenAI's default), else "none";
    "required" and a named function constrain the output to calls (of any of the tools, or
    of that function) in the format the hermes parser reads, so they always parse."""

    tool_choice: ToolChoiceMode | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: the first call only

    def tool_functions(self) -> list[FunctionDefinition]:
        """The functions of ``tools`` (each body has its own shape of tool)."""
        raise NotImplementedError

    def forces_calls(self) -> bool:
        """Whether the response must be tool calls ("required", or a named function)."""
        return self.tool_choice not in (None, "none", "auto")

    def _needs_tools(self) -> ValueError:
        choice = self.tool_choice
        named = repr(choice) if isinstance(choice, str) else \
            f"naming the function {choice.function_name!r}"
        return ValueError(f"tool_choice {named} needs tools")

    def calls_tools(self) -> bool:
        """Whether the response is to be parsed for tool calls."""
        if self.tool_choice not in (None, "none") and not self.tools:
            raise self._needs_tools()
        return bool(self.tools) and self.tool_choice != "none"

    def with_tool_constraint(self, found: dict[str, MakeConstraint]
                             ) -> dict[str, MakeConstraint]:
        """``found`` (output constraints), and the calls ``tool_choice`` forces if it does."""
        if self.forces_calls():
            found["tool_choice"] = self._tool_call_constraint
        return found

    def _tool_call_constraint(self) -> StructuredOutputsParams:
        """The grammar of the calls the response must be: one or more (one without
        ``parallel_tool_calls``) of any of the tools, or one of the named function."""
        functions = self.tool_functions()
        if not functions:
            raise self._needs_tools()
        many = self.parallel_tool_calls
        if isinstance(self.tool_choice, BaseModel):
            name, many = self.tool_choice.function_name, False
            functions = [f for f in functions if f.name == name]
            if not functions:
                raise ValueError(f"tool_choice names the function {name!r}, which is not "
                                 "among the tools")
        grammar = tool_call_grammar([(f.name, f.parameters) for f in functions], many)
        if len(grammar) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the tools' parameter schemas are too long to constrain the "
                             f"output to their calls ({len(grammar)} characters of grammar, at "
                             f"most {MAX_CONSTRAINT_CHARS})")
        return StructuredOutputsParams(grammar=grammar)


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class ChatCompletionRequest(_GenerationRequest, ChatTemplateOptions, ToolChoice):
    messages: Messages
    max_completion_tokens: Length | None = None  # the newer OpenAI name of max_tokens
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None

    QUIET = {**QUIET_GUIDED, "response_format": QUIET_TEXT_FORMAT, "tool_choice": QUIET_TOOL_CHOICE}

    def unsupported_fields(self) -> list[str]:
        """Fields set to a value whose behaviour Sangam does not implement: none."""
        return []

    def tool_functions(self) -> list[FunctionDefinition]:
        return [t.function for t in self.tools or ()]

    def output_constraints(self) -> dict[str, MakeConstraint]:
        return self.with_tool_constraint(_with_format(
            super().output_constraints(), "response_format", self.response_format))

    def sampling_overrides(self) -> dict[str, object]:
        overrides = super().sampling_overrides()
        if self.max_completion_tokens is not None:
            overrides.setdefault("max_tokens", self.max_completion_tokens)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.logprobs:
            overrides["logprobs"] = self.top_logprobs or 0
        return overrides


def _with_format(found: dict[str, MakeConstraint], name: str,
                 text_format: BaseModel | None) -> dict[str, MakeConstraint]:
    """``found`` (output constraints), and a response format's (field ``name``) unless it is
    plain text."""
    if text_format is not None and not isinstance(text_format, TextFormat):
        found[name] = text_format.params
    return found


# Responses.
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    num_forwards: int  # Sangam: model forwards spent (refreshes + cached steps)
    # OpenAI's, when the engine caches prefixes (block-causal models): each prompt's cached
    # tokens, as its first choice found them.
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format. Each token's log-probability is the model's at the
    step that committed it; top_logprobs maps that token and the step's ``logprobs`` most
    probable ones (by their text, as vLLM) to theirs."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]  # Sangam: the response's token ids (a stream chunk: the new ones)
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    # Sangam: with min_threshold, the threshold each block used (a stream chunk: its block's)
    block_thresholds: list[float] | None = None
    # Sangam: with stream_options.include_drafts, a draft chunk's provisional block in progress
    # (its text and token ids); None in every other chunk.
    draft: str | None = None
    draft_token_ids: list[int] | None = None
    # Sangam: with return_trajectory, per position of the response canvas (token_ids first,
    # then the canvas past them; a stream chunk: its new tokens', the last chunk the rest),
    # every value a forward wrote there as [forward index, token id, log-probability]
    trajectory: list[list[tuple[int, int, float]]] | None = None
    # Sangam: the weights version that generated it (0 as loaded; +1 per weight update)
    weight_version: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: only tool calls
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    token_ids: list[int]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    # Sangam: with min_threshold, the threshold each block used (a stream chunk: its block's)
    block_thresholds: list[float] | None = None
    # Sangam: with return_trajectory, per position of the response canvas (token_ids first,
    # then the canvas past them; a stream chunk: its new tokens', the last chunk the rest),
    # every value a forward wrote there as [forward index, token id, log-probability]
    trajectory: list[list[tuple[int, int, float]]] | None = None
    # Sangam: the weights version that generated it (0 as loaded; +1 per weight update)
    weight_version: int = 0


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(BaseModel):
    index: int  # the call's place in the choice's tool_calls
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None  # sent whole, in a choice's last chunk


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    token_ids: list[int]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    # Sangam: with min_threshold, the threshold each block used (a stream chunk: its block's)
    block_thresholds: list[float] | None = None
    # Sangam: with stream_options.include_drafts, a draft chunk's provisional block in progress
    # (its text and token ids); None in every other chunk.
    draft: str | None = None
    draft_token_ids: list[int] | None = None
    # Sangam: with return_trajectory, per position of the response canvas (token_ids first,
    # then the canvas past them; a stream chunk: its new tokens', the last chunk the rest),
    # every value a forward wrote there as [forward index, token id, log-probability]
    trajectory: list[list[tuple[int, int, float]]] | None = None
    # Sangam: the weights version that generated it (0 as loaded; +1 per weight update)
    weight_version: int = 0


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "sangam"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _not_both(data: Any) -> Any:
    if isinstance(data, dict) and data.get("prompt") is not None \
            and data.get("messages") is not None:
        raise ValueError("give exactly one of prompt or messages")
    return data


class TokenizePromptRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True

    _exclusive = model_validator(mode="before")(_not_both)


class TokenizeChatRequest(ChatTemplateOptions):
    model: str | None = None
    messages: Messages

    _exclusive = model_validator(mode="before")(_not_both)


# vLLM's /tokenize: a prompt, or chat messages through the chat template (the template writes
# its own special tokens).
TokenizeRequest = Annotated[
    Annotated[TokenizePromptRequest, Tag("prompt-request")]
    | Annotated[TokenizeChatRequest, Tag("chat-request")],
    Discriminator(lambda data: "chat-request" if (
        isinstance(data, TokenizeChatRequest) or isinstance(data, dict) and "messages" in data)
        else "prompt-request")]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class VersionResponse(BaseModel):
    version: str


class ProfileStarted(BaseModel):
    status: Literal["profiling"] = "profiling"


class ProfileStopped(BaseModel):
    trace: str  # the Chrome trace file written


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class TokenizerInfoResponse(BaseModel):
    """vLLM's ``GET /tokenizer_info``: the tokenizer's class and its configuration (the
    tokenizer_config.json keys it was built with, file paths left out), and the chat template
    the server applies; clients such as lm-eval build the same tokenizer from it."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
