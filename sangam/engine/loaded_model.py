"""A model ready to serve: weights, tokenizer, stop tokens, and request validation."""

from __future__ import annotations

import functools
import inspect
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sangam.config import EngineConfig
from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.engine.stop_strings import response_text
from sangam.models import (
    AttentionBackend,
    DiffusionLM,
    ModelConfig,
    TorchAttentionBackend,
    load_model,
    load_tokenizer,
    stop_token_ids,
)
from sangam.sampling_params import RequestOutput, SamplingParams


def default_device() -> str:
    """cuda when a GPU is visible, else cpu. Counted through NVML where it works, which leaves
    CUDA uninitialized (``torch.cuda.is_available`` would not): a process that asks may still
    fork workers that use CUDA, as a multi-worker node does."""
    return "cuda" if torch.cuda.device_count() > 0 else "cpu"


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op elsewhere). Triton
    launches kernels, and CUDA graphs capture, on the current device's stream, and the current
    device is per thread: a model on cuda:1 run from a thread still on cuda:0 would be handed
    cuda:0 streams (an illegal memory access, or a failed capture)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def checkpoint_path(cfg: EngineConfig) -> str | Path:
    """``cfg.model``: a checkpoint directory, or a shipped demo model's name (a directory of
    that name wins); None: the default demo model."""
    from sangam.demo import DEMO_MODELS, demo_model_path

    if cfg.model is None:
        return demo_model_path()
    if cfg.model in DEMO_MODELS and not Path(cfg.model).is_dir():
        return demo_model_path(cfg.model)
    return cfg.model


def context_limit(cfg: EngineConfig, model_config: ModelConfig) -> int | None:
    """``cfg.max_model_len``, checked against the model's context (positions beyond it were
    never trained and have no RoPE table)."""
    if cfg.max_model_len is not None and cfg.max_model_len > model_config.max_position:
        raise ValueError(f"max_model_len {cfg.max_model_len} is beyond the model's context of "
                         f"{model_config.max_position}")
    return cfg.max_model_len


def make_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """``None`` picks triton on GPU and the PyTorch reference on CPU (DESIGN.md §5)."""
    name = name or ("triton" if device.type == "cuda" else "torch")
    if name == "torch":
        return TorchAttentionBackend()
    from sangam.models.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that become SamplingParams defaults (HF name -> ours).
GENERATION_KEYS = {"max_new_tokens": "max_tokens", "block_length": "block_length",
                   "unmasking": "unmasking", "threshold": "threshold", "factor": "factor",
                   "tokens_per_step": "tokens_per_step", "cache": "cache"}


def read_generation_defaults(path: str | Path) -> dict:
    """SamplingParams defaults a checkpoint suggests in its ``generation_config.json`` (e.g. a
    model trained on short responses): only the keys Sangam understands, validated."""
    f = Path(path) / GENERATION_CONFIG
    if not f.is_file():
        return {}
    raw = json.loads(f.read_text())
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_KEYS.items() if theirs in raw}
    SamplingParams(**defaults)  # a broken file fails at load time, naming the key
    return defaults


@dataclass
class LoadedModel:
    path: str
    model: DiffusionLM | None  # None in a multi-worker front, which never runs the model
    config: ModelConfig
    tokenizer: object | None
    stop_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    # Request defaults: the checkpoint's generation_config.json, then EngineConfig's.
    request_defaults: dict = field(default_factory=dict)
    max_model_len: int | None = None  # EngineConfig.max_model_len, checked by context_limit

    @classmethod
    def load(cls, cfg: EngineConfig) -> LoadedModel:
        path = checkpoint_path(cfg)
        device = torch.device(cfg.device or default_device())
        model = load_model(path, device, None if cfg.dtype == "auto" else cfg.dtype,
                           cfg.load_format)
        model.attention_backend = make_attention_backend(cfg.attention_backend, device)
        p = next(model.parameters())
        return cls.around(cfg, path, model, model.config, p.device, p.dtype)

    @classmethod
    def around(cls, cfg: EngineConfig, path: str | Path, model: DiffusionLM | None,
               model_config: ModelConfig, device: torch.device, dtype: torch.dtype
               ) -> LoadedModel:
        """``model`` (None on a front whose workers hold the weights) with the checkpoint's
        tokenizer (or ``cfg.tokenizer``'s), stop ids, request defaults and context limit."""
        tokenizer = load_tokenizer(cfg.tokenizer or path, required=cfg.tokenizer is not None)
        # A block-causal model's requests default to the block size it was trained with.
        trained = ({"block_length": model_config.causal_block_size}
                   if model_config.block_causal else {})
        return cls(str(path), model, model_config, tokenizer,
                   stop_token_ids(model_config.eos_token_id, tokenizer), device, dtype,
                   {**trained, **read_generation_defaults(path), **cfg.request_defaults()},
                   context_limit(cfg, model_config))

    def default_params(self, **overrides) -> SamplingParams:
        """A request's SamplingParams: the one place its defaults merge. The checkpoint's
        generation_config.json, then the engine's flags (--block-length...), then
        ``overrides`` (a request's own fields)."""
        return SamplingParams(**{**self.request_defaults, **overrides})

    @property
    def context_length(self) -> int:
        """The longest prompt + canvas a request may have: the model's, or --max-model-len."""
        return self.max_model_len or self.config.max_position

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer: pass prompt_token_ids instead "
                             "of text prompts")
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template (or
        ``chat_template``, a Jinja template's text). As in vLLM: ``add_generation_prompt`` opens
        the assistant's turn; ``continue_final_message`` leaves the last message open, for the
        model to continue; ``chat_template_kwargs`` are extra variables of the template;
        ``tools`` (OpenAI's function definitions) are the template's ``tools``. A missing
        tokenizer or template, or a conversation the template rejects, is a ValueError."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so it cannot chat: pass "
                             "prompt_token_ids instead")
        if not messages:
            raise ValueError("the conversation (messages) is empty")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be "
                             "true: a reply either opens a new turn or continues the last one")
        extra = dict(chat_template_kwargs or {})
        # The template's variables only: never the tokenizer call's own options.
        reserved = set(inspect.signature(self.tokenizer.apply_chat_template).parameters)
        clash = sorted(k for k in extra if k in reserved or not k.isidentifier())
        if clash:
            raise ValueError(f"chat_template_kwargs cannot set {clash}")
        if continue_final_message:  # only then: transformers < 4.45 does not know the option
            extra["continue_final_message"] = True
        import jinja2  # transformers renders chat templates with it; only chat needs it

        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                tools=tools, tokenize=False, **extra)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ValueError(f"cannot apply the chat template: {e}") from None
        # The template already wrote the special tokens (BOS...): do not add them again.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def new_state(self, prompt_ids: list[int], params: SamplingParams, rng: random.Random,
                  suffix_ids: list[int] = ()) -> DecodeState:
        """Validate one request and build its canvas (its prompt truncated as the params ask;
        with ``suffix_ids``, an infill before them); errors say what is wrong."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        suffix_ids = list(suffix_ids)
        if self.config.block_causal:
            params.check_block_causal(len(suffix_ids))
        keep = params.truncate_prompt_tokens
        if keep == -1:
            # A block-causal canvas may reach B - 1 positions past the plain one.
            slack = params.block_length - 1 if self.config.block_causal else 0
            keep = max(1, self.context_length - params.canvas_length - slack - len(suffix_ids))
        if keep is not None:
            prompt_ids = prompt_ids[-keep:]
        vocab = self.config.vocab_size
        for name, ids in (("prompt", prompt_ids), ("suffix", suffix_ids)):
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} token ids must be integers in [0, {vocab}); got "
                                 f"{bad[:5]}")
        canvas = params.canvas_after(len(prompt_ids), self.config.block_causal)
        total = len(prompt_ids) + canvas + len(suffix_ids)
        if total > self.context_length:
            suffix = f" plus suffix ({len(suffix_ids)} tokens)" if suffix_ids else ""
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) plus response canvas "
                f"({canvas} tokens){suffix} is {total} tokens, beyond the model's "
                f"context of {self.context_length}")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token ids must be in [0, {vocab}); got {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and this checkpoint has none: use "
                             "stop_token_ids")
        seed = params.seed if params.seed is not None else rng.getrandbits(63)
        return DecodeState(list(prompt_ids), params, self.config.mask_token_id, self.stop_ids,
                           self.config.shift_logits, seed, suffix_ids, self.config.block_causal)

    def output(self, request_id: str, prompt_ids: list[int], state: DecodeState,
               finished: bool, reason: str | None, metrics: dict,
               text: IncrementalDetokenizer | None = None,
               error: str | None = None) -> RequestOutput:
        """What the caller sees of a request now: its tokens, their text (which, while the
        request runs, holds back what could still become a stop string), their logprobs when
        asked for. ``text``, the request's own, makes reading its outputs in order decode each
        block once."""
        tokens = state.output_token_ids()
        decode = self.decode if text is None else functools.partial(text, self.decode)
        return RequestOutput(
            request_id=request_id, prompt_token_ids=prompt_ids, token_ids=tokens,
            make_text=functools.partial(response_text, tokens, state.params, finished, decode),
            num_forwards=state.num_forwards,
            logprobs=(state.output_logprobs(len(tokens))
                      if state.params.logprobs is not None else None),
            top_logprobs=(state.output_top_logprobs(len(tokens))
                          if state.params.logprobs else None),
            finished=finished, finish_reason=reason if finished else None,
            stop_reason=state.stop_reason() if finished and reason == "stop" else None,
            block_thresholds=state.output_block_thresholds(), metrics=metrics, error=error)
