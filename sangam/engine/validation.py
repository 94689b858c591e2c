"""A request's admission check: every value it brings is bounded before it reaches
arithmetic, an index or an array (docs/design.md §8), and its canvas is built."""

from __future__ import annotations

import random

from sangam.decoding.completion import MAX_SEARCH_STATES
from sangam.decoding.grammar import (
    MAX_COMPLETION_TOKENS,
    Constraint,
    GrammarCompiler,
    GrammarState,
)
from sangam.decoding.state import DecodeState, stop_ids_of
from sangam.decoding.uniform import CanvasSpec
from sangam.engine.loaded_model import LoadedModel
from sangam.models import ModelConfig
from sangam.sampling_params import (
    MASKED_ONLY_FIELDS,
    UNIFORM_FIELDS,
    SamplingParams,
    UniformStateParams,
)
from sangam.sched.block_cursor import BlockCursor


def new_state(loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams,
              rng: random.Random, suffix_ids: list[int] = ()) -> DecodeState:
    """Validate one request and build its canvas (its prompt truncated as the params ask;
    with ``suffix_ids``, an infill before them); errors say what is wrong."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    cfg = loaded.config
    if cfg.gemma is not None:
        return _canvas_state(loaded, list(prompt_ids), params, rng, list(suffix_ids))
    given = sorted(params.uniform_given())
    if given:
        raise ValueError(f"{', '.join(given)} apply to uniform-state models (DiffusionGemma); "
                         f"{cfg.architecture} is a masked-diffusion model")
    suffix_ids = list(suffix_ids)
    if loaded.config.block_causal:
        params.check_block_causal(len(suffix_ids))
    elif params.edit_threshold is not None:
        raise ValueError("edit_threshold (token editing) needs a block-causal model (LLaDA2.x): "
                         "only there is the current block's K/V recomputed at every step")
    keep = params.truncate_prompt_tokens
    causal = loaded.config.block_causal
    if keep == -1:
        canvas = BlockCursor.max_canvas_len(params.max_tokens, params.block_length, causal)
        keep = max(1, loaded.context_length - canvas - len(suffix_ids))
    if keep is not None:
        prompt_ids = prompt_ids[-keep:]
    vocab = loaded.config.vocab_size
    for name, ids in (("prompt", prompt_ids), ("suffix", suffix_ids)):
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} token ids must be integers in [0, {vocab}); got "
                             f"{bad[:5]}")
    canvas = BlockCursor.canvas_len(len(prompt_ids), params.max_tokens, params.block_length,
                                    causal)
    total = len(prompt_ids) + canvas + len(suffix_ids)
    if total > loaded.context_length:
        suffix = f" plus suffix ({len(suffix_ids)} tokens)" if suffix_ids else ""
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) plus response canvas "
            f"({canvas} tokens){suffix} is {total} tokens, beyond the model's "
            f"context of {loaded.context_length}")
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ValueError(f"{name}: token ids must be in [0, {vocab}); got {bad[:5]}")
    if params.stop and loaded.text.tokenizer is None:
        raise ValueError("stop strings need a tokenizer and this checkpoint has none: use "
                         "stop_token_ids")
    if params.structured_outputs is not None and suffix_ids:
        raise ValueError("structured_outputs cannot be combined with a suffix (infilling): "
                         "the grammar would end before the suffix begins")
    grammar = _grammar(loaded, params)
    seed = params.seed if params.seed is not None else rng.getrandbits(63)
    return DecodeState(list(prompt_ids), params, loaded.config.mask_token_id, loaded.stop_ids,
                       loaded.config.shift_logits, seed, suffix_ids, loaded.config.block_causal,
                       grammar)


def _grammar(loaded: LoadedModel, params: SamplingParams) -> GrammarState | None:
    """The request's grammar state, if it asks for structured output (any family)."""
    if params.structured_outputs is None:
        return None
    constraint = Constraint.of(params.structured_outputs)
    compiler = loaded.grammar_compiler()
    compiler.compile(constraint)  # cached: the server compiled it off its event loop
    check_constraint_budget(compiler, constraint, params.max_tokens)
    return GrammarState(constraint, loaded.tokenizer_path, compiler.vocab_size,
                        compiler.eos_token_id, ends=stop_ids_of(params, loaded.stop_ids),
                        max_tokens=params.max_tokens)


def check_constraint_budget(compiler: GrammarCompiler, constraint: Constraint,
                            max_tokens: int) -> None:
    """Refuse ``constraint`` unless its shortest output (cached per constraint) and an end
    token fit in ``max_tokens``: a constrained response always ends complete
    (docs/decoding.md, "Structured output")."""
    start = compiler.start_completion(constraint)
    if start is None:
        raise ValueError(f"structured_outputs: the search for the constraint's shortest output "
                         f"(up to {MAX_COMPLETION_TOKENS} tokens, {MAX_SEARCH_STATES} states) "
                         "found none")
    if len(start) + 1 > max_tokens:
        raise ValueError(f"structured_outputs: the constraint needs max_tokens of at least "
                         f"{len(start) + 1} (its shortest output is {len(start)} tokens, then "
                         f"an end token); max_tokens is {max_tokens}")


def family_refusals(cfg: ModelConfig) -> dict[str, str]:
    """The request fields a model of ``cfg`` refuses whatever their value, with why: the
    other decoding family's (a uniform-state model takes a masked option at its default)."""
    if cfg.gemma is None:
        why = f"uniform-state models only; {cfg.architecture} is masked diffusion"
        return dict.fromkeys(UNIFORM_FIELDS, why)
    why = f"masked-diffusion models only; {cfg.architecture} is uniform-state"
    return dict.fromkeys(MASKED_ONLY_FIELDS, why)


def _canvas_state(loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams,
                  rng: random.Random, suffix_ids: list[int]) -> DecodeState:
    """``new_state`` for a uniform-state model (DiffusionGemma): its options are the
    denoising ones (the request's, else the checkpoint's, else transformers'); the masked
    family's are refused, never ignored."""
    cfg = loaded.config
    masked = params.masked_given()
    if masked:
        raise ValueError(f"{', '.join(masked)} do not apply to {cfg.architecture} (uniform-state "
                         "diffusion: its options are " + ", ".join(UNIFORM_FIELDS) + ")")
    if suffix_ids:
        raise ValueError(f"{cfg.architecture} has no infilling (suffix)")
    options = UniformStateParams(**{**loaded.uniform_defaults(), **params.uniform_given()})
    length = cfg.gemma.canvas_length
    keep = params.truncate_prompt_tokens
    if keep == -1:
        keep = max(1, loaded.context_length - BlockCursor.canvas_len(0, params.max_tokens, length))
    if keep is not None:
        prompt_ids = prompt_ids[-keep:]
    vocab = cfg.vocab_size
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab}); got {bad[:5]}")
    total = len(prompt_ids) + BlockCursor.canvas_len(len(prompt_ids), params.max_tokens, length)
    if total > loaded.context_length:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) plus response canvases "
                         f"({total - len(prompt_ids)} tokens, whole canvases of {length}) is "
                         f"{total} tokens, beyond the model's context of "
                         f"{loaded.context_length}")
    if params.stop and loaded.text.tokenizer is None:
        raise ValueError("stop strings need a tokenizer and this checkpoint has none: use "
                         "stop_token_ids")
    seed = params.seed if params.seed is not None else rng.getrandbits(63)
    spec = CanvasSpec(options, length, vocab, cfg.gemma.sliding_window)
    return DecodeState(prompt_ids, params, cfg.mask_token_id, loaded.stop_ids, False, seed,
                       grammar=_grammar(loaded, params), canvas=spec)
