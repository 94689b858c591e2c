"""``LLM``: offline batched generation through the engine (DESIGN.md §3)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from sangam.config import EngineConfig
from sangam.decoding.reference import ReferenceDecoder
from sangam.engine.loaded_model import LoadedModel
from sangam.sampling_params import RequestOutput, SamplingParams


class LLM:
    """Load a checkpoint and generate.

    ``LLM(model="path/to/checkpoint", device="cpu", dtype="float64", token_budget=1024, ...)``:
    every :class:`~sangam.config.EngineConfig` field is a keyword argument.
    """

    def __init__(self, model: str | None = None, **engine_options):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_options) - fields)
        if unknown:
            raise TypeError(f"LLM() got unknown options {unknown}; valid: {sorted(fields)}")
        self.config = EngineConfig(model=model, **engine_options)
        self.loaded = LoadedModel.load(self.config)
        self._rng = random.Random(self.config.seed)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None) -> list[RequestOutput]:
        """Generate for text ``prompts`` or ``prompt_token_ids``; one SamplingParams or one per
        prompt. Outputs come back in input order."""
        ids = self._prompt_ids(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(ids))
        states = [self.loaded.new_state(p, sp, self._rng) for p, sp in zip(ids, params)]
        decoder = ReferenceDecoder(self.loaded.model, self.config.page_size)
        outs = []
        for i, (p, st) in enumerate(zip(ids, states)):
            decoder.run(st)
            tokens = st.output_token_ids()
            outs.append(RequestOutput(str(i), list(p), tokens, self.loaded.decode(tokens),
                                      st.num_forwards, True, st.finish_reason))
        return outs

    def _prompt_ids(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            return [self.loaded.encode(p) for p in prompts]
        return [list(p) for p in prompt_token_ids]

    @staticmethod
    def _params(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} SamplingParams for {n} prompts")
        return sampling_params
