"""Schemathesis hooks for tests/test_openapi_conformance.py (loaded through SCHEMATHESIS_HOOKS).

``positive_data_acceptance`` is replaced by ``schema_valid_requests_served``, which is stricter
where it matters: a schema-valid request must be served (2xx), and the only other answers it
may get are a 404 for a model or stored response the server does not have (the built-in
check allows 404s too) or a 400 whose message is one of ``CONSTRAINTS_BEYOND_THE_SCHEMA``:
rules JSON Schema cannot state (they relate fields to each other, to the model or to the
server's flags). Any other refusal of a schema-valid request is a failure.
"""

from __future__ import annotations

import schemathesis

# (fragment of the 400's message, why the schema cannot say it)
CONSTRAINTS_BEYOND_THE_SCHEMA = [
    ("beyond the model's context", "prompt + response canvas depend on the tokenizer and the "
     "model's context"),
    ("KV pages", "whether a canvas fits the KV pool depends on the server's memory"),
    ("prompt token ids must be in", "a prompt's ids are checked against the vocabulary after "
     "the text/ids union is resolved"),
    ("logit_bias: token ids must be in", "logit_bias keys are JSON strings: the vocabulary "
     "bound cannot be put on them"),
    ("json must be a", "a JSON schema given as text must parse as an object, and one given as "
     "an object is bounded by its JSON text's length"),
    ("the constraint needs max_tokens of at least", "a constraint's shortest output depends on "
     "the grammar and the tokenizer, and must fit max_tokens"),
    ("does not compile", "whether a JSON schema, regex or grammar compiles is the grammar "
     "compiler's to say"),
    ("a constraint is a string of at most", "a choice list is bounded by its JSON text's "
     "length too"),
    ("structured output needs a tokenizer", "a constraint compiles for the model's tokenizer"),
    ("structured_outputs cannot be combined with edit_threshold", "structured output relates "
     "to edit_threshold"),
    ("not among the tools", "a named tool_choice relates to tools"),
    ("must be an object's JSON schema", "a forced tool call's arguments are an object: a tool's "
     "parameters schema must allow one"),
    ("too long to constrain the output", "the grammar of forced tool calls is bounded like any "
     "grammar"),
    ("--enable-auto-tool-choice", "calling tools depends on a server flag"),
    ("needs tools", "tool_choice relates to tools"),
    ("min_tokens must be", "min_tokens <= max_tokens"),
    ("min_threshold must be", "min_threshold <= threshold, under the threshold rule"),
    ("needs a block-causal model", "token editing depends on the served model's attention"),
    ("logprobs cannot be combined with edit_threshold", "logprobs relates to edit_threshold"),
    ("need a cache", "refresh intervals other than 1 relate to cache"),
    ("top_logprobs needs logprobs", "top_logprobs relates to logprobs"),
    ("contradict each other", "ignore_eos is the inverse of stop_at_eos"),
    ("echo with logprobs", "echo relates to logprobs"),
    ("chat template", "what a chat template accepts is the template's own code"),
    ("chat_template_kwargs cannot set", "the template's variables must not shadow the "
     "tokenizer call's options"),
    ("add_generation_prompt and continue_final_message", "the two options exclude each other"),
    ("more than the server ever holds", "prompts x n against --max-queue-len"),
    ("a request id", "X-Request-Id / request_id must be printable"),
    ("the prompt is empty", "a text may tokenize to nothing"),
    ("give exactly one of prompt or messages", "the two forms of /tokenize exclude each other"),
]


@schemathesis.check
def schema_valid_requests_served(ctx, response, case) -> None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return
    if response.status_code == 404 and ("model_not_found" in response.text
                                        or "response_not_found" in response.text):
        return  # a model name it does not serve, a response id it does not hold
    if response.status_code == 400:
        message = response.json().get("error", {}).get("message", "")
        if any(fragment in message for fragment, _ in CONSTRAINTS_BEYOND_THE_SCHEMA):
            return
    raise AssertionError(f"a schema-valid request got {response.status_code}: "
                         f"{response.text[:500]}")
