"""``LLM``: offline batched generation through the engine (docs/design.md §3)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from sangam.config import EngineConfig
from sangam.engine.multi import make_engine
from sangam.engine.weight_group import WeightUpdateGroup
from sangam.models.tokenizer import load_chat_template
from sangam.sampling_params import RequestOutput, SamplingParams

# A prompt: its text, or vLLM's TextPrompt / TokensPrompt dicts (plus Sangam's suffix).
Prompt = str | Mapping[str, Any]
__all__ = ["LLM", "WeightUpdateGroup"]  # the trainer's end of init_weights_update_group
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "suffix", "suffix_token_ids"})


class LLM:
    """Load a checkpoint and generate.

    ``LLM(model="path/to/checkpoint", device="cpu", dtype="float64", token_budget=1024, ...)``:
    every :class:`~sangam.config.EngineConfig` field is a keyword argument, also under vLLM's
    names (``gpu_memory_utilization``, ``max_num_seqs``). vLLM's ``trust_remote_code`` is
    accepted and changes nothing: Sangam implements LLaDA and Dream itself and never runs a
    checkpoint's code.
    """

    def __init__(self, model: str | None = None, *, trust_remote_code: bool = False,
                 **engine_options):
        try:
            self.config = EngineConfig.from_options(model=model, **engine_options)
        except TypeError as e:
            raise TypeError(f"LLM(): {e}") from None
        self.engine = make_engine(self.config)
        self.loaded = self.engine.loaded
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.loaded.text.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the checkpoint's generation_config.json
        defaults over SamplingParams' own (vLLM's name)."""
        return self.loaded.default_params()

    def get_tokenizer(self):
        """The checkpoint's tokenizer (None without one): vLLM's name for ``tokenizer``."""
        return self.loaded.text.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if any (also done at interpreter exit)."""
        self.engine.shutdown()

    # RL rollouts (docs/design.md §3.1), SGLang's names: between generate calls, so no
    # request is in flight.
    @property
    def weights_version(self) -> int:
        """0 as loaded; each weight update adds 1. Every output carries the version that
        generated it (``RequestOutput.weight_version``)."""
        return self.engine.weights_version

    def update_weights_from_tensor(self, named_tensors: Mapping[str, Any]
                                   | Sequence[tuple[str, Any]]) -> int:
        """Copy full (unsharded) tensors, named as in the checkpoint, into the weights in place
        (every worker, every tensor-parallel rank its slice); the prefix cache is flushed.
        Returns the new weights version. Refused, changing nothing, when a name, shape, dtype
        or value does not fit the model."""
        return self.engine.update_weights_from_tensor(named_tensors)

    def update_weights_from_disk(self, model_path: str) -> int:
        """Load every weight of the checkpoint at ``model_path`` (the same architecture) in
        place; returns the new weights version."""
        return self.engine.update_weights_from_disk(model_path)

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str | None = None) -> None:
        """Join a trainer's weight-update group (``sangam.WeightUpdateGroup`` with rank 0 on
        the trainer's side); this engine's ranks are ``rank_offset`` onwards. Blocks until all
        have joined (gloo on CPU, nccl on GPU by default)."""
        self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                              world_size, group_name, backend)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]]) -> int:
        """Receive ``names`` from the trainer's broadcasts (in this order, full shapes) and
        copy them in place; returns the new weights version."""
        return self.engine.update_weights_from_distributed(names, dtypes, shapes)

    def flush_cache(self) -> None:
        """Empty the prefix cache."""
        self.engine.flush_cache()

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free the KV pool's and the weights' memory (``tags``: "kv_cache", "weights"; default
        both) for a colocated trainer, until ``resume_memory_occupation``."""
        self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back (the weights as they were when released)."""
        self.engine.resume_memory_occupation(tags)

    def generate(self, prompts: Prompt | Sequence[Prompt] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for ``prompts`` (texts, or vLLM's ``{"prompt": text}`` and
        ``{"prompt_token_ids": ids}``, to which ``"suffix"`` (text) or ``"suffix_token_ids"``
        may add a suffix: the response then fills the gap before it) or ``prompt_token_ids``;
        one SamplingParams or one per prompt. One output per prompt, in input order; with
        ``n`` > 1 its ``outputs`` hold the prompt's n samples (the output itself is the first).
        ``use_tqdm`` shows a progress bar."""
        inputs = self._inputs(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(inputs))
        # Each prompt's n samples are n requests (seeds seed + j, as the server's n choices).
        work = [(i, sp.for_sample(j)) for i, sp in enumerate(params) for j in range(sp.n)]
        engine = self.engine
        rids = [f"generate-{next(self._counter)}" for _ in work]
        try:
            for rid, (i, sp) in zip(rids, work):
                prompt, suffix = inputs[i]
                engine.add_request(rid, prompt, sp, suffix_token_ids=suffix)
        except Exception:  # refuse the whole call; requests already queued are withdrawn
            for rid in rids:
                engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        pending = set(rids)
        try:
            with tqdm(total=len(rids), desc="Generating", unit="req",
                      disable=not use_tqdm) as bar:
                while pending:
                    for out in engine.step():
                        if out.finished and out.request_id in pending:
                            done[out.request_id] = out
                            pending.discard(out.request_id)
                            bar.update()
        finally:  # interrupted (Ctrl-C in a notebook...): what is left must not linger
            for rid in pending:
                engine.abort_request(rid)
        outs: list[RequestOutput] = []
        for rid, (i, _) in zip(rids, work):  # a prompt's first sample carries the others
            if len(outs) == i:
                outs.append(done[rid])
            else:
                outs[i].siblings.append(done[rid])
        return outs

    def chat(self, messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate the assistant's turn of one conversation (a list of ``{"role", "content"}``
        messages) or of several (a list of such lists), through the tokenizer's chat template,
        as the server's /v1/chat/completions does. ``chat_template`` (a Jinja template, or a
        file holding one) replaces the tokenizer's; the other options are vLLM's (see
        ``LoadedModel.encode_chat``). ``tools`` are OpenAI's function definitions, for the
        template to show the model; as in vLLM, the response stays text (the server parses
        tool calls out of it)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("no conversation given")
        template = load_chat_template(chat_template) if chat_template is not None else None
        ids = [self.loaded.text.encode_chat(list(c), template, add_generation_prompt,
                                       continue_final_message, chat_template_kwargs, tools)
               for c in conversations]
        return self.generate(sampling_params=sampling_params, prompt_token_ids=ids,
                             use_tqdm=use_tqdm)

    def _inputs(self, prompts, prompt_token_ids) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, suffix ids) of each prompt."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, (str, Mapping)):
                prompts = [prompts]
            return [self._one_input(p) for p in prompts]
        return [(list(p), []) for p in prompt_token_ids]

    def _one_input(self, prompt: Prompt) -> tuple[list[int], list[int]]:
        if isinstance(prompt, str):
            return self.loaded.text.encode(prompt), []
        if isinstance(prompt, Mapping) and set(prompt) <= _PROMPT_KEYS:
            head = _part(prompt, "prompt", "prompt_token_ids")
            tail = _part(prompt, "suffix", "suffix_token_ids")
            has_head = "prompt" in prompt or "prompt_token_ids" in prompt
            if has_head and head is not None and tail is not None:
                # The suffix continues the text: no special tokens (BOS) of its own.
                suffix = self.loaded.text.encode(tail, False) if isinstance(tail, str) else tail
                return (self.loaded.text.encode(head) if isinstance(head, str) else head), suffix
        raise ValueError(f"a prompt is a text, {{'prompt': text}} or "
                         f"{{'prompt_token_ids': ids}}, plus optionally 'suffix' (text) or "
                         f"'suffix_token_ids'; got {prompt!r:.80}")

    def _params(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:  # the checkpoint's generation_config.json, if any
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} SamplingParams for {n} prompts")
        return sampling_params


def _part(prompt: Mapping[str, Any], text_key: str, ids_key: str) -> str | list[int] | None:
    """A prompt dict's text or token ids under one of two keys: [] if neither is there, None
    if both are or the value has the wrong type."""
    if text_key in prompt and ids_key in prompt:
        return None
    if text_key in prompt:
        text = prompt[text_key]
        return text if isinstance(text, str) else None
    ids = prompt.get(ids_key, [])
    return list(ids) if isinstance(ids, (list, tuple)) else None
