"""Budget-aware structured output on a realistic vocabulary (docs/results.md, "Structured
output"): the cost of the shortest-output search and of the per-token budget rule.

    .venv/bin/python microbench/constraint_budget.py [--vocab 32000] [--files 3000]

Trains a byte-level BPE (``tokenizers``) on the installed packages' Python sources, compiles a
forced tool call's JSON schema (five required arguments, one optional free string) for it,
times its shortest output (the admission search), then decodes that schema at two budgets
with every proposal drawn at random from the allowed tokens — a model that never chooses to
end, the rule's worst case — against the same decode with no budget (mask and matcher only).
"""

from __future__ import annotations

import argparse
import glob
import json
import site
import time

import numpy as np

TOOL_CALL = {"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"const": "book_flight"},
    "arguments": {"type": "object",
                  "required": ["origin", "destination", "date", "passengers", "cabin"],
                  "properties": {"origin": {"type": "string", "minLength": 3},
                                 "destination": {"type": "string"},
                                 "date": {"type": "string",
                                          "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                 "passengers": {"type": "integer", "minimum": 1},
                                 "cabin": {"enum": ["economy", "business", "first"]},
                                 "notes": {"type": "string"}}}}}


def train_tokenizer(vocab: int, files: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    paths = sorted(p for root in site.getsitepackages()
                   for p in glob.glob(f"{root}/**/*.py", recursive=True))[:files]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator((open(p, errors="ignore").read() for p in paths),
                            trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def decode(constraint, tokenizer, max_tokens: int | None, limit: int) -> tuple[int, int, float]:
    """(tokens, tokens the rule replaced, seconds) of a decode with random proposals."""
    from sangam.decoding.grammar import GrammarState

    state = GrammarState(constraint, "bench", len(tokenizer), tokenizer.eos_token_id,
                         max_tokens=max_tokens)
    rng = np.random.default_rng(0)
    n = replaced = 0
    start = time.perf_counter()
    while not state.done() and n < limit:
        proposed = int(rng.choice(np.flatnonzero(state.allowed(len(tokenizer)))))
        token = proposed if max_tokens is None else state.fit(proposed)
        replaced += token != proposed
        state.consume(token)
        n += 1
    return n, replaced, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    from sangam.decoding.grammar import Constraint, compiler_for, register_tokenizer

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000, help="the BPE's vocabulary size")
    p.add_argument("--files", type=int, default=3000, help="source files to train it on")
    args = p.parse_args(argv)
    start = time.perf_counter()
    tokenizer = train_tokenizer(args.vocab, args.files)
    print(f"tokenizer: {len(tokenizer)} tokens, trained in {time.perf_counter() - start:.1f} s")
    register_tokenizer("bench", tokenizer)
    compiler = compiler_for("bench", len(tokenizer), tokenizer.eos_token_id)
    constraint = Constraint("json", json.dumps(TOOL_CALL))
    compiler.compile(constraint)
    start = time.perf_counter()
    shortest = compiler.start_completion(constraint)
    print(f"shortest output: {len(shortest)} tokens, found in "
          f"{time.perf_counter() - start:.3f} s: {tokenizer.decode(list(shortest))}")
    need = len(shortest) + 1
    for budget in (need + 8, need + 64, None):
        limit = budget or need + 64
        n, replaced, seconds = decode(constraint, tokenizer, budget, limit)
        what = f"max_tokens {budget}" if budget else "no budget"
        print(f"{what}: {n} tokens, {replaced} replaced by the rule, "
              f"{1e3 * seconds / n:.2f} ms a token (mask, rule, matcher)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
