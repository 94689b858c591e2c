"""Structured output: a request's constraint compiled to a grammar, and the matcher that says
which tokens may come next (docs/decoding.md, "Structured output").

The backend is llguidance (JSON schema, regex, choice lists and Lark grammars over any
tokenizer, with incremental token masks). A constraint compiles once per (tokenizer,
constraint) and is cached; compiling never needs the model. A request's matcher state is a
function of its committed response tokens, so a request moved between workers or processes
rebuilds it by replaying them (:meth:`GrammarState.__setstate__`).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from dataclasses import dataclass

import numpy as np

from sangam.decoding.completion import TokenTable, shortest_completion
from sangam.sampling_params import CONSTRAINT_KINDS, MAX_CONSTRAINT_CHARS

# The JSON compiler's defaults (a schema's "x-guidance" overrides them): fixed separators, no
# free whitespace, which a model could otherwise pad a response with forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_COMPILED = 256  # compiled grammars kept per tokenizer (LRU)
# The longest completion searched for at a constraint's start: beyond it a constraint is
# refused as needing more than any request could give it.
MAX_COMPLETION_TOKENS = 4096


class ConstraintError(ValueError):
    """A constraint that does not compile; the message is the compiler's."""


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint: ``kind`` (CONSTRAINT_KINDS) and its text (a JSON
    schema or a choice list as canonical JSON; a regex; a Lark/GBNF grammar)."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"a constraint's kind must be one of {CONSTRAINT_KINDS}, got "
                             f"{self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > 2 * MAX_CONSTRAINT_CHARS:
            raise ValueError(f"a constraint is a string of at most {MAX_CONSTRAINT_CHARS} "
                             "characters")

    @classmethod
    def of(cls, params) -> Constraint:
        """The constraint of a ``StructuredOutputsParams``."""
        kind = params.kind
        if kind == "choice":
            return cls(kind, json.dumps(list(params.choice)))
        return cls(kind, "" if kind == "json_object" else getattr(params, kind))

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (raises ConstraintError)."""
        import llguidance

        kind, text = self.kind, self.text
        if kind == "json_object":
            kind, text = "json", json.dumps({"type": "object"})
        try:
            if kind == "json":  # compact JSON: no whitespace between tokens, as vLLM's
                return llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults=JSON_OPTIONS)
            return llguidance.grammar_from(kind, text)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"{self.kind}: {e}") from None


class TokenBytes:
    """A tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes (special tokens
    empty, flagged special), EOS, and encoding. Works for any tokenizer whose tokens decode
    one by one (llguidance's own loader cannot read every tokenizer.json, the demo model's
    among them)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        special = set(tokenizer.all_special_ids)
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        size = len(tokenizer)
        self.tokens = [b"" if i in special or i >= size else
                       _token_bytes(tokenizer, i) for i in range(vocab_size)]
        self.special_token_ids = sorted(t for t in special if t < vocab_size)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def _token_bytes(tokenizer, token_id: int) -> bytes:
    """One token's bytes: byte-level BPE pieces map back through GPT-2's byte table,
    SentencePiece byte pieces (<0xAB>) to their byte, others through decode."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        table = _byte_decoder()
        if piece and all(c in table for c in piece) and any(c in "ĠĊ" for c in piece):
            return bytes(table[c] for c in piece)
    return tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode("utf-8")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-ins for the 256 bytes."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class GrammarCompiler:
    """Compiles constraints for one tokenizer, cached (thread-safe: the server compiles on a
    worker thread while the engine thread reads the cache; two threads compiling the same new
    constraint at once both compile it, and neither waits on the other)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        import llguidance

        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        token_bytes = TokenBytes(tokenizer, vocab_size, eos_token_id)
        self.table = TokenTable(token_bytes.tokens)
        self.llg = llguidance.LLTokenizer(llguidance.TokenizerWrapper(token_bytes),
                                          n_vocab=vocab_size)
        self._compile = functools.lru_cache(maxsize=MAX_COMPILED)(self._compile_uncached)
        self._start = functools.lru_cache(maxsize=MAX_COMPILED)(self._start_uncached)

    def _compile_uncached(self, constraint: Constraint) -> str:
        import llguidance

        grammar = constraint.grammar_text()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.llg)
        if error:
            raise ConstraintError(f"{constraint.kind}: {error}")
        return grammar

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint`` (raises ConstraintError with the compiler's
        message); cached."""
        return self._compile(constraint)

    def _start_uncached(self, constraint: Constraint) -> tuple[int, ...] | None:
        found = shortest_completion(self.matcher(constraint), self.table, MAX_COMPLETION_TOKENS)
        return None if found is None else tuple(found)

    def start_completion(self, constraint: Constraint) -> tuple[int, ...] | None:
        """The shortest whole output of ``constraint`` that the search finds (docs/decoding.md),
        None if none within MAX_COMPLETION_TOKENS; cached, as compiling is (the server
        computes it with the compile, off its event loop)."""
        return self._start(constraint)

    def matcher(self, constraint: Constraint):
        """A fresh llguidance matcher at the start of ``constraint``."""
        import llguidance

        return llguidance.LLMatcher(self.llg, self.compile(constraint), log_level=0)


_TOKENIZERS: dict[str, object] = {}  # the process's tokenizers, by their directory
_COMPILERS: dict[str, GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def register_tokenizer(tokenizer_path: str, tokenizer) -> None:
    """Make the tokenizer read from ``tokenizer_path`` known to this process (every loaded
    model does, so that a request moved here from another process finds its compiler)."""
    _TOKENIZERS[os.path.abspath(tokenizer_path)] = tokenizer


def compiler_for(tokenizer_path: str, vocab_size: int, eos_token_id: int) -> GrammarCompiler:
    """The process's compiler for the registered tokenizer of ``tokenizer_path`` (built on
    first use: about a second for a large vocabulary)."""
    key = os.path.abspath(tokenizer_path)
    with _COMPILERS_LOCK:
        found = _COMPILERS.get(key)
        if found is None:
            if key not in _TOKENIZERS:
                raise ConstraintError(f"no tokenizer from {tokenizer_path!r} in this process")
            found = _COMPILERS[key] = GrammarCompiler(_TOKENIZERS[key], vocab_size,
                                                      eos_token_id)
        return found


class GrammarState:
    """A request's matcher, kept a function of the request's committed response tokens: before
    each use it consumes those it has not seen (however they arrived: committed here, or
    copied in from another worker's progress). Pickles as its constraint and where to find
    the tokenizer; unpickled, it rebuilds by replaying.

    With ``max_tokens`` it is budget-aware (docs/design.md §2.10): it holds ``plan``, a
    completion of the grammar that with an end token fits the positions left. The plan too is
    a function of the committed tokens (the constraint's cached shortest output, then each
    token's ``_next_plan``), so a replay rebuilds the same one and a moved request decides as
    it would have in place."""

    def __init__(self, constraint: Constraint, tokenizer_path: str, vocab_size: int,
                 eos_token_id: int, ends: frozenset[int] = frozenset(),
                 max_tokens: int | None = None):
        self.constraint = constraint
        self.where = (tokenizer_path, vocab_size, eos_token_id)
        # The request's stop ids: each may end the response wherever the grammar allows EOS
        # (a chat model ends its turn with its end-of-turn token, not the tokenizer's EOS).
        self.ends = np.array(sorted(ends), dtype=np.int64)
        self.max_tokens = max_tokens  # None: no budget
        self._restart()

    def _restart(self) -> None:
        compiler = compiler_for(*self.where)
        self._matcher = compiler.matcher(self.constraint)
        self.consumed = 0  # response tokens the matcher has consumed
        start = None if self.max_tokens is None else compiler.start_completion(self.constraint)
        self.plan: list[int] | None = None if start is None else list(start)
        self._next: tuple[int, int, list[int] | None] | None = None  # fit's, for consume

    def __getstate__(self) -> dict:
        return {"constraint": self.constraint, "where": self.where, "ends": self.ends,
                "max_tokens": self.max_tokens}

    def __setstate__(self, state: dict) -> None:
        self.constraint, self.where, self.ends = state["constraint"], state["where"], state["ends"]
        self.max_tokens = state["max_tokens"]
        self._matcher, self.consumed = None, 0

    def sync(self, response: np.ndarray, mask_token_id: int):
        """The matcher after the committed prefix of ``response`` (the tokens before its first
        mask)."""
        masked = (response == mask_token_id).nonzero()[0]
        return self.sync_to(response[:int(masked[0]) if masked.size else len(response)])

    def sync_to(self, prefix: np.ndarray):
        """The matcher after exactly the response tokens ``prefix``."""
        if self._matcher is None or self.consumed > len(prefix):
            self._restart()
        for t in prefix[self.consumed:].tolist():
            self.consume(t)
        return self._matcher

    @property
    def end_token(self) -> int:
        """The grammar's end (the tokenizer's EOS): what a response pads with after it."""
        return self.where[2]

    def done(self) -> bool:
        """Whether the grammar is complete with nothing more allowed: only its end follows."""
        return self._matcher.is_stopped()

    def is_end(self, token: int) -> bool:
        """Whether ``token`` ends the response (the grammar's EOS or a stop id)."""
        return token == self.where[2] or token in self.ends

    def _next_plan(self, token: int) -> list[int] | None:
        """The plan after ``token`` at the next position: [] once the grammar accepts; the
        plan's rest if ``token`` is its next; the plan itself if it still completes the
        grammar after ``token``; else the shortest completion a search finds that, with an end
        token, fits the positions then left (None: none)."""
        m = self._matcher
        if self.is_end(token) or m.is_stopped():
            return []
        after = m.deep_copy()
        if not after.consume_token(int(token)):
            return None
        plan = self.plan or []
        if after.is_accepting():
            return []
        if plan and plan[0] == token:
            return plan[1:]
        trial = after.deep_copy()
        if plan and trial.consume_tokens(plan) and trial.is_accepting():
            return plan
        left = self.max_tokens - self.consumed - 1  # positions after this one
        return shortest_completion(after, compiler_for(*self.where).table, left - 1)

    def fit(self, token: int) -> int:
        """The token to take at the next response position, the model's choice being the
        allowed ``token``: ``token`` itself if a completion of the grammar and an end token
        still fit in the positions after it, else the plan's next token (the grammar's end
        once complete). The plan fits by induction from the request's admission."""
        if self.max_tokens is None or self.is_end(token) or self._matcher.is_stopped():
            return token
        left = self.max_tokens - self.consumed - 1
        rest = self._next_plan(token)
        if rest is not None and len(rest) + 1 <= left:
            self._next = (self.consumed, int(token), rest)
            return int(token)
        if not self.plan:
            return self.where[2]
        return self.plan[0]

    def allowed(self, vocab_size: int) -> np.ndarray:
        """Which tokens may come next, as a bool array over the vocabulary; once the grammar
        is complete, only EOS (the canvas pads with it; the output is cut there)."""
        m = self._matcher
        if m.is_stopped():
            out = np.zeros(vocab_size, dtype=bool)
            out[self.where[2]] = True
            return out
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")
        out = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, len(bits))
        out[:n] = bits[:n].astype(bool)
        if out[self.where[2]]:
            out[self.ends[self.ends < vocab_size]] = True
        return out

    def consume(self, token: int) -> None:
        m = self._matcher
        if token in self.ends:  # a stop id where EOS was allowed: the grammar's EOS
            token = self.where[2]
        if self.max_tokens is not None:  # before the matcher moves: the plan reads its state
            known, self._next = self._next, None
            self.plan = (known[2] if known is not None and known[:2] == (self.consumed, token)
                         else self._next_plan(token))
        if not m.is_stopped() and not m.consume_token(int(token)):
            raise ConstraintError(f"the grammar rejected token {token}: {m.get_error()}")
        self.consumed += 1
